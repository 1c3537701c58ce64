"""The path of docs/verl-pipeline.md: verl's own ``main_ppo`` with claas_verl's loss and estimator.

``claas_seq_is`` and ``claas_rpp_ema`` are selected only through config keys, on the tiny GRPO recipe with the
CPU preset, two ways:

* pip-installed: this interpreter, where claas_verl's ``verl.plugins`` entry point is installed and
  ``VERL_USE_EXTERNAL_MODULES`` is unset;
* ``VERL_USE_EXTERNAL_MODULES=claas_verl.verl_ext.plugin`` only: an interpreter without claas_verl
  (``bare_python``, no distribution, no entry point) with the checkout on ``PYTHONPATH``.

Each run starts its own local Ray (``RAY_ADDRESS=local`` from tests/conftest.py). Slow: two verl jobs.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SELECT = (
    "actor_rollout_ref.actor.policy_loss.loss_mode=claas_seq_is",
    "algorithm.adv_estimator=claas_rpp_ema",
    "+algorithm.claas_rpp_ema={}",
)


@pytest.fixture(scope="module")
def tiny_root() -> Path:
    from claas_verl.tiny import ensure_tiny

    return Path(ensure_tiny().root)


def _main_ppo(python: Path | str, env: dict, out: Path) -> list[str]:
    cmd = [str(python), "-m", "verl.trainer.main_ppo", f"--config-path={REPO}/recipes/ppo", "--config-name=tiny_grpo",
           "+cpu=default", *SELECT, "trainer.total_training_steps=2", "trainer.save_freq=-1"]
    proc = subprocess.run(cmd, cwd=REPO, env={**env, "CLAAS_OUT_DIR": str(out), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    steps = [line for line in log.splitlines() if re.search(r"step:\d+ - ", line)]
    assert len(steps) == 2, log[-4000:]
    for line in steps:
        # metrics that only claas_seq_is reports (the sequence-level ratio), and a real gradient
        for key in ("actor/seq_ratio_mean", "actor/pg_loss"):
            m = re.search(rf"{re.escape(key)}:(-?[0-9.eE+-]+|nan|inf)", line)
            assert m and math.isfinite(float(m.group(1))), (key, line[:300])
        grad = re.search(r"actor/grad_norm:([0-9.eE+-]+)", line)
        assert grad and float(grad.group(1)) > 0, line[:300]
    return steps


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "PYTHONPATH")}
    env.update(extra)
    return env


def test_main_ppo_with_the_installed_plugin(tiny_root, tmp_path):
    plugins = [e.value for e in importlib.metadata.entry_points(group="verl.plugins")]
    assert "claas_verl.verl_ext.plugin" in plugins, f"claas_verl is not pip-installed here: {plugins}"
    # PYTHONPATH keeps this checkout's code first when the installed claas_verl is another checkout's
    # editable install; the plugin itself is found through the entry point only
    _main_ppo(sys.executable, _env(CLAAS_TINY_DIR=str(tiny_root), PYTHONPATH=str(REPO)), tmp_path)


def test_main_ppo_with_verl_use_external_modules_only(tiny_root, tmp_path, bare_python):
    _main_ppo(bare_python, _env(CLAAS_TINY_DIR=str(tiny_root), PYTHONPATH=str(REPO),
                                VERL_USE_EXTERNAL_MODULES="claas_verl.verl_ext.plugin"), tmp_path)


def test_without_the_plugin_claas_names_are_unknown_to_verl(tiny_root, tmp_path, bare_python):
    """Control: the bare interpreter really lacks the plugin (no entry point, no VERL_USE_EXTERNAL_MODULES)."""
    probe = subprocess.run(
        [str(bare_python), "-c", "import verl.trainer.ppo.core_algos as c; c.get_policy_loss_fn('claas_seq_is')"],
        cwd=tmp_path, env=_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert probe.returncode != 0 and "claas_seq_is" in probe.stderr, probe.stderr[-2000:]
