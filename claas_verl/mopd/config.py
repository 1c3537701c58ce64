"""The ``mopd.*`` section of a composed recipe as one frozen, validated schema, built once per process.

:meth:`MopdConfig.from_config` reads every key the MOPD code uses (the planner's keys through
:class:`claas_verl.schedule.ScheduleConfig`, ``mopd.signal`` through
:func:`claas_verl.mopd.trainer.alignment.aux_config`) and checks it; a bad value raises ``ValueError`` naming the
key and the fix (``mopd.sampler_poll_s=0: ...``). The code holds no default of its own that could disagree with the
YAML: an unset key raises naming the file that sets it (:func:`claas_verl.preflight.recipe_keys.recipe_key`). The
schedule's and :class:`AuxConfig`'s dataclass defaults serve plain-mapping callers (tests, the worker round trip);
``tests/mopd/test_mopd_config.py`` keeps them equal to ``recipes/mopd/common/base.yaml`` and
``recipes/mopd/signal/kl.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from omegaconf import OmegaConf

from claas_verl.distill.topk import check_std_floor
from claas_verl.mopd.trainer.alignment import AuxConfig, aux_config
from claas_verl.mopd.trainer.config_checks import check_teacher_dtype
from claas_verl.preflight.recipe_keys import BASE_YAML, TRAIN_YAML, recipe_key
from claas_verl.schedule import ScheduleConfig

SIGNAL_YAML = "recipes/mopd/signal/kl.yaml"  # the base of every signal group
MODEL_YAML = "recipes/mopd/model/<group>.yaml"
# every key of mopd.signal, all set by SIGNAL_YAML (aux_kinds: the plan step kinds that run the alignment terms)
SIGNAL_KEYS = ("sats", "vr", "hidden", "ratio", "rho", "window", "layers", "drop_trailing", "aux_kinds", "combine",
               "target_budget_gib")


def _int(value, key: str, minimum: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"mopd.{key}={value!r}: {why} (an integer >= {minimum})")
    return value


def _bool(value, key: str, why: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"mopd.{key}={value!r}: {why} (true or false)")
    return value


def _path(node, key: str) -> str | None:
    """A path-like value, None where the recipe leaves it unset (``???``) or absent (checked where it is used)."""
    value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
    return None if value is None else str(value)


def check_sampler_poll(poll) -> float:
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 60:
        raise ValueError(f"mopd.sampler_poll_s={poll!r}: give the sampler's polling interval in seconds, "
                         f"0 < s <= 60 ({BASE_YAML} sets 0.05)")
    return float(poll)


def check_replay_std_floor(value) -> float:
    try:
        return check_std_floor(value)
    except ValueError:
        raise ValueError(f"mopd.train.replay_std_floor={value!r}: the least σ a replay step's rewards are divided "
                         f"by, a finite number >= 0 ({TRAIN_YAML} sets 0.0, the paper's σ_d)") from None


@dataclass(frozen=True)
class DomainConfig:
    """``mopd.domains.<d>``: its prompt file, its expert E_d and its held-out prompts (None: unset)."""

    prompts: str | None
    expert: str | None
    test_prompts: str | None


@dataclass(frozen=True)
class TrainConfig:
    """The ``mopd.train`` keys the MOPD code reads (the optimizer's are mapped onto verl's keys by the recipes)."""

    topk: int  # κ of eqs. (4)-(5)
    teacher_dtype: str  # docs/math.md §B.1 precision of the teachers' forwards
    fresh_optimizer_per_stage: bool
    replay_std_floor: float  # replay steps divide by max(σ_d, floor) (docs/math.md §B.2.2); 0: the paper
    max_prompt_length: int
    max_response_length: int


@dataclass(frozen=True)
class EvalConfig:
    """``mopd.eval``: the held-out forgetting evaluation."""

    enabled: bool
    prompts: int  # held-out prompts per learned domain


@dataclass(frozen=True)
class MopdConfig:
    """``mopd.*`` of a composed recipe, validated (see the module doc)."""

    student: str
    block_size: int
    sampler_poll_s: float  # verl's sync sampler's polling interval
    weight_sync_probe_tokens: int  # 0: no weight-sync probe
    domains: Mapping[str, DomainConfig]
    train: TrainConfig
    eval: EvalConfig
    signal: AuxConfig
    schedule: ScheduleConfig

    @classmethod
    def from_config(cls, cfg) -> MopdConfig:
        """Build from the composed config (an OmegaConf node with a ``mopd`` section)."""
        mopd = OmegaConf.select(cfg, "mopd", default=None)
        if mopd is None:
            raise ValueError("mopd: the config has no `mopd` section; compose a recipe under recipes/mopd/")
        student = recipe_key(mopd, "student", MODEL_YAML)
        if not isinstance(student, str) or not student:
            raise ValueError(f"mopd.student={student!r}: set it to the student's local Hugging Face model directory")
        domains = recipe_key(mopd, "domains", "recipes/mopd/data/<group>.yaml")
        return cls(
            student=student,
            block_size=_int(recipe_key(mopd, "block_size"), "block_size", 1, "prompts per block"),
            sampler_poll_s=check_sampler_poll(recipe_key(mopd, "sampler_poll_s")),
            weight_sync_probe_tokens=_int(recipe_key(mopd, "weight_sync_probe_tokens"), "weight_sync_probe_tokens", 0,
                                          "tokens of the weight-sync probe, 0 to turn it off"),
            domains=MappingProxyType({str(d): DomainConfig(_path(domains[d], "prompts"), _path(domains[d], "expert"),
                                                           _path(domains[d], "test_prompts")) for d in domains}),
            train=_train(mopd),
            eval=EvalConfig(
                enabled=_bool(recipe_key(mopd, "eval.enabled"), "eval.enabled", "run the forgetting evaluation"),
                prompts=_int(recipe_key(mopd, "eval.prompts"), "eval.prompts", 1, "held-out prompts per domain"),
            ),
            signal=_signal(mopd),
            schedule=ScheduleConfig.from_omegaconf(mopd),
        )

    @property
    def order(self) -> tuple[str, ...]:
        return self.schedule.order


def _signal(mopd) -> AuxConfig:
    signal = {k: recipe_key(mopd, f"signal.{k}", SIGNAL_YAML) for k in SIGNAL_KEYS}
    for k in ("sats", "vr", "hidden", "drop_trailing"):
        why = "drop a final region without a separator (docs/math.md §B.4)" if k == "drop_trailing" else \
            "turns this alignment term on (docs/math.md §B.3-B.5)"
        _bool(signal[k], f"signal.{k}", why)
    return aux_config(signal)


def _train(mopd) -> TrainConfig:
    def key(name):
        return recipe_key(mopd, f"train.{name}", TRAIN_YAML)

    length = "tokens (the verl rollout's max_model_len is their sum)"
    return TrainConfig(
        topk=_int(key("topk"), "train.topk", 1, "κ, the student's top-k candidates of eqs. (4)-(5)"),
        teacher_dtype=check_teacher_dtype(key("teacher_dtype")),
        fresh_optimizer_per_stage=_bool(key("fresh_optimizer_per_stage"), "train.fresh_optimizer_per_stage",
                                        "a new AdamW state at every stage (docs/math.md §B.1)"),
        replay_std_floor=check_replay_std_floor(key("replay_std_floor")),
        max_prompt_length=_int(key("max_prompt_length"), "train.max_prompt_length", 1, length),
        max_response_length=_int(key("max_response_length"), "train.max_response_length", 1, length),
    )


__all__ = ["MopdConfig", "DomainConfig", "TrainConfig", "EvalConfig", "check_sampler_poll", "SIGNAL_KEYS"]
