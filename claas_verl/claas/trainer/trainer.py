"""The CLaaS asynchronous replay trainer: verl's v1 ``PPOTrainer`` driven by a replay-buffer actor.

Registered as ``trainer.v1.trainer_mode=claas``. Rollout producers (a background asyncio loop in this
process, :mod:`claas_verl.claas.trainer.producer`) run the scenario stream on the rollout servers with
the currently served policy and add graded per-step entries to a ``ReplayBufferActor``; concurrently,
verl's own loop (``PPOTrainer.fit``, not copied) trains on M entries drawn from that buffer whenever
it holds ``B_min`` (docs/math.md §A.1, Algorithm 1 of the CLaaS paper (zh)). This module holds verl's hooks only;
the work is done by one component per job, each holding its own state:

* :mod:`~claas_verl.claas.trainer.checks`: the verl settings the CLaaS contract needs (before Ray starts);
* :mod:`~claas_verl.claas.trainer.rollout_side`: environment, stream, replay actor, EMA statistics, ICL memory,
  producers;
* :mod:`~claas_verl.claas.trainer.splits`: the split protocol (docs/math.md §A.1.6) and M's rows;
* :mod:`~claas_verl.claas.trainer.checkpoints`: checkpoint point and resume (format: resume.py);
* :mod:`~claas_verl.claas.trainer.chat_api`: the chat API in front of the rollout replicas (``claas.service``);
* :mod:`~claas_verl.claas.trainer.records`: trace, counters, served-policy probe, end-of-run records.

The hooks:

* ``_init_dataloader``: no prompt dataset: prompts come from the scenario stream;
* ``prepare_step``: never pulls from a dataloader; snapshots the EMA reward statistics that the
  ``claas_rpp_ema`` estimator reads when the minibatch is built (docs/math.md §A.3.1);
* the custom sampler (:class:`~claas_verl.claas.trainer.sampler.ClaasReplaySampler`, verl's ``replay_buffer``
  attribute, :attr:`ClaasTrainer.sampler` here) injects the drawn entries into TransferQueue;
  ``algorithm.rollout_correction.bypass_mode=True`` makes their behaviour log-probs the old log-probs, so
  ``claas_seq_is`` gets the exact per-sequence ratio;
* ``on_sample_end``: does NOT sleep the rollout replicas (generation goes on during training);
* ``on_step_end``: ``on_update`` on the buffer (k += 1, age eviction, docs/math.md §A.1.6), then pushes the new
  weights (only the LoRA adapter with ``model.lora.merge=False``) with version k, then waits,
  event-driven, for the next update to be possible and runs the split protocol in between.

SDPO (``claas.algorithm=sdpo``, docs/math.md §A.3.3): the producers also render each failed step's teacher context
x' (the last user turn re-prompted with the verifier feedback), and the chat API each turn's from the user's feedback
text (:mod:`claas_verl.claas.service.teacher`), which travels with the entry; the actor roles run
:class:`~claas_verl.claas.trainer.sdpo_worker.ClaasSdpoWorker` (EMA teacher over the LoRA adapter, teacher top-K
log-probs on x' before each update, ``sdpo_loss`` in the update, EMA step after an applied finite step).

``trainer_mode``, the checkpoint wrapping, the worker swap, "no dataloader" and ending verl's loop are the shared
seams of :mod:`claas_verl.verl_ext.trainer_base`; the private verl names are listed in
:mod:`claas_verl.verl_ext.trainer_couplings`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.utils.debug import marked_timer

from claas_verl.claas.service.teacher import TEXT_ONLY_KEY
from claas_verl.claas.trainer import verl_couplings as vc
from claas_verl.claas.trainer.chat_api import ChatApiWiring
from claas_verl.claas.trainer.checkpoints import ClaasCheckpoints
from claas_verl.claas.trainer.checks import (
    SAMPLER_NAME,
    SAMPLER_PATH,
    check_claas_config,
    select,
    serves_lora_adapter,
)
from claas_verl.claas.trainer.config import ClaasConfig
from claas_verl.claas.trainer.records import RunCounters, RunRecords, served_weights_probe
from claas_verl.claas.trainer.rollout_side import RolloutSide
from claas_verl.claas.trainer.sampler import ClaasReplaySampler
from claas_verl.claas.trainer.splits import SplitProtocol
from claas_verl.claas.trainer.tenants_side import TenantTraining
from claas_verl.utils.progress import Progress
from claas_verl.verl_ext.trainer_base import (
    VerlSeams,
    drop_prompt_dataloader,
    hidden_verl_progress_bar,
    swap_actor_worker,
)

logger = logging.getLogger(__name__)


@register_trainer("claas")
class ClaasTrainer(VerlSeams, PPOTrainer):
    """CLaaS replay trainer (see the module docstring). Configure with a ``claas:`` block (:class:`ClaasConfig`)."""

    def __init__(self, config):
        if "claas" not in config:
            raise ValueError("trainer.v1.trainer_mode=claas needs a `claas:` config block (see recipes/claas/)")
        self.claas = ClaasConfig.from_config(config.claas)
        check_claas_config(config, self.claas)
        if select(config, "actor_rollout_ref.rollout.name") == "vllm" and serves_lora_adapter(config):
            from claas_verl.claas.vllm_versioned_lora import register

            register(config)  # LoRA updates: new adapter id, switch, old one unloaded once drained, no cache reset
        super().__init__(config)
        if not isinstance(self.sampler, ClaasReplaySampler):
            raise ValueError(f"trainer.v1.sampler.custom_sampler must select {SAMPLER_PATH}.{SAMPLER_NAME}")
        out_dir = config.trainer.default_local_dir
        self.records = RunRecords(out_dir, trace=self.claas.trace)
        self.counters = RunCounters()
        self.chat = ChatApiWiring(self.claas, out_dir)
        self.ckpt = ClaasCheckpoints(config, self.claas, self.records, self.counters, self.chat,
                                     save_verl=self._save_verl_checkpoint, save_teacher=self._save_sdpo_teacher)
        self.side: RolloutSide | None = None  # built in on_init_end, once the replicas serve version 0
        self.tenants: TenantTraining | None = None  # claas.service.tenants: one adapter per tenant (tenants_side)
        self.splits: SplitProtocol | None = None
        # after every push (single adapter) the replicas and the trainer score a fixed probe; tenants: verified reloads
        self.weight_probe = None
        if self.claas.trains and self.claas.weight_sync_probe_tokens and not self.claas.service.tenant_names:
            from claas_verl.verl_ext.weight_probe import WeightSyncProbe

            self.weight_probe = WeightSyncProbe(self.claas.weight_sync_probe_tokens,
                                                self.claas.weight_sync_max_abs_diff, system="claas")
        # The stream, not a step count, ends the run: verl's bar would count to the 10**9 placeholder, so it is
        # hidden and this line reports updates (with an ETA only when claas.max_updates caps them).
        self.progress: Progress | None = None

    @property
    def sampler(self) -> ClaasReplaySampler:
        """verl's sampler, which verl stores as ``replay_buffer``; the replay buffer is ``side.replay_actor``."""
        return self.replay_buffer

    @property
    def sdpo(self) -> bool:
        return self.claas.algorithm == "sdpo"

    # ------------------------------------------------------------------ verl hooks: construction
    def _init_resource_pool_mgr(self):
        from claas_verl.preflight.placement import check_placement

        super()._init_resource_pool_mgr()
        check_placement(self.resource_pool_manager)  # an unplaceable pool would wait forever in verl
        if self.claas.service.tenant_names:
            from claas_verl.claas.trainer.tenant_worker import ClaasSdpoTenantsWorker, ClaasTenantsWorker

            # per-tenant adapter, optimizer state, schedule (and SDPO teacher) swapped around each update
            swap_actor_worker(self, ClaasSdpoTenantsWorker if self.sdpo else ClaasTenantsWorker)
        elif self.sdpo:
            from claas_verl.claas.trainer.sdpo_worker import ClaasSdpoWorker

            swap_actor_worker(self, ClaasSdpoWorker)  # the SDPO update (EMA teacher, re-prompted teacher pass)
        elif self.claas.trains:
            from claas_verl.claas.trainer.worker import ClaasWorker

            swap_actor_worker(self, ClaasWorker)  # the trainer's side of the weight-sync probe

    def _init_dataloader(self):
        """No prompt dataset: scenarios come from the environment's stream (docs/math.md §A.1.3); the stream, not
        epochs, ends training (or ``claas.max_updates``)."""
        drop_prompt_dataloader(self, total_steps=self.claas.max_updates or 10**9)

    def on_init_end(self):
        if self.sdpo:
            # θ_T = θ⁰: the EMA teacher copies the LoRA adapter before any update (docs/math.md §A.3.3)
            vc.actor_worker_group(self).claas_sdpo_setup(dataclasses.asdict(self.claas.sdpo))
            if self.ckpt.resume is not None:  # θ_T of checkpoint N (θ of N was loaded by verl's _load_checkpoint)
                restored = vc.actor_worker_group(self).claas_sdpo_load(self.ckpt.resume_dir)[0]  # rank 0's
                self.ckpt.teacher_ema_steps = restored["ema_steps"]
                self.ckpt.teacher_restored = restored
                logger.info("SDPO EMA teacher restored (%s EMA steps)", self.ckpt.teacher_ema_steps)
        # Serve the initial weights (version 0) before any rollout, as verl's sync trainer does.
        self.checkpoint_manager.update_weights(self.global_steps)
        if self.weight_probe is not None:
            self._probe_weight_sync()  # the baseline the first push's change is measured against
        self._set_up_run()

    def _set_up_run(self) -> None:
        out_dir = self.config.trainer.default_local_dir
        ckpt = self.ckpt
        self.side = side = RolloutSide(self.config, self.claas, tokenizer=self.tokenizer,
                                       llm_server_manager=self.llm_server_manager, sampler=self.sampler,
                                       resume=ckpt.resume, resume_dir=ckpt.resume_dir, warn=self.records.warn)
        side.producer.on_commit = lambda record: self.records.trace({"event": "commit", **record})
        if self.claas.service.tenant_names:
            self.tenants = TenantTraining(
                self.claas, vc.actor_worker_group(self), side.replay_actor, self.sampler, out_dir,
                reinforce_ema=self.config.algorithm.adv_estimator == "claas_rpp_ema")
            self.tenants.setup(self.tokenizer)
            if ckpt.resume is not None:
                if ckpt.resume.tenants is None:
                    raise ValueError(f"{ckpt.resume_dir}: the checkpoint holds no tenant state (it was written "
                                     "by a single-tenant job)")
                self.tenants.restore(ckpt.resume_dir, ckpt.resume.tenants)
            ckpt.tenants = self.tenants
        self.splits = SplitProtocol(self.claas, side, self.chat, self.records, self.counters, out_dir, ckpt)
        os.makedirs(out_dir, exist_ok=True)
        record = ckpt.restore_run_state(side, self.splits) if ckpt.resume is not None else None
        if self.claas.service.enabled:
            self.chat.start(side.generate, self.tokenizer, side.max_model_len,
                            model_path=self.config.actor_rollout_ref.model.path, replay_actor=side.replay_actor,
                            policy_version=self.global_steps, on_accepted=self._on_chat_accepted,
                            extra_stats=self._chat_extra_stats, tenants=self.tenants)
        self.records.trace({"event": "start", "claas": OmegaConf.to_container(self.config.claas, resolve=True),
                            "split_ids": side.stream.ids(), "warnings": self.records.warnings})
        if record is not None:
            if self.tenants is not None:  # what every tenant resumed at, before any update of this job
                record["tenants"] = self.tenants.stats()
            self.records.trace(record)

    # ------------------------------------------------------------------ verl hooks: the loop
    def on_sample_end(self):
        # Unlike verl's sync trainer, the replicas are NOT put to sleep: producers keep generating during training.
        return None

    def prepare_step(self) -> dict:
        """Replaces the dataloader pull: snapshot b, v for ``claas_rpp_ema`` (read when this minibatch is built)."""
        out = {"claas/wait_buffer_s": self.counters.last_wait_s, "claas/split": self.splits.idx + 1}
        if self.tenants is not None:  # the update's tenant, swapped in; its EMA statistics bound
            out.update(self.tenants.begin())
        if self.side.ema is not None:
            out.update(self.side.ema.snapshot_for_step())
        return out

    def on_train_begin(self):
        cap = self.claas.max_updates
        self.progress = Progress("[claas] training", None if cap is None else cap - self.counters.updates,
                                 unit="updates" if self.counters.updates == 0 else "updates since resume")
        self.splits.begin(self.ckpt.resume.position if self.ckpt.resume is not None else None)
        if not self.splits.advance_until_ready():
            self.stop_before_first_step()  # nothing to train on (e.g. ICL)
            self.ckpt.at_shutdown(self.side, self.splits)

    def on_step_end(self):
        c = self.counters
        c.updates += 1
        c.last_update_unix = time.time()
        replay = self.side.replay_actor
        if self.tenants is not None:
            size_before = ray.get(replay.size.remote(tenant=self.tenants.current))
            with marked_timer("claas_tenant_update", self.timing_raw, color="red"):
                probe = {"tenant_update": self.tenants.end()}  # swap out, count, verified reload
            evicted = probe["tenant_update"]["evicted_age"]
        else:
            with marked_timer("claas_on_update", self.timing_raw, color="red"):
                size_before = ray.get(replay.size.remote())
                evicted = ray.get(replay.on_update.remote())  # k += 1 first: a pushed version is never ahead of k
            with marked_timer("update_weights", self.timing_raw, color="red"):
                self.checkpoint_manager.update_weights(self.global_steps)
            probe = {}
            if self.weight_probe is not None:  # the replicas serve what was trained, or the job stops here
                with marked_timer("weight_sync_probe", self.timing_raw, color="red"):
                    probe["weight_sync"] = self._probe_weight_sync()
            # update_weights returned: version k is on every replica the API routes to; only now announce it
            self.chat.publish(self.global_steps)
            if self.claas.trace_served_weights:
                probe.update(served_weights_probe(self.llm_server_manager))
        if self.sdpo:
            probe["sdpo"] = vc.actor_worker_group(self).claas_sdpo_probe()[0]  # rank 0's EMA bookkeeping
        self.records.trace({"event": "update", "update": c.updates, "global_steps": self.global_steps,
                            "split": self.splits.idx + 1, "buffer_size_at_update": size_before,
                            "evicted_age": evicted, "sampled": self.sampler.last_sample, **probe})
        # the split this update trained in (the wait below may start the next one)
        where = {"split": f"{self.splits.idx + 1}/{self.side.stream.num_splits}"} if self.claas.producer.enabled else {}
        stop = self.claas.max_updates is not None and c.updates >= self.claas.max_updates
        if self.ckpt.due:  # trainer.save_freq: the checkpoint point (k = N, update N pushed)
            with marked_timer("save_checkpoint", self.timing_raw, color="green"):
                self.ckpt.take(self.side, self.splits)
        with marked_timer("claas_wait_buffer", self.timing_raw, color="blue"):
            more = False if stop else self.splits.advance_until_ready()
        if not more:
            self.stop_after_this_step()
            self.ckpt.at_shutdown(self.side, self.splits)
        self.progress.update(**where, buffer=size_before)
        # verl merges these into this step's metrics (_consume_sync_metrics)
        self._pending_sync_metrics = {"claas/evicted_age": evicted, "claas/buffer_size": size_before,
                                      **probe.get("weight_sync", {})}

    def fit(self, agent_loop_manager=None):
        """verl's loop (unchanged), then the run's records; producers are stopped whatever happens."""
        try:
            with hidden_verl_progress_bar():
                super().fit(agent_loop_manager)
            if self.claas.producer.enabled:
                self._write_continual_metrics()
            else:
                self._write_service_stats()
        finally:
            self.chat.close()
            if self.side is not None:
                self.side.close()

    def _probe_weight_sync(self) -> dict[str, float]:
        wg = vc.actor_worker_group(self)
        return self.weight_probe.measure(self.tokenizer, self.checkpoint_manager.replicas,
                                         lambda ids, targets: wg.claas_probe_logprobs(ids, targets)[0])

    # ------------------------------------------------------------------ verl hooks: checkpoints (VerlSeams)
    def checkpoint_now(self) -> bool:
        """verl's ``fit`` asks right after ``step()``, when the buffer's k is still one behind the policy and update N
        is not pushed: only mark a checkpoint due; ``on_step_end`` takes it at the checkpoint point."""
        if self.ckpt.in_progress:
            return True
        self.ckpt.due = True
        return False

    def before_checkpoint_load(self) -> None:
        self.ckpt.read_before_verl_loads()

    def after_checkpoint_loaded(self) -> None:
        self.ckpt.check_verl_loaded(self.global_steps)

    def _save_verl_checkpoint(self, k: int) -> None:
        """verl's checkpoint (policy, optimizer, critic, tracker file) as ``global_step_{k}``."""
        saved, self.global_steps = self.global_steps, k
        try:
            self._save_checkpoint()
        finally:
            self.global_steps = saved

    def _save_sdpo_teacher(self, claas_dir: str) -> list | None:
        if not self.sdpo:
            return None
        return [os.path.basename(p) for p in vc.actor_worker_group(self).claas_sdpo_save(claas_dir)]

    # ------------------------------------------------------------------ chat API callbacks
    def _on_chat_accepted(self, entries: list, accepted: int) -> None:
        """docs/math.md §A.3.1: the EMA sees every reward the buffer accepted, at insertion time (as the producers do);
        an SDPO text-only entry carries no reward of the user's (stored as 0, marked) and is skipped. The trace's commit
        line lets a resume count the entries accepted after its checkpoint."""
        self.records.trace({"event": "commit", "scenario": None, "accepted": accepted})
        emas = self.tenants.ema if self.tenants is not None else self.side.ema
        if emas is None:
            return
        if accepted != len(entries):
            raise RuntimeError(f"the buffer accepted {accepted} of {len(entries)} entries of one chat write; "
                               "the chat API writes one entry per call")
        rewarded = [e for e in entries if not e.metadata.get(TEXT_ONLY_KEY)]
        if self.tenants is None:
            emas.update_many(e.reward for e in rewarded)
            return
        for e in rewarded:  # each tenant's statistics see its own rewards only
            emas.update_many(e.metadata["tenant"], [e.reward])

    def _chat_extra_stats(self) -> dict:
        out = {"buffer": self.side.buffer_stats(), "updates": self.counters.updates, "resumes": self.ckpt.resumes,
               "last_update_unix": self.counters.last_update_unix}
        if self.side.ema is not None:
            out["ema"] = self.side.ema.state_dict()
        if self.tenants is not None:
            out["tenant_training"] = self.tenants.stats()
            if self.tenants.ema is not None:
                out["ema"] = self.tenants.ema.state_dict()
        return out

    # ------------------------------------------------------------------ end-of-run records
    def _write_continual_metrics(self) -> None:
        buffer_stats = self.side.buffer_stats()
        extra = {"algorithm": self.claas.algorithm, "updates": self.counters.updates,
                 "splits": self.splits.split_records, "split_ids": self.side.stream.ids(),
                 "producer": self.side.producer.stats.as_dict(), "resumes": self.ckpt.resumes,
                 "trainer_wait_buffer_s": self.counters.wait_s, "wall_s": self.records.wall_s()}
        self.records.write_continual_metrics(self.splits.matrix, self.side.stream.num_splits, buffer_stats, extra,
                                             algorithm=self.claas.algorithm, a_max=self.claas.a_max)

    def _write_service_stats(self) -> None:
        """Service-driven run: no scenario splits, so no M; record the API's and the buffer's statistics."""
        stats = self.chat.final_stats()
        path = self.records.write_service_stats({
            "algorithm": self.claas.algorithm, "updates": self.counters.updates, "service": stats,
            "resumes": self.ckpt.resumes, "trainer_wait_buffer_s": self.counters.wait_s,
            "wall_s": self.records.wall_s()})
        t = stats["turns"]
        print(f"[claas] {self.counters.updates} updates from the chat API; served {t['served']}, completed "
              f"{t['completed']}, accepted {t['accepted']}, expired {t['expired']}; stats: {path}", flush=True)
