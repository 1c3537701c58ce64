"""Every recipe under recipes/mopd composes with Hydra and plans; the plan command's JSON is the library's plan."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from claas_verl.mopd.recipe_schedule import plan_from_config
from claas_verl.paths import recipes_dir

RECIPES = recipes_dir() / "mopd"
ALL = sorted(p.stem for p in RECIPES.glob("*.yaml"))
REPO = Path(__file__).resolve().parents[2]

# MOPD paper Table 6 step counts (and Table 15's one-seed configurations)
PAPER_STEPS = {
    "seq": 104, "seq_recovery": 139, "seq_recovery mopd.recovery.blocks_per_domain=14": 174,
    "seq_expert_recovery": 139, "replay_kl": 132, "replay_kl_sats": 132, "replay_kl_oprd": 132, "fsar_shared": 132,
    "replay_kl_fixed mopd.replay.b=3": 138, "fsar mopd.replay.b=3": 138, "replay_kl_fixed": 174, "fsar": 174,
    "replay_kl_recovery": 167, "replay_kl_sats_recovery": 167, "replay_kl_oprd_recovery": 167,
    "fsar_shared_recovery": 167, "fsar_recovery": 209, "replay_kl_expert_recovery": 167,
    "joint": 104, "joint mopd.joint.passes=2": 208,
}
# the continual benchmark's methods at scale=gym (recipes/mopd/data/gym.yaml: 12 blocks per domain), plan lengths
GYM_STEPS = {"seq scale=gym": 36, "replay_kl scale=gym": 44, "replay_kl_fixed scale=gym mopd.replay.b=3": 46,
             "seq_recovery scale=gym mopd.recovery.blocks_per_domain=2": 42,
             "fsar_shared scale=gym mopd.signal.window=16": 44, "joint scale=gym": 36,
             "replay_kl_experts scale=gym": 44, "replay_kl scale=gym mopd.train.replay_std_floor=0.3": 44}
TINY = ["seq scale=tiny", "replay_kl scale=tiny", "fsar_shared scale=tiny mopd.signal.window=16",
        "replay_kl_fixed scale=tiny mopd.replay.b=2", "seq_recovery scale=tiny mopd.recovery.blocks_per_domain=2",
        "joint scale=tiny", "segments scale=tiny"]


def load(spelling, overrides=()):
    """``mopd/<recipe>`` with the spelling's overrides (``"seq scale=tiny"``: docs/recipes.md), then ``overrides``."""
    name, *spelled = spelling.split()
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        return compose(config_name=f"mopd/{name}", overrides=[*spelled, *overrides])


def test_every_table6_configuration_and_tiny_variant_has_a_recipe():
    assert {s.split()[0] for s in [*PAPER_STEPS, *TINY, *GYM_STEPS]} <= set(ALL)


def test_every_recipe_opens_with_its_command():
    for name in ALL:
        text = (RECIPES / f"{name}.yaml").read_text().splitlines()
        assert any(t.startswith(f"# python -m claas_verl.plan --config-name mopd/{name}") for t in text[:3]), name


@pytest.mark.parametrize("name", sorted(set(ALL) | set(PAPER_STEPS) | set(GYM_STEPS) | set(TINY)))
def test_recipe_composes_and_plans(name):
    cfg = load(name)
    assert cfg.plan.format == "text"
    plan = plan_from_config(cfg)
    if name in PAPER_STEPS:
        assert len(plan) == PAPER_STEPS[name]
        assert list(cfg.mopd.order) == ["logic", "math", "code", "safety", "if"]
        # prompt files of `python -m claas_verl.mopd.data mopd`, under $CLAAS_DATA_DIR (default data/mopd)
        assert cfg.mopd.domains.logic.prompts == f"{os.environ.get('CLAAS_DATA_DIR', 'data/mopd')}/logic/train.parquet"
        t = cfg.mopd.train
        assert (t.responses_per_prompt, t.temperature, t.top_p, t.max_prompt_length, t.max_response_length) == (
            4, 1.0, 1.0, 2048, 16384)
        assert (t.lr, list(t.betas), t.weight_decay, t.grad_clip, t.topk, cfg.mopd.block_size) == (
            1e-5, [0.9, 0.999], 0.01, 1000.0, 16, 32)
    elif name in GYM_STEPS:
        assert len(plan) == GYM_STEPS[name]
        assert list(cfg.mopd.order) == ["reverse", "spell", "palin"]
        assert cfg.mopd.domains.palin.expert.endswith("/experts/palin")
        assert cfg.mopd.domains.spell.test_prompts.endswith("/data/spell/test.parquet")
    elif "scale=tiny" not in name.split():  # a paper-scale recipe outside Table 6 (replay_kl_experts, segments)
        assert list(cfg.mopd.order) == ["logic", "math", "code", "safety", "if"] and len(plan) > 0
    else:
        assert list(cfg.mopd.order) == ["logic", "math", "code"]
        assert cfg.mopd.domains.code.expert.endswith("/experts/code")
        assert cfg.mopd.domains.math.prompts.endswith("/data/math/train.parquet")


def test_recipe_groups_set_the_signals():
    s = load("fsar").mopd.signal
    assert (s.sats, s.vr, s.hidden, s.rho, s.ratio, s.window, s.layers) == (True, True, True, 2.0, 1.0, 2000, "all")
    s = load("replay_kl_sats").mopd.signal
    assert (s.sats, s.vr, s.hidden, list(s.layers)) == (True, False, False, [6, 13, 20, 27])
    assert load("replay_kl_oprd").mopd.signal.hidden and not load("replay_kl").mopd.signal.sats


def test_tiny_dir_interpolation_follows_the_environment(monkeypatch):
    monkeypatch.setenv("CLAAS_TINY_DIR", "/somewhere/tiny")
    cfg = load("seq scale=tiny")
    assert cfg.mopd.student == "/somewhere/tiny/student"
    assert cfg.mopd.domains.logic.prompts == "/somewhere/tiny/data/logic/train.parquet"


def test_overrides_reach_the_plan():
    # the three-stage prefix of the paper runs from the five-domain recipe by overriding the order
    assert len(plan_from_config(load("replay_kl", ["mopd.order=[logic,math,code]"]))) == 76
    fixed_b3_fsar = load("replay_kl", ["mopd/budget=fixed_b7", "mopd.replay.b=3", "mopd/signal=fsar"])
    assert len(plan_from_config(fixed_b3_fsar)) == 138


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "claas_verl.plan", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_json_equals_library_plan_and_errors_name_the_key(tmp_path):
    # one subprocess per behaviour: importing claas_verl is slow on a shared CPU box
    out = run_cli("--config-name", "mopd/replay_kl_fixed", "scale=tiny", "plan.format=json", "mopd.replay.b=3",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # stdout holds the JSON document only
    expected = plan_from_config(load("replay_kl_fixed scale=tiny", ["mopd.replay.b=3"])).to_json_dict()
    assert doc == expected and len(doc["steps"]) == 10 + 1 + 6
    assert set(doc["steps"][0]) == {"stage", "kind", "domain", "block", "teacher"}
    assert list(tmp_path.iterdir()) == []  # planning writes no Hydra output folder or log

    bad = run_cli("--config-name", "mopd/seq_recovery", "scale=tiny", "mopd.recovery.blocks_per_domain=2",
                  "mopd.setting=S1", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "mopd.recovery.enabled" in bad.stderr and "mopd.setting=S2" in bad.stderr
