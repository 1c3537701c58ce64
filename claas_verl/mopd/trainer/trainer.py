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
7. ``steps.jsonl`` gets the executed step with its metrics.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

import numpy as np
import torch
import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn
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
from claas_verl.mopd.trainer import stages as S
from claas_verl.mopd.trainer import weight_probe as WP
from claas_verl.mopd.trainer.alignment import AUX_KEY, aux_config, region_fields
from claas_verl.mopd.trainer.verl_couplings import MOPDTrainerCouplings
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
        self.paths = S.ModelPaths(
            student0=str(mopd.student),
            experts={d: str(mopd.domains[d].get("expert")) for d in self.plan.order},
            run_dir=self.run_dir,
        )
        self.domain_index = {d: i for i, d in enumerate(self.plan.order)}
        self.eval_enabled = bool(recipe_key(mopd, "eval.enabled"))
        self.eval_prompts = int(recipe_key(mopd, "eval.prompts"))
        if self.config.data.train_batch_size != self.block_size:
            raise ValueError(
                f"data.train_batch_size={self.config.data.train_batch_size} must equal mopd.block_size="
                f"{self.block_size}: every step trains exactly one block"
            )
        actor = config.actor_rollout_ref.actor
        S.check_one_update_per_step(self.block_size, actor.get("ppo_mini_batch_size"), actor.get("ppo_epochs"))
        self.teacher_dtype = S.check_teacher_dtype(recipe_key(mopd, "train.teacher_dtype", TRAIN_YAML))
        # replay steps of FSAR/SATS/OPRD recipes: alignment terms + balanced update (docs/math.md §B.3-B.7)
        self.aux = aux_config(mopd.get("signal") or {})
        if self.aux.enabled and actor.get("strategy") not in ("fsdp2",):
            raise ValueError(f"mopd.signal enables {list(self.aux.terms)}: the balanced update needs "
                             f"actor_rollout_ref.actor.strategy=fsdp2, got {actor.get('strategy')!r}")
        self._separators = None
        self._stage: int | None = None  # stage whose teachers are loaded (None: none yet)
        self._resumed_mid_stage = False
        self._saved_at = -1
        self._pending_end_eval: tuple[int, int] | None = None  # (stage, its last global step) to evaluate on resume
        # after every weight sync the rollout scores a fixed probe (weight_probe); 0 turns the check off
        self.probe_tokens = int(recipe_key(mopd, "weight_sync_probe_tokens") or 0)
        if self.probe_tokens < 0:
            raise ValueError(f"mopd.weight_sync_probe_tokens={self.probe_tokens}: give the probe's length in tokens "
                             "(0 turns the weight-sync check off)")
        self._probe_served: list[list[float]] | None = None  # the previous sync's served log-probs

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
        from verl.trainer.ppo.utils import create_rl_dataset

        self.domain_datasets, self.eval_datasets = {}, {}
        for d in self.plan.order:
            spec = self.config.mopd.domains[d]
            ds = create_rl_dataset(spec.prompts, self.config.data, self.tokenizer, self.processor, is_train=True)
            need = self.plan.num_blocks[d] * self.block_size
            if len(ds) < need:
                raise ValueError(
                    f"mopd.domains.{d}.prompts: {len(ds)} usable prompts but the plan needs {need} "
                    f"({self.plan.num_blocks[d]} blocks of {self.block_size}); were prompts dropped by "
                    "data.filter_overlong_prompts / data.max_prompt_length?"
                )
            self.domain_datasets[d] = ds
            test = spec.get("test_prompts")
            if test:
                self.eval_datasets[d] = create_rl_dataset(test, self.config.data, self.tokenizer, self.processor,
                                                          is_train=False)
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
        step = self.current_step()
        ds = self.domain_datasets[step["domain"]]
        rows = range(step["block"] * self.block_size, (step["block"] + 1) * self.block_size)
        batch_dict = collate_fn([ds[i] for i in rows])
        batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        return batch

    # ================================================================= stage boundaries
    def on_step_begin(self):
        super().on_step_begin()
        if self._pending_end_eval is not None:  # the stage-end evaluation a crash lost (the weights are M_stage)
            stage, gs = self._pending_end_eval
            self._pending_end_eval = None
            print(f"[mopd] resumed after stage {stage} ended: re-running its lost stage-end forgetting evaluation")
            self._evaluate(stage, "end", S.learned_domains(self.plan_steps, gs - 1), gs)
            self._stage = None
        step = self.current_step()
        if self._stage == step["stage"]:
            return
        first_step_of_stage = S.step_index(self.global_steps, len(self.plan_steps)) == self.bounds[step["stage"]][0]
        if first_step_of_stage and self.eval_enabled:
            self.evaluate_stage_start(step["stage"])
        self._begin_stage(step["stage"], fresh_optimizer=first_step_of_stage)

    def _begin_stage(self, stage: int, fresh_optimizer: bool):
        teachers = S.stage_teachers(self.plan_steps, stage)
        S.check_held(teachers, self.plan.held_by_stage[stage], stage, self.plan.setting)
        specs = {t: self.paths.path(t) for t in teachers}
        for name, path in specs.items():
            if not os.path.exists(os.path.join(path, "config.json")):
                raise ValueError(f"teacher {name} of stage {stage}: no Hugging Face model at {path}")
        loaded = self.actor_rollout_wg.mopd_set_teachers(specs, self.teacher_dtype)[0]
        dropped = 0
        if fresh_optimizer and bool(recipe_key(self.config.mopd, "train.fresh_optimizer_per_stage", TRAIN_YAML)):
            dropped = self.actor_rollout_wg.mopd_reset_optimizer()[0]
        logger.info(f"MOPD stage {stage}: teachers {loaded}; fresh optimizer={fresh_optimizer} (dropped {dropped})")
        print(f"[mopd] stage {stage} begins at global step {self.global_steps}: teachers {loaded}"
              + (", fresh AdamW state" if fresh_optimizer else ", optimizer state kept (resumed mid-stage)"))
        self._stage = stage

    def is_stage_end(self, global_step: int) -> bool:
        step = self.current_step(global_step)
        return S.step_index(global_step, len(self.plan_steps)) == self.bounds[step["stage"]][1]

    def on_init_end(self):
        super().on_init_end()  # pushes the initial (or resumed) weights to the rollout replicas
        if self.probe_tokens:
            self.probe_weight_sync()  # the baseline the first step's change is measured against

    def on_step_end(self):
        super().on_step_end()  # pushes the updated weights to the rollout replicas
        if self.probe_tokens:
            self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}),
                                          **self.probe_weight_sync()}
        self._optim_steps = int(self.actor_rollout_wg.mopd_optimizer_steps()[0])
        if not self.is_stage_end(self.global_steps):
            return
        if self._saved_at != self.global_steps:
            self._save_checkpoint()
        if self.eval_enabled:
            self.evaluate_forgetting()

    def probe_weight_sync(self) -> dict[str, float]:
        """Score the fixed probe on every rollout replica and in the trainer's student (:mod:`.weight_probe`)."""
        ids = WP.probe_ids(self.tokenizer, self.probe_tokens)
        served = WP.served_logprobs(self.checkpoint_manager.replicas, ids)
        trained = self.actor_rollout_wg.mopd_probe_logprobs(ids, [tokens for tokens, _ in served])[0]
        metrics = WP.probe_metrics(served, trained, self._probe_served)
        self._probe_served = [logps for _, logps in served]
        return metrics

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

    def canonical_row_order(self, batch):
        """Sort the step's rows by their token ids inside each data-parallel rank's share (in place).

        verl's async rollout returns the responses in completion order, and the docs/math.md §B.7 loss (per-micro-batch
        means) depends on which responses share a micro-batch; a content order makes the update a function of
        the samples alone (same seeds -> same step; an exact resume). Each rank keeps the rows verl's
        ``_balance_batch`` gave it (contiguous equal shares), so its token balance is unchanged.
        """
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        rows = [r.cpu().long().numpy().tobytes() for r in data["input_ids"].unbind()]
        wg = self.actor_rollout_wg
        ranks = wg._dispatch_info.get("actor") if hasattr(wg, "_dispatch_info") else None
        dp = max(ranks) + 1 if ranks else 1
        n = len(rows)
        if n % dp:
            raise ValueError(f"{n} rows do not split evenly over {dp} data-parallel ranks")
        share = n // dp
        order = []
        for c in range(dp):
            order += sorted(range(c * share, (c + 1) * share), key=lambda i: (len(rows[i]), rows[i]))
        batch.reorder(order)
        return batch

    def mopd_student_topk(self, batch, metrics: dict):
        """Pre-update forward of the training model: store the student's top-κ ids and log-probs S (B.2.1).

        The worker writes them as two flattened-rows fields, ``F.TOPK_IDS`` and ``F.STUDENT_LP``
        (:func:`claas_verl.mopd.trainer.workers.fold_topk_outputs`).
        """
        self.canonical_row_order(batch)
        batch.extra_info.update(self._distill_flags(F.PHASE_STUDENT_TOPK))
        self.actor_rollout_wg.compute_log_prob(batch)
        return batch

    def _teacher_q(self, batch, teacher: str):
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
            Sx, Q, mask, mask_nested = self._teacher_q(batch, step["teacher"])
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
        print(f"[mopd] step {global_step}/{len(self.plan_steps)} stage={step['stage']} kind={step['kind']} "
              f"domain={step['domain']} block={step['block']} teacher={step['teacher']} "
              f"kl_topk={metrics.get('mopd/kl_topk', float('nan')):.4f} "
              f"sigma={metrics.get('mopd/adv_sigma', float('nan')):.4g}")

    # ================================================================= checkpoints
    def _step_dir(self, gs: int) -> str:
        return os.path.join(self.run_dir, f"global_step_{gs}")

    def mopd_after_save(self):
        gs = self.global_steps
        self._saved_at = gs
        step = self.current_step(gs)
        if self.is_stage_end(gs):
            self._snapshot(step["stage"], gs)
        state = {
            "global_step": gs,
            "plan_index": gs - 1,
            "stage": step["stage"],
            "stage_complete": self.is_stage_end(gs),
            "snapshots": S.existing_snapshots(self.paths, max(self.bounds)),
            "plan_fingerprint": S.plan_fingerprint(self.plan_steps),
            "plan_length": len(self.plan_steps),
        }
        S.write_state(self._step_dir(gs), state)

    def _snapshot(self, stage: int, gs: int):
        """M_stage in Hugging Face format, copied out of verl's checkpoint (which may be rotated away later)."""
        src = os.path.join(self._step_dir(gs), "actor", "huggingface")
        if not os.path.exists(os.path.join(src, "config.json")):
            raise ValueError(
                f"no Hugging Face export in {src}: add 'hf_model' to "
                "actor_rollout_ref.actor.checkpoint.save_contents (the MOPD recipes do)"
            )
        dst = self.paths.snapshot(stage)
        tmp = dst + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
        print(f"[mopd] stage {stage} ends: snapshot M_{stage} -> {dst}")

    def mopd_after_load(self):
        gs = self.global_steps
        if gs == 0:
            return
        state = S.read_state(self._step_dir(gs))
        if state is None:
            raise ValueError(f"{self._step_dir(gs)} has no {S.STATE_FILE}: not a MOPD checkpoint")
        if state["plan_fingerprint"] != S.plan_fingerprint(self.plan_steps):
            raise ValueError(
                f"the checkpoint {self._step_dir(gs)} was written for a different plan; resume with the same recipe "
                "or set trainer.resume_mode=disable"
            )
        existing = S.existing_snapshots(self.paths, max(self.bounds))
        missing, recopy, stale = S.reconcile_snapshots(state.get("snapshots", []), existing, state["stage"],
                                                       state["stage_complete"])
        if missing:
            raise ValueError(
                f"the checkpoint {self._step_dir(gs)} recorded stage snapshots {state.get('snapshots')} but "
                f"{missing} are gone from {os.path.dirname(self.paths.snapshot(1))}: restore them or resume from an "
                "earlier checkpoint (trainer.resume_from_path)"
            )
        for j in recopy:
            self._snapshot(j, gs)  # killed between the save and the copy
        for j in stale:  # written by work after this checkpoint: this run makes its own M_j again
            src = self.paths.snapshot(j)
            dst = os.path.join(os.path.dirname(src), "discarded", f"student_{j}.after_step_{gs}")
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            print(f"[mopd] snapshot M_{j} was not recorded by checkpoint {gs} (later, discarded work): moved to {dst}")
        dropped = S.truncate_steps(self.run_dir, gs)
        print(f"[mopd] resumed at global step {gs} (stage {state['stage']}); {dropped} later audit lines discarded")
        if (state["stage_complete"] and self.eval_enabled and gs < len(self.plan_steps)
                and not S.stage_end_measured(S.read_forgetting(self.run_dir), state["stage"])):
            self._pending_end_eval = (state["stage"], gs)  # a crash lost it: measured before the next step
        # the next step's on_step_begin loads the teachers; a stage that is not finished keeps its optimizer
        self._stage = None

    # ================================================================= forgetting
    def evaluate_stage_start(self, stage: int):
        """Before a stage's first update: KL from the student to the expert of every domain the stage teaches.

        With the stage-end rows this shows what the stage learned (the KL should fall from here to the stage end)
        next to what later stages forget. Measured again when a run resumes from the checkpoint before it.
        """
        # the current step has not updated yet: the replicas serve the weights of global step - 1
        self._evaluate(stage, "start", S.taught_domains(self.plan_steps, stage), self.global_steps - 1)

    def evaluate_forgetting(self):
        """At a stage end: KL from the stage-final student to the expert of every domain learned so far."""
        gs = self.global_steps
        self._evaluate(self.current_step(gs)["stage"], "end", S.learned_domains(self.plan_steps, gs - 1), gs)
        # the next stage (if any) loads its own teachers
        self._stage = None

    def _evaluate(self, stage: int, at: str, domains: list[str], version: int):
        """Measure ``domains`` (those with held-out prompts) at weight ``version``; append the rows, rewrite the
        tables."""
        rows = []
        for d in domains:
            if d not in self.eval_datasets:
                continue
            measured = self._eval_domain(d, version)
            rows.append({"stage": stage, "at": at, "global_step": version, "domain": d, **measured})
            print(f"[mopd] stage {stage} {at}: KL(student || E[{d}]) = {measured['kl']:.4f} "
                  f"(binned {measured['kl_binned']:.4f}), score {measured['score']:.3f}")
        self._write_forgetting(rows)

    def _write_forgetting(self, rows: list[dict]):
        if not rows:
            return
        S.append_forgetting(self.run_dir, rows)
        table = S.forgetting_table(S.read_forgetting(self.run_dir), title=self.config.trainer.experiment_name)
        with open(os.path.join(self.run_dir, S.FORGETTING_MD), "w") as f:
            f.write(table + "\n")

    def _eval_domain(self, domain: str, version: int) -> dict[str, float]:
        """Sample the student on ``domain``'s held-out prompts; return ``kl`` (the student-weighted top-k KL to the
        domain's expert, as the MOPD paper logs it), ``kl_binned`` (the (k+1)-bin KL, a non-negative lower bound of the
        full-vocabulary KL) and ``score`` (mean reward).

        ``version``: the weight version the rollout replicas serve (tags the rollout and the weight re-sync).
        """
        ds = self.eval_datasets[domain]
        rows = range(min(self.eval_prompts, len(ds)))
        batch_dict = collate_fn([ds[i] for i in rows])
        batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", version)
        tu.assign_non_tensor_data(batch, "validate", True)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": version} for _ in rows]
        tq.kv_batch_put(keys=list(batch["uid"]), partition_id="val", tags=tags)
        self.agent_loop_manager.generate_sequences(batch)
        meta, _ = self.replay_buffer.sample(global_steps=version, partition_id="val", batch_size=len(rows))
        self.checkpoint_manager.sleep_replicas()
        try:
            meta = self._balance_batch(meta, metrics={})
            self.actor_rollout_wg.mopd_set_teachers({f"expert:{domain}": self.paths.path(f"expert:{domain}")},
                                                    self.teacher_dtype)
            self.mopd_student_topk(meta, {})  # reorders the rows (canonical_row_order): read the tags after it
            real = np.array([not t.get("is_padding", False) for t in meta.tags])
            Sx, Q, mask, _ = self._teacher_q(meta, f"expert:{domain}")
            sel = torch.as_tensor(real)
            kl = float(topk_weighted_kl(Sx[sel], Q[sel], mask[sel]))
            kl_binned = float(topk_binned_kl(Sx[sel], Q[sel], mask[sel]))
            scores = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=["rm_scores"])
            score = float(padded(scores["rm_scores"]).sum(-1)[sel].mean())
        finally:
            tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)
            self.checkpoint_manager.update_weights(version)
        return {"kl": kl, "kl_binned": kl_binned, "score": score}


__all__ = ["MOPDTrainer"]
