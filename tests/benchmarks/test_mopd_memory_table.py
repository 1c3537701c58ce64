"""``benchmarks/mopd_memory_table.py --check``: every row of the memory table measured (exact tensor bytes, CPU)
at a tiny size agrees with its formula within 15%."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import mopd_memory_table as M  # noqa: E402


def test_every_row_agrees_with_its_measurement():
    rows = M.check(*M.TINY)
    names = {name for name, _, _ in rows}
    assert {"params (fp32 shard + bf16 gathered root and 2 layers)", "grads (fp32 shard)",
            "optimizer (AdamW, fp32 shard)", "activations, token pass", "logits chunks, token pass",
            "activations, alignment pass (SATS)",
            "teacher forward (gathered fp32 params + max of log-prob and target pass)",
            "teacher targets, host RAM (bounded)", "balancing buffers g_tok and u, host RAM (pinned)"} <= names
    for name, predicted, measured in rows:
        assert abs(measured / predicted - 1) <= M.TOLERANCE, name


def test_pinned_host_buffers_round_up_to_powers_of_two():
    """CUDA's caching host allocator: the 8B shards' 2 x 8.2 GB (15.3 GiB) of g_tok and u take 20.3 GiB."""
    exact = M.table(M.QWEN3_8B, M.Run(pinned_pow2=False))["balancing buffers g_tok and u, host RAM (pinned)"]
    pinned = M.table(M.QWEN3_8B, M.Run())["balancing buffers g_tok and u, host RAM (pinned)"]
    assert 15.0 < exact / 2**30 < 15.5 and 20.0 < pinned / 2**30 < 20.5
