"""The verl 0.9.1 internals that claas_verl/claas/vllm_versioned_lora.py relies on, checked in verl's source text
(vLLM is not installed in the default venv, so the modules are read, not imported). A verl upgrade that moves one
fails here by name (docs/verl-couplings.md, "Versioned LoRA on verl's vLLM rollout")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import verl

ROLLOUT = Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout"

COUPLINGS = [
    # (file, regex, why)
    ("utils.py", r"class vLLMColocateWorkerExtension\b", "the worker extension ClaasLoRAWorkerExtension subclasses"),
    ("utils.py", r"def _update_weights\(\s*self,\s*weights[^)]*peft_config[^)]*base_sync_done",
     "overridden: a LoRA sync adds the adapter under a new id"),
    ("utils.py", r"self\._update_weights\(", "update_weights_from_ipc hands every LoRA sync to _update_weights"),
    ("utils.py", r"VLLM_LORA_PATH = ", "the placeholder path of in-memory adapters"),
    ("vllm_async_server.py", r"class vLLMHttpServer\b", "ClaasVLLMHttpServer subclasses it"),
    ("vllm_async_server.py", r"def _get_worker_extension_cls\(self\)", "selects ClaasLoRAWorkerExtension"),
    ("vllm_async_server.py", r"async def launch_server\(self", "wrapped: the engine client becomes versioned"),
    ("vllm_async_server.py", r"self\.engine = engine_client", "the engine client the server's generate uses"),
    ("vllm_async_server.py", r"self\.engine\.generate\(\s*prompt=", "verl's generate goes through self.engine"),
    ("vllm_async_server.py", r"async def clear_kv_cache\(self\)", "overridden: adopts the new adapter, no reset"),
    ("vllm_async_server.py", r"def lora_as_adapter\(self\)", "versioned serving only for LoRA adapters"),
    ("vllm_async_server.py", r"self\.server_class = ray\.remote\(vLLMHttpServer\)", "ClaasVLLMReplica's servers"),
    ("vllm_async_server.py", r'"max_loras": 1', "verl's one-adapter batches (new requests wait for the old ones)"),
    ("vllm_async_server.py", r"\*\*engine_kwargs,[\s\S]*args\.update\(lora_args\)",
     "engine_kwargs.vllm.max_loras is overwritten by verl's 1 (lift_max_loras puts it back)"),
    ("vllm_async_server.py", r"build_cli_args_from_config\(args\)[\s\S]*await self\.run_server\(server_args\)"
     r"[\s\S]*await self\.run_headless\(server_args\)",
     "the parsed arguments reach run_server / run_headless, where lift_max_loras applies"),
    ("vllm_async_server.py", r"async def run_server\(self, args: argparse\.Namespace\)", "overridden: max_loras"),
    ("vllm_async_server.py", r"async def run_headless\(self, args: argparse\.Namespace\)", "overridden: max_loras"),
    ("vllm_rollout.py", r"server_handle\.clear_kv_cache\.remote\(\)", "called right after every weight sync"),
]


@pytest.mark.parametrize("name, pattern, why", COUPLINGS, ids=[f"{c[0]}:{c[2][:40]}" for c in COUPLINGS])
def test_verl_still_has(name, pattern, why):
    source = (ROLLOUT / name).read_text()
    assert re.search(pattern, source), f"verl {verl.__version__} moved {pattern!r} in {name} ({why})"


def test_max_cpu_loras_is_required():
    from omegaconf import OmegaConf

    from claas_verl.claas.lora_versions import check_rollout_config

    def cfg(vllm_kwargs):
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {"engine_kwargs": {"vllm": vllm_kwargs}}}})

    check_rollout_config(cfg({"max_cpu_loras": 2}))
    for bad in ({}, {"max_cpu_loras": 1}):
        with pytest.raises(ValueError, match="engine_kwargs.vllm.max_cpu_loras"):
            check_rollout_config(cfg(bad))


def test_max_loras_from_the_recipe_replaces_verls_one():
    import argparse

    from omegaconf import OmegaConf

    from claas_verl.claas.lora_versions import check_rollout_config, lift_max_loras

    args = argparse.Namespace(enable_lora=True, max_loras=1)  # what verl's launch_server parsed
    assert lift_max_loras(args, {"max_loras": 4, "max_cpu_loras": 6}) and args.max_loras == 4
    assert not lift_max_loras(args, {"max_loras": 2})  # never lowered
    assert not lift_max_loras(args, {}) and args.max_loras == 4
    off = argparse.Namespace(enable_lora=False, max_loras=1)
    assert not lift_max_loras(off, {"max_loras": 4}) and off.max_loras == 1  # no LoRA: nothing to lift
    with pytest.raises(ValueError, match="max_loras must be an int >= 1"):
        lift_max_loras(argparse.Namespace(enable_lora=True, max_loras=1), {"max_loras": 0})

    def cfg(vllm_kwargs):
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {"engine_kwargs": {"vllm": vllm_kwargs}}}})

    check_rollout_config(cfg({"max_cpu_loras": 4, "max_loras": 4}))
    with pytest.raises(ValueError, match="max_cpu_loras=3 is below max_loras=4"):
        check_rollout_config(cfg({"max_cpu_loras": 3, "max_loras": 4}))
