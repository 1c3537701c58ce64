"""``benchmarks/mopd_memory_table.py --check``: every row of the memory table measured (exact tensor bytes, CPU)
at a tiny size agrees with its formula within 15%."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import mopd_memory_table as memory_table  # noqa: E402


def test_every_row_agrees_with_its_measurement():
    rows = memory_table.check(*memory_table.TINY)
    names = {name for name, _, _ in rows}
    assert {"params (fp32 shard + bf16 gathered root and 2 layers)", "grads (fp32 shard)",
            "optimizer (AdamW, fp32 shard)", "activations, token pass", "logits chunks, token pass",
            "activations, alignment pass (SATS)",
            "teacher forward (gathered fp32 params + max of log-prob and target pass)",
            "teacher targets, host RAM (bounded)", "balancing buffers g_tok and u, host RAM (pinned)"} <= names
    for name, predicted, measured in rows:
        assert abs(measured / predicted - 1) <= memory_table.TOLERANCE, name


def test_pinned_host_buffers_round_up_to_powers_of_two():
    """CUDA's caching host allocator: the 8B shards' 2 x 8.2 GB (15.3 GiB) of g_tok and u take 20.3 GiB."""
    row = "balancing buffers g_tok and u, host RAM (pinned)"
    exact = memory_table.table(memory_table.QWEN3_8B, memory_table.Run(pinned_pow2=False))[row]
    pinned = memory_table.table(memory_table.QWEN3_8B, memory_table.Run())[row]
    assert 15.0 < exact / 2**30 < 15.5 and 20.0 < pinned / 2**30 < 20.5


def test_the_token_pass_peaks_at_one_moment_of_its_backward_not_at_the_sum_of_its_rows():
    """Hand-derived at a shape where the LM head's backward is the largest moment (module docstring, A/B/C)."""
    s = memory_table.Shape("hand", 2, 64, 2, 1, 32, 128, 10_000, False)
    r = memory_table.Run(ranks=1, mb_tokens=100, chunk=10)
    N, V, D = 100, 10_000, 64  # A = 5.92 MB; B (a layer recomputed) = 3.66 MB; C (the root's reduction) = 4.56 MB
    moment_a = 2 * 2 * N * D + 2 * 2 * N * 32 + (4 * N * V + 1.5 * 10 * V * 4) + 2 * V * D
    assert memory_table.token_pass_backward(s, r) == moment_a
    t = memory_table.table(s, r)
    # the recomputed layer never meets the logits' gradient
    for paper in (memory_table.QWEN3_1_7B, memory_table.QWEN3_8B):
        rows = memory_table.table(paper, memory_table.Run())
        assert memory_table.token_pass_backward(paper, memory_table.Run()) < rows["activations, token pass"] + rows[
            "logits chunks, token pass"]
    # the first micro-batch: the root's reduction holds every fp32 gradient shard, on top of the held logits
    assert (memory_table.token_pass_backward(s, r, first_micro_batch=True)
            >= 2 * N * V + 2 * s.root_params + 4 * s.params)
    assert (memory_table.peaks(t)["optimizer step"]
            == sum(t[k] for k in t if k.startswith(memory_table.STATE)) + 4 * s.params)


def test_the_phases_agree_with_the_h200_measurements_committed_with_them():
    """benchmarks/results/gpu_acceptance: what one H200 measured, against the table's phases of this commit."""
    import json

    from benchmarks import gpu_acceptance

    report = json.loads((REPO / "benchmarks/results/gpu_acceptance/gpu_report.json").read_text())
    assert report["device"].startswith("NVIDIA") and report["ok"]
    checks = {c["name"]: c["numbers"] for c in report["checks"]}
    for name, shape in (("balanced_replay_step", gpu_acceptance.GPU.qwen3),
                        ("balanced_replay_step_tied", gpu_acceptance.GPU.qwen3_tied)):
        phases = gpu_acceptance.step_memory_phases(shape, gpu_acceptance.GPU)
        phases.pop("host balancing buffers")  # pinned host memory: not in CUDA's counters
        measured = checks[name]
        assert checks[name]["shape"] == shape.name
        token = measured["token pass_measured_gib"] * 2**30
        step = measured["step_measured_gib"] * 2**30
        assert abs(token / phases["token pass"] - 1) <= gpu_acceptance.MEMORY_TOLERANCE, name
        assert abs(step / max(phases.values()) - 1) <= gpu_acceptance.MEMORY_TOLERANCE, name
    hb = checks["host_balancer"]  # 8B shard shapes, 4 ranks, g_tok and u on the host
    t = memory_table.table(memory_table.QWEN3_8B, memory_table.Run(ranks=4, grad_copies=0))
    assert hb["params_per_rank"] == sum(memory_table._shard(p, 4) for p in memory_table.QWEN3_8B.param_shapes())
    predicted = t["grads (fp32 shard)"] + t["balancing on the device (fp32 shards + one in transit)"]
    assert abs(hb["device_peak_gib"] * 2**30 / predicted - 1) <= gpu_acceptance.MEMORY_TOLERANCE
