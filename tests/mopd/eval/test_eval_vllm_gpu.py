"""The evaluation's vLLM path on the tiny student (GPU only; skipped cleanly without CUDA and vllm).

Run: ``pytest -m gpu tests/mopd/eval/test_eval_vllm_gpu.py``. Checks per-request seeding (same seed, same samples;
another seed, other samples), the MOPD paper's samples per item, the truncation flag, and one CLI run through vLLM.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(), reason="needs CUDA and vllm"
    ),
]

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "eval"


def test_vllm_generator_seeded_samples_and_truncation(tiny):
    from claas_verl.mopd.eval.generate import VLLMGenerator

    gen = VLLMGenerator(str(tiny.student), max_model_len=1024, gpu_memory_utilization=0.3, max_new_tokens_cap=16)
    msgs = [[{"role": "user", "content": "Compute 2 + 3."}], [{"role": "user", "content": "Say hi."}]]
    a = gen.generate(msgs, 4, 0.7, 0.95, 8192, seed=0)
    assert [len(r) for r in a] == [4, 4]
    assert a == gen.generate(msgs, 4, 0.7, 0.95, 8192, seed=0)
    assert a != gen.generate(msgs, 4, 0.7, 0.95, 8192, seed=1)
    gen.cap = 1
    one = [c for r in gen.generate(msgs, 4, 1.0, 0.95, 8192, seed=0) for c in r]
    assert all(c.truncated or c.text == "" for c in one)


def test_eval_cli_through_vllm(tiny, tmp_path):
    from claas_verl.mopd.eval.cli import main

    out = tmp_path / "runs"
    assert main(["--model", str(tiny.student), "--name", "student", "--benchmarks", "BBH,MuSR,AIME24,MBPP",
                 "--seeds", "0", "--out", str(out), "--data-dir", str(FIX), "--backend", "vllm",
                 "--max-model-len", "1024", "--max-new-tokens-cap", "32"]) == 0
    state = json.loads((out / "student" / "scores.json").read_text())
    assert set(state["seeds"]["0"]) == {"BBH", "MuSR", "AIME24", "MBPP", "MBPP+"}
    assert state["stats"]["0"]["AIME24"]["responses"] == 32  # 2 problems × 16 samples
