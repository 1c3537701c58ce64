"""verl's side of the ``hf`` rollout: the replica that launches the server, and the adapter in each trainer worker.

* ``HFReplica``: a ``RolloutReplica`` that launches one
  :class:`~claas_verl.verl_ext.cpu.hf_rollout.HFRolloutServer` Ray actor per replica, registered under the name
  ``"hf"`` in verl's public ``RolloutReplicaRegistry``.
* ``HFServerAdapter``: the ``BaseRollout`` living inside each trainer worker. verl's naive weight sync calls its
  ``update_weights`` with a generator of the trainer's full tensors, which it streams to the server in buckets.

Select it with ``actor_rollout_ref.rollout.name=hf`` (the CPU preset does).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from claas_verl.verl_ext.cpu.hf_rollout import HFRolloutServer

# Weight-sync bucket: tensors are shipped to the server through Ray's object store
# in groups of about this many bytes, so a large model never needs two full copies in flight.
_BUCKET_BYTES = 64 << 20


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """The Ray actor name of a replica's server: the adapter in every trainer worker finds it by this name."""
    job = ray.get_runtime_context().get_job_id()
    return f"claas_hf_rollout_{job}_{replica_rank}_{node_rank}"


def _load_replica_base():
    from verl.workers.rollout.replica import RolloutReplica

    return RolloutReplica


class HFReplica(_load_replica_base()):
    """One ``HFRolloutServer`` per replica; ``server_address`` is a pseudo address (no HTTP server)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        node_id = ray.get_runtime_context().get_node_id()
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda w: ray.get_runtime_context().get_node_id())
        server_cls = ray.remote(HFRolloutServer)
        server = server_cls.options(
            name=server_actor_name(self.replica_rank),
            num_cpus=0,
            max_concurrency=self.max_concurrency,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=True),
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        await server.get_policy_version.remote()  # surface load errors (bad model path) here
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-rollout://replica-{self.replica_rank}"

    async def sleep(self):
        await asyncio.gather(*[s.wait_for_requests_to_drain.remote() for s in self.servers])

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        await asyncio.gather(*[s.abort_all_requests.remote(reject_request=reject_request) for s in self.servers])
        return {"aborted_count": 0, "request_ids": []}


def _load_base_rollout():
    from verl.workers.rollout.base import BaseRollout

    return BaseRollout


class HFServerAdapter(_load_base_rollout()):
    """Inside each trainer worker: forwards weight syncs to this replica's ``HFRolloutServer``.

    Every rank must drain the weight generator (FSDP gathers full tensors collectively);
    only the replica's rollout rank 0 ships them.
    """

    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.is_leader_rank = self.rollout_rank == 0
        self._server = None
        self.sleep_level = 1

    @property
    def server_handle(self):
        if self._server is None and self.is_leader_rank:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        base_sync_done: bool = True,
        global_steps: int | None = None,
        **kwargs,
    ):
        if wire_format != "named_tensors":
            raise ValueError(
                f"the 'hf' rollout accepts wire_format='named_tensors' only, got {wire_format!r}; "
                "set actor_rollout_ref.rollout.checkpoint_engine.backend=naive"
            )
        from verl.workers.rollout.utils import ensure_async_iterator

        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        sends = []
        async for name, tensor in ensure_async_iterator(weights):
            if not self.is_leader_rank:
                continue  # still drained: the generator's all-gathers need every rank
            t = tensor.detach().to("cpu", copy=True)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= _BUCKET_BYTES:
                sends.append(self.server_handle.receive_weights.remote(bucket))
                bucket, size = [], 0
        if not self.is_leader_rank:
            return None
        if bucket:
            sends.append(self.server_handle.receive_weights.remote(bucket))
        await asyncio.gather(*sends)
        return await self.server_handle.finish_weight_update.remote(
            peft_config=peft_config, base_sync_done=base_sync_done, global_steps=global_steps
        )
