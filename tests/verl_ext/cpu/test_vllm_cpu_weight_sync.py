"""Full-weight syncs into vLLM's CPU build (docs/verl-couplings.md, V4): the linear layers keep their weights,
verl's in-place load writes into them and its ``process_weights_after_loading`` repacks the GEMMs, so every update
is what the engine serves.

The vLLM tests run a real engine on the tiny student in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
verl's own worker extension, and sync new weights through verl's ``vLLMColocateWorkerExtension._update_weights``
followed by the post-processing verl's ``update_weights_from_ipc`` runs after its last bucket. Without the plugin's
hook the first sync fails with vLLM's ``'Parameter' object has no attribute 'weight_loader'``.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from claas_verl.verl_ext.cpu.vllm_weight_sync import keep_cpu_linear_weights

# vLLM's float32 CPU kernels vs one HF forward: rounding only (tests/claas/service/test_service_vllm.py, TOL_TOKEN)
TOL_TOKEN = 1e-4
PROBE = [5, 17, 300, 42, 9, 511, 77, 128, 3, 64, 250, 901]


def test_wrapper_forces_remove_weight_false_once():
    calls = []

    def dispatch(layer, remove_weight):
        calls.append((layer, remove_weight))

    mod = types.SimpleNamespace(dispatch_cpu_unquantized_gemm=dispatch)
    assert keep_cpu_linear_weights(mod) is True
    assert keep_cpu_linear_weights(mod) is False  # already wrapped: not twice
    mod.dispatch_cpu_unquantized_gemm("qkv", remove_weight=True)
    mod.dispatch_cpu_unquantized_gemm("emb", False)
    assert calls == [("qkv", False), ("emb", False)]
    assert keep_cpu_linear_weights(types.SimpleNamespace()) is False  # a vLLM without the function: nothing to do


# ----------------------------------------------------------------------------------------------- real vLLM (CPU)


@pytest.mark.vllm
def test_vllm_still_removes_cpu_linear_weights_and_verl_still_repacks():
    """The couplings: vLLM's CPU linear post-processing removes the weight (what the hook undoes), and verl's sync
    post-processes after loading (what repacks the GEMM from the synced values)."""
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    src = inspect.getsource(UnquantizedLinearMethod.process_weights_after_loading)
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in src
    assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in src  # looked up per call
    assert list(inspect.signature(layer_utils.dispatch_cpu_unquantized_gemm).parameters) == ["layer", "remove_weight"]
    sync = inspect.getsource(vLLMColocateWorkerExtension.update_weights_from_ipc)
    assert sync.index("receiver.receive_weights(") < sync.index("process_weights_after_loading(model, model_config")
    import verl  # noqa: F401  (loads the claas_verl plugin, which installs the hook)

    assert getattr(layer_utils.dispatch_cpu_unquantized_gemm, "_claas_keeps_weight", False)


def _hf_prompt_logprobs(model, ids) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1)
    return [float(lp[i, t]) for i, t in enumerate(ids[1:])]


def _vllm_prompt_logprobs(llm, ids) -> list[float]:
    from vllm import SamplingParams, TokensPrompt

    out = llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]


def _sync_like_verl(worker, weights):
    """verl's full-weight sync inside the vLLM worker, minus the bucket transport: ``_update_weights`` per bucket,
    then the post-processing ``update_weights_from_ipc`` runs once after the last bucket."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    worker._update_weights(weights, peft_config=None, base_sync_done=False)
    for model, model_config in worker._iter_all_models_with_config():
        process_weights_after_loading(model, model_config, worker.device or torch.device("cpu"))


@pytest.mark.vllm
def test_every_full_weight_sync_is_served(tiny, hf_fp32, monkeypatch):
    import verl  # noqa: F401  (the plugin hook, as in verl's vLLM worker, which imports verl before loading)
    from vllm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(tiny.student), dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
              worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension")
    student = hf_fp32(tiny.student)
    previous = _vllm_prompt_logprobs(llm, PROBE)
    diff = max(abs(a - b) for a, b in zip(previous, _hf_prompt_logprobs(student, PROBE)))
    assert diff < TOL_TOKEN, diff  # the loaded checkpoint
    gen = torch.Generator().manual_seed(0)
    for step in range(3):  # three updates, as a trainer syncs after each step
        with torch.no_grad():
            for p in student.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        weights = list(student.state_dict().items())
        llm.collective_rpc(_sync_like_verl, args=(weights,))
        served = _vllm_prompt_logprobs(llm, PROBE)
        ref = _hf_prompt_logprobs(student, PROBE)
        diff = max(abs(a - b) for a, b in zip(served, ref))
        moved = max(abs(a - b) for a, b in zip(served, previous))
        assert diff < TOL_TOKEN, (step, diff)  # the engine serves exactly the synced weights
        assert moved > 100 * TOL_TOKEN, (step, moved)  # and they are new
        previous = served
    del llm
