"""verl's vLLM rollout with versioned LoRA updates (:mod:`claas_verl.claas.lora_versions`), through verl's own
extension points.

verl 0.9.1's LoRA sync (``vLLMColocateWorkerExtension.update_weights_from_ipc``, ``vLLMRollout.update_weights``)
removes its one adapter (fixed id 123), adds the new one under the same id, then asks the server to reset the prefix
cache (``vLLMHttpServer.clear_kv_cache``). With generation running during training (CLaaS), that leaves a window in
which verl's ``generate`` serves requests on the base model, takes the adapter away from running requests, and
resets the prefix cache under them. Three thin subclasses change that, without copying verl's sync or generate:

* :class:`ClaasLoRAWorkerExtension` (verl's ``worker_extension_cls``): a LoRA sync adds the adapter under the next
  versioned id and name (:func:`~claas_verl.claas.lora_versions.next_lora_id`); the served one stays loaded.
  verl's removal of id 123 before the sync then finds nothing to remove.
* :class:`ClaasVLLMHttpServer`: after launch, its engine client is wrapped in
  :class:`~claas_verl.claas.lora_versions.VersionedLoRAEngine`, so verl's ``generate`` runs every request on the
  adapter served when it starts, to its last token. ``clear_kv_cache`` (verl calls it right after every sync) adopts
  the newly added adapter instead of resetting the prefix cache: blocks are keyed by adapter name, and the name is new.
  The old adapter is removed from the engine when its last request ends. A full-weight sync (no new adapter) keeps
  verl's reset.
* :class:`ClaasVLLMReplica` builds its servers from :class:`ClaasVLLMHttpServer`; :func:`register` installs it as
  verl's ``vllm`` rollout replica (``RolloutReplicaRegistry``). The CLaaS trainer calls it for LoRA-adapter runs.

vLLM configuration: verl hard-codes ``max_loras=1`` (one adapter per batch), so requests of the new adapter wait
until the old adapter's running requests finish (a stall during each switch, never a base-model reply).
``actor_rollout_ref.rollout.engine_kwargs.vllm.max_loras`` lifts it: :class:`ClaasVLLMHttpServer` sets it on the
parsed server arguments verl hands to ``run_server``/``run_headless`` (:func:`~claas_verl.claas.lora_versions.
lift_max_loras`; not yet run end to end). Keeping the old adapter cached while its requests end needs
``max_cpu_loras >= 2`` (and ``>= max_loras``): ``actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras`` (4 in
``recipes/claas/common/paper_model.yaml``); :func:`register` refuses a smaller value.

Status: the decision logic is tested against a real vLLM engine on CPU (tests/claas/test_lora_versions_vllm.py);
this glue runs end to end inside verl's vLLM rollout on vLLM's CPU build for LoRA-only syncs
(tests/claas/test_vllm_versioned_lora_e2e.py, marked ``vllm`` and ``slow``; unchanged on a CUDA build), and the verl
names it relies on are checked by tests/claas/test_vllm_versioned_lora_couplings.py. Full-weight syncs take verl's
own path (unchanged here); on vLLM's CPU build they work once the platform plugin keeps the linear weights
(docs/verl-couplings.md, V4). Neither has run on a GPU yet.
"""

from __future__ import annotations

import logging
from typing import Any

from claas_verl.claas.lora_versions import (
    LORA_ID_BASE,
    VersionedLoRAEngine,
    check_rollout_config,
    lift_max_loras,
    lora_name,
    next_lora_id,
)

logger = logging.getLogger(__name__)


def _worker_extension_base():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    return vLLMColocateWorkerExtension


def _server_base():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    return vLLMHttpServer


class ClaasLoRAWorkerExtension(_worker_extension_base()):
    """verl's worker extension, except that a LoRA sync adds the adapter under a new id instead of replacing id 123."""

    def _update_weights(self, weights, peft_config, base_sync_done):
        if not (peft_config and base_sync_done):
            return super()._update_weights(weights, peft_config, base_sync_done)
        from verl.utils.vllm import TensorLoRARequest
        from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_PATH

        alias_unstacked_mapper()
        lora_id = next_lora_id(self.list_loras())
        # clone: the tensors outlive the receiver's reused transfer buffer (as verl does)
        tensors = {name: tensor.clone() for name, tensor in weights}
        self.add_lora(TensorLoRARequest(lora_name=lora_name(lora_id), lora_int_id=lora_id, lora_path=VLLM_LORA_PATH,
                                        peft_config=peft_config, lora_tensors=tensors))
        logger.info("claas: LoRA sync added adapter %s (%d tensors)", lora_id, len(tensors))


def alias_unstacked_mapper() -> bool:
    """verl 0.9.1's in-memory LoRA loader (``VLLMHijack``) calls ``WeightsMapper.get_unstacked_mapper()`` on vLLM >=
    0.25; vLLM 0.30 renamed it ``get_rename_mapper`` (its own loader calls that: "ignore stacking and deletions"), so
    every LoRA sync of a model with an ``hf_to_vllm_mapper`` (Qwen2) fails with AttributeError. Alias the old name to
    the new one where only the new one exists (docs/verl-couplings.md, V5); True if it aliased."""
    from vllm.model_executor.models.utils import WeightsMapper

    if hasattr(WeightsMapper, "get_unstacked_mapper") or not hasattr(WeightsMapper, "get_rename_mapper"):
        return False
    WeightsMapper.get_unstacked_mapper = WeightsMapper.get_rename_mapper
    return True


class ClaasVLLMHttpServer(_server_base()):
    """verl's vLLM server with versioned LoRA serving (see the module docstring)."""

    def _get_worker_extension_cls(self) -> str:
        return f"{ClaasLoRAWorkerExtension.__module__}.{ClaasLoRAWorkerExtension.__qualname__}"

    async def launch_server(self, *args, **kwargs):
        out = await super().launch_server(*args, **kwargs)
        if self.lora_as_adapter and getattr(self, "engine", None) is not None:
            self.engine = VersionedLoRAEngine(self.engine)
        return out

    def _lift_max_loras(self, args) -> None:
        engine_kwargs = self.config.get("engine_kwargs", {}).get(self._get_engine_kwargs_key(), {}) or {}
        if lift_max_loras(args, engine_kwargs):
            logger.info("claas: vLLM serves up to %d adapters per batch (verl sets 1)", args.max_loras)

    async def run_server(self, args):
        self._lift_max_loras(args)
        return await super().run_server(args)

    async def run_headless(self, args):
        self._lift_max_loras(args)
        return await super().run_headless(args)

    async def claas_lora_state(self) -> dict:
        """:meth:`VersionedLoRAEngine.state` plus the adapter ids the engine holds (``loaded``); {} without LoRA."""
        engine = getattr(self, "engine", None)
        if not isinstance(engine, VersionedLoRAEngine):
            return {}
        return {**engine.state(), "loaded": sorted(int(i) for i in await engine.list_loras())}

    async def clear_kv_cache(self):
        engine = getattr(self, "engine", None)
        if isinstance(engine, VersionedLoRAEngine) and self.node_rank == 0 and await adopt_new_adapter(engine):
            return  # a LoRA switch: the new adapter name keys the prefix cache, nothing to reset under running requests
        await super().clear_kv_cache()


async def adopt_new_adapter(engine: VersionedLoRAEngine) -> bool:
    """Serve the newest versioned adapter the workers hold if it is not served yet; True if it switched."""
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_PATH
    from vllm.lora.request import LoRARequest

    loaded = [int(i) for i in await engine.list_loras() if int(i) > LORA_ID_BASE]
    if not loaded:
        return False
    newest = max(loaded)
    if newest == engine.served_lora_id():
        return False
    engine.adopt(LoRARequest(lora_name=lora_name(newest), lora_int_id=newest, lora_path=VLLM_LORA_PATH))
    return True


def _replica_class():
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    class ClaasVLLMReplica(vLLMReplica):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(ClaasVLLMHttpServer)

    return ClaasVLLMReplica


def register(config: Any) -> None:
    """Make verl's ``vllm`` rollout replica the versioned-LoRA one (call in the trainer process before the rollout
    replicas are created); only for LoRA-adapter runs (``model.lora.merge`` false)."""
    check_rollout_config(config)
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("vllm", _replica_class)
