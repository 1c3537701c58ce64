"""LoRA hot-reload on the HF backend over HTTP: the version increments, later entries carry it, and the served
policy really changed (the recorded log-probs are those of base + adapter, not of the base model)."""

from __future__ import annotations

import httpx
import pytest
import torch
from peft import PeftModel
from service_helpers import ADMIN, USER, big_buffer, recompute_logprob, running_service
from transformers import AutoModelForCausalLM

from claas_verl.claas.service import ClaasServiceClient, HFBackend
from claas_verl.tiny import ensure_tiny
from claas_verl.tiny.adapters import random_lora_adapter

torch.set_num_threads(1)


def _load_base(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _make_adapter(student, out_dir, seed: int) -> str:
    # lora_B ×20: a visible change of the logits, far above the 1e-4 comparison tolerance
    random_lora_adapter(student, out_dir, seed=seed, b_scale=20.0)
    return str(out_dir)


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny()


def test_reload_increments_version_and_later_entries_carry_it(tiny, tmp_path):
    adapter1 = _make_adapter(tiny.student, tmp_path / "a1", seed=1)
    adapter2 = _make_adapter(tiny.student, tmp_path / "a2", seed=2)
    backend = HFBackend(tiny.student, default_max_tokens=6, seed=0)
    buf = big_buffer()
    with running_service(backend, buf) as (service, url), ClaasServiceClient(url, admin_key=ADMIN) as client:
        r0 = client.chat(USER, max_tokens=5)
        assert r0["claas"]["policy_version"] == 0 and r0["model"] == "claas-hf"
        # The trainer's order: optimizer step -> buffer.on_update() (k=1) -> publish the adapter as version k. (The
        # buffer clamps a version ahead of its k, so the test keeps the two in step like the trainer does.)
        buf.on_update()
        out = client.load_adapter(adapter1)
        from claas_verl.claas.tenants.adapters import adapter_file_digest

        digest = adapter_file_digest(adapter1)  # the reply names the weights that served it
        assert out == {"tenant": "default", "policy_version": 1, "adapter_sha256": digest, "model": "claas-hf-lora-v1"}
        assert r0["claas"]["adapter_sha256"] is None
        assert client.health()["policy_version"] == 1
        assert sorted(m["id"] for m in client.models()["data"]) == ["claas-hf", "claas-hf-lora-v1"]
        r1 = client.chat(USER, max_tokens=5)
        assert r1["claas"]["policy_version"] == 1 and r1["model"] == "claas-hf-lora-v1"
        assert r1["claas"]["adapter_sha256"] == digest
        # An explicit version (the trainer's update count) may jump, never go back.
        for _ in range(4):
            buf.on_update()
        assert client.load_adapter(adapter2, policy_version=5)["policy_version"] == 5
        bad = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": adapter1, "policy_version": 3},
                            headers={"Authorization": f"Bearer {ADMIN}"})
        assert bad.status_code == 400 and "greater than the served policy version 5" in bad.json()["error"]["message"]
        missing = httpx.post(f"{url}/v1/claas/load_adapter", json={"lora_path": str(tmp_path / "nope")},
                               headers={"Authorization": f"Bearer {ADMIN}"})
        assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
        r5 = client.chat(USER, max_tokens=5)
        assert r5["claas"]["policy_version"] == 5
        for r in (r0, r1, r5):
            assert client.feedback(r["id"], 1.0)["status"] == "accepted"
        assert client.stats()["reloads"] == 2
    by_uid = {e.uid: e for e in buf.entries()}
    e0, e1, e5 = by_uid[r0["id"]], by_uid[r1["id"]], by_uid[r5["id"]]
    assert (e0.P, e1.P, e5.P) == (0, 1, 5)
    # Only the served adapter stays loaded (older ones are deleted on reload).
    assert list(backend.model.peft_config) == ["v5"]

    base = _load_base(tiny.student)
    served1 = PeftModel.from_pretrained(_load_base(tiny.student), adapter1).eval()
    lp_base = recompute_logprob(base, e1.prompt_ids, e1.response_ids)
    lp_served = recompute_logprob(served1, e1.prompt_ids, e1.response_ids)
    assert e1.behaviour_logprob == pytest.approx(lp_served, abs=1e-4)
    assert abs(lp_served - lp_base) > 1e-2  # the adapter really changed the served policy
    assert e0.behaviour_logprob == pytest.approx(recompute_logprob(base, e0.prompt_ids, e0.response_ids), abs=1e-4)
