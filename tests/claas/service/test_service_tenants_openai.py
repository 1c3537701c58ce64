"""Tenants served by one vLLM server through ``TenantOpenAIBackend``, over real HTTP.

Against the loopback stand-in of vLLM (``FakeVLLM``, which answers 404 for an adapter it does not hold, as vLLM
does): each tenant's requests name its own adapter; with room for two adapters, the third tenant's load unloads the
least recently used one, and that tenant's next request loads it again BEFORE the chat is sent (never a 404, never
the base model); a reload verified by the serving probe is served only when the probe accepts it. Against real vLLM
on CPU: ``test_tenants_on_real_vllm`` (``make test-vllm``).
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.responses import JSONResponse
from service_helpers import ADMIN, running_service
from tenant_helpers import auth, chat, partitions
from test_service_openai_backend import FakeVLLM

from claas_verl.claas.service.backend import AdapterRejected
from claas_verl.claas.service.openai_tenants import TenantOpenAIBackend
from claas_verl.claas.service.server import ServiceThread
from claas_verl.claas.tenants.verify import ReloadProbe

KEYS = {"a": "sk-a", "b": "sk-b", "c": "sk-c"}
TENANTS = {t: {"api_keys": [k], "b_min": 1, "b_max": 8, "a_max": 100} for t, k in KEYS.items()}


@pytest.fixture
def fake():
    f = FakeVLLM()
    f.scored: list[dict] = []

    @f.app.post("/v1/completions")
    async def completions(body: dict):  # the probe: teacher-forced prompt log-probs of the named model
        f.scored.append(body)
        if body["model"] not in f.loaded | {"base"}:
            return JSONResponse(status_code=404, content={"error": f"model {body['model']} not found"})
        lp = -0.5 if body["model"] == "base" else -0.25
        rows = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t in body["prompt"][1:]]
        return {"choices": [{"text": "x", "prompt_logprobs": rows}]}

    server = ServiceThread(f.app).start()
    f.url = server.url
    yield f
    server.stop()


def _adapter(tmp_path, name: str) -> str:
    """A directory with an adapter file (the fake reads no weights; the backend hashes the file for the digest)."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / name
    d.mkdir()
    save_file({"w": torch.full((2,), float(len(name)))}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text("{}")
    return str(d)


def test_each_tenant_gets_its_adapter_and_an_unloaded_one_is_loaded_again_before_its_request(fake, tmp_path):
    backend = TenantOpenAIBackend(fake.url, "base", list(KEYS), max_loaded_adapters=2)
    with running_service(backend, partitions(TENANTS), tenants=TENANTS, adapter_root=str(tmp_path)) as (_, url):
        for t in KEYS:  # c's load unloads a's adapter (room for two)
            r = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": _adapter(tmp_path, t), "tenant": t},
                           headers=auth(ADMIN), timeout=60)
            assert r.status_code == 200, r.text
        assert fake.loaded == {"claas-b-v1", "claas-c-v1"} and [u["lora_name"] for u in fake.unloads] == ["claas-a-v1"]
        fake.chats.clear()
        for t in ("a", "b", "c"):
            claas = chat(url, KEYS[t]).json()["claas"]
            assert (claas["tenant"], claas["policy_version"]) == (t, 1)
            assert claas["adapter_sha256"] == backend.adapter_sha256(t, 1) is not None
        assert [c["model"] for c in fake.chats] == ["claas-a-v1", "claas-b-v1", "claas-c-v1"]  # no 404, no base
        assert [x["lora_name"] for x in fake.loads].count("claas-a-v1") == 2  # loaded again on demand
        assert backend.cache.counts["reloads"] >= 1 and len(fake.loaded) == 2
        names = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth(KEYS["a"])).json()["data"]]
        assert names == ["base", "claas-a-v1"]  # the tenant sees its own served model only


def test_a_reload_is_served_only_if_the_serving_probe_accepts_it(fake, tmp_path):
    import asyncio

    backend = TenantOpenAIBackend(fake.url, "base", list(KEYS), max_loaded_adapters=2)
    ids = [5, 6, 7, 8]
    seen = []

    def accept(served):
        seen.append(served)
        return served == [-0.25, -0.25, -0.25]  # what the trainer's forward would give

    v = asyncio.run(backend.load_adapter(_adapter(tmp_path, "good"), tenant="a", probe=ReloadProbe(ids, accept)))
    assert v == 1 and backend.served_version("a") == 1 and fake.scored[-1]["model"] == "claas-a-v1"
    with pytest.raises(AdapterRejected, match="still serving v1"):
        asyncio.run(backend.load_adapter(_adapter(tmp_path, "bad"), tenant="a",
                                         probe=ReloadProbe(ids, lambda served: False)))
    assert backend.served_version("a") == 1 and "claas-a-v2" not in fake.loaded  # dropped, the tenant kept v1
    assert backend.score_probe(ids, "b") == [-0.5] * 3  # b serves the base model
    with pytest.raises(ValueError, match="name the tenant"):
        asyncio.run(backend.load_adapter(_adapter(tmp_path, "x"), tenant=None))


@pytest.mark.vllm
def test_tenants_on_real_vllm(vllm_server, tiny, tmp_path, hf_fp32):
    """Real vLLM on CPU (max_loras 2): three tenants' adapters over two slots, the evicted one loaded again on
    demand, every reply on its tenant's adapter, and the probe scored by vLLM equal to a PEFT forward."""
    import asyncio

    from claas_verl.claas.service.sampling import SamplingParams
    from claas_verl.claas.tenants.verify import probe_ids, probe_token_logprobs
    from claas_verl.tiny.adapters import random_lora_adapter

    models = {t: random_lora_adapter(tiny.student, tmp_path / t, seed=seed, b_scale=20.0)
              for seed, t in enumerate(KEYS, 1)}
    backend = TenantOpenAIBackend(vllm_server.url, "tiny", list(KEYS), max_loaded_adapters=2,
                                  default_max_tokens=6, api_key=vllm_server.api_key)
    from transformers import AutoTokenizer

    ids = probe_ids(AutoTokenizer.from_pretrained(str(tiny.student)), 8)

    async def run():  # one event loop: the backend's HTTP client belongs to it
        try:
            for t in KEYS:
                trained = probe_token_logprobs(models[t], ids)
                probe = ReloadProbe(ids, lambda s, tr=trained: max(abs(a - b) for a, b in zip(s, tr)) < 1e-3)
                assert await backend.load_adapter(str(tmp_path / t), tenant=t, probe=probe) == 1
            assert sorted(backend.cache.loaded()) == ["b@v1", "c@v1"]
            for t in ("a", "b", "c"):  # a's adapter was unloaded for c's: loaded again before a's request
                gen = await backend.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=6),
                                             tenant=t)
                assert gen.policy_version == 1 and gen.model == f"claas-{t}-v1"
                served = await asyncio.to_thread(backend.score_probe, ids, t)
                assert max(abs(a - b) for a, b in zip(served, probe_token_logprobs(models[t], ids))) < 1e-3
            assert backend.cache.counts["reloads"] >= 1
        finally:
            await backend.aclose()

    asyncio.run(run())
