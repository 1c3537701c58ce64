"""The previous layout's module paths keep importing for one release, as the same modules (claas_verl/_moved.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import claas_verl
from claas_verl import _moved

# importing it needs vLLM (the vllm-marked tests import it in the vLLM venv); its mapping is checked by name
NEEDS_VLLM = {"claas_verl.verl_ext.vllm_versioned_lora"}


@pytest.mark.parametrize("old", sorted(set(_moved.MOVED) - NEEDS_VLLM))
def test_old_path_is_the_new_module(old):
    new = _moved.MOVED[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # pickling and reloading see the real name
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def test_old_child_module_runs_once():
    """A class imported under its old path is the class of the new path (the file did not run a second time)."""
    from claas_verl.claas.trainer.sampler import ClaasReplaySampler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from claas_verl.trainer.claas.sampler import ClaasReplaySampler as old
    assert old is ClaasReplaySampler


def test_old_command_path_runs():
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "claas_verl.merges", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ties" in out.stdout


def test_unmoved_names_are_left_alone():
    assert _moved.new_name("claas_verl.verl_ext.vllm_versioned_lora") == "claas_verl.claas.vllm_versioned_lora"
    assert _moved.new_name("claas_verl.losses") is None and _moved.new_name("claas_verl.dataset") is None
    assert claas_verl.__name__ == "claas_verl"
