"""verl custom sampler that feeds each training step from the CLaaS replay-buffer actor.

Selected with ``trainer.v1.sampler.custom_sampler.{path,name}`` (the recipes set
``path: pkg://claas_verl.claas.trainer.sampler``, ``name: ClaasReplaySampler``). verl's v1
trainer calls ``sample(global_steps, partition_id, batch_size)`` once per step and expects the
step's batch metadata back. This sampler

1. waits on the replay actor until it holds ``B_min`` entries (``sample_when_ready``: an
   ``asyncio.Condition`` in the actor, no polling sleep) and draws ``batch_size`` (= M) entries
   uniformly without replacement in the same atomic call (docs/math.md §A.1.6);
2. writes them into TransferQueue under fresh keys with the fields and tags verl's agent loop
   writes (:mod:`claas_verl.claas.trainer.tq_fields`);
3. returns the ``KVBatchMeta`` of those keys. The trainer clears them after the step; the replay
   actor keeps the canonical entries, which is what allows reuse and age eviction.

There is no validation partition: CLaaS evaluates checkpoints on scenario splits instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from claas_verl.claas.replay.store import fetch_entries
from claas_verl.claas.service.teacher import TEACHER_IDS_KEY
from claas_verl.claas.trainer.tq_fields import entry_fields, entry_tag, replay_key


class ClaasReplaySampler:
    """Custom v1 sampler over a ``ReplayBufferActor``; bind the actor with :meth:`bind` before the first step.

    The constructor takes the keyword arguments verl passes to every sampler (they configure verl's own
    staleness control, which does not apply here: CLaaS ages entries out by update count, A_max).
    """

    def __init__(self, trainer_mode: str = "claas", trainer_config: Any = None, max_off_policy_threshold: Any = None,
                 max_off_policy_strategy: str = "drop", sampler_kwargs: Any = None, refill_fn: Any = None, **_: Any):
        self.trainer_mode = trainer_mode
        self.sampler_kwargs = dict(sampler_kwargs or {})
        self.replay = None
        self.data_source = "claas"
        self.sdpo = False
        # a multi-tenant job: the tenant whose update this is (its partition is drawn from) and the version its
        # served adapter had before the update (the lag base); set by the trainer before each step
        self.tenant: str | None = None
        self.tenant_version: int = 0
        self.last_sample: list[dict] = []  # (uid, P, reward, seq, scenario[, sd]) of the latest draw (traces, tests)

    def bind(self, replay_actor: Any, data_source: str = "claas", sdpo: bool = False) -> None:
        self.replay = replay_actor
        self.data_source = data_source
        self.sdpo = sdpo  # also write the SDPO teacher-context fields

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        """Block until the buffer is ready, draw ``batch_size`` entries, put them in TransferQueue."""
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        if partition_id != "train":
            raise ValueError(
                f"ClaasReplaySampler serves the 'train' partition only (got {partition_id!r}); CLaaS evaluates "
                "split checkpoints itself: keep trainer.test_freq=-1 and trainer.val_before_train=false"
            )
        if self.replay is None:
            raise RuntimeError("ClaasReplaySampler.sample before bind(replay_actor): the CLaaS trainer binds it")
        # EntryRefs: the rows are fetched from the object store here, not through the actor
        tenant_kw = {} if self.tenant is None else {"tenant": self.tenant}
        entries = fetch_entries(ray.get(self.replay.sample_when_ready.remote(int(batch_size), **tenant_kw)))
        keys = [replay_key() for _ in entries]
        fields = list_of_dict_to_tensordict([entry_fields(e, self.data_source, sdpo=self.sdpo) for e in entries])
        tags = [entry_tag(e) for e in entries]
        tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields, tags=tags)
        self.last_sample = [{"uid": e.uid, "P": int(e.P), "reward": float(e.reward), "seq": int(e.seq),
                             "scenario": int(e.scenario_id),
                             # SDPO: whether the entry has a teacher context (sd_mask = 1)
                             **({"sd": bool(e.metadata.get(TEACHER_IDS_KEY))} if self.sdpo else {})} for e in entries]
        # Policy-version lag of the sampled entries: updates done before this one minus the serving version (with
        # tenants: the tenant's own version before this update; P counts the tenant's versions)
        base = (global_steps - 1) if self.tenant is None else self.tenant_version
        lag = np.array([base - int(e.P) for e in entries], dtype=float)
        metrics = {
            "claas/sample/version_lag_mean": float(lag.mean()),
            "claas/sample/version_lag_max": float(lag.max()),
            "claas/sample/reward_mean": float(np.mean([e.reward for e in entries])),
        }
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags), metrics

