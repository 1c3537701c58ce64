"""The ``mopd.*`` section of a composed recipe as one frozen, validated schema, built once per process.

:meth:`MopdConfig.from_config` reads every key the MOPD code uses and checks it; a bad value raises ``ValueError``
naming the key and the fix (``mopd.sampler_poll_s=0: ...``). The schema owns each key's default and help text:
:class:`MopdConfig`, :class:`EvalConfig` and :class:`DomainConfig` here,
:class:`~claas_verl.mopd.config_train.TrainConfig` (``mopd.train``, with the verl keys derived from it),
:class:`~claas_verl.mopd.config_signal.SignalSection` (``mopd.signal``) and the planner's
:class:`claas_verl.schedule.ScheduleConfig`. The recipes repeat those defaults (``recipes/mopd/common/base.yaml``,
``train/paper.yaml``, ``signal/kl.yaml``; ``tests/mopd/test_mopd_config_schema.py`` holds them equal), and a run
reads the composed recipe: an unset key raises naming the file that sets it
(:func:`claas_verl.preflight.recipe_keys.recipe_key`). docs/config.md lists every key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from omegaconf import OmegaConf

from claas_verl.mopd.config_signal import SIGNAL_KEYS, AuxConfig, aux_config
from claas_verl.mopd.config_train import (
    TRAIN_KEYS,
    TRAIN_YAML,
    TrainConfig,
    check_bool,
    check_int,
    check_replay_std_floor,
    check_teacher_dtype,
    check_verl_keys,
)
from claas_verl.mopd.recipe_schedule import schedule_from_recipe
from claas_verl.preflight.recipe_keys import BASE_YAML, recipe_key
from claas_verl.schedule import ScheduleConfig
from claas_verl.utils.schema import knob

SIGNAL_YAML = "recipes/mopd/signal/kl.yaml"  # the base of every signal group
MODEL_YAML = "recipes/mopd/model/<group>.yaml"


def _path(node, key: str) -> str | None:
    """A path-like value, None where the recipe leaves it unset (``???``) or absent (checked where it is used)."""
    value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
    return None if value is None else str(value)


def _plain(node, key: str):
    """``key`` of ``node`` as plain Python (lists, not ListConfig); None where it is absent or ``???``."""
    value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_sampler_poll(poll) -> float:
    if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 60:
        raise ValueError(f"mopd.sampler_poll_s={poll!r}: give the sampler's polling interval in seconds, "
                         f"0 < s <= 60 ({BASE_YAML} sets 0.05)")
    return float(poll)


def check_probe_tolerance(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"mopd.weight_sync_max_abs_diff={value!r}: give the largest accepted served-vs-trained "
                         f"log-prob difference in nats (> 0; {BASE_YAML} sets 0.5), or null to only log it")
    return float(value)


@dataclass(frozen=True)
class DomainConfig:
    """``mopd.domains.<d>``: one domain of the stream (None: unset; preflight names a required path before Ray)."""

    prompts: str | None = knob(None, "the domain's training prompt file (parquet)")
    expert: str | None = knob(None, "E_d, the domain's expert: a local Hugging Face model directory")
    test_prompts: str | None = knob(None, "the domain's held-out prompts of the forgetting evaluation")
    num_blocks: int | None = knob(None, "blocks of the domain's stage (null: its prompts // mopd.block_size)")


@dataclass(frozen=True)
class EvalConfig:
    """``mopd.eval``: the held-out forgetting evaluation (student -> expert KL and score at every stage start and
    end)."""

    enabled: bool = knob(True, "run the forgetting evaluation")
    prompts: int = knob(4, "held-out prompts per learned domain (mopd.domains.<d>.test_prompts)")
    responses_per_prompt: int = knob(4, "sampled student responses per held-out prompt (KL and score are averaged "
                                     "over them)")


@dataclass(frozen=True)
class ProbeConfig:
    """``mopd.probe``: a fixed probe of forgetting inside a stage (benchmarks/plans/mopd_replay.md, "Per-step log").

    At every stage start, ``responses_per_prompt`` replies to the first ``prompts`` held-out prompts of every domain
    learned so far (the stage's own included) are sampled from M_{k-1} (``student:<k-1>``, loaded beside the stage's
    teachers; M_0 = π0) with ``seed``, and frozen for the stage. After every step: ``mopd/probe_kl/<domain>``, the
    exact full-vocabulary KL(student ‖ M_{k-1}) at τ = 1, token mean over those replies, and ``mopd/update_norm``,
    ‖θ_after − θ_before‖. The probe's replies are sampled with one full forward per token (no KV cache, every rank
    alike), which suits short responses (the gym benchmark's 40 tokens), not 16k-token ones."""

    enabled: bool = knob(False, "log the fixed probe's KL to M_{k-1} and the update norm after every step")
    prompts: int = knob(16, "held-out prompts per domain learned so far (mopd.domains.<d>.test_prompts)")
    responses_per_prompt: int = knob(2, "replies per probe prompt, sampled from M_{k-1} at the stage start")
    seed: int = knob(0, "the probe's sampling seed at every stage start")


@dataclass(frozen=True)
class MopdConfig:
    """``mopd.*`` of a composed recipe, validated (see the module doc)."""

    student: str = knob(help="π_0, the student: a local Hugging Face model directory")
    domains: Mapping[str, DomainConfig] = knob(help="the domains by name (keys: DomainConfig)")
    block_size: int = knob(32, "prompts per block (one plan step trains on one block)")
    sampler_poll_s: float = knob(0.05, "how often verl's sync sampler looks for the step's finished rollouts "
                                 "(verl: 2 s)")
    weight_sync_probe_tokens: int = knob(8, "after every weight sync the rollout and the trainer score a fixed "
                                         "probe of this many tokens (rollout/weight_sync_max_abs_logprob_diff, "
                                         "~1e-5 when the update arrived); 0: off")
    weight_sync_max_abs_diff: float | None = knob(0.5, "the job stops (ServedWeightsMismatch) when a replica's "
                                                  "probe log-probs differ from the trainer's by more than this "
                                                  "(nats, max and mean over the probe); bf16 rollouts: 0.06-0.13; "
                                                  "null: only log the metric")
    train: TrainConfig = knob(help="optimizer, sampling and precision", factory=TrainConfig)
    eval: EvalConfig = knob(help="the forgetting evaluation", factory=EvalConfig)
    probe: ProbeConfig = knob(help="the fixed per-step probe of forgetting", factory=ProbeConfig)
    signal: AuxConfig = knob(help="the alignment terms (keys: SignalSection)", factory=AuxConfig)
    schedule: ScheduleConfig | None = knob(None, "the plan (keys: the planner's, docs/math.md §B.8)")

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

        def integer(dotted: str, minimum: int, why: str) -> int:
            return check_int(recipe_key(mopd, dotted), dotted, minimum, why)

        built = cls(
            student=student,
            block_size=integer("block_size", 1, "prompts per block"),
            sampler_poll_s=check_sampler_poll(recipe_key(mopd, "sampler_poll_s")),
            weight_sync_probe_tokens=integer("weight_sync_probe_tokens", 0,
                                             "tokens of the weight-sync probe, 0 to turn it off"),
            weight_sync_max_abs_diff=check_probe_tolerance(recipe_key(mopd, "weight_sync_max_abs_diff")),
            domains=MappingProxyType({str(d): _domain(domains[d]) for d in domains}),
            train=TrainConfig.from_mapping(lambda name: recipe_key(mopd, f"train.{name}", TRAIN_YAML)),
            eval=EvalConfig(
                enabled=check_bool(recipe_key(mopd, "eval.enabled"), "eval.enabled", "run the forgetting evaluation"),
                prompts=integer("eval.prompts", 1, "held-out prompts per domain"),
                responses_per_prompt=integer("eval.responses_per_prompt", 1, "sampled responses per held-out prompt"),
            ),
            probe=ProbeConfig(
                enabled=check_bool(recipe_key(mopd, "probe.enabled"), "probe.enabled", "log the fixed probe"),
                prompts=integer("probe.prompts", 1, "held-out prompts per domain of the probe"),
                responses_per_prompt=integer("probe.responses_per_prompt", 1, "replies per probe prompt"),
                seed=integer("probe.seed", 0, "the probe's sampling seed"),
            ),
            signal=_signal(mopd),
            schedule=schedule_from_recipe(mopd),
        )
        check_verl_keys(cfg, lambda dotted: _plain(cfg, dotted))  # verl keys derived from mopd.*, not set apart
        return built

    @property
    def order(self) -> tuple[str, ...]:
        return self.schedule.order


def _signal(mopd) -> AuxConfig:
    signal = {k: recipe_key(mopd, f"signal.{k}", SIGNAL_YAML) for k in SIGNAL_KEYS}
    for k in ("sats", "vr", "hidden", "drop_trailing"):
        why = "drop a final region without a separator (docs/math.md §B.4)" if k == "drop_trailing" else \
            "turns this alignment term on (docs/math.md §B.3-B.5)"
        check_bool(signal[k], f"signal.{k}", why)
    return aux_config(signal)


def _domain(node) -> DomainConfig:
    return DomainConfig(_path(node, "prompts"), _path(node, "expert"), _path(node, "test_prompts"),
                        OmegaConf.select(node, "num_blocks", default=None))  # the planner validates num_blocks


__all__ = ["MopdConfig", "DomainConfig", "TrainConfig", "EvalConfig", "ProbeConfig", "check_sampler_poll",
           "check_replay_std_floor", "check_teacher_dtype", "SIGNAL_KEYS", "TRAIN_KEYS"]
