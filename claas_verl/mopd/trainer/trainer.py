"""The continual MOPD stage trainer: verl's synchronous v1 ``PPOTrainer`` executing a plan step by step.

Registered as ``register_trainer("mopd")`` (select with ``trainer.v1.trainer_mode=mopd``; ``python -m
claas_verl.main_mopd`` does it). verl's own ``fit`` loop runs unchanged; per global step N (plan step N-1):

1. ``on_step_begin``: at a stage boundary, load the stage's teachers into the workers (dropping the others)
   and give the student a fresh AdamW state (docs/math.md §B.1); after a resume, load the teachers of the current stage.
2. verl asks for prompts: ``_next_train_batch`` returns the plan step's block (``mopd.block_size`` rows of the
   domain's prompt file, block b = rows ``b·size .. (b+1)·size-1``); the rollout samples ``n`` responses each.
3. ``_compute_old_log_prob``: the training model's pre-update forward returns the student's top-κ ids and
   full-vocabulary log-probs (docs/math.md §B.2.1).
4. ``_compute_advantage``: the step's teacher returns its log-probs at those ids; the driver computes the
   rewards of eq. (4), the per-domain σ and advantages (B.2.2) over the whole step batch, and the logged KL.
   On replay steps of recipes with alignment terms (``mopd.signal.{sats,vr,hidden}``), the driver first
   computes the step regions from the response ids (stored as two 2-D fields, shared by teacher and student)
   and the teacher forward also keeps its bf16 alignment targets in the (colocated) worker process.
5. ``_update_actor``: one optimizer update with the ``claas_topk_distill`` loss (B.2.3), no KL, no entropy; on
   the steps above, the balanced multi-pass update of docs/math.md §B.6/B.7 (token pass, SATS/VR/hidden passes,
   eqs. 10 and 9 on the all-reduced norms) inside the actor worker, before clipping and the AdamW step.
6. verl saves checkpoints every ``trainer.save_freq`` steps; this trainer also saves at every stage end, copies
   the Hugging Face export to ``snapshots/student_<stage>`` (M_stage), writes ``mopd_state.json`` beside
   verl's files, and measures forgetting (student → expert KL on held-out prompts of every learned domain).
7. ``steps.jsonl`` gets the executed step with its metrics; the console a line with the stage's ETA.

This module holds verl's hooks only; ``mopd.*`` is read once into :class:`claas_verl.mopd.config.MopdConfig`, and the
rest is one component per job, each holding its state: :mod:`~claas_verl.mopd.trainer.distill_step` (the step's math:
student and teacher forwards, rewards, advantages, the update's batch), :mod:`~claas_verl.mopd.trainer.blocks`
(per-domain prompts, a step's block), :mod:`~claas_verl.mopd.trainer.teachers` (the teachers the workers hold),
:mod:`~claas_verl.mopd.trainer.snapshots` (M_j, resume state and its reconciliation),
:mod:`~claas_verl.mopd.trainer.forgetting` (the held-out evaluation), :mod:`~claas_verl.verl_ext.weight_probe`
(did the weight sync arrive), :mod:`~claas_verl.mopd.trainer.step_probe` (``mopd.probe``: the fixed probe's KL to
M_{k-1} and the update norm per step; worker side :mod:`~claas_verl.mopd.trainer.fixed_probe`); the run's files
are written by :mod:`~claas_verl.mopd.trainer.audit_trail`, :mod:`~claas_verl.mopd.trainer.resume_state` and
:mod:`~claas_verl.mopd.trainer.forgetting_table`.
"""

from __future__ import annotations

import logging
import os

from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from claas_verl.mopd.config import MopdConfig
from claas_verl.mopd.trainer.audit_trail import append_step, skipped_update
from claas_verl.mopd.trainer.blocks import block_batch, load_domains
from claas_verl.mopd.trainer.distill_step import DistillStep
from claas_verl.mopd.trainer.fixed_probe import MOPDStepLogWorker
from claas_verl.mopd.trainer.forgetting import ForgettingEval
from claas_verl.mopd.trainer.plan_steps import ModelPaths, stage_bounds, step_index
from claas_verl.mopd.trainer.snapshots import CARRIED_STATE_KEY, StageSnapshots
from claas_verl.mopd.trainer.stage_progress import StageProgress
from claas_verl.mopd.trainer.step_probe import StepProbe
from claas_verl.mopd.trainer.teachers import StageTeachers
from claas_verl.schedule import build_plan
from claas_verl.verl_ext.trainer_base import VerlSeams, swap_actor_worker
from claas_verl.verl_ext.weight_probe import WeightSyncProbe

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


@register_trainer("mopd")
class MOPDTrainer(VerlSeams, PPOTrainerSync):
    """Continual multi-teacher on-policy distillation over a ``claas_verl.schedule`` plan (see module doc).

    The private ``PPOTrainer`` methods it overrides are listed, each with its reason, in
    :mod:`claas_verl.verl_ext.trainer_couplings` (checked against the installed verl by
    ``tests/mopd/trainer/test_mopd_verl_couplings.py``); ``trainer_mode`` and the checkpoint hooks come from
    :class:`~claas_verl.verl_ext.trainer_base.VerlSeams`."""

    def __init__(self, config):
        self.mopd = MopdConfig.from_config(config)  # before verl's __init__, whose sampler reads it
        super().__init__(config)
        mopd = self.mopd
        self.plan = build_plan(mopd.schedule)
        self.plan_steps = [s.to_dict() for s in self.plan.steps]
        self.bounds = stage_bounds(self.plan_steps)
        self.block_size = mopd.block_size
        self.run_dir = str(config.trainer.default_local_dir)
        paths = ModelPaths(student0=mopd.student, experts={d: str(mopd.domains[d].expert) for d in self.plan.order},
                           run_dir=self.run_dir)
        self.distill = DistillStep(mopd, config, {d: i for i, d in enumerate(self.plan.order)})
        self._saved_at = -1
        self.domain_datasets: dict = {}
        self.teachers = StageTeachers(self.plan, self.plan_steps, paths, mopd.train.teacher_dtype,
                                      fresh_optimizer=mopd.train.fresh_optimizer_per_stage,
                                      also_previous=mopd.probe.enabled)
        self.snapshots = StageSnapshots(paths, self.plan_steps, self.bounds)
        self.forgetting = ForgettingEval(self, mopd.eval)
        self.progress = StageProgress(self.plan_steps, self.bounds)
        # after every weight sync the rollout scores a fixed probe (weight_probe); 0 turns the check off
        self.probe = WeightSyncProbe(mopd.weight_sync_probe_tokens, mopd.weight_sync_max_abs_diff)
        # mopd.probe: the fixed probe's KL to M_{k-1} and the update norm after every step (steps.jsonl)
        self.step_probe = StepProbe(mopd.probe, self.plan_steps, self.bounds, mopd.train.max_response_length)

    # ================================================================= verl wiring
    def _init_resource_pool_mgr(self):
        """Every role verl maps to its ActorRolloutRefWorker runs the MOPD worker (with the per-step log's methods,
        ``fixed_probe.MOPDStepLogWorker``) instead; the pools are checked
        against the cluster before any placement group exists (an unplaceable pool would wait forever in verl)."""
        from verl.trainer.ppo.utils import Role

        from claas_verl.preflight.placement import check_placement

        super()._init_resource_pool_mgr()
        if Role.Critic in self.role_worker_mapping:
            raise ValueError("continual MOPD trains no critic: drop critic settings (algorithm.adv_estimator=grpo)")
        swap_actor_worker(self, MOPDStepLogWorker)
        check_placement(self.resource_pool_manager)

    # ================================================================= data
    def _build_replay_buffer(self):
        """verl's sync sampler sleeps ``poll_interval`` (2 s, not configurable in verl) between looks at the
        step's finished rollouts; it becomes ``mopd.sampler_poll_s``. The samples do not depend on it."""
        sampler = super()._build_replay_buffer()
        sampler.poll_interval = self.mopd.sampler_poll_s
        return sampler

    def _init_dataloader(self):
        """verl's dataloader, plus one dataset per domain (train and held-out) for block lookup."""
        super()._init_dataloader()
        self.domain_datasets, self.forgetting.datasets = load_domains(self.config, self.mopd, self.plan,
                                                                      self.tokenizer, self.processor)
        self.step_probe.datasets = self.forgetting.datasets
        if self.total_training_steps > len(self.plan_steps):
            raise ValueError(
                f"trainer.total_training_steps={self.total_training_steps} exceeds the plan's {len(self.plan_steps)} "
                "steps; leave it null (main_mopd sets the plan length) or lower it to stop early"
            )

    def current_step(self, global_step: int | None = None) -> dict:
        gs = self.global_steps if global_step is None else global_step
        return self.plan_steps[step_index(gs, len(self.plan_steps))]

    def _next_train_batch(self, num_prompts: int | None = None):
        """The prompts of a step are the rows of the plan step's block (no sampler); a replay step asks for
        ``mopd.train.replay_responses_per_prompt`` replies per prompt when set (verl's per-prompt ``__rollout_n__``)."""
        if num_prompts not in (None, self.block_size):
            raise ValueError(f"the MOPD trainer submits whole blocks of {self.block_size} prompts, not {num_prompts}")
        step = self.current_step()
        return block_batch(self.domain_datasets, step, self.block_size, self.global_steps,
                           rollout_n=self.distill.responses_per_prompt(step["kind"]))

    # ================================================================= stage boundaries
    def on_step_begin(self):
        super().on_step_begin()
        self.forgetting.run_pending()  # the stage-end evaluation a crash lost (the weights are M_stage)
        step = self.current_step()
        if self.teachers.stage == step["stage"]:
            return
        first_step_of_stage = step_index(self.global_steps, len(self.plan_steps)) == self.bounds[step["stage"]][0]
        if first_step_of_stage:
            self.forgetting.stage_start(step["stage"], self.global_steps)
        self.teachers.begin_stage(self.actor_rollout_wg, step["stage"], first_step_of_stage, self.global_steps)
        self.step_probe.begin_stage(self.actor_rollout_wg, step["stage"], self.tokenizer)
        self.progress.begin(step["stage"])

    def is_stage_end(self, global_step: int) -> bool:
        step = self.current_step(global_step)
        return step_index(global_step, len(self.plan_steps)) == self.bounds[step["stage"]][1]

    def on_init_end(self):
        super().on_init_end()  # pushes the initial (or resumed) weights to the rollout replicas
        if self.probe.tokens:
            self._probe_weight_sync()  # the baseline the first step's change is measured against

    def on_step_end(self):
        super().on_step_end()  # pushes the updated weights to the rollout replicas
        if self.probe.tokens:
            self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}),
                                          **self._probe_weight_sync()}
        self._optim_steps = int(self.actor_rollout_wg.mopd_optimizer_steps()[0])
        if not self.is_stage_end(self.global_steps):
            return
        if self._saved_at != self.global_steps:
            self._save_checkpoint()
        self.forgetting.stage_end(self.current_step()["stage"], self.global_steps)

    def _probe_weight_sync(self) -> dict[str, float]:
        wg = self.actor_rollout_wg
        return self.probe.measure(self.tokenizer, self.checkpoint_manager.replicas,
                                  lambda ids, targets: wg.mopd_probe_logprobs(ids, targets)[0])

    # ================================================================= the step's math (distill_step)
    def _compute_old_log_prob(self, batch, metrics: dict):
        """The pre-update forward returns the student's top-κ (docs/math.md §B.2.1) through the engine's
        distillation logits-processor path, which verl's method disables (``compute_loss=False``)."""
        return self.distill.student_topk(batch, self.actor_rollout_wg)

    def _compute_advantage(self, batch, metrics: dict):
        """Teacher log-probs at the student's ids, rewards (eq. 4) and per-domain advantages (B.2.2) instead of a
        verl advantage estimator."""
        return self.distill.teacher_advantages(batch, self.actor_rollout_wg, self.current_step(), self.tokenizer,
                                               metrics)

    def _update_actor(self, batch, metrics: dict):
        """One update with the distillation flags (verl's method resets them from ``config.distillation``); with
        ``mopd.probe`` the update's size and the probe's KL after it join the step's metrics."""
        self.step_probe.before_update(self.actor_rollout_wg)
        step = self.current_step()
        batch = self.distill.update_actor(batch, self.actor_rollout_wg, step["kind"], metrics, domain=step["domain"])
        self.step_probe.after_update(self.actor_rollout_wg, metrics)
        return batch

    # ================================================================= audit trail
    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        """After verl computes a step's metrics, the step is appended to ``steps.jsonl``."""
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        step = self.current_step(global_steps)
        metrics["mopd/optimizer_steps_in_stage"] = getattr(self, "_optim_steps", -1)
        # verl zeroes the gradients and skips AdamW when the norm is not finite (it only prints a warning)
        metrics["mopd/update_skipped"] = int(skipped_update(metrics))
        if metrics["mopd/update_skipped"]:
            logger.warning(f"MOPD step {global_steps}: non-finite gradient norm, optimizer update skipped")
        # the audit trail keeps verl's per-phase timings and throughput too: where a slow step's time went
        keep = {k: v for k, v in metrics.items() if k.startswith(("mopd/", "actor/", "response_length/mean",
                                                                    "critic/score/mean", "timing_s/", "perf/",
                                                                    "rollout/weight_sync_"))}
        append_step(self.run_dir, global_steps, step, keep)
        print(self.progress.line(global_steps, metrics), flush=True)

    # ================================================================= checkpoints (VerlSeams hooks)
    def after_checkpoint_saved(self):
        gs = self.global_steps
        self._saved_at = gs
        extra = {}
        if self.mopd.signal.balance == "carried":  # worker-side state verl's checkpoint does not hold
            extra[CARRIED_STATE_KEY] = self.actor_rollout_wg.mopd_carried_state()[0]
        self.snapshots.after_save(gs, self.current_step(gs)["stage"], self.is_stage_end(gs), extra)

    def after_checkpoint_loaded(self):
        gs = self.global_steps
        if gs == 0:
            return
        state = self.snapshots.resume(gs)
        if self.mopd.train.replay_optimizer == "separate" and not state["stage_complete"]:
            raise ValueError(
                f"resuming at global step {gs}, inside stage {state['stage']}, with mopd.train.replay_optimizer="
                "separate: verl's checkpoint holds one optimizer state, so the replay steps' own AdamW state of this "
                "stage is lost (docs/verl-couplings.md). Resume from a stage-end checkpoint, or rerun the stage")
        self.forgetting.note_resume(state, gs)
        if self.mopd.signal.balance == "carried":
            # the checkpoint's multipliers, so the resumed replay steps are carried or exact as without the kill; a
            # checkpoint written with balance=exact has none (the next step of each key is then exact)
            self.actor_rollout_wg.mopd_carried_load(state.get(CARRIED_STATE_KEY))
        # the next step's on_step_begin loads the teachers; a stage that is not finished keeps its optimizer
        self.teachers.stage = None


__all__ = ["MOPDTrainer"]
