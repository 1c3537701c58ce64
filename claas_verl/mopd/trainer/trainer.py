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

This module holds verl's hooks and the step's math; the rest is one component per job, each holding its state:
:mod:`~claas_verl.mopd.trainer.blocks` (per-domain prompts, a step's block), :mod:`~claas_verl.mopd.trainer.teachers`
(the teachers the workers hold), :mod:`~claas_verl.mopd.trainer.snapshots` (M_j, resume state and its
reconciliation), :mod:`~claas_verl.mopd.trainer.forgetting` (the held-out evaluation),
:mod:`~claas_verl.mopd.trainer.weight_probe` (did the weight sync arrive) and
:mod:`~claas_verl.mopd.trainer.records` (the run's files: audit trail, resume state, forgetting table).
"""

from __future__ import annotations

import logging
import os

import torch
import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict
from verl.workers.utils.padding import response_to_nested

from claas_verl.align import separator_token_ids
from claas_verl.distill import (
    domain_normalized_advantages,
    domain_stds,
    topk_binned_kl,
    topk_rewards,
    topk_weighted_kl,
)
from claas_verl.mopd.trainer import fields as F
from claas_verl.mopd.trainer import records as S
from claas_verl.mopd.trainer.alignment import AUX_KEY, aux_config, region_fields
from claas_verl.mopd.trainer.blocks import block_batch, canonical_row_order, load_domains
from claas_verl.mopd.trainer.forgetting import ForgettingEval
from claas_verl.mopd.trainer.snapshots import StageSnapshots
from claas_verl.mopd.trainer.teachers import StageTeachers
from claas_verl.mopd.trainer.verl_couplings import MOPDTrainerCouplings
from claas_verl.mopd.trainer.weight_probe import WeightSyncProbe
from claas_verl.mopd.trainer.workers import TEACHER_KEY, MOPDWorker
from claas_verl.preflight.recipe_keys import TRAIN_YAML, recipe_key
from claas_verl.schedule import plan_from_config
from claas_verl.verl_ext.packed_batch import padded
from claas_verl.verl_ext.trainer_base import swap_actor_worker

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


@register_trainer("mopd")
class MOPDTrainer(MOPDTrainerCouplings, PPOTrainerSync):
    """Continual multi-teacher on-policy distillation over a ``claas_verl.schedule`` plan (see module doc)."""

    def __init__(self, config):
        super().__init__(config)
        self.plan = plan_from_config(config)
        self.plan_steps = [s.to_dict() for s in self.plan.steps]
        self.bounds = S.stage_bounds(self.plan_steps)
        mopd = config.mopd
        self.topk = int(mopd.train.topk)
        self.block_size = int(mopd.block_size)
        self.run_dir = str(config.trainer.default_local_dir)
        paths = S.ModelPaths(
            student0=str(mopd.student),
            experts={d: str(mopd.domains[d].get("expert")) for d in self.plan.order},
            run_dir=self.run_dir,
        )
        self.domain_index = {d: i for i, d in enumerate(self.plan.order)}
        if self.config.data.train_batch_size != self.block_size:
            raise ValueError(
                f"data.train_batch_size={self.config.data.train_batch_size} must equal mopd.block_size="
                f"{self.block_size}: every step trains exactly one block"
            )
        actor = config.actor_rollout_ref.actor
        S.check_one_update_per_step(self.block_size, actor.get("ppo_mini_batch_size"), actor.get("ppo_epochs"))
        teacher_dtype = S.check_teacher_dtype(recipe_key(mopd, "train.teacher_dtype", TRAIN_YAML))
        # replay steps of FSAR/SATS/OPRD recipes: alignment terms + balanced update (docs/math.md §B.3-B.7)
        self.aux = aux_config(mopd.get("signal") or {})
        if self.aux.enabled and actor.get("strategy") not in ("fsdp2",):
            raise ValueError(f"mopd.signal enables {list(self.aux.terms)}: the balanced update needs "
                             f"actor_rollout_ref.actor.strategy=fsdp2, got {actor.get('strategy')!r}")
        self._separators = None
        self._saved_at = -1
        self.domain_datasets: dict = {}
        fresh = bool(recipe_key(mopd, "train.fresh_optimizer_per_stage", TRAIN_YAML))
        self.teachers = StageTeachers(self.plan, self.plan_steps, paths, teacher_dtype, fresh_optimizer=fresh)
        self.snapshots = StageSnapshots(paths, self.plan_steps, self.bounds)
        self.forgetting = ForgettingEval(self, enabled=bool(recipe_key(mopd, "eval.enabled")),
                                         prompts=int(recipe_key(mopd, "eval.prompts")))
        self.progress = S.StageProgress(self.plan_steps, self.bounds)
        # after every weight sync the rollout scores a fixed probe (weight_probe); 0 turns the check off
        self.probe = WeightSyncProbe(int(recipe_key(mopd, "weight_sync_probe_tokens") or 0))

    # ================================================================= verl wiring
    def mopd_use_worker_class(self):
        """Every role verl maps to its ActorRolloutRefWorker runs the MOPD worker instead."""
        from verl.trainer.ppo.utils import Role

        if Role.Critic in self.role_worker_mapping:
            raise ValueError("continual MOPD trains no critic: drop critic settings (algorithm.adv_estimator=grpo)")
        swap_actor_worker(self, MOPDWorker)

    # ================================================================= data (called from the couplings)
    def mopd_tune_sampler(self, sampler):
        """verl's sync sampler sleeps ``poll_interval`` (2 s, not configurable in verl) between looks at the
        step's finished rollouts; it becomes ``mopd.sampler_poll_s``. The samples do not depend on it."""
        poll = recipe_key(self.config.mopd, "sampler_poll_s")
        if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 60:
            raise ValueError(f"mopd.sampler_poll_s={poll!r}: give the sampler's polling interval in seconds, "
                             "0 < s <= 60 (recipes/mopd/common/base.yaml sets 0.05)")
        sampler.poll_interval = float(poll)
        return sampler

    def mopd_init_datasets(self):
        self.domain_datasets, self.forgetting.datasets = load_domains(self.config, self.plan, self.tokenizer,
                                                                      self.processor)
        if self.total_training_steps > len(self.plan_steps):
            raise ValueError(
                f"trainer.total_training_steps={self.total_training_steps} exceeds the plan's {len(self.plan_steps)} "
                "steps; leave it null (main_mopd sets the plan length) or lower it to stop early"
            )

    def current_step(self, global_step: int | None = None) -> dict:
        gs = self.global_steps if global_step is None else global_step
        return self.plan_steps[S.step_index(gs, len(self.plan_steps))]

    def mopd_block_batch(self, num_prompts: int | None = None):
        if num_prompts not in (None, self.block_size):
            raise ValueError(f"the MOPD trainer submits whole blocks of {self.block_size} prompts, not {num_prompts}")
        return block_batch(self.domain_datasets, self.current_step(), self.block_size, self.global_steps)

    # ================================================================= stage boundaries
    def on_step_begin(self):
        super().on_step_begin()
        self.forgetting.run_pending()  # the stage-end evaluation a crash lost (the weights are M_stage)
        step = self.current_step()
        if self.teachers.stage == step["stage"]:
            return
        first_step_of_stage = S.step_index(self.global_steps, len(self.plan_steps)) == self.bounds[step["stage"]][0]
        if first_step_of_stage:
            self.forgetting.stage_start(step["stage"], self.global_steps)
        self.teachers.begin_stage(self.actor_rollout_wg, step["stage"], first_step_of_stage, self.global_steps)
        self.progress.begin(step["stage"])

    def is_stage_end(self, global_step: int) -> bool:
        step = self.current_step(global_step)
        return S.step_index(global_step, len(self.plan_steps)) == self.bounds[step["stage"]][1]

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
        return self.probe.measure(self.tokenizer, self.checkpoint_manager.replicas, self.actor_rollout_wg)

    # ================================================================= the step's math
    def _distill_flags(self, phase: str) -> dict:
        return {
            "calculate_entropy": False,
            "compute_loss": True,  # the logits processor IS the loss function; verl only calls it then
            "distillation_use_topk": True,
            "distillation_only": True,  # no sampled-token log-probs needed
            "temperature": self.config.actor_rollout_ref.rollout.temperature,
            F.PHASE_KEY: phase,
            F.TOPK_KEY: self.topk,
        }

    def mopd_student_topk(self, batch, metrics: dict):
        """Pre-update forward of the training model: store the student's top-κ ids and log-probs S (B.2.1).

        The worker writes them as two flattened-rows fields, ``F.TOPK_IDS`` and ``F.STUDENT_LP``
        (:func:`claas_verl.mopd.trainer.workers.fold_topk_outputs`).
        """
        canonical_row_order(batch, self.actor_rollout_wg)
        batch.extra_info.update(self._distill_flags(F.PHASE_STUDENT_TOPK))
        self.actor_rollout_wg.compute_log_prob(batch)
        return batch

    def teacher_q(self, batch, teacher: str):
        """Teacher ``teacher``'s top-k log-probs Q at the student's ids, with the student's S and the response mask."""
        batch.extra_info.update(self._distill_flags(F.PHASE_TEACHER))
        batch.extra_info[TEACHER_KEY] = teacher
        self.actor_rollout_wg.mopd_teacher_forward(batch)
        batch.extra_info.pop(TEACHER_KEY, None)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=[F.TEACHER_LP, F.STUDENT_LP, "response_mask"])
        mask_nested = data["response_mask"]
        Q = F.unpack_rows(data[F.TEACHER_LP], self.topk, F.TEACHER_LP).float()
        Sx = F.unpack_rows(data[F.STUDENT_LP], self.topk, F.STUDENT_LP).float()
        mask = padded(mask_nested).float()
        return Sx, Q, mask, mask_nested

    def mopd_teacher_advantages(self, batch, metrics: dict):
        """Teacher Q at the student's ids, rewards r (eq. 4), per-domain advantages A (B.2.2), logged KL."""
        step = self.current_step()
        aux = self.aux.applies_to(step["kind"])
        if aux:
            self._store_regions(batch, metrics)
            batch.extra_info[AUX_KEY] = self.aux.to_dict()  # the teacher also returns its alignment targets
        try:
            Sx, Q, mask, mask_nested = self.teacher_q(batch, step["teacher"])
        finally:
            batch.extra_info.pop(AUX_KEY, None)
        r = topk_rewards(Sx, Q, mask)
        # one domain per step (B.2.2): every response of the block belongs to the step's domain
        dom = torch.full((r.shape[0],), self.domain_index[step["domain"]], dtype=torch.long)
        A = domain_normalized_advantages(r, mask, dom, sync=False)
        stats = domain_stds(r, mask, dom, sync=False)[self.domain_index[step["domain"]]]
        out = {F.ADVANTAGES: F.pack_rows(A, mask_nested)}
        # verl's metrics read 2-D advantages/returns: Σ_v A[t, v] per token
        per_token = A.sum(-1)
        out["advantages"] = response_to_nested(per_token, mask_nested)
        out["returns"] = response_to_nested(per_token, mask_nested)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict(out))
        metrics.update({
            "mopd/kl_topk": float(topk_weighted_kl(Sx, Q, mask)),
            "mopd/kl_binned": float(topk_binned_kl(Sx, Q, mask)),
            "mopd/adv_sigma": stats["scale"],
            "mopd/reward_count": stats["count"],
            "mopd/stage": step["stage"],
            "mopd/block": step["block"],
        })
        return batch

    def _store_regions(self, batch, metrics: dict):
        """Step regions computed ONCE here from the response ids, shared by teacher and student (docs/math.md §B.4)."""
        if self._separators is None:
            self._separators = separator_token_ids(self.tokenizer)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["input_ids", "response_mask"])
        # regions from the response ids themselves (not response_from_nested, which shifts ids by one)
        out, rid, win = region_fields(data["input_ids"], data["response_mask"], self._separators, self.aux)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict(out))
        metrics["mopd/regions_per_response"] = float((rid.amax(-1) + 1).clamp(min=0).float().mean())
        metrics["mopd/window_tokens"] = float(win.sum())

    def mopd_update_actor(self, batch, metrics: dict):
        """One optimizer update (one epoch, one mini-batch: the whole step batch) with the MOPD loss."""
        n = self.config.actor_rollout_ref.rollout.n
        mini = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * n
        info = self._distill_flags(F.PHASE_UPDATE)
        info.pop("compute_loss")
        info.update({
            "global_batch_size": mini,
            "mini_batch_size": mini,
            "epochs": 1,
            "seed": self.config.actor_rollout_ref.actor.data_loader_seed,
            "dataloader_kwargs": {"shuffle": False},
        })
        if self.aux.applies_to(self.current_step()["kind"]):
            info[AUX_KEY] = self.aux.to_dict()  # balanced multi-pass update in the actor worker (docs/math.md §B.6/B.7)
        batch.extra_info.update(info)
        try:
            output = self.actor_rollout_wg.update_actor(batch)
        finally:
            batch.extra_info.pop(AUX_KEY, None)
        out = rename_dict(output["metrics"], "actor/")
        if "actor/mfu" in out:
            out["perf/mfu/actor"] = out.pop("actor/mfu")
        metrics.update(reduce_metrics(out))
        return batch

    # ================================================================= audit trail
    def mopd_record_step(self, metrics: dict, global_step: int):
        step = self.current_step(global_step)
        metrics["mopd/optimizer_steps_in_stage"] = getattr(self, "_optim_steps", -1)
        # verl zeroes the gradients and skips AdamW when the norm is not finite (it only prints a warning)
        metrics["mopd/update_skipped"] = int(S.skipped_update(metrics))
        if metrics["mopd/update_skipped"]:
            logger.warning(f"MOPD step {global_step}: non-finite gradient norm, optimizer update skipped")
        keep = {k: v for k, v in metrics.items() if k.startswith(("mopd/", "actor/", "response_length/mean",
                                                                    "critic/score/mean", "timing_s/step",
                                                                    "rollout/weight_sync_"))}
        S.append_step(self.run_dir, global_step, step, keep)
        print(self.progress.line(global_step, metrics), flush=True)

    # ================================================================= checkpoints
    def mopd_after_save(self):
        gs = self.global_steps
        self._saved_at = gs
        self.snapshots.after_save(gs, self.current_step(gs)["stage"], self.is_stage_end(gs))

    def mopd_after_load(self):
        gs = self.global_steps
        if gs == 0:
            return
        self.forgetting.note_resume(self.snapshots.resume(gs), gs)
        # the next step's on_step_begin loads the teachers; a stage that is not finished keeps its optimizer
        self.teachers.stage = None


__all__ = ["MOPDTrainer"]
