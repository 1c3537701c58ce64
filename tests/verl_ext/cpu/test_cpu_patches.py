"""Each verl 0.9.1 coupling of the CPU backend still exists (fails loudly after a verl upgrade moves a name),
and the plugin's registrations are visible in the driver and inside a Ray worker."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

os.environ.setdefault("VERL_PLATFORM", "cpu")


def test_patched_names_exist_in_verl():
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    import verl.workers.engine_workers as engine_workers
    import verl.workers.rollout.base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert isinstance(rollout_base._ROLLOUT_REGISTRY, dict)  # P1
    assert callable(engine_workers.initialize_global_process_group_ray)  # P2
    assert callable(fsdp_impl.CPUOffloadPolicy)  # P3
    assert hasattr(fsdp_impl.FSDPEngineWithLMHead, "_build_fsdp_module")
    assert isinstance(RolloutReplicaRegistry._registry, dict)


def test_valuehead_loader_is_wrapped_with_verl_signature():
    import verl  # noqa: F401  (loads the plugin, which installs the post-import hooks)
    import verl.utils.model as model_module

    from claas_verl.verl_ext.cpu.patches import VALUEHEAD_LOADER

    fn = getattr(model_module, VALUEHEAD_LOADER)  # P4: fails loudly if verl renames/moves it
    assert list(inspect.signature(fn).parameters) == ["local_path", "torch_dtype", "model_config", "trust_remote_code"]
    assert getattr(fn, "_claas_cpu_patch", False), "the post-import hook did not wrap verl's value-model loader"


def test_valuehead_loader_on_cpu_builds_an_sdpa_value_model(monkeypatch):
    import verl.utils.model as model_module
    from transformers import AutoConfig

    from claas_verl.tiny import ensure_tiny
    from claas_verl.verl_ext.cpu import patches

    patches.patch_valuehead_attention(model_module)  # idempotent if the hook already ran
    monkeypatch.setattr(patches, "on_cpu_platform", lambda: True)
    path = str(ensure_tiny().student)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_labels = 1
    model = model_module.load_valuehead_model(path, torch.float32, cfg, False)
    assert model.config._attn_implementation == "sdpa"  # verl would ask for flash_attention_2
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1)  # one value per position


def test_valuehead_loader_off_cpu_calls_verl(monkeypatch):
    from claas_verl.verl_ext.cpu import patches

    calls = []

    class FakeModule:
        pass

    fake = FakeModule()
    fake.load_valuehead_model = lambda *a: calls.append(a) or "verl"
    patches.patch_valuehead_attention(fake)
    monkeypatch.setattr(patches, "on_cpu_platform", lambda: False)
    assert fake.load_valuehead_model("p", torch.float32, None, False) == "verl"
    assert calls == [("p", torch.float32, None, False)]


def test_plugin_registrations_resolve():
    import verl  # noqa: F401  (loads the claas_verl plugin)
    from verl.plugin.platform import PlatformRegistry
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.engine import EngineRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from claas_verl.verl_ext.cpu.hf_replica import HFReplica, HFServerAdapter
    from claas_verl.verl_ext.cpu.platform import PlatformCPU

    assert PlatformRegistry.get("cpu") is PlatformCPU
    assert get_rollout_class("hf", "async") is HFServerAdapter
    assert get_rollout_replica_class("hf") is HFReplica
    engine = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    assert engine.__name__ == "CPUFSDPEngineWithLMHead"
    assert callable(get_policy_loss_fn("claas_seq_is"))


def test_gloo_backend_patch_passes_cpu_gloo():
    seen = {}
    from claas_verl.verl_ext.cpu import patches

    class FakeModule:
        pass

    fake = FakeModule()
    fake.initialize_global_process_group_ray = lambda timeout_second=None, backend=None: seen.update(backend=backend)
    patches.patch_process_group_backend(fake)
    fake.initialize_global_process_group_ray()
    assert seen["backend"] == "cpu:gloo"  # verl would build the invalid "cpu:gloo,cpu:gloo"
    fake.initialize_global_process_group_ray(backend="cpu:gloo,cuda:nccl")
    assert seen["backend"] == "cpu:gloo,cuda:nccl"  # explicit backends are left alone


def test_unpinned_cpu_offload_restores_name():
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl

    from claas_verl.verl_ext.cpu.patches import unpinned_cpu_offload

    original = fsdp_impl.CPUOffloadPolicy
    with unpinned_cpu_offload(fsdp_impl):
        assert fsdp_impl.CPUOffloadPolicy(pin_memory=True).pin_memory is False
    assert fsdp_impl.CPUOffloadPolicy is original


def test_cpu_platform_backend_and_device():
    from claas_verl.verl_ext.cpu.platform import PlatformCPU

    p = PlatformCPU()
    assert p.communication_backend_name() == "gloo"
    assert p.device_name == "cpu" and p.current_device() == "cpu"
    p.device_module.empty_cache()
    assert p.device_module.memory_allocated() == 0


def test_losses_and_rollout_resolve_inside_a_ray_worker(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    def probe():
        # No claas_verl import here: the verl.plugins entry point alone must provide everything.
        from verl.plugin.platform import get_platform
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.workers.rollout.base import get_rollout_class

        loss = get_policy_loss_fn("claas_seq_is")
        return get_platform().device_name, loss.__name__, get_rollout_class("hf").__name__

    device, loss_name, rollout_name = ray.get(probe.remote(), timeout=300)
    assert device == "cpu"
    assert loss_name and rollout_name == "HFServerAdapter"


def test_missing_vllm_names_the_library_and_fix():
    import importlib.util

    from verl.workers.rollout.replica import get_rollout_replica_class

    if importlib.util.find_spec("vllm") is not None:
        return  # vllm installed: nothing to report (GPU machines)
    with pytest.raises(ImportError, match=r"'vllm'.*\+cpu=default"):
        get_rollout_replica_class("vllm")
