"""The CLaaS trainer's shims over private verl 0.9.1 names, and its view of the one list of them
(:mod:`claas_verl.verl_ext.trainer_couplings`, where every entry says who relies on it and why).

Public extension points used elsewhere (no coupling): ``register_trainer``, the custom v1 sampler,
``TrainingWorker.set_loss_fn``, ``register`` / ``Dispatch`` for worker methods.

Private names (each listed in :data:`COUPLINGS`; ``tests/claas/trainer/test_claas_verl_couplings.py`` and
``tests/verl_ext/test_trainer_couplings.py`` fail loudly when a verl upgrade moves one of them):

* ``PPOTrainer._init_resource_pool_mgr``: wrapped so the pools are checked before placement and (SDPO) the roles
  verl maps to ``ActorRolloutRefWorker`` get :class:`~claas_verl.claas.trainer.sdpo_worker.ClaasSdpoWorker`
  (:func:`claas_verl.verl_ext.trainer_base.swap_actor_worker`).
* ``PPOTrainer._init_dataloader``: replaced (no prompt dataset;
:func:`claas_verl.verl_ext.trainer_base.drop_prompt_dataloader`).
* ``PPOTrainer.replay_buffer`` (verl's name for its sampler; here the ``ClaasReplaySampler``, which the trainer
  calls ``sampler``; the replay buffer itself is the ``ReplayBufferActor``, ``replay_actor``).
* ``PPOTrainer._pending_sync_metrics``: set in ``on_step_end`` with the buffer's per-update statistics; verl's
  ``_consume_sync_metrics`` merges it into the step's metrics.
* ``trainer_mode`` and ending verl's loop (``total_training_steps``): the shared base,
  :class:`claas_verl.verl_ext.trainer_base.VerlSeams`.
* ``PPOTrainer.role_worker_mapping`` / ``actor_rollout_wg`` (instance attributes set by verl).
* ``ActorRolloutRefWorker.actor_worker_cls``: class-attribute hook selecting the SDPO training worker.
* ``TrainingWorker.train_mini_batch``: overridden (pre-pass + teacher pass before verl's update, EMA after).
* ``BaseEngine.optimizer_step``: shadowed by an instance attribute during one update, to record whether the
  step was applied (finite gradient norm) and to skip it when the minibatch carries no SDPO signal.
* ``BaseEngine.eval_mode`` and the FSDP engine's ``module`` attribute: the no-grad pre/teacher forwards.
* the FSDP engine's ``optimizer`` and ``lr_scheduler`` attributes (``claas.service.tenants``): each tenant's AdamW
  state and learning-rate schedule are swapped in before its update and out after it
  (:mod:`claas_verl.claas.trainer.tenant_worker`), as are its LoRA shards in ``module``.
* the non-tensor batch key ``distillation_use_topk``: makes verl's FSDP engine call the installed loss as a
  logits processor ``fn(student_logits=[1, N, V], data=micro_batch)`` (``prepare_model_outputs``); with
  ``distillation_only`` it computes no sampled-token log-probs of its own (no in-place flash-attn
  cross-entropy on the logits the processor keeps). The two call forms, and the refusal of the non-tensor
  ``sp_size > 1`` verl's ``FSDPEngine.forward_backward_batch`` sets, live in the seam MOPD's loss shares,
  :class:`claas_verl.verl_ext.logits_loss.LogitsProcessorLoss`.
* ``PPOTrainer._save_checkpoint`` / ``_load_checkpoint`` (every algorithm; resume.py): extended so the CLaaS state
  sits in verl's ``global_step_N`` folder. The resume invariant relies on verl's ``fit`` calling
  ``_save_checkpoint`` (deferred by the override to ``on_step_end``), on ``_save_checkpoint`` writing
  ``latest_checkpointed_iteration.txt`` after the actor (the commit point), and on ``_load_checkpoint`` finding the
  folder with ``find_latest_ckpt_path`` (the override resolves the same folder first).
"""

from __future__ import annotations

import contextlib
import math

import torch

from claas_verl.verl_ext.trainer_couplings import couplings_of, source_markers_of

# this system's view of the one list in claas_verl.verl_ext.trainer_couplings (the shared base's couplings included)
COUPLINGS: tuple[tuple[str, str, str], ...] = couplings_of("claas")
# (module, owner, method, string the method's source must contain): checked against verl's source by the test.
SOURCE_MARKERS: tuple[tuple[str, str, str, str], ...] = source_markers_of("claas")


def actor_worker_group(trainer):
    return trainer.actor_rollout_wg


def engine_module(engine) -> torch.nn.Module:
    return engine.module


def module_device(module) -> torch.device:
    p = next(module.parameters())
    return p.to_local().device if hasattr(p, "to_local") else p.device


@contextlib.contextmanager
def shadow_optimizer_step(engine, skip: bool):
    """For one update: record whether verl's ``optimizer_step`` applied a finite step; with ``skip`` do not step.

    Yields a dict whose ``applied`` is True iff an optimizer step ran with a finite gradient norm (verl skips
    non-finite ones itself). A skipped step clears the gradients and reports grad norm 0.
    """
    original = engine.optimizer_step
    state = {"applied": False, "grad_norm": None}

    def optimizer_step():
        if skip:
            engine.optimizer_zero_grad()
            state["grad_norm"] = 0.0
            return 0.0
        grad_norm = original()
        g = float(grad_norm)
        state["grad_norm"] = g
        state["applied"] = math.isfinite(g)
        return grad_norm

    engine.optimizer_step = optimizer_step
    try:
        yield state
    finally:
        del engine.optimizer_step  # the instance attribute shadowed the class method


def all_reduce_sum(counts: torch.Tensor) -> tuple[float, ...]:
    """Σ over data-parallel ranks (the default process group) of a small CPU tensor."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        counts = counts.clone()
        dist.all_reduce(counts)
    return tuple(float(x) for x in counts)
