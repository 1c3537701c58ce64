"""benchmarks/bench_mopd_step.py: the trainer and the proxy are compared on the recipe's own sizes and blocks, and
the reported figure is the least disturbed run with its first (stage-start) step left out."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.bench_mopd_step import TRAINER_PHASES, best, recipe_sizes, table  # noqa: E402


def test_the_sizes_and_blocks_are_gym_seqs():
    sizes = recipe_sizes(4)
    assert (sizes["block_size"], sizes["replies"], sizes["topk"]) == (16, 4, 128)
    assert sizes["blocks"] == [("reverse", b) for b in range(4)]  # the first stage of recipes/mopd/data/gym.yaml


def _run(walls):
    return {"steps": [{**{p: 0.1 for p in TRAINER_PHASES}, "step": w, "wall": w, "response_tokens": 300}
                      for w in walls]}


def test_best_skips_the_first_step_and_keeps_the_fastest_run():
    got = best([_run([30.0, 4.0, 6.0]), _run([1.0, 5.0, 5.0])])
    assert got["wall"] == 5.0 and got["all_walls"] == [5.0, 5.0]
    got = best([_run([30.0, 4.0, 5.0]), _run([1.0, 5.0, 5.0])])
    assert got["wall"] == 4.5
    text = table(got, got)
    assert "| **wall step** | **4.500** | **4.500** |" in text and "| update_weights | 0.100 | - |" in text
