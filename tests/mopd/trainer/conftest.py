"""Shared helpers of the MOPD trainer's end-to-end tests: the tiny offline bundle, running main_mopd, the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# shorter responses and fewer held-out prompts than the recipe (the plan and optimizer are the recipe's)
FAST = ("mopd.train.max_response_length=12", "mopd.eval.prompts=2", "trainer.save_freq=-1")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


@pytest.fixture
def fast() -> tuple[str, ...]:
    return FAST


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from claas_verl.tiny import ensure_tiny

    existing = os.environ.get("CLAAS_TINY_DIR")
    return Path(existing) if existing and (Path(existing) / "student").exists() else Path(ensure_tiny().root)


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """The tiny bundle built with Qwen3 models (q/k norms; ``python -m claas_verl.tiny make DIR --arch qwen3``)."""
    from claas_verl.tiny import ensure_tiny

    return Path(ensure_tiny(arch="qwen3").root)  # honours $CLAAS_TINY_QWEN3_DIR


@pytest.fixture
def mopd_plan(tiny_dir):
    """``mopd_plan(recipe) -> [step dicts]``: what ``python -m claas_verl.plan ... plan.format=json`` prints."""

    def plan(recipe: str, *overrides: str) -> list[dict]:
        from hydra import compose, initialize_config_dir

        from claas_verl.mopd.recipe_schedule import plan_from_config
        from claas_verl.paths import recipes_dir

        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            cfg = compose(config_name=recipe, overrides=[f"claas.tiny_dir={tiny_dir}", *overrides])
        return plan_from_config(cfg).to_json_dict()["steps"]

    return plan


@pytest.fixture
def mopd_run(tiny_dir, tmp_path):
    """``mopd_run(recipe, name, *overrides) -> (run_dir, log)``: one ``python -m claas_verl.main_mopd`` job."""

    def run(recipe: str, name: str, *overrides: str, timeout: int = 900):
        env = dict(os.environ, CLAAS_TINY_DIR=str(tiny_dir), CLAAS_OUT_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "claas_verl.main_mopd", f"--config-name={recipe}",
               f"trainer.experiment_name={name}", *overrides]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-8000:]
        return tmp_path / name, log

    return run
