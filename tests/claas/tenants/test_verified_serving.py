"""Verified serving: the probe comparison and its alarm (hand numbers), and the HF backend refusing to serve a
reloaded adapter that is not the trained one (it keeps the previous version, counts, logs and stops at the limit)."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch
from tenant_adapters import far_adapter

from claas_verl.claas.tenants.adapters import adapter_digest
from claas_verl.claas.tenants.verify import (
    DEFAULT_TOLERANCE,
    ReloadProbe,
    VerifiedServing,
    probe_ids,
    probe_token_logprobs,
)
from claas_verl.metrics.served_check import ProbeTolerance, ServedCheckAlarm, ServedWeightsMismatch, compare_probe

TOL = ProbeTolerance(max_abs=0.1, mean_abs=0.05)


def test_the_comparison_by_hand():
    # diffs 0.02, 0.08 | 0.02 -> max 0.08 <= 0.1, mean 0.04 <= 0.05: accepted
    v = compare_probe([[-1.0, -2.0], [-0.5]], [[-1.02, -1.92], [-0.52]], TOL)
    assert v.ok and v.max_abs == pytest.approx(0.08) and v.mean_abs == pytest.approx(0.04) and v.tokens == 3
    assert not compare_probe([[-1.0]], [[-1.11]], TOL).ok  # max 0.11 > 0.1
    assert not compare_probe([[-1.0, -1.0, -1.0]], [[-1.06, -1.06, -1.06]], TOL).ok  # mean 0.06 > 0.05
    bad = compare_probe([[-1.0]], [[math.nan]], TOL)
    assert not bad.ok and math.isnan(bad.max_abs)
    with pytest.raises(ValueError, match="differ in shape"):
        compare_probe([[-1.0]], [[-1.0, -2.0]], TOL)
    with pytest.raises(ValueError, match="max_abs must be a finite number > 0"):
        ProbeTolerance(0, 1)
    with pytest.raises(ValueError, match="max_failures must be an int >= 1"):
        ServedCheckAlarm(TOL, 0, "x")


def test_a_mismatch_keeps_the_previous_version_counts_logs_and_stops_at_the_limit(caplog):
    vs = VerifiedServing(["a", "b"], (0, "d0"), TOL, max_failures=2)
    assert vs.offer("a", 1, "d1", [-1.0], [-1.01]) and vs.served("a") == (1, "d1")
    with caplog.at_level(logging.ERROR, logger="claas_verl.metrics.served_check"):
        assert not vs.offer("b", 1, "e1", [-1.0], [-2.0])
    assert vs.served("b") == (0, "d0") and vs.failures("b") == 1 and vs.failures("a") == 0
    assert "tenant 'b' v1" in caplog.text and "max |served - trained| = 1 nat" in caplog.text
    state = vs.state_dict()
    with pytest.raises(ValueError, match="a reload must offer a later version"):
        vs.offer("a", 1, "d1", [-1.0], [-1.0])
    with pytest.raises(ServedWeightsMismatch, match=r"tenant 'a' v2 .* 2 mismatch\(es\), the limit is 2"):
        vs.offer("a", 2, "d2", [-1.0], [-3.0])
    assert vs.served("a") == (1, "d1")
    stats = vs.stats()
    assert stats["probe_failures_total"] == 2 and stats["tenants"]["a"]["probe_failures"] == 1
    resumed = VerifiedServing(["a", "b"], (0, "d0"), TOL, max_failures=2)
    resumed.load_state_dict(state)
    assert resumed.served("a") == (1, "d1") and resumed.failures("b") == 1 and resumed.alarm.total_failures == 1


def _adapter(tiny, out, seed):
    """A saved adapter, the trainer's forward of it and the digest of its weights."""
    path, trained = far_adapter(tiny, out, seed)
    weights = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    return path, trained, adapter_digest(weights)


def test_the_hf_backend_serves_only_a_verified_adapter(tiny, tmp_path, caplog):
    from claas_verl.claas.service import HFBackend
    from claas_verl.claas.service.backend import AdapterRejected

    torch.set_num_threads(1)
    path_a, trained_a, digest_a = _adapter(tiny, tmp_path / "a", 1)
    path_b, trained_b, _ = _adapter(tiny, tmp_path / "b", 2)
    backend = HFBackend(tiny.student, default_max_tokens=4)
    ids = probe_ids(backend.tokenizer, 12)
    base_lp = probe_token_logprobs(backend.model, ids)
    vs = VerifiedServing(["t"], (0, "base"), DEFAULT_TOLERANCE, max_failures=2)

    def probe(version, digest, trained_model):
        trained = probe_token_logprobs(trained_model, ids)
        return ReloadProbe(ids, lambda served: vs.offer("t", version, digest, served, trained))

    async def main():
        # the trainer trained A but the file on disk is B (a stale or foreign adapter): from the base model
        with pytest.raises(AdapterRejected, match="still serving claas-hf"):
            await backend.load_adapter(path_b, probe=probe(1, digest_a, trained_a))
        assert backend.policy_version == 0 and backend.served_model == "claas-hf"
        assert probe_token_logprobs(backend.model, ids) == base_lp  # the base model, its LoRA layers removed
        # the right file: served from now on
        assert await backend.load_adapter(path_a, probe=probe(1, digest_a, trained_a)) == 1
        assert vs.served("t") == (1, digest_a) and backend.served_model == "claas-hf-lora-v1"
        served_a = probe_token_logprobs(backend.model, ids)
        # the second mismatch reaches the limit: the run stops, and v1 is still what is served
        with pytest.raises(ServedWeightsMismatch, match="limit is 2"):
            await backend.load_adapter(path_b, probe=probe(2, "d2", trained_a))
        assert backend.policy_version == 1 and probe_token_logprobs(backend.model, ids) == served_a
        return served_a

    with caplog.at_level(logging.ERROR, logger="claas_verl.metrics.served_check"):
        served_a = asyncio.run(main())
    assert vs.failures("t") == 2 and caplog.text.count("do not match the trained ones") == 2
    # the served adapter is the trained one: fp32 on CPU, the same forward
    assert max(abs(s - t) for s, t in zip(served_a, probe_token_logprobs(trained_a, ids))) < 1e-5
    assert max(abs(s - t) for s, t in zip(base_lp, probe_token_logprobs(trained_b, ids))) > DEFAULT_TOLERANCE.max_abs
