"""The CLaaS asynchronous replay trainer: verl's v1 ``PPOTrainer`` driven by a replay-buffer actor.

Registered as ``trainer.v1.trainer_mode=claas``. Rollout producers (a background asyncio loop in this
process, :mod:`claas_verl.trainer.claas.producer`) run the scenario stream on the rollout servers with
the currently served policy and add graded per-step entries to a ``ReplayBufferActor``; concurrently,
verl's own loop (``PPOTrainer.fit``, not copied) trains on M entries drawn from that buffer whenever
it holds ``B_min`` (SPEC A.1, Algorithm 1 of 002). Only hooks are used:

* ``_init_dataloader``: no prompt dataset: prompts come from the scenario stream;
* ``prepare_step``: never pulls from a dataloader; snapshots the EMA reward statistics that the
  ``claas_rpp_ema`` estimator reads when the minibatch is built (SPEC A.3.1);
* the custom sampler (:class:`~claas_verl.trainer.claas.sampler.ClaasReplaySampler`) injects the drawn
  entries into TransferQueue; ``algorithm.rollout_correction.bypass_mode=True`` makes their behaviour
  log-probs the old log-probs, so ``claas_seq_is`` gets the exact per-sequence ratio;
* ``on_sample_end``: does NOT sleep the rollout replicas (generation goes on during training);
* ``on_step_end``: ``on_update`` on the buffer (k += 1, age eviction, SPEC A.1.6), then pushes the new
  weights (only the LoRA adapter with ``model.lora.merge=False``) with version k, then waits,
  event-driven, for the next update to be possible and runs the split protocol in between.

SDPO (``claas.algorithm=sdpo``, SPEC A.3.3): the producers also render each failed step's teacher context x' (the
last user turn re-prompted with the verifier feedback), which travels with the entry; the actor roles run
:class:`~claas_verl.trainer.claas.sdpo_worker.ClaasSdpoWorker` (EMA teacher over the LoRA adapter, teacher top-K
log-probs on x' before each update, ``sdpo_loss`` in the update, EMA step after an applied finite step). The
private verl names this needs are in :mod:`claas_verl.trainer.claas.verl_couplings`.

Split protocol (SPEC A.1.6, 001 §4): for split j, its rollouts run with training concurrent; when they
end, training continues until ``|B| < B_min``; checkpoint j is saved; the served policy is evaluated on
every split (row j of M); then split j+1 starts. ``continual_metrics.json`` (M, forward transfer,
forgetting, final, buffer statistics) is written in ``trainer.default_local_dir``.

Checkpoints and resume (:mod:`claas_verl.trainer.claas.resume`): verl's own ``_save_checkpoint`` /
``_load_checkpoint`` (``trainer.save_freq``, ``trainer.resume_mode``) save and load the policy and optimizer;
the overrides here add the CLaaS state (buffer snapshot, k, EMA statistics, SDPO teacher, stream position) to
the same ``global_step_N`` folder, at one checkpoint point: in ``on_step_end`` after update N is applied,
counted (k = N) and pushed, with the producers' commits paused. verl's loop calls ``_save_checkpoint`` before
``on_step_end`` (k one behind); the override only marks it due. A split end always checkpoints. Resuming
restores every piece from one N (the restart-consistency invariant stated in resume.py).

The base class's semantics stay those of the synchronous trainer (``trainer_mode`` is reset to
``"sync"`` after construction: verl switches checkpoint/TransferQueue behaviour on any other name).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from omegaconf import OmegaConf, open_dict
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.utils.debug import marked_timer

from claas_verl.trainer.claas import resume as rs
from claas_verl.trainer.claas.config import ClaasConfig
from claas_verl.trainer.claas.producer import BackgroundLoop, ChatRenderer, RolloutProducer
from claas_verl.trainer.claas.sampler import ClaasReplaySampler

SERVICE_ADMIN_FILE = "service_admin.key"  # a run's own admin key when none is configured (mode 0600)

logger = logging.getLogger(__name__)

SAMPLER_PATH = "pkg://claas_verl.trainer.claas.sampler"
SAMPLER_NAME = "ClaasReplaySampler"
TRACE_FILE = "claas_trace.jsonl"


class _NoPromptLoader:
    """Stands in for verl's prompt dataloader (CLaaS prompts come from the scenario stream)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, dotted, default=default)
    return default if value is None else value


def check_claas_config(config: Any, claas: ClaasConfig) -> None:
    """Reject verl settings that would silently break the CLaaS contract; each error names the key and the fix."""
    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{key}={_get(config, key)!r}: {why}")

    rollout = "actor_rollout_ref.rollout"
    need(float(_get(config, f"{rollout}.temperature", 1.0)) == 1.0, f"{rollout}.temperature",
         "CLaaS entries must be sampled at temperature 1 (SPEC §0: behaviour log-probs of the sampled "
         "distribution); set it to 1.0 (evaluation temperature is claas.eval.temperature)")
    need(int(_get(config, f"{rollout}.n", 1)) == 1, f"{rollout}.n",
         "CLaaS draws single trajectories from the buffer (no GRPO groups); set it to 1")
    sampler = _get(config, "trainer.v1.sampler.custom_sampler.path")
    need(sampler in (SAMPLER_PATH, SAMPLER_PATH.replace(".", "/")), "trainer.v1.sampler.custom_sampler.path",
         f"set it to {SAMPLER_PATH} (name {SAMPLER_NAME}) so steps are fed from the replay buffer")
    need(_get(config, "trainer.v1.sampler.custom_sampler.name") == SAMPLER_NAME,
         "trainer.v1.sampler.custom_sampler.name", f"set it to {SAMPLER_NAME}")
    need(int(_get(config, "trainer.test_freq", -1)) <= 0, "trainer.test_freq",
         "CLaaS evaluates split checkpoints itself (claas.eval); set it to -1")
    need(not bool(_get(config, "trainer.val_before_train", False)), "trainer.val_before_train", "set it to false")
    if not claas.trains:
        return
    need(int(_get(config, "data.train_batch_size", 0)) == claas.m, "data.train_batch_size",
         f"one update draws claas.m={claas.m} entries; set it to ${{claas.m}}")
    need(int(_get(config, "actor_rollout_ref.actor.ppo_mini_batch_size", 0)) == claas.m,
         "actor_rollout_ref.actor.ppo_mini_batch_size",
         "one optimizer step per sampled minibatch (SPEC A.1.6); set it to ${claas.m}")
    # verl splits the update batch evenly over the data-parallel ranks, then each rank's share into micro-batches
    ranks = int(_get(config, "trainer.nnodes", 1)) * int(_get(config, "trainer.n_gpus_per_node", 1))
    need(claas.m % ranks == 0, "trainer.n_gpus_per_node",
         f"claas.m={claas.m} entries per update must split evenly over the {ranks} training ranks")
    per_rank = claas.m // ranks
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    micro = _get(config, key, None)
    need(micro is None or bool(_get(config, "actor_rollout_ref.actor.use_dynamic_bsz", False))
         or per_rank % int(micro) == 0, key,
         f"each of the {ranks} training ranks gets claas.m / {ranks} = {per_rank} entries per update; set it to a "
         f"divisor of {per_rank}")
    need(int(_get(config, "actor_rollout_ref.actor.ppo_epochs", 1)) == 1, "actor_rollout_ref.actor.ppo_epochs",
         "each sampled minibatch gives exactly one update; set it to 1")
    need(bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)),
         "algorithm.rollout_correction.bypass_mode",
         "the stored behaviour log-probs are the old log-probs of the IS ratio; set it to true")
    loss_mode = _get(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    need(str(loss_mode).startswith("claas_seq_is"), "actor_rollout_ref.actor.policy_loss.loss_mode",
         "only a per-sequence behaviour log-prob is stored, so a per-token ratio is meaningless; use claas_seq_is")
    if claas.algorithm == "sdpo":
        need(int(_get(config, "actor_rollout_ref.model.lora_rank", 0)) > 0, "actor_rollout_ref.model.lora_rank",
             "the SDPO EMA teacher is kept over the LoRA adapter (SPEC A.3.3); set a LoRA rank > 0")
        need(not bool(_get(config, "critic.enable", False)), "critic.enable", "SDPO trains no critic; set it false")


def _lora_adapter(config: Any) -> bool:
    """The rollout serves a LoRA adapter (rank > 0, not merged into the base weights)."""
    rank = max(int(_get(config, "actor_rollout_ref.model.lora_rank", 0) or 0),
               int(_get(config, "actor_rollout_ref.model.lora.rank", 0) or 0))
    return rank > 0 and not bool(_get(config, "actor_rollout_ref.model.lora.merge", False))


def _served_fingerprint(named: dict[str, torch.Tensor]) -> str:
    """sha1 over the served weights (sorted names, fp32 bytes): changes iff any served weight changes."""
    h = hashlib.sha1()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


@register_trainer("claas")
class ClaasTrainer(PPOTrainer):
    """CLaaS replay trainer (see the module docstring). Configure with a ``claas:`` block (:class:`ClaasConfig`)."""

    def __init__(self, config):
        if "claas" not in config:
            raise ValueError("trainer.v1.trainer_mode=claas needs a `claas:` config block (see recipes/claas/)")
        self.claas = ClaasConfig.from_config(config.claas)
        check_claas_config(config, self.claas)
        if _get(config, "actor_rollout_ref.rollout.name") == "vllm" and _lora_adapter(config):
            from claas_verl.verl_ext.vllm_versioned_lora import register

            register(config)  # LoRA updates: new adapter id, switch, old one unloaded once drained, no cache reset
        super().__init__(config)
        # verl switches async checkpoint/TransferQueue behaviour on any mode name other than "sync";
        # the CLaaS loop is synchronous from the base class's point of view.
        self.trainer_mode = "sync"
        if not isinstance(self.replay_buffer, ClaasReplaySampler):
            raise ValueError(f"trainer.v1.sampler.custom_sampler must select {SAMPLER_PATH}.{SAMPLER_NAME}")
        self._loop: BackgroundLoop | None = None
        self._split_future: concurrent.futures.Future | None = None
        self._split_idx = -1
        self._matrix: list[list[float]] = []
        self._split_records: list[dict] = []
        self._warnings: list[str] = []
        self._updates = 0
        self._wait_s = 0.0
        self._last_wait_s = 0.0
        self._t_start = time.time()
        self.service = None
        self._service_thread = None
        self._last_update_unix: float | None = None
        self._stop = threading.Event()  # set by POST /v1/claas/shutdown: the loop ends after the current update
        self._trace_lock = threading.Lock()  # trace lines come from the trainer thread and the producers' loop
        self._split_complete = False  # the current split's rollouts ended and its training ran until |B| < B_min
        self._resume: rs.ClaasState | None = None  # the CLaaS state of the checkpoint this run resumes from
        self._resume_dir: str | None = None
        self._resumes: list[dict] = []  # one record per resume of this run's history
        self._ckpt_due = False  # verl's loop asked for a checkpoint; taken at the checkpoint point (on_step_end)
        self._in_checkpoint = False
        self._last_ckpt_step: int | None = None  # step of the latest verl checkpoint this history wrote or loaded
        self._sink = None
        self._sdpo_restored: int | None = None  # EMA steps of the SDPO teacher restored at a resume

    # ------------------------------------------------------------------ verl hooks
    def _init_resource_pool_mgr(self):
        from claas_verl.preflight.placement import check_placement

        super()._init_resource_pool_mgr()
        check_placement(self.resource_pool_manager)  # an unplaceable pool would wait forever in verl
        if self.claas.algorithm == "sdpo":
            from claas_verl.trainer.claas import verl_couplings as vc

            vc.use_sdpo_worker(self)  # the actor runs the SDPO update (EMA teacher, re-prompted teacher pass)

    def _init_dataloader(self):
        """No prompt dataset: scenarios come from the environment's stream (SPEC A.1.3)."""
        self.train_dataset = self.val_dataset = None
        self.train_dataloader = _NoPromptLoader()
        self.train_dataloader_it = None
        self.val_dataloader = _NoPromptLoader()
        self.steps_per_epoch = 1 << 62  # the epoch counter never advances: the stream, not epochs, ends training
        cap = self.claas.max_updates or 10**9
        self.total_training_steps = cap
        with open_dict(self.config):
            self.config.trainer.total_epochs = 1
            if OmegaConf.select(self.config, "actor_rollout_ref.actor.optim"):
                self.config.actor_rollout_ref.actor.optim.total_training_steps = cap
            if OmegaConf.select(self.config, "critic.optim"):
                self.config.critic.optim.total_training_steps = cap

    def on_init_end(self):
        if self.claas.algorithm == "sdpo":
            from claas_verl.trainer.claas import verl_couplings as vc

            # θ_T = θ⁰: the EMA teacher copies the LoRA adapter before any update (SPEC A.3.3)
            vc.actor_worker_group(self).claas_sdpo_setup(dataclasses.asdict(self.claas.sdpo))
            if self._resume is not None:  # θ_T of checkpoint N (θ of N was loaded by verl's _load_checkpoint)
                self._sdpo_restored = vc.actor_worker_group(self).claas_sdpo_load(self._resume_dir)[0]
                logger.info("SDPO EMA teacher restored (%s EMA steps)", self._sdpo_restored)
        # Serve the initial weights (version 0) before any rollout, as verl's sync trainer does.
        self.checkpoint_manager.update_weights(self.global_steps)
        self._setup_claas()

    def on_sample_end(self):
        # Unlike verl's sync trainer, the replicas are NOT put to sleep: producers keep generating during training.
        return None

    def prepare_step(self) -> dict:
        """Replaces the dataloader pull: snapshot b, v for ``claas_rpp_ema`` (read when this minibatch is built)."""
        if self._ema_live is not None:
            with self._ema_lock:
                self._ema_bound.load_state_dict(self._ema_live.state_dict())
        out = {"claas/wait_buffer_s": self._last_wait_s, "claas/split": self._split_idx + 1}
        if self._ema_bound is not None:
            out.update({"claas/ema_baseline": self._ema_bound.baseline, "claas/ema_variance": self._ema_bound.variance})
        return out

    def on_train_begin(self):
        pos = self._resume.position if self._resume is not None else None
        if pos is not None and pos.split >= 0 and not pos.complete:
            self._start_split(pos.split, skip=pos.done)  # the split in progress: its uncommitted scenarios
        else:
            if pos is not None and pos.split >= 0 and len(self._matrix) <= pos.split:
                self._record_row(pos.split)  # killed after checkpoint j, before row j of M was evaluated
            self._start_next_split()
        if not self._advance_until_ready():
            self.total_training_steps = self.global_steps - 1  # nothing to train on (e.g. ICL): skip the loop
            self._checkpoint_at_shutdown()

    def on_step_end(self):
        self._updates += 1
        self._last_update_unix = time.time()
        with marked_timer("claas_on_update", self.timing_raw, color="red"):
            size_before = ray.get(self.replay.size.remote())
            evicted = ray.get(self.replay.on_update.remote())  # k += 1 first: a pushed version is never ahead of k
        with marked_timer("update_weights", self.timing_raw, color="red"):
            self.checkpoint_manager.update_weights(self.global_steps)
        if self.service is not None:
            # update_weights returned: version k is on every replica the API routes to; only now announce it
            self.service.backend.publish(self.global_steps)
        probe = self._probe_served_policy()
        if self.claas.algorithm == "sdpo":
            from claas_verl.trainer.claas import verl_couplings as vc

            probe["sdpo"] = vc.actor_worker_group(self).claas_sdpo_probe()[0]  # rank 0's EMA bookkeeping
        self._trace({"event": "update", "update": self._updates, "global_steps": self.global_steps,
                     "split": self._split_idx + 1, "buffer_size_at_update": size_before, "evicted_age": evicted,
                     "sampled": self.replay_buffer.last_sample, **probe})
        stop = self.claas.max_updates is not None and self._updates >= self.claas.max_updates
        if self._ckpt_due:  # trainer.save_freq: the checkpoint point (k = N, update N pushed)
            with marked_timer("save_checkpoint", self.timing_raw, color="green"):
                self._claas_checkpoint()
        with marked_timer("claas_wait_buffer", self.timing_raw, color="blue"):
            more = False if stop else self._advance_until_ready()
        if not more:
            self.total_training_steps = self.global_steps  # verl's loop ends after this step
            self._checkpoint_at_shutdown()
        self._pending_sync_metrics = {"claas/evicted_age": evicted, "claas/buffer_size": size_before}

    def fit(self, agent_loop_manager=None):
        """verl's loop (unchanged), then the continual metrics; producers are stopped whatever happens."""
        try:
            super().fit(agent_loop_manager)
            if self.claas.producer.enabled:
                self._finalize()
            else:
                self._finalize_service()
        finally:
            self._shutdown()

    # ------------------------------------------------------------------ set-up
    def _setup_claas(self) -> None:
        from claas_verl.envs import ICLFeedbackMemory, make_environment
        from claas_verl.losses.advantages import EmaRewardStats
        from claas_verl.replay import make_replay_actor, validate_replay_sizes
        from claas_verl.verl_ext.claas_losses import bind_rpp_ema_stats

        c = self.claas
        self.env = make_environment(c.env.name, **c.env.kwargs)
        self.stream = self.env.stream(seed=c.stream.seed, num_splits=c.stream.num_splits,
                                      split_size=c.stream.split_size, split_groups=c.stream.split_groups,
                                      group_key=c.stream.group_key)
        per_split = min(self.stream.max_entries_per_split(c.entry_unit))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            validate_replay_sizes(c.m, c.b_min, c.b_max, expected_entries_per_split=per_split)
        for w in caught:  # SPEC A.1.8: B_min above what one split can produce
            msg = str(w.message)
            self._warnings.append(msg)
            logger.warning(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)

        # Entries arrive by reference (the producer puts each batch's tokens into the object store). The producer
        # runs in this process, which outlives the actor (max_restarts=0), so the buffers need no adoption copy.
        self.replay = make_replay_actor(c.b_max, c.b_min, c.a_max, seed=c.seed, entry_unit=c.entry_unit,
                                        max_restarts=0, adopt=False)
        self.replay_buffer.bind(self.replay, data_source=f"claas/{c.env.name}", sdpo=c.algorithm == "sdpo")
        r = self._resume
        if r is not None:
            ray.get(self.replay.load.remote(os.path.join(self._resume_dir, r.buffer["file"])))
            got = ray.get(self.replay.summary.remote())
            if got["k"] != r.global_steps or got["uids"] != r.buffer["uids"]:
                raise rs.ResumeMismatch(f"{self._resume_dir}: the buffer snapshot (k={got['k']}, {got['size']} "
                                        f"entries) is not the one state.json records (k={r.buffer['k']}, "
                                        f"{r.buffer['size']} entries)")

        self._ema_lock = threading.Lock()
        self._ema_live = self._ema_bound = None
        if self.config.algorithm.adv_estimator == "claas_rpp_ema":
            self._ema_live = EmaRewardStats(beta=c.rpp.beta, b0=c.rpp.b0, v0=c.rpp.v0, v_min=c.rpp.v_min)
            self._ema_bound = EmaRewardStats(beta=c.rpp.beta, b0=c.rpp.b0, v0=c.rpp.v0, v_min=c.rpp.v_min)
            bind_rpp_ema_stats(self._ema_bound)
            if r is not None:
                if r.ema is None:
                    raise rs.ResumeMismatch(f"{self._resume_dir}: the checkpoint holds no EMA reward statistics")
                self._ema_live.load_state_dict(r.ema)
                self._ema_bound.load_state_dict(r.ema)

        tokenizer = self.tokenizer
        self.icl_memory = None
        if c.algorithm == "icl":
            self.icl_memory = ICLFeedbackMemory(lambda s: len(tokenizer.encode(s, add_special_tokens=False)),
                                                token_budget=c.icl.token_budget,
                                                max_quote_chars=c.icl.max_quote_chars)
            if r is not None and r.icl_memory is not None:
                self.icl_memory.load_state_dict(r.icl_memory)
        rollout = self.config.actor_rollout_ref.rollout
        max_len = _get(rollout, "max_model_len")
        max_prompt = (int(max_len) - c.producer.max_new_tokens) if max_len else int(_get(rollout, "prompt_length"))
        client = self.llm_server_manager.get_client()

        async def generate(request_id, prompt_ids, sampling_params):
            return await client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

        self.producer = RolloutProducer(
            generate, ChatRenderer(tokenizer), self.replay if c.trains else None,
            max_new_tokens=c.producer.max_new_tokens, max_concurrent=c.producer.max_concurrent_scenarios,
            max_retries=c.producer.max_retries, entry_unit=c.entry_unit,
            max_prompt_tokens=max_prompt, ema_stats=self._ema_live, ema_lock=self._ema_lock,
            icl_memory=self.icl_memory,
            sdpo_reprompt={"reprompt_success": c.sdpo.reprompt_success} if c.algorithm == "sdpo" else None,
        )
        self.producer.on_commit = lambda record: self._trace({"event": "commit", **record})
        self._loop = BackgroundLoop()
        os.makedirs(self.config.trainer.default_local_dir, exist_ok=True)
        record = self._restore_run_state() if r is not None else None
        if c.service.enabled:
            self._start_service(generate, tokenizer, int(max_len) if max_len else None)
        self._trace({"event": "start", "claas": OmegaConf.to_container(self.config.claas, resolve=True),
                     "split_ids": self.stream.ids(), "warnings": self._warnings})
        if record is not None:
            self._trace(record)

    # ------------------------------------------------------------------ checkpoints and resume (resume.py)
    def _save_checkpoint(self):
        """verl's checkpoint (policy, optimizer, critic, tracker file), only from :meth:`_claas_checkpoint`.

        verl's ``fit`` calls this right after ``step()`` when ``trainer.save_freq`` says so; there the buffer's k is
        still one behind the policy and update N is not pushed, so the call only marks a checkpoint due, and
        ``on_step_end`` takes it at the checkpoint point."""
        if not self._in_checkpoint:
            self._ckpt_due = True
            return None
        return super()._save_checkpoint()

    def _claas_checkpoint(self) -> None:
        """Checkpoint N = k: the CLaaS state into ``global_step_N/claas/`` first, then verl's part, whose tracker file
        (``latest_checkpointed_iteration.txt``, written last) commits it. See the invariant in resume.py."""
        self._ckpt_due = False
        k = int(ray.get(self.replay.update_count.remote()))
        if k != self._updates:
            raise RuntimeError(f"checkpoint point broken: the buffer's k={k} but {self._updates} updates were done")
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{k}")
        claas_dir = os.path.join(folder, rs.CLAAS_DIR)
        os.makedirs(claas_dir, exist_ok=True)
        teacher = None
        if self.claas.algorithm == "sdpo":
            from claas_verl.trainer.claas import verl_couplings as vc

            # θ_T changes only inside an update, which runs in this thread: no pause needed
            teacher = [os.path.basename(p) for p in vc.actor_worker_group(self).claas_sdpo_save(claas_dir)]
        state = self._capture_state(k, claas_dir, teacher)
        if self._last_ckpt_step != k:  # a split end at the step of a periodic checkpoint re-writes only the state
            saved, self.global_steps, self._in_checkpoint = self.global_steps, k, True
            try:
                self._save_checkpoint()
            finally:
                self.global_steps, self._in_checkpoint = saved, False
            self._last_ckpt_step = k
        self._trace({"event": "checkpoint", "global_steps": k, "path": folder, "buffer_size": state.buffer["size"],
                     "position": dataclasses.asdict(state.position)})

    def _checkpoint_at_shutdown(self) -> None:
        """Service-driven runs: the chat API stops taking chats and feedback (503) and the requests inside it finish
        first, so every reward it acknowledged is in the buffer that is captured. Then a final checkpoint of the last
        update (whatever ``trainer.save_freq``, once an update was done), or a re-capture of the CLaaS state of that
        checkpoint (the chats accepted since then are kept; verl's part is unchanged)."""
        if self.service is not None:
            self.service.stop_intake()
            if not self.service.wait_idle(60.0):
                msg = "chat API requests still running 60 s after intake stopped; checkpointing without them"
                self._warnings.append(msg)
                logger.warning(msg)
        if (not self.claas.producer.enabled and self.claas.trains
                and (int(_get(self.config, "trainer.save_freq", -1)) > 0 or self._updates > 0)):
            self._claas_checkpoint()

    def _capture_state(self, k: int, claas_dir: str, teacher: list | None) -> rs.ClaasState:
        """Buffer snapshot + state.json, captured with commits paused (producers: their commit lock; chat API: its
        sink drained and gated), so the snapshot, the EMA and the committed-scenario list describe one instant."""
        split_size = self.stream.split_size if self.claas.producer.enabled else 0

        async def capture() -> rs.ClaasState:
            buffer_file = rs.new_buffer_file()
            await self.replay.save.remote(os.path.join(claas_dir, buffer_file))
            summary = await self.replay.summary.remote()
            if summary["k"] != k:
                raise RuntimeError(f"the buffer's k moved from {k} to {summary['k']} during the checkpoint")
            ema = None
            if self._ema_live is not None:
                with self._ema_lock:
                    ema = self._ema_live.state_dict()
            prod = self.producer.state_dict()
            j = self._split_idx if self.claas.producer.enabled and self._split_idx < self.stream.num_splits else -1
            lo = j * split_size
            position = rs.StreamPosition(split=j, done=[i for i in prod["done"] if lo <= i < lo + split_size],
                                         complete=self._split_complete)
            state = rs.ClaasState(
                global_steps=k, updates=self._updates, config=self._identity(), position=position,
                buffer={"file": buffer_file, **summary}, matrix=[list(r) for r in self._matrix],
                split_records=list(self._split_records), ema=ema, producer=prod["stats"],
                icl_memory=self.icl_memory.state_dict() if self.icl_memory is not None else None,
                service=self.service.stats() if self.service is not None else None, sdpo_teacher=teacher,
                resumes=list(self._resumes))
            rs.save_state(claas_dir, state)
            # Written while commits are paused: commits traced before it are in this snapshot, those after are not.
            self._trace({"event": "claas_state", "global_steps": k, "buffer_size": summary["size"]})
            return state

        if self.claas.producer.enabled:
            return self._loop.submit(self.producer.paused(capture)).result()
        with self._sink.paused() if self._sink is not None else contextlib.nullcontext():
            return self._loop.submit(capture()).result()

    def _identity(self) -> dict:
        def select(key: str):
            value = OmegaConf.select(self.config, key)
            return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

        return rs.config_identity(select)

    def _resume_folder(self) -> str | None:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` will load (same rules), or None."""
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path, get_checkpoint_tracker_filename

        mode = self.config.trainer.resume_mode
        if mode == "auto":
            root = os.path.abspath(self.config.trainer.default_local_dir)
            try:
                return find_latest_ckpt_path(root)
            except ValueError as exc:
                raise rs.ResumeMismatch(
                    f"{get_checkpoint_tracker_filename(root)} is unreadable ({exc}): it names the last complete "
                    "checkpoint; write the highest N of a global_step_N folder holding claas/state.json and actor/ "
                    "into it, or remove it to start afresh") from exc
        if mode == "resume_path":
            return os.path.abspath(self.config.trainer.resume_from_path)
        return None

    def _load_checkpoint(self):
        """verl's ``_load_checkpoint`` (policy, optimizer, critic), after the CLaaS state of the same folder was read
        and checked (so a state of another recipe or config is refused before anything is loaded)."""
        folder = self._resume_folder()
        if folder is not None:
            n = int(os.path.basename(folder.rstrip("/")).split("global_step_")[-1])
            self._resume_dir = os.path.join(folder, rs.CLAAS_DIR)
            self._resume = rs.load_state(self._resume_dir, self._identity(), global_steps=n)
        super()._load_checkpoint()
        if self._resume is not None:
            if self.global_steps != self._resume.global_steps:
                raise rs.ResumeMismatch(f"verl loaded step {self.global_steps}, the CLaaS state is of step "
                                        f"{self._resume.global_steps}")
            self._last_ckpt_step = self.global_steps

    def _restore_run_state(self) -> dict:
        """Trainer-side state of the resumed checkpoint (counters, M rows, stream position) and the record of what the
        killed run did after it (discarded, re-done), read from the trace before this run appends to it."""
        r = self._resume
        self._updates = r.updates
        self._matrix = [list(row) for row in r.matrix]
        self._split_records = list(r.split_records)
        self._split_idx, self._split_complete = r.position.split, r.position.complete
        self.producer.load_state_dict({"stats": r.producer, "done": r.position.done})
        discarded = None
        if self.claas.trace:
            trace = rs.read_trace(os.path.join(self.config.trainer.default_local_dir, TRACE_FILE))
            discarded = rs.discarded_since(trace, r.global_steps)
        regenerate = r.position.remaining(self.stream.split_size) if self.claas.producer.enabled else []
        record = {"event": "resume", "global_steps": r.global_steps, "k": r.buffer["k"],
                  "buffer_size": r.buffer["size"], "buffer_uids": r.buffer["uids"], "ema": r.ema,
                  "position": dataclasses.asdict(r.position), "regenerate": regenerate,
                  "discarded": discarded, "sdpo_teacher_ema_steps": self._sdpo_restored,
                  "path": os.path.dirname(self._resume_dir)}
        self._resumes = [*r.resumes, {k: v for k, v in record.items() if k not in ("event", "buffer_uids")}]
        d = discarded or {}
        where = (f"split {r.position.split + 1} ({len(r.position.done)}/{self.stream.split_size} scenarios committed, "
                 f"{len(regenerate)} to generate)" if r.position.split >= 0 and not r.position.complete
                 else f"after split {r.position.split + 1}" if r.position.split >= 0 else "service-driven")
        redo = (f"scenarios {d.get('scenarios', '?')}, generated again" if self.claas.producer.enabled
                else "chat turns, not recorded again")
        print(f"[claas] resumed from {os.path.dirname(self._resume_dir)}: k={r.buffer['k']}, buffer "
              f"{r.buffer['size']} entries, {where}; discarded from the killed run: {d.get('updates', '?')} updates, "
              f"{d.get('entries_accepted', '?')} entries accepted after the checkpoint ({redo})", flush=True)
        return record

    # ------------------------------------------------------------------ split protocol
    def _start_next_split(self) -> None:
        if not self.claas.producer.enabled:
            return  # service-driven: no scenario stream
        if self._split_idx + 1 >= self.stream.num_splits:
            self._split_idx = self.stream.num_splits
            self._split_future = None
            return
        self._start_split(self._split_idx + 1)

    def _start_split(self, j: int, skip=()) -> None:
        """Run split j's rollouts in the background, except the global scenario indices in ``skip`` (committed
        before the checkpoint a resumed run starts from)."""
        self._split_idx, self._split_complete = j, False
        scenarios = self.stream.split(j)
        offset = j * self.stream.split_size
        self._split_future = self._loop.submit(self.producer.run_split(scenarios, index_offset=offset, skip=skip))
        self._trace({"event": "split_start", "split": j + 1, "global_steps": self.global_steps,
                     "skip": sorted(skip)})

    def _advance_until_ready(self) -> bool:
        """Block until an update is possible (True) or the whole stream is done (False), running split ends.

        Event-driven: waits on the replay actor's ``wait_ready`` (an asyncio condition notified by ``add``)
        and on the current split's producer future, whichever completes first.
        """
        t0 = time.perf_counter()
        try:
            if not self.claas.producer.enabled:
                return self._wait_service_ready()
            while self._split_future is not None:
                if self._split_future.done() and self._split_future.exception() is not None:
                    # dead producers fail the run at once, with their cause, never training on without them
                    raise RuntimeError("the rollout producers died") from self._split_future.exception()
                if self.claas.trains:
                    ref = self.replay.wait_ready.remote()
                    ready = ref.future()
                    concurrent.futures.wait([ready, self._split_future], return_when=concurrent.futures.FIRST_COMPLETED)
                    if ready.done():
                        if ready.result():
                            return True
                    else:
                        try:
                            ray.cancel(ref)  # the split ended first: drop the waiter parked in the actor
                        except Exception:  # noqa: BLE001 - a parked waiter is harmless
                            pass
                self._split_future.result()  # the split's rollouts ended (re-raises a producer error)
                # SPEC A.1.6 step 2: keep training until |B| < B_min, then checkpoint and move on.
                if self.claas.trains and ray.get(self.replay.ready.remote()):
                    return True
                self._finish_split()
                self._start_next_split()
            return False
        finally:
            self._last_wait_s = time.perf_counter() - t0
            self._wait_s += self._last_wait_s

    def _wait_service_ready(self) -> bool:
        """Service-driven loop: block until the chat API filled the buffer to B_min (True) or a shutdown was asked
        (False); fails at once if the API thread died."""
        while not self._stop.is_set():
            if self._service_thread is not None and not self._service_thread.alive:
                raise RuntimeError("the chat API thread died; see the log above")
            if ray.get(self.replay.wait_ready.remote(1.0)):
                return True
        return False

    def _finish_split(self) -> None:
        j = self._split_idx
        out_dir = self.config.trainer.default_local_dir
        self._split_complete = True
        k = self._updates
        self._split_records.append({"split": j + 1, "global_steps": k, "updates": self._updates,
                                    "checkpoint": os.path.join(out_dir, f"global_step_{k}") if self.claas.trains
                                    else None})
        if self.claas.trains:
            self._claas_checkpoint()  # checkpoint j: verl's actor (+critic) and the CLaaS state at global_step_{k}
        split_dir = os.path.join(out_dir, f"claas_split_{j + 1}")
        os.makedirs(split_dir, exist_ok=True)
        ray.get(self.replay.save.remote(os.path.join(split_dir, "replay_buffer.pkl")))
        state = {**self._split_records[-1], "producer": self.producer.stats.as_dict(),
                 "buffer": ray.get(self.replay.stats.remote())}
        if self._ema_live is not None:
            with self._ema_lock:
                state["ema"] = self._ema_live.state_dict()
        if self.icl_memory is not None:
            state["icl_memory"] = self.icl_memory.state_dict()
        with open(os.path.join(split_dir, "state.json"), "w") as f:
            json.dump(state, f, indent=2, default=str)
        self._record_row(j)

    def _record_row(self, j: int) -> None:
        """Row j of M (evaluated after checkpoint j, so a run killed in between evaluates it when resumed)."""
        row = self._evaluate_row() if self.claas.eval.enabled else [float("nan")] * self.stream.num_splits
        self._matrix.append(row)
        self._trace({"event": "split_end", "split": j + 1, "global_steps": self._updates, "M_row": row,
                     "buffer_size": ray.get(self.replay.size.remote())})
        print(f"[claas] split {j + 1}/{self.stream.num_splits} done at update {self._updates}: M[{j + 1},:] = "
              + ", ".join(f"{v:.3f}" for v in row), flush=True)

    def _evaluate_row(self) -> list[float]:
        """Row j of M: the policy served right after checkpoint j, on every split k (SPEC A.4)."""
        e = self.claas.eval
        row = []
        for k in range(self.stream.num_splits):
            res = self._loop.submit(self.producer.evaluate(
                self.stream.split(k), n_samples=e.n_samples, temperature=e.temperature,
                max_new_tokens=e.max_new_tokens)).result()
            row.append(res["pass_rate"])
        return row

    # ------------------------------------------------------------------ chat API
    def _start_service(self, generate, tokenizer, max_model_len: int | None) -> None:
        """Start the chat API (``claas.service``) on this process, in front of the job's rollout replicas."""
        from claas_verl.service import ChatService, ServiceConfig, build_app
        from claas_verl.service.config import check_exposure
        from claas_verl.service.rollout_backend import RolloutBackend
        from claas_verl.service.server import ServiceThread
        from claas_verl.service.sinks import ActorSink

        s = self.claas.service
        keys = tuple(s.api_keys) or tuple(k for k in os.environ.get("CLAAS_API_KEY", "").split(",") if k)
        cap = s.max_tokens or self.claas.producer.max_new_tokens
        admin = s.admin_key or os.environ.get("CLAAS_ADMIN_KEY") or self._mint_admin_key()
        cfg = ServiceConfig(
            record=True, default_scenario_id=0, max_pending=s.max_pending, pending_ttl_s=s.pending_ttl_s,
            api_keys=keys, admin_key=admin, adapter_root=None,
            reward=s.reward, max_body_bytes=s.max_body_bytes, max_messages=s.max_messages,
            max_message_chars=s.max_message_chars, max_tokens=cap, default_max_tokens=cap,
            allow_keyless=s.allow_keyless, max_pending_per_key=s.max_pending_per_key,
            max_pending_bytes=s.max_pending_bytes, rate_limit_per_s=s.rate_limit_per_s,
            rate_limit_burst=s.rate_limit_burst, body_timeout_s=s.body_timeout_s, max_buffer_share=s.max_buffer_share,
        )
        check_exposure(s.host, cfg)
        backend = RolloutBackend(generate, tokenizer, model_name=s.model_name, default_max_tokens=cap,
                                 max_model_len=max_model_len, eos_token_ids=self._eos_ids(),
                                 policy_version=self.global_steps)
        sink = self._sink = rs.pausable_sink(ActorSink)(self.replay, on_accepted=self._on_service_accepted)
        self.service = ChatService(backend, sink, config=cfg, extra_stats=self._service_extra_stats,
                                   on_shutdown=self._stop.set)
        self._service_thread = ServiceThread(
            build_app(self.service), host=s.host, port=s.port, limit_concurrency=s.limit_concurrency,
            header_timeout_s=s.header_timeout_s, proxy_headers=s.proxy_headers,
            forwarded_allow_ips=s.forwarded_allow_ips).start()
        url = self._service_thread.url
        with open(os.path.join(self.config.trainer.default_local_dir, "service.json"), "w") as f:
            json.dump({"url": url, "base_url": f"{url}/v1", "model": s.model_name, "pid": os.getpid()}, f)
        print(f"[claas] chat API at {url}/v1 (model {s.model_name!r}, auth "
              f"{'on' if keys else 'off'}); policy version {self.global_steps}", flush=True)

    def _mint_admin_key(self) -> str:
        """No admin key configured: one for this run only, readable by the run directory's owner alone
        (``service_admin.key``, mode 0600), so that ``main_claas`` can turn a SIGTERM into a graceful shutdown."""
        import secrets

        key = secrets.token_urlsafe(32)
        path = os.path.join(self.config.trainer.default_local_dir, SERVICE_ADMIN_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return key

    def _eos_ids(self) -> list[int]:
        """EOS ids of the policy (generation config + tokenizer): a reply ending on one has finish_reason "stop"."""
        from transformers import GenerationConfig

        ids = set()
        try:
            eos = GenerationConfig.from_pretrained(self.config.actor_rollout_ref.model.path).eos_token_id
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        except OSError:  # no generation_config.json: the tokenizer's EOS only
            pass
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    def _on_service_accepted(self, entries: list, accepted: int) -> None:
        """SPEC A.3.1: the EMA sees every reward the buffer accepted, at insertion time (as the producers do). The
        trace's commit line lets a resume count the entries accepted after its checkpoint."""
        self._trace({"event": "commit", "scenario": None, "accepted": accepted})
        if self._ema_live is None:
            return
        if accepted != len(entries):
            raise RuntimeError(f"the buffer accepted {accepted} of {len(entries)} entries of one chat write; "
                               "the chat API writes one entry per call")
        with self._ema_lock:
            self._ema_live.update_many(e.reward for e in entries)

    def _service_extra_stats(self) -> dict:
        out = {"buffer": ray.get(self.replay.stats.remote()), "updates": self._updates, "resumes": self._resumes,
               "last_update_unix": self._last_update_unix}
        if self._ema_live is not None:
            with self._ema_lock:
                out["ema"] = self._ema_live.state_dict()
        return out

    def _finalize_service(self) -> None:
        """Service-driven run: no scenario splits, so no M; record the API's and the buffer's statistics."""
        self.service.recorder.sink.flush(30.0)
        stats = self.service.stats()
        record = {"algorithm": self.claas.algorithm, "updates": self._updates, "service": stats,
                  "resumes": self._resumes,
                  "trainer_wait_buffer_s": self._wait_s, "wall_s": time.time() - self._t_start,
                  "warnings": self._warnings}
        path = Path(self.config.trainer.default_local_dir) / "service_stats.json"
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        t = stats["turns"]
        print(f"[claas] {self._updates} updates from the chat API; served {t['served']}, completed {t['completed']}, "
              f"accepted {t['accepted']}, expired {t['expired']}; stats: {path}", flush=True)

    # ------------------------------------------------------------------ records
    def _probe_served_policy(self) -> dict:
        if not self.claas.probe_served_policy:
            return {}
        out = {}
        for r, replica in enumerate(self.llm_server_manager.get_replicas()):
            server = replica.servers[0]
            if hasattr(server, "claas_lora_state"):  # verl's vLLM rollout with versioned LoRA updates
                out[f"served_lora_{r}"] = ray.get(server.claas_lora_state.remote())
            if not hasattr(server, "get_named_parameters"):
                continue
            version = ray.get(server.get_policy_version.remote())
            named = ray.get(server.get_named_parameters.remote())
            out[f"served_version_{r}"] = int(version)
            out[f"served_fingerprint_{r}"] = _served_fingerprint(named)
            if hasattr(server, "get_last_update"):  # which tensors the latest push carried (adapter-only check)
                last = ray.get(server.get_last_update.remote())
                out[f"served_last_push_kind_{r}"] = last["kind"]
                out[f"served_last_push_names_{r}"] = last["names"]
        return out

    def _trace(self, record: dict) -> None:
        if not self.claas.trace:
            return
        record = {"t": round(time.time() - self._t_start, 3), **record}
        line = json.dumps(record, default=str) + "\n"
        with self._trace_lock, open(os.path.join(self.config.trainer.default_local_dir, TRACE_FILE), "a") as f:
            f.write(line)

    def _finalize(self) -> None:
        from claas_verl.metrics import write_continual_metrics

        K = self.stream.num_splits
        if len(self._matrix) != K:
            msg = f"only {len(self._matrix)} of {K} splits finished (claas.max_updates reached); M is partial"
            self._warnings.append(msg)
            logger.warning(msg)
            self._matrix += [[float("nan")] * K for _ in range(K - len(self._matrix))]
        buffer_stats = ray.get(self.replay.stats.remote())
        extra = {
            "algorithm": self.claas.algorithm,
            "updates": self._updates,
            "splits": self._split_records,
            "split_ids": self.stream.ids(),
            "producer": self.producer.stats.as_dict(),
            "resumes": self._resumes,
            "trainer_wait_buffer_s": self._wait_s,
            "wall_s": time.time() - self._t_start,
            "warnings": self._warnings,
        }
        M = np.array(self._matrix, dtype=float)
        out_dir = self.config.trainer.default_local_dir
        if np.isfinite(M).all():
            paths = write_continual_metrics(out_dir, M, buffer_stats=buffer_stats, extra=extra,
                                            title=f"CLaaS {self.claas.algorithm}: M[j, k]")
        else:
            # A cell with no gradable step (or an unfinished protocol): record what exists, metrics null.
            msg = "M has cells without any graded step (or unfinished splits); transfer metrics are not defined"
            self._warnings.append(msg)
            logger.warning(msg)
            record = {"M": [[v if math.isfinite(v) else None for v in row] for row in M.tolist()], "K": K,
                      "forward_transfer": None, "forgetting": None, "final": None,
                      "buffer_stats": buffer_stats, **extra}
            paths = {"json": Path(out_dir) / "continual_metrics.json"}
            paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
        fmt = lambda v: "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
        rec = json.loads(paths["json"].read_text())
        print(f"[claas] {self._updates} updates; forward_transfer={fmt(rec['forward_transfer'])} "
              f"forgetting={fmt(rec['forgetting'])} final={fmt(rec['final'])}; max entry uses="
              f"{buffer_stats['max_uses']} (A_max+1={self.claas.a_max + 1}); metrics: {paths['json']}", flush=True)

    def _shutdown(self) -> None:
        if self._service_thread is not None:
            self._service_thread.stop()
            self._service_thread = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
