"""``mopd.train``: the optimizer, sampling and precision keys of a MOPD run (MOPD paper App. "Training details",
docs/math.md §B.1), their defaults, help text and validation (pure python: the config layer).

:class:`TrainConfig` reads every key of ``mopd.train``. The trainer uses ``topk``, ``teacher_dtype``,
``fresh_optimizer_per_stage``, ``replay_std_floor`` and ``std_floor_kinds``, the replay arms (``replay_weight``,
``replay_optimizer``, ``replay_responses_per_prompt``) and the lengths itself; the others are verl's settings under a
MOPD name, and ``recipes/mopd/verl/*.yaml`` derive verl's keys from them by interpolation, in that one place
(:data:`VERL_KEYS` lists each derived key; :func:`check_verl_keys` refuses a composed config where a verl key was
set apart from its ``mopd.train`` key, so composition order never decides which of two values wins).
``recipes/mopd/train/paper.yaml`` repeats the defaults (held equal by ``tests/mopd/test_mopd_config_schema.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from claas_verl.preflight.recipe_keys import TRAIN_YAML
from claas_verl.utils.schema import knob

# mopd.train.teacher_dtype: docs/math.md §B.1 teachers hold fp32 weights and run under bf16 autocast (GPU recipes);
# "fp32" runs them in plain fp32 (the CPU runtime), "bf16" casts the weights (FSDP param_dtype=bf16)
TEACHER_DTYPES = ("fp32_bf16_autocast", "fp32", "bf16")
FSDP_DTYPES = ("bf16", "fp16", "fp32")  # verl's FSDP mixed-precision dtypes
LR_SCHEDULES = ("constant", "cosine")  # verl's optim.lr_scheduler_type
REPLAY_OPTIMIZERS = ("shared", "separate")  # mopd.train.replay_optimizer

# mopd.<key> -> the verl keys recipes/mopd/verl/*.yaml derive from it (``${mopd.<key>}``)
VERL_KEYS = {
    "train.responses_per_prompt": ("actor_rollout_ref.rollout.n",),
    "train.temperature": ("actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.val_kwargs.temperature"),
    "train.top_p": ("actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.val_kwargs.top_p"),
    "train.max_prompt_length": ("data.max_prompt_length", "actor_rollout_ref.rollout.prompt_length"),
    "train.max_response_length": ("data.max_response_length", "actor_rollout_ref.rollout.response_length"),
    "train.lr": ("actor_rollout_ref.actor.optim.lr",),
    "train.lr_schedule": ("actor_rollout_ref.actor.optim.lr_scheduler_type",),
    "train.warmup_steps": ("actor_rollout_ref.actor.optim.lr_warmup_steps",),
    "train.betas": ("actor_rollout_ref.actor.optim.betas",),
    "train.weight_decay": ("actor_rollout_ref.actor.optim.weight_decay",),
    "train.grad_clip": ("actor_rollout_ref.actor.optim.clip_grad",),
    "train.ppo_epochs": ("actor_rollout_ref.actor.ppo_epochs",),
    "train.clip_ratio": ("actor_rollout_ref.actor.clip_ratio",),
    "train.clip_ratio_c": ("actor_rollout_ref.actor.clip_ratio_c",),
    "train.kl_coef": ("algorithm.kl_ctrl.kl_coef",),
    "train.entropy_coeff": ("actor_rollout_ref.actor.entropy_coeff",),
    "train.student_param_dtype": ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",),
    "train.grad_reduce_dtype": ("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype",),
    "eval.responses_per_prompt": ("actor_rollout_ref.rollout.val_kwargs.n",),
    "block_size": ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    "student": ("actor_rollout_ref.model.path",),
}


def check_teacher_dtype(value) -> str:
    if value not in TEACHER_DTYPES:
        raise ValueError(f"mopd.train.teacher_dtype must be one of {list(TEACHER_DTYPES)}, got {value!r}")
    return str(value)


def check_replay_std_floor(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"mopd.train.replay_std_floor={value!r}: the least σ a replay step's rewards are divided "
                         f"by, a finite number >= 0 ({TRAIN_YAML} sets 0.0, the paper's σ_d)")
    return float(value)


# Plan step kinds the σ floor may apply to (claas_verl.schedule.plan.KINDS; not imported: this layer is pure python)
FLOOR_STEP_KINDS = ("new", "replay", "recovery", "joint")


def check_std_floor_kinds(value) -> tuple[str, ...]:
    """``mopd.train.std_floor_kinds``: a non-empty list of distinct plan step kinds."""
    kinds = [value] if isinstance(value, str) else value
    try:
        kinds = tuple(kinds)
    except TypeError:
        kinds = ()
    if not kinds or any(k not in FLOOR_STEP_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"mopd.train.std_floor_kinds={value!r}: the plan step kinds whose rewards are divided by "
                         f"max(σ_d, replay_std_floor), a non-empty list of distinct kinds from "
                         f"{list(FLOOR_STEP_KINDS)} ({TRAIN_YAML} sets [replay])")
    return kinds


def check_replay_weight(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"mopd.train.replay_weight={value!r}: the constant a replay step's advantages are multiplied "
                         f"by after σ_d, a finite number > 0 ({TRAIN_YAML} sets 1.0, the paper)")
    return float(value)


def check_replay_responses(value, responses_per_prompt: int) -> int | None:
    """``mopd.train.replay_responses_per_prompt``: null (the new-domain steps' count) or a multiple of
    ``responses_per_prompt``: verl sizes its batch padding (``_get_dp_size_divisor``) by ``rollout.n``, so a replay
    step of R replies per prompt must stay a whole number of n-reply groups to add no padding rows."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % responses_per_prompt:
        raise ValueError(f"mopd.train.replay_responses_per_prompt={value!r}: replies per prompt on replay steps, "
                         f"null (mopd.train.responses_per_prompt={responses_per_prompt}) or a positive multiple of "
                         f"{responses_per_prompt} (verl pads a step batch to whole groups of rollout.n replies)")
    return value


def check_int(value, key: str, minimum: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"mopd.{key}={value!r}: {why} (an integer >= {minimum})")
    return value


def check_bool(value, key: str, why: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"mopd.{key}={value!r}: {why} (true or false)")
    return value


def _number(value, key: str, low: float, high: float = math.inf, *, open_low: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < low or value > high or (open_low and value == low):
        bound = f"> {low}" if open_low else f">= {low}"
        bound += f" and <= {high}" if high < math.inf else ""
        raise ValueError(f"mopd.{key}={value!r}: give a finite number {bound}")
    return float(value)


def _choice(value, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"mopd.{key}={value!r}: choose one of {list(allowed)}")
    return str(value)


@dataclass(frozen=True)
class TrainConfig:
    """``mopd.train``: every key, with the MOPD paper's values as defaults."""

    responses_per_prompt: int = knob(4, "sampled student responses per prompt")
    temperature: float = knob(1.0, "sampling temperature of the training and evaluation rollouts")
    top_p: float = knob(1.0, "top-p of the training and evaluation rollouts")
    max_prompt_length: int = knob(2048, "longest prompt in tokens (a longer one is refused before Ray starts; the "
                                  "rollout's max_model_len is the sum of the two lengths)")
    max_response_length: int = knob(16384, "longest response in tokens")
    lr: float = knob(1.0e-5, "AdamW learning rate")
    lr_schedule: str = knob("constant", "learning-rate schedule (verl's lr_scheduler_type: constant, cosine)")
    warmup_steps: int = knob(0, "learning-rate warm-up steps")
    betas: tuple[float, float] = knob((0.9, 0.999), "AdamW betas")
    weight_decay: float = knob(0.01, "AdamW weight decay")
    grad_clip: float = knob(1000.0, "gradient-norm clip")
    fresh_optimizer_per_stage: bool = knob(True, "a new AdamW state at every stage, recovery included "
                                           "(docs/math.md §B.1)")
    ppo_epochs: int = knob(1, "epochs over a step's block; one epoch of one mini-batch (ppo_mini_batch_size = "
                           "block_size) is one optimizer update per plan step, ratio 1 (docs/math.md §B.1)")
    clip_ratio: float = knob(0.2, "PPO clip ratio (never acts: the ratio is 1)")
    clip_ratio_c: float = knob(3.0, "dual-clip constant (never acts)")
    kl_coef: float = knob(0.0, "KL-in-reward coefficient (MOPD uses none)")
    entropy_coeff: float = knob(0.0, "entropy bonus coefficient")
    topk: int = knob(16, "κ: the student's top-κ candidates of eqs. (4)-(5)")
    replay_std_floor: float = knob(0.0, "replay steps divide their rewards by max(σ_d, floor) (docs/math.md "
                                   "§B.2.2); 0: σ_d, the paper; > 0 is a deviation")
    std_floor_kinds: tuple[str, ...] = knob(("replay",), "the plan step kinds replay_std_floor applies to: replay "
                                            "(default); recovery and new add the other steps that can start next "
                                            "to their teacher (docs/math.md §B.2.2)")
    replay_responses_per_prompt: int | None = knob(None, "sampled responses per prompt on replay steps only (null: "
                                                   "responses_per_prompt, the paper; else a multiple of it)")
    replay_weight: float = knob(1.0, "replay steps' advantages are multiplied by this constant after σ_d (1: the "
                                "paper; a deviation otherwise)")
    replay_optimizer: str = knob("shared", "AdamW state of replay steps: shared (one state for every step of a stage, "
                                 "the paper) | separate (replay steps keep their own state, fresh every stage; "
                                 "docs/verl-couplings.md says what verl forces)")
    teacher_dtype: str = knob("fp32_bf16_autocast", "precision of the teachers' forwards (docs/math.md §B.1): "
                              "fp32_bf16_autocast (fp32 weights, bf16 autocast) | fp32 | bf16")
    student_param_dtype: str = knob("bf16", "the student's FSDP param_dtype (fp32 master weights)")
    grad_reduce_dtype: str = knob("fp32", "the student's FSDP gradient-reduction dtype")

    @classmethod
    def from_mapping(cls, get) -> TrainConfig:
        """Validate every key; ``get(name)`` returns ``mopd.train.<name>`` (or raises naming the YAML that sets it)."""
        length = "tokens (the verl rollout's max_model_len is their sum)"
        betas = list(get("betas"))
        responses = check_int(get("responses_per_prompt"), "train.responses_per_prompt", 1,
                              "sampled responses per prompt")
        replay_optimizer = _choice(get("replay_optimizer"), "train.replay_optimizer", REPLAY_OPTIMIZERS)
        fresh = check_bool(get("fresh_optimizer_per_stage"), "train.fresh_optimizer_per_stage",
                           "a new AdamW state at every stage (docs/math.md §B.1)")
        if replay_optimizer == "separate" and not fresh:
            raise ValueError("mopd.train.replay_optimizer=separate needs mopd.train.fresh_optimizer_per_stage=true: "
                             "the replay steps' own AdamW state is fresh every stage and lives only in the worker "
                             "(verl's checkpoint holds one optimizer state), so it cannot carry across stages")
        if len(betas) != 2:
            raise ValueError(f"mopd.train.betas={betas!r}: give AdamW's two betas, e.g. [0.9, 0.999]")
        return cls(
            responses_per_prompt=responses,
            temperature=_number(get("temperature"), "train.temperature", 0.0),
            top_p=_number(get("top_p"), "train.top_p", 0.0, 1.0, open_low=True),
            max_prompt_length=check_int(get("max_prompt_length"), "train.max_prompt_length", 1, length),
            max_response_length=check_int(get("max_response_length"), "train.max_response_length", 1, length),
            lr=_number(get("lr"), "train.lr", 0.0, open_low=True),
            lr_schedule=_choice(get("lr_schedule"), "train.lr_schedule", LR_SCHEDULES),
            warmup_steps=check_int(get("warmup_steps"), "train.warmup_steps", 0, "learning-rate warm-up steps"),
            betas=tuple(_number(b, f"train.betas[{i}]", 0.0, 1.0) for i, b in enumerate(betas)),
            weight_decay=_number(get("weight_decay"), "train.weight_decay", 0.0),
            grad_clip=_number(get("grad_clip"), "train.grad_clip", 0.0, open_low=True),
            fresh_optimizer_per_stage=fresh,
            ppo_epochs=check_int(get("ppo_epochs"), "train.ppo_epochs", 1, "epochs per step"),
            clip_ratio=_number(get("clip_ratio"), "train.clip_ratio", 0.0, open_low=True),
            clip_ratio_c=_number(get("clip_ratio_c"), "train.clip_ratio_c", 0.0, open_low=True),
            kl_coef=_number(get("kl_coef"), "train.kl_coef", 0.0),
            entropy_coeff=_number(get("entropy_coeff"), "train.entropy_coeff", -math.inf),
            topk=check_int(get("topk"), "train.topk", 1, "κ, the student's top-k candidates of eqs. (4)-(5)"),
            replay_std_floor=check_replay_std_floor(get("replay_std_floor")),
            std_floor_kinds=check_std_floor_kinds(get("std_floor_kinds")),
            replay_responses_per_prompt=check_replay_responses(get("replay_responses_per_prompt"), responses),
            replay_weight=check_replay_weight(get("replay_weight")),
            replay_optimizer=replay_optimizer,
            teacher_dtype=check_teacher_dtype(get("teacher_dtype")),
            student_param_dtype=_choice(get("student_param_dtype"), "train.student_param_dtype", FSDP_DTYPES),
            grad_reduce_dtype=_choice(get("grad_reduce_dtype"), "train.grad_reduce_dtype", FSDP_DTYPES),
        )


TRAIN_KEYS = tuple(f.name for f in fields(TrainConfig))


def check_verl_keys(cfg, select) -> None:
    """Refuse a composed config whose verl key differs from the ``mopd.*`` key it is derived from (a verl key set
    on its own, e.g. ``actor_rollout_ref.actor.optim.lr=...`` instead of ``mopd.train.lr=...``). ``select(dotted)``
    returns a key of ``cfg`` as plain Python, or ``None`` when absent (the planner composes no verl runtime group)."""
    for mopd_key, verl_keys in VERL_KEYS.items():
        want = select(f"mopd.{mopd_key}")
        for verl_key in verl_keys:
            got = select(verl_key)
            if got is None or want is None:
                continue
            same = got == want or (isinstance(got, list | tuple) and list(got) == list(want))
            if not same:
                raise ValueError(f"{verl_key}={got!r} differs from mopd.{mopd_key}={want!r}: set mopd.{mopd_key} "
                                 f"(recipes/mopd/verl/ derive {verl_key} from it), not {verl_key}")
