"""``benchmarks/gpu_acceptance.py --cpu``: the GPU acceptance check's code paths at tiny shapes, so it cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_acceptance  # noqa: E402


def test_cpu_mode_runs_every_check_and_writes_the_report(tmp_path):
    out = tmp_path / "report.json"
    status = gpu_acceptance.main(["--cpu", "--out", str(out)])
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["teacher_targets_qwen3", "teacher_targets_r1_distill", "balanced_replay_step",
                            "balanced_replay_step_tied", "topk_loss", "host_balancer", "vllm_reload_and_lora",
                            "replay_step_ratios"]
    assert report["mode"] == "cpu" and report["attn_implementation"] == "sdpa"
    for c in checks.values():
        assert set(c) >= {"name", "ok", "numbers", "seconds", "skipped"}
    if not checks["vllm_reload_and_lora"]["skipped"]:
        pytest.fail("the vLLM check must skip, with its reason, without a GPU")
    step = checks["balanced_replay_step"]
    failed = [n for n, c in checks.items() if not c["ok"]]
    assert failed == [] and status == 0, {n: checks[n].get("error") for n in failed}
    assert checks["teacher_targets_qwen3"]["numbers"]["target_bytes"] == \
        checks["teacher_targets_qwen3"]["numbers"]["predicted_bytes"]
    assert checks["host_balancer"]["numbers"]["rel_err"] < 1e-5
    assert checks["topk_loss"]["numbers"]["grad_rel_err_vs_unchunked"] < 1e-2
    ratios = checks["replay_step_ratios"]["numbers"]
    assert ratios["carried_step_was_carried"] and set(ratios["ratios"]) == {
        "worker exact / token only", "worker exact, separate passes / token only", "worker carried / token only",
        "floor exact / token only", "floor carried / token only"}
    metrics = step["numbers"]["metrics"]
    assert metrics["mopd/tok_part_norm"] == pytest.approx(metrics["mopd/aux_part_norm"], rel=1e-5)  # ratio 1
