"""The chat service in front of a REAL vLLM server (GPU only; skipped cleanly without CUDA and vllm).

Starts ``vllm.entrypoints.openai.api_server`` on the offline tiny model (fp32, LoRA enabled, runtime LoRA updating
on), then checks what the CPU tests can only check against a fake: vLLM's sampled-token log-probs at τ=1 summed over
the response (EOS included) match an HF forward pass, and a hot-reloaded adapter is served and recorded with its
version. Run: ``pytest -m gpu tests/service/test_service_vllm_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from service_helpers import USER, big_buffer, recompute_logprob, running_service
from transformers import AutoModelForCausalLM

from claas_verl.service import ClaasServiceClient, OpenAIBackend
from claas_verl.tiny import ensure_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(), reason="needs CUDA and vllm"
    ),
]

# vLLM's fp32 kernels differ from HF's CPU ones by rounding only; per token ~1e-5, so 1e-3 on a short sum.
TOL = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    tiny = ensure_tiny()
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny.student),
           "--served-model-name", "tiny", "--dtype", "float32", "--enable-lora", "--max-lora-rank", "8",
           "--max-loras", "2", "--max-model-len", "512", "--gpu-memory-utilization", "0.2", "--enforce-eager",
           "--generation-config", "vllm", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not become healthy:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url, tiny
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_vllm_logprobs_match_hf_and_reload_is_recorded(vllm_server, tmp_path):
    url, tiny = vllm_server
    torch.manual_seed(0)
    peft_model = get_peft_model(_base(tiny.student), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                init_lora_weights=False))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))

    buf = big_buffer()
    backend = OpenAIBackend(url, "tiny", default_max_tokens=16)
    with running_service(backend, buf) as (_, svc), ClaasServiceClient(svc) as client:
        r0 = client.chat(USER, seed=1)
        assert client.feedback(r0["id"], 1.0)["status"] == "submitted"
        buf.on_update()
        assert client.load_adapter(str(adapter))["policy_version"] == 1
        r1 = client.chat(USER, seed=1)
        assert r1["model"] == "claas-v1" and r1["claas"]["policy_version"] == 1
        assert client.feedback(r1["id"], 1.0)["status"] == "submitted"
    by_uid = {e.uid: e for e in buf.entries()}
    e0, e1 = by_uid[r0["id"]], by_uid[r1["id"]]
    assert (e0.P, e1.P) == (0, 1)
    base = _base(tiny.student)
    assert e0.behaviour_logprob == pytest.approx(recompute_logprob(base, e0.prompt_ids, e0.response_ids), abs=TOL)
    served = PeftModel.from_pretrained(_base(tiny.student), str(adapter)).eval()
    assert e1.behaviour_logprob == pytest.approx(recompute_logprob(served, e1.prompt_ids, e1.response_ids), abs=TOL)
