"""The MOPD system's view of the private verl 0.9.1 names it touches (the list itself, shared with the CLaaS
trainer and the base both stand on: :mod:`claas_verl.verl_ext.trainer_couplings`), and the helpers that read
private attributes of verl's workers and FSDP engine.

verl has no hooks for: choosing each step's prompts from a plan, running a logits processor in the
pre-update forward, asking a teacher for log-probs at the student's ids, resetting the optimizer, or keeping
extra resume state. :class:`claas_verl.mopd.trainer.trainer.MOPDTrainer` therefore overrides a few private
methods of ``PPOTrainer`` directly (as the CLaaS trainer does), and the functions below read a few private
attributes of verl's FSDP engine. Each name is listed in :data:`COUPLINGS`;
``tests/mopd/trainer/test_mopd_verl_couplings.py`` fails loudly when a verl upgrade moves or renames one of them.

Trainer overrides (``verl.trainer.ppo.v1.trainer_base.PPOTrainer``), all in ``MOPDTrainer``:

* ``trainer_mode`` (attribute): verl reads it as a sync/async switch; registering under ``"mopd"`` would
  silently select the async replay buffer, dataloader refill and TransferQueue checkpointing. The shared base
  (:class:`claas_verl.verl_ext.trainer_base.VerlSeams`) always answers ``"sync"`` (the registered name is kept in
  ``registered_mode``).
* ``_init_resource_pool_mgr``: the roles verl maps to ``ActorRolloutRefWorker`` get the MOPD worker class, and the
  pools are checked against the cluster before any placement group exists (:mod:`claas_verl.preflight.placement`).
* ``_init_dataloader``: also builds one dataset per domain (train and held-out) for block lookup.
* ``_next_train_batch``: the prompts of a step are the rows of the plan step's block (no sampler).
* ``_build_replay_buffer``: verl's sync sampler, polled every ``mopd.sampler_poll_s`` instead of its fixed 2 s
  (a step's rollouts finish in well under a second on the CPU benchmark, which then waited 2 s per step).
* ``_compute_old_log_prob``: the pre-update forward returns the student's top-κ (docs/math.md §B.2.1) through the
  engine's distillation logits-processor path, which the base method disables (``compute_loss=False``).
* ``_compute_advantage``: teacher log-probs at the student's ids, rewards (eq. 4) and per-domain advantages
  (B.2.2) instead of a verl advantage estimator.
* ``_update_actor``: the base method resets the distillation flags from ``config.distillation``.
* ``_save_checkpoint`` / ``_load_checkpoint``: extra resume state (plan position, stage, snapshots).
* ``_compute_metrics``: after verl computes a step's metrics, the step is appended to ``steps.jsonl``.

Called (not overridden) private trainer methods: ``_balance_batch`` (forgetting evaluation batches).

Worker/engine internals (``verl.workers``): ``ActorRolloutRefWorker.actor_worker_cls`` (class attribute
hook), ``TrainingWorker.train_batch`` (overridden: replay steps with alignment terms swap in the balanced
multi-pass step for ``BaseEngine.train_batch`` during one call, reusing ``forward_backward_batch``,
``optimizer_zero_grad``, ``optimizer_step``; teachers' ``FSDPEngine.module`` under ``eval_mode`` gives the
alignment targets), the ref-config conversion of ``ActorRolloutRefWorker.init_model`` (mirrored in
:func:`teacher_training_config`), ``FSDPEngine.optimizer`` / ``lr_scheduler`` / ``checkpoint_manager`` /
``_build_lr_scheduler`` (optimizer reset).
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from typing import Any

from claas_verl.verl_ext.trainer_couplings import couplings_of, instance_attributes_of

# this system's view of the one list in claas_verl.verl_ext.trainer_couplings (the shared base's couplings included)
COUPLINGS: tuple[tuple[str, str, str], ...] = couplings_of("mopd")
INSTANCE_ATTRIBUTES: tuple[tuple[str, str], ...] = instance_attributes_of("mopd")


# ---------------------------------------------------------------------------------------------- worker side
def teacher_training_config(worker_config, model_path: str, teacher_dtype: str = "fp32_bf16_autocast"):
    """A forward-only ``TrainingWorkerConfig`` for a teacher at ``model_path``.

    Mirrors the private conversion ``ActorRolloutRefWorker.init_model`` applies to ``config.ref`` (the
    ``log_prob_*`` keys renamed to the engine's ``ppo_*`` ones), so a teacher engine is built exactly like
    verl's reference model, only from another checkpoint. ``teacher_dtype`` (``mopd.train.teacher_dtype``) sets
    the FSDP ``param_dtype`` of the teacher's weights: fp32 for ``fp32`` and ``fp32_bf16_autocast`` (then
    :func:`apply_teacher_dtype` turns on bf16 autocast after the engine is built), bf16 for ``bf16``.
    """
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import MtpConfig, TrainingWorkerConfig

    ref = deepcopy(worker_config.ref)
    with open_dict(ref):
        ref.ppo_mini_batch_size = worker_config.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
        if ref.get("fsdp_config") is not None:  # the teacher's weights (docs/math.md §B.1), see the docstring
            if ref.fsdp_config.get("mixed_precision") is None:
                ref.fsdp_config.mixed_precision = {}
            ref.fsdp_config.mixed_precision.param_dtype = "bf16" if teacher_dtype == "bf16" else "fp32"
    model = deepcopy(worker_config.model)
    with open_dict(model):
        model.path = model_path
        # experts may ship no tokenizer files; student and teachers must share the tokenizer anyway
        model.tokenizer_path = worker_config.model.get("tokenizer_path") or worker_config.model.path
    ref_config = omega_conf_to_dataclass(ref)
    model_config = omega_conf_to_dataclass(model)
    model_config.mtp = MtpConfig(enable=False)
    cfg = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=ref_config.engine,
        optimizer_config=ref_config.optim,
        checkpoint_config=ref_config.checkpoint,
        profiler_config=None,
    )
    cfg.engine_config.forward_only = True
    cfg.engine_config.use_dynamic_bsz = ref.use_dynamic_bsz
    cfg.engine_config.infer_max_token_len_per_gpu = ref.ppo_max_token_len_per_gpu
    cfg.engine_config.infer_micro_batch_size_per_gpu = ref.ppo_micro_batch_size_per_gpu
    cfg.engine_config.use_remove_padding = worker_config.model.get("use_remove_padding", False)
    return cfg


def apply_teacher_dtype(engine: Any, teacher_dtype: str) -> None:
    """docs/math.md §B.1 teachers: fp32 weights under bf16 autocast. verl ties its forward's autocast to the FSDP
    ``param_dtype`` (fp32 means no autocast), so the built teacher engine's autocast dtype is set here."""
    import torch

    if teacher_dtype == "fp32_bf16_autocast":
        if not hasattr(engine, "_autocast_dtype"):
            raise ValueError("mopd.train.teacher_dtype=fp32_bf16_autocast needs verl's FSDP engine (actor strategy "
                             "fsdp/fsdp2); use teacher_dtype=fp32 or bf16")
        engine._autocast_dtype = torch.bfloat16


def reset_engine_optimizer(engine: Any) -> int:
    """Fresh AdamW state and LR schedule for a new stage (docs/math.md §B.1); returns how many parameter states were
    dropped.

    Clearing ``optimizer.state`` makes the next step start from m = v = 0 and step = 0, which is what
    a newly built AdamW does; the LR scheduler is rebuilt so warm-up (if any) restarts too. verl's
    checkpoint manager keeps its own reference to the scheduler, so it is pointed at the new one.
    """
    opt = engine.optimizer
    if opt is None:
        raise ValueError("the engine has no optimizer (forward-only); only the student's optimizer can be reset")
    if getattr(engine, _ACTIVE_STATE, "main") != "main":
        use_optimizer_state(engine, "main")
    dropped = len(opt.state)
    opt.state.clear()
    if getattr(engine, _HELD_STATE, None) is not None:
        getattr(engine, _HELD_STATE).clear()  # the replay steps' own state (replay_optimizer=separate) is fresh too
    for group in opt.param_groups:  # undo any scheduler scaling before the new scheduler records initial_lr
        if "initial_lr" in group:
            group["lr"] = group["initial_lr"]
            del group["initial_lr"]
    engine.lr_scheduler = engine._build_lr_scheduler(opt)
    ckpt = getattr(engine, "checkpoint_manager", None)
    if ckpt is not None and hasattr(ckpt, "lr_scheduler"):
        ckpt.lr_scheduler = engine.lr_scheduler
    return dropped


OPTIMIZER_STATES = ("main", "replay")
_ACTIVE_STATE = "_mopd_active_optimizer_state"  # which of OPTIMIZER_STATES engine.optimizer.state holds now
_HELD_STATE = "_mopd_held_optimizer_state"  # the other one, kept aside


def use_optimizer_state(engine: Any, which: str) -> int:
    """Make ``engine.optimizer`` step with AdamW state ``which`` (``main`` | ``replay``;
    ``mopd.train.replay_optimizer=separate``); returns the parameter states it now holds (0: fresh).

    verl's FSDP engine builds exactly one optimizer (``FSDPEngine.optimizer``) and one LR scheduler, checkpoints that
    optimizer only, and steps it inside ``train_batch``. A second state is therefore swapped in and out of the same
    ``torch.optim.AdamW``: its per-parameter ``state`` dict (m, v and the step count used by the bias correction)
    is exchanged, while the param groups (lr, betas, weight decay) and the LR scheduler stay shared (a warm-up
    counts every update). The state kept aside is not in verl's checkpoint: a mid-stage resume refuses
    (``MOPDTrainer.after_checkpoint_loaded``), and :func:`reset_engine_optimizer` empties both.
    """
    if which not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer state {which!r}: choose one of {list(OPTIMIZER_STATES)}")
    opt = engine.optimizer
    if opt is None:
        raise ValueError("the engine has no optimizer (forward-only)")
    if getattr(engine, _ACTIVE_STATE, "main") != which:
        held = getattr(engine, _HELD_STATE, None)
        setattr(engine, _HELD_STATE, opt.state)
        opt.state = held if held is not None else defaultdict(dict)
        setattr(engine, _ACTIVE_STATE, which)
    return len(opt.state)


def optimizer_step_count(engine: Any) -> int:
    """AdamW's ``step`` of the first parameter with state (0 when the state is empty): a fresh-state probe."""
    for state in engine.optimizer.state.values():
        step = state.get("step")
        if step is not None:
            return int(step.item() if hasattr(step, "item") else step)
    return 0
