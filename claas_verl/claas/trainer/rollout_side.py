"""The rollout side of a CLaaS run: environment and scenario stream, the replay-buffer actor, the EMA reward
statistics, the ICL memory and the rollout producers on their background loop (docs/math.md §A.1, A.3.1).

Built once the rollout replicas serve the initial weights; a resumed run restores the buffer snapshot, the EMA and
the ICL memory of its checkpoint here (the trainer-side counters are restored by the checkpoint component).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any

import ray

from claas_verl.claas.trainer import resume as rs
from claas_verl.claas.trainer.checks import select
from claas_verl.claas.trainer.config import ClaasConfig
from claas_verl.claas.trainer.producer import BackgroundLoop, ChatRenderer, RolloutProducer
from claas_verl.claas.trainer.tenants_side import buffer_summary

logger = logging.getLogger(__name__)


class RewardEma:
    """The EMA reward statistics b, v (docs/math.md §A.3.1) of ``claas_rpp_ema``: ``live`` sees every accepted reward at
    insertion time (producers and chat API threads, under ``lock``); ``bound`` is what the advantage estimator reads,
    a copy of ``live`` taken when a minibatch is built."""

    def __init__(self, rpp: Any):
        from claas_verl.claas.verl_losses import bind_rpp_ema_stats
        from claas_verl.losses.advantages import EmaRewardStats

        self.lock = threading.Lock()
        self.live = EmaRewardStats(beta=rpp.beta, b0=rpp.b0, v0=rpp.v0, v_min=rpp.v_min)
        self.bound = EmaRewardStats(beta=rpp.beta, b0=rpp.b0, v0=rpp.v0, v_min=rpp.v_min)
        bind_rpp_ema_stats(self.bound)

    def state_dict(self) -> dict:
        with self.lock:
            return self.live.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.live.load_state_dict(state)
        self.bound.load_state_dict(state)

    def update_many(self, rewards) -> None:
        with self.lock:
            self.live.update_many(rewards)

    def snapshot_for_step(self) -> dict:
        """b, v for the minibatch about to be built (and its metrics)."""
        with self.lock:
            self.bound.load_state_dict(self.live.state_dict())
        return {"claas/ema_baseline": self.bound.baseline, "claas/ema_variance": self.bound.variance}


class RolloutSide:
    """Environment, stream, replay actor, EMA, ICL memory, producer and its loop of one run."""

    def __init__(self, config: Any, claas: ClaasConfig, *, tokenizer: Any, llm_server_manager: Any, sampler: Any,
                 resume: rs.ClaasState | None, resume_dir: str | None, warn):
        from claas_verl.claas.envs import ICLFeedbackMemory, make_environment
        from claas_verl.claas.replay import make_replay_actor

        c = claas
        self.env = make_environment(c.env.name, **c.env.kwargs)
        self.stream = self.env.stream(seed=c.stream.seed, num_splits=c.stream.num_splits,
                                      split_size=c.stream.split_size, split_groups=c.stream.split_groups,
                                      group_key=c.stream.group_key)
        per_split = min(self.stream.max_entries_per_split(c.entry_unit))
        msg = c.unreachable_b_min(per_split)  # the sizes were validated once, by ClaasConfig
        if msg is not None:
            warn(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)

        # Entries arrive by reference (the producer puts each batch's tokens into the object store). The producer
        # runs in this process, which outlives the actor (max_restarts=0), so the buffers need no adoption copy.
        # with tenants: one partition per tenant, with the tenant's own B_min, B_max, A_max and age clock
        self.tenants = c.service.tenant_names
        common = {"seed": c.seed, "entry_unit": c.entry_unit, "max_restarts": 0, "adopt": False}
        self.replay_actor = (make_replay_actor(partitions=c.service.directory.replay_partitions(), **common)
                             if self.tenants else make_replay_actor(c.b_max, c.b_min, c.a_max, **common))
        sampler.bind(self.replay_actor, data_source=f"claas/{c.env.name}", sdpo=c.algorithm == "sdpo")
        r = resume
        if r is not None:
            ray.get(self.replay_actor.load.remote(os.path.join(resume_dir, r.buffer["file"])))
            got = buffer_summary(self.replay_actor, self.tenants)
            if got["k"] != r.global_steps or got["uids"] != r.buffer["uids"]:
                raise rs.ResumeMismatch(f"{resume_dir}: the buffer snapshot (k={got['k']}, {got['size']} "
                                        f"entries) is not the one state.json records (k={r.buffer['k']}, "
                                        f"{r.buffer['size']} entries)")

        self.ema: RewardEma | None = None
        if config.algorithm.adv_estimator == "claas_rpp_ema" and not self.tenants:  # tenants: TenantEmas
            self.ema = RewardEma(c.rpp)
            if r is not None:
                if r.ema is None:
                    raise rs.ResumeMismatch(f"{resume_dir}: the checkpoint holds no EMA reward statistics")
                self.ema.load_state_dict(r.ema)

        self.icl_memory = None
        if c.algorithm == "icl":
            self.icl_memory = ICLFeedbackMemory(lambda s: len(tokenizer.encode(s, add_special_tokens=False)),
                                                token_budget=c.icl.token_budget,
                                                max_quote_chars=c.icl.max_quote_chars)
            if r is not None and r.icl_memory is not None:
                self.icl_memory.load_state_dict(r.icl_memory)
        rollout = config.actor_rollout_ref.rollout
        max_len = select(rollout, "max_model_len")
        self.max_model_len = int(max_len) if max_len else None
        max_prompt = (int(max_len) - c.producer.max_new_tokens) if max_len else int(select(rollout, "prompt_length"))
        client = llm_server_manager.get_client()

        async def generate(request_id, prompt_ids, sampling_params):
            return await client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

        self.generate = generate
        self.producer = RolloutProducer(
            generate, ChatRenderer(tokenizer), self.replay_actor if c.trains else None,
            max_new_tokens=c.producer.max_new_tokens, max_concurrent=c.producer.max_concurrent_scenarios,
            max_retries=c.producer.max_retries, entry_unit=c.entry_unit,
            max_prompt_tokens=max_prompt, ema_stats=self.ema.live if self.ema else None,
            ema_lock=self.ema.lock if self.ema else None, icl_memory=self.icl_memory,
            sdpo_reprompt={"reprompt_success": c.sdpo.reprompt_success} if c.algorithm == "sdpo" else None,
        )
        self.loop = BackgroundLoop()

    def buffer_stats(self) -> dict:
        return ray.get(self.replay_actor.stats.remote())

    def buffer_size(self) -> int:
        return ray.get(self.replay_actor.size.remote())

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
            self.loop = None
        self.env.close()
