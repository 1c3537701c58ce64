"""Shared helpers of the MOPD trainer's tests: the tiny offline bundle, running main_mopd, the plans."""

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
    """``mopd_plan(spelling) -> [step dicts]``: what ``python -m claas_verl.plan ... plan.format=json`` prints.

    ``spelling`` is a recipe and its command-line overrides, e.g. ``"mopd/seq scale=tiny"`` (docs/recipes.md)."""

    def plan(spelling: str, *overrides: str) -> list[dict]:
        from hydra import compose, initialize_config_dir

        from claas_verl.mopd.recipe_schedule import plan_from_config
        from claas_verl.paths import recipes_dir

        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            recipe, *spelled = spelling.split()
            cfg = compose(config_name=recipe, overrides=[*spelled, f"tiny_dir={tiny_dir}", *overrides])
        return plan_from_config(cfg).to_json_dict()["steps"]

    return plan


@pytest.fixture
def small_plan():
    """``small_plan(budget) -> (plan, [step dicts])``: logic, math, code in 4, 3, 3 blocks of 4 prompts, m=3."""

    def plan(budget: str = "shared", recovery: bool = False, setting: str = "S1"):
        from claas_verl.schedule import ScheduleConfig, build_plan

        cfg = ScheduleConfig.from_dict({
            "order": ["logic", "math", "code"],
            "block_size": 4,
            "budget": budget,
            "setting": setting,
            "replay": {"m": 3},
            "recovery": {"enabled": recovery, "blocks_per_domain": 2},
            "domains": {d: {"num_blocks": n, "prompts": None, "expert": f"/e/{d}"}
                        for d, n in (("logic", 4), ("math", 3), ("code", 3))},
        })
        built = build_plan(cfg)
        return built, [s.to_dict() for s in built.steps]

    return plan


@pytest.fixture
def mopd_run(tiny_dir, tmp_path):
    """``mopd_run(spelling, name, *overrides) -> (run_dir, log)``: one ``python -m claas_verl.main_mopd`` job
    (``spelling``: a recipe and its overrides, as ``mopd_plan`` takes it)."""

    def run(spelling: str, name: str, *overrides: str, timeout: int = 900):
        recipe, *spelled = spelling.split()
        env = dict(os.environ, CLAAS_TINY_DIR=str(tiny_dir), CLAAS_OUT_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "claas_verl.main_mopd", f"--config-name={recipe}", *spelled,
               f"trainer.experiment_name={name}", *overrides]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-8000:]
        return tmp_path / name, log

    return run
