"""Bad input gets an error naming the key or library and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from claas_verl.verl_ext.cpu.checks import check_model_path, check_trainer_device, require_library

REPO = Path(__file__).resolve().parents[3]


def test_unsupported_device_names_the_key():
    with pytest.raises(ValueError, match=r"trainer\.device='tpu'.*cpu"):
        check_trainer_device("tpu", cuda_available=False)
    with pytest.raises(ValueError, match=r"trainer\.device=cuda.*\+cpu=default"):
        check_trainer_device("cuda", cuda_available=False)
    check_trainer_device("cuda", cuda_available=True)
    check_trainer_device("cpu", cuda_available=False)


def test_main_ppo_checks_the_device_before_ray_starts():
    """P5: verl's main_ppo.auto_set_device is wrapped; on this CUDA-less machine its default device fails fast."""
    import torch
    from verl.trainer import main_ppo

    assert getattr(main_ppo.auto_set_device, "_claas_device_check", False), "P5 not installed: verl moved the name?"
    cuda_cfg = OmegaConf.create({"trainer": {"device": "cuda"}})
    if torch.cuda.is_available():
        main_ppo.auto_set_device(cuda_cfg)  # valid on a GPU machine
    else:
        with pytest.raises(ValueError, match=r"trainer\.device=cuda"):
            main_ppo.auto_set_device(cuda_cfg)
    main_ppo.auto_set_device(OmegaConf.create({"trainer": {"device": "cpu"}}))


def test_missing_model_path_and_library_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.path=.*claas_verl\.tiny make"):
        check_model_path(str(tmp_path / "nope"))
    with pytest.raises(ImportError, match=r"'surely_not_installed_lib'.*Fix: pip install it"):
        require_library("surely_not_installed_lib", "this feature", "pip install it")


def test_misspelled_recipe_key_is_named_before_anything_starts():
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={REPO / 'recipes' / 'ppo'}",
         "--config-name=tiny_grpo", "+cpu=default", "trainer.total_trainig_steps=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "total_trainig_steps" in proc.stderr + proc.stdout
