"""``MopdConfig``: every MOPD recipe builds it; a bad value names its key, an unset one the YAML that sets it; it is
frozen; and the code defaults that plain-mapping callers see agree with the recipes'."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from claas_verl.mopd.config import SIGNAL_KEYS, MopdConfig

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "recipes"))
from recipe_spellings import SPELLINGS  # noqa: E402

# every recipe (paper scale) and every documented spelling of the other scales (docs/recipes.md): "seq",
# "seq scale=tiny", "seq_recovery scale=tiny mopd.recovery.blocks_per_domain=2", ...
RECIPES = sorted({p.stem for p in (REPO / "recipes" / "mopd").glob("*.yaml")}
                 | {s.removeprefix("mopd/") for s in SPELLINGS.values() if s.startswith("mopd/")})


@pytest.fixture(scope="module")
def composed(tmp_path_factory) -> dict:
    """Every recipe under recipes/mopd at every scale, composed as ``python -m claas_verl.plan`` composes it (no
    runtime group)."""
    from hydra import compose, initialize_config_dir

    from claas_verl.paths import recipes_dir

    tiny = tmp_path_factory.mktemp("tiny")  # paths only: the domains give num_blocks, nothing is read
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        return {r: compose(config_name=f"mopd/{r.split()[0]}", overrides=[*r.split()[1:], f"tiny_dir={tiny}"])
                for r in RECIPES}


def _with(cfg, **changes):
    """A copy of ``cfg`` with ``mopd.<dotted>`` set (value) or deleted (``...``)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for dotted, value in changes.items():
        parent, leaf = f"mopd.{dotted.replace('__', '.')}".rsplit(".", 1)
        node = OmegaConf.select(out, parent)
        if value is ...:
            del node[leaf]
        else:
            node[leaf] = value
    return out


def test_every_mopd_recipe_builds_the_schema(composed):
    assert len(composed) == len(RECIPES) > 30
    for recipe, cfg in composed.items():
        mopd = MopdConfig.from_config(cfg)
        assert mopd.block_size == cfg.mopd.block_size and mopd.train.topk == cfg.mopd.train.topk, recipe
        assert set(mopd.order) <= set(mopd.domains), recipe
        assert mopd.signal.enabled == any(cfg.mopd.signal[t] for t in ("sats", "vr", "hidden")), recipe
    fsar = MopdConfig.from_config(composed["fsar_shared scale=tiny mopd.signal.window=16"])
    assert fsar.signal.terms == ("sats", "vr", "hidden") and fsar.signal.kinds == ("replay",)
    tiny = MopdConfig.from_config(composed["seq scale=tiny"])
    assert tiny.domains["logic"].test_prompts.endswith("data/logic/test.parquet")
    assert (tiny.sampler_poll_s, tiny.weight_sync_probe_tokens, tiny.eval.enabled) == (0.05, 8, True)
    assert tiny.weight_sync_max_abs_diff == 0.5  # the check acts by default
    # a path the recipe leaves required (`???`) stays unset here; preflight names it before Ray starts
    assert MopdConfig.from_config(composed["seq"]).domains["code"].expert is None


@pytest.mark.parametrize("key, value, message", [
    ("sampler_poll_s", 0, r"mopd.sampler_poll_s=0: give the sampler's polling interval in seconds, 0 < s <= 60 "
                          r"\(recipes/mopd/common/base.yaml sets 0.05\)"),
    ("sampler_poll_s", -1, r"mopd.sampler_poll_s=-1"),
    ("sampler_poll_s", 120, r"mopd.sampler_poll_s=120"),
    ("sampler_poll_s", "fast", r"mopd.sampler_poll_s='fast'"),
    ("sampler_poll_s", True, r"mopd.sampler_poll_s=True"),
    ("block_size", 0, r"mopd.block_size=0: prompts per block \(an integer >= 1\)"),
    ("weight_sync_probe_tokens", -1, r"mopd.weight_sync_probe_tokens=-1: .*0 to turn it off"),
    ("weight_sync_probe_tokens", None, r"mopd.weight_sync_probe_tokens=None"),
    ("weight_sync_max_abs_diff", 0, r"mopd.weight_sync_max_abs_diff=0: .*\(> 0; recipes/mopd/common/base.yaml sets "
                                    r"0.5\), or null to only log it"),
    ("weight_sync_max_abs_diff", "tight", r"mopd.weight_sync_max_abs_diff='tight'"),
    ("train__topk", 0, r"mopd.train.topk=0"),
    ("train__teacher_dtype", "fp16", r"mopd.train.teacher_dtype must be one of"),
    ("train__fresh_optimizer_per_stage", "yes", r"mopd.train.fresh_optimizer_per_stage='yes'.*true or false"),
    ("train__max_response_length", 0, r"mopd.train.max_response_length=0"),
    ("train__replay_std_floor", -0.5, r"mopd.train.replay_std_floor=-0.5: the least σ .*sets 0.0"),
    ("train__replay_std_floor", "high", r"mopd.train.replay_std_floor='high'"),
    ("train__std_floor_kinds", [], r"mopd.train.std_floor_kinds=\[\]: the plan step kinds .*sets \[replay\]"),
    ("train__std_floor_kinds", ["replay", "warmup"], r"mopd.train.std_floor_kinds=\['replay', 'warmup'\]: .*'new', "
                                                     r"'replay', 'recovery', 'joint'"),
    ("train__std_floor_kinds", ["replay", "replay"], r"a non-empty list of distinct kinds"),
    ("train__replay_weight", 0, r"mopd.train.replay_weight=0: the constant .* > 0 .*sets 1.0, the paper"),
    ("train__replay_weight", float("inf"), r"mopd.train.replay_weight=inf"),
    ("train__replay_optimizer", "own", r"mopd.train.replay_optimizer='own': choose one of \['shared', 'separate'\]"),
    ("train__replay_responses_per_prompt", 6, r"replay_responses_per_prompt=6: .* positive multiple of 4"),
    ("train__replay_responses_per_prompt", 0, r"replay_responses_per_prompt=0"),
    ("probe__enabled", "on", r"mopd.probe.enabled='on'.*\(true or false\)"),
    ("probe__prompts", 0, r"mopd.probe.prompts=0: held-out prompts per domain of the probe \(an integer >= 1\)"),
    ("probe__responses_per_prompt", 0, r"mopd.probe.responses_per_prompt=0"),
    ("probe__seed", -1, r"mopd.probe.seed=-1"),
    ("replay__cycle", "backwards", r"mopd.replay.cycle: must be one of \['forward', 'reversed'\], got 'backwards'"),
    ("eval__enabled", 1, r"mopd.eval.enabled=1: run the forgetting evaluation \(true or false\)"),
    ("eval__prompts", 0, r"mopd.eval.prompts=0"),
    ("signal__window", 0, r"mopd.signal.window must be >= 1"),
    ("signal__hidden", "yes", r"mopd.signal.hidden='yes': .*\(true or false\)"),
    ("signal__aux_kinds", ["new"], r"mopd.signal.aux_kinds must be a non-empty subset"),
    ("student", "", r"mopd.student='': set it to the student's local Hugging Face model directory"),
])
def test_a_bad_value_names_its_key(composed, key, value, message):
    with pytest.raises(ValueError, match=message):
        MopdConfig.from_config(_with(composed["seq scale=tiny"], **{key: value}))


@pytest.mark.parametrize("key, home", [
    ("sampler_poll_s", "recipes/mopd/common/base.yaml"),
    ("weight_sync_probe_tokens", "recipes/mopd/common/base.yaml"),
    ("weight_sync_max_abs_diff", "recipes/mopd/common/base.yaml"),
    ("eval__prompts", "recipes/mopd/common/base.yaml"),
    ("train__teacher_dtype", "recipes/mopd/train/paper.yaml"),
    ("train__fresh_optimizer_per_stage", "recipes/mopd/train/paper.yaml"),
    ("train__replay_std_floor", "recipes/mopd/train/paper.yaml"),
    ("train__replay_weight", "recipes/mopd/train/paper.yaml"),
    ("train__std_floor_kinds", "recipes/mopd/train/paper.yaml"),
    ("train__replay_optimizer", "recipes/mopd/train/paper.yaml"),
    ("probe__seed", "recipes/mopd/common/base.yaml"),
    ("signal__target_budget_gib", "recipes/mopd/signal/kl.yaml"),
    ("signal__drop_trailing", "recipes/mopd/signal/kl.yaml"),
    ("student", "recipes/mopd/model/<group>.yaml"),
])
def test_an_unset_key_names_the_yaml_that_sets_it(composed, key, home):
    dotted = key.replace("__", ".")
    with pytest.raises(ValueError, match=rf"mopd.{dotted} is not set: compose {home}"):
        MopdConfig.from_config(_with(composed["seq scale=tiny"], **{key: ...}))


def test_a_config_without_a_mopd_section_is_named():
    with pytest.raises(ValueError, match="no `mopd` section"):
        MopdConfig.from_config(OmegaConf.create({"trainer": {}}))


def test_the_schema_is_frozen(composed):
    mopd = MopdConfig.from_config(composed["fsar_shared scale=tiny mopd.signal.window=16"])
    for obj, field in ((mopd, "block_size"), (mopd.train, "topk"), (mopd.eval, "prompts"), (mopd.signal, "window"),
                       (mopd.domains["logic"], "expert")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, 1)
    with pytest.raises(TypeError):
        mopd.domains["logic"] = mopd.domains["math"]  # a read-only mapping


def test_the_signal_base_sets_every_key_and_agrees_with_the_alignment_defaults():
    """``mopd.signal`` keys are required of the recipe (every signal group composes ``signal/kl.yaml``);
    :class:`AuxConfig`'s defaults serve plain-mapping callers (tests, the worker round trip) and must equal it."""
    from claas_verl.mopd.trainer.alignment import AuxConfig, aux_config

    kl = OmegaConf.load(REPO / "recipes" / "mopd" / "signal" / "kl.yaml").mopd.signal
    assert set(kl.keys()) == set(SIGNAL_KEYS)
    assert aux_config(kl) == AuxConfig() == aux_config({})
    # every AuxConfig field is fed by one of SIGNAL_KEYS (the three terms, aux_kinds -> kinds)
    fed = {"terms", "kinds"} | set(SIGNAL_KEYS)
    assert {f.name for f in dataclasses.fields(AuxConfig)} <= fed


def test_the_schedule_defaults_agree_with_the_base_recipe():
    """The planner's dataclass defaults (plain-mapping callers) equal ``recipes/mopd/common/base.yaml``."""
    from claas_verl.schedule import ScheduleConfig

    domains = {"order": ["a", "b"], "domains": {"a": {"num_blocks": 2}, "b": {"num_blocks": 3}}}
    base = OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "mopd" / "common" / "base.yaml").mopd)
    assert ScheduleConfig.from_dict({**base, **domains}) == ScheduleConfig.from_dict(domains)


def test_the_replay_arms_are_read_and_a_separate_state_needs_fresh_stages(composed):
    base = composed["seq scale=tiny"]
    cfg = MopdConfig.from_config(_with(base, train__replay_weight=0.1, train__replay_optimizer="separate",
                                       train__replay_responses_per_prompt=16, replay__cycle="reversed",
                                       probe__enabled=True, probe__prompts=3))
    assert (cfg.train.replay_weight, cfg.train.replay_optimizer, cfg.train.replay_responses_per_prompt) == (
        0.1, "separate", 16)
    assert cfg.schedule.replay.cycle == "reversed" and cfg.probe.enabled and cfg.probe.prompts == 3
    with pytest.raises(ValueError, match=r"replay_optimizer=separate needs mopd.train.fresh_optimizer_per_stage=true"):
        MopdConfig.from_config(_with(base, train__replay_optimizer="separate", train__fresh_optimizer_per_stage=False))
    paper = MopdConfig.from_config(base)
    assert (paper.train.replay_weight, paper.train.replay_optimizer, paper.train.replay_responses_per_prompt) == (
        1.0, "shared", None)
    assert paper.schedule.replay.cycle == "forward" and not paper.probe.enabled


def test_the_floor_step_kinds_are_the_plans_step_kinds():
    from claas_verl.mopd.config_train import FLOOR_STEP_KINDS
    from claas_verl.schedule.plan import KINDS

    assert FLOOR_STEP_KINDS == KINDS  # the config layer keeps its own copy (no schedule import there)
