"""Every coupling of the CPU backend to verl 0.9.1 internals, in one place.

verl loads plugins from inside ``verl/__init__.py``; importing its engine or
rollout modules at that moment fails (they resolve the platform at import time,
and half of verl is not importable yet). So the plugin installs *post-import
hooks*: each registration below runs right after the verl module it touches
finishes importing (or at once, if it already has). Nothing runs on GPU
platforms except ``register_hf_rollout`` (harmless: it only adds a name); the
P2 and P4 wrappers are installed everywhere but check the platform when called
(the platform cannot be resolved while verl is still importing) and defer to
verl's own function off the CPU platform.

Public extension points used (no patch): ``PlatformRegistry.register``,
``RolloutReplicaRegistry.register``, ``EngineRegistry.register``.

Monkeypatches (each checked by ``tests/verl_ext/cpu/test_cpu_patches.py``, which
fails loudly if a verl upgrade moves the name):

P1. ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` — the rollout-class table
    has no public register function; we add ``("hf", "async")``.
P2. ``verl.workers.engine_workers.initialize_global_process_group_ray`` — verl
    builds the backend string ``"cpu:gloo,{device}:{backend}"``, which on device
    ``cpu`` becomes ``"cpu:gloo,cpu:gloo"`` and torch rejects the duplicate.
    On the CPU platform the wrapper passes ``backend="cpu:gloo"``.
P3. ``verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy`` — FSDP2
    forward-only engines (reference policy, teachers) hard-code
    ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator. Only
    inside our CPU engine's ``_build_fsdp_module`` the name is swapped for a
    ``pin_memory=False`` factory, then restored.
P4. ``verl.utils.model.load_valuehead_model`` — the PPO critic's loader
    hard-codes ``attn_implementation="flash_attention_2"`` (both its
    ``AutoModelForTokenClassification`` path and its trl fallback), so a value
    model cannot be built without flash-attn. On the CPU platform only, the
    wrapper loads the same ``AutoModelForTokenClassification`` with ``sdpa``;
    elsewhere verl's function runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from claas_verl.verl_ext.import_hooks import when_imported

logger = logging.getLogger(__name__)

HF_ROLLOUT_ADAPTER_FQN = "claas_verl.verl_ext.cpu.hf_replica.HFServerAdapter"

# --------------------------------------------------------------------------- registrations


def on_cpu_platform() -> bool:
    from verl.plugin.platform import get_platform

    return get_platform().device_name == "cpu"


def register_hf_rollout_class(base_module) -> None:
    """P1: add the HF adapter to verl's private rollout-class table."""
    table = base_module._ROLLOUT_REGISTRY
    table.setdefault(("hf", "async"), HF_ROLLOUT_ADAPTER_FQN)


def register_hf_replica(replica_module) -> None:
    """Public: ``RolloutReplicaRegistry.register("hf", loader)``."""

    def _load():
        from claas_verl.verl_ext.cpu.hf_replica import HFReplica

        return HFReplica

    registry = replica_module.RolloutReplicaRegistry
    registry.register("hf", _load)
    # Public API too: wrap verl's own vLLM loader so "vllm not installed" says so (and how to fix it).
    from claas_verl.verl_ext.cpu.checks import guard_rollout_loader

    vllm_loader = registry._registry.get("vllm")
    if vllm_loader is not None and not hasattr(vllm_loader, "__wrapped__"):
        registry.register("vllm", guard_rollout_loader("vllm", vllm_loader, "vllm"))


def patch_process_group_backend(engine_workers_module) -> None:
    """P2: on the CPU platform, initialise torch.distributed with ``cpu:gloo`` only."""
    original = engine_workers_module.initialize_global_process_group_ray
    if getattr(original, "_claas_cpu_patch", False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and on_cpu_platform():
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._claas_cpu_patch = True
    engine_workers_module.initialize_global_process_group_ray = initialize_global_process_group_ray


@contextlib.contextmanager
def unpinned_cpu_offload(transformer_impl_module):
    """P3: inside the block, ``CPUOffloadPolicy(...)`` in verl's FSDP engine never pins memory."""
    original = transformer_impl_module.CPUOffloadPolicy

    def cpu_offload_policy(*args, **kwargs):
        kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    transformer_impl_module.CPUOffloadPolicy = cpu_offload_policy
    try:
        yield
    finally:
        transformer_impl_module.CPUOffloadPolicy = original


def register_cpu_fsdp_engines(transformer_impl_module) -> None:
    """Public: register verl's FSDP/FSDP2 engines for device ``cpu`` (verl registers cuda/npu only)."""
    from verl.workers.engine.base import EngineRegistry

    registry = EngineRegistry._engines
    for model_type, base_name in (
        ("language_model", "FSDPEngineWithLMHead"),
        ("value_model", "FSDPEngineWithValueHead"),
    ):
        if "cpu" in registry.get(model_type, {}).get("fsdp2", {}):
            continue
        base = getattr(transformer_impl_module, base_name)

        def _build_fsdp_module(self, module, _base=base):
            with unpinned_cpu_offload(transformer_impl_module):
                return _base._build_fsdp_module(self, module)

        engine_cls = type(f"CPU{base_name}", (base,), {"_build_fsdp_module": _build_fsdp_module})
        engine_cls.__module__ = __name__
        EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine_cls)


VALUEHEAD_LOADER = "load_valuehead_model"


def patch_valuehead_attention(model_module) -> None:
    """P4: on the CPU platform, build verl's value model with sdpa attention instead of flash-attn."""
    original = getattr(model_module, VALUEHEAD_LOADER)
    if getattr(original, "_claas_cpu_patch", False):
        return

    @functools.wraps(original)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        if not on_cpu_platform():
            return original(local_path, torch_dtype, model_config, trust_remote_code)
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation="sdpa", trust_remote_code=trust_remote_code,
        )

    load_valuehead_model._claas_cpu_patch = True
    setattr(model_module, VALUEHEAD_LOADER, load_valuehead_model)


def install_hooks() -> None:
    """Called by the plugin at ``import verl`` time: schedule every registration above."""
    when_imported("verl.workers.rollout.base", register_hf_rollout_class)
    when_imported("verl.workers.rollout.replica", register_hf_replica)
    when_imported("verl.workers.engine_workers", patch_process_group_backend)
    when_imported("verl.workers.engine.fsdp.transformer_impl", register_cpu_fsdp_engines)
    when_imported("verl.utils.model", patch_valuehead_attention)  # P4 (checks the platform at call time)
