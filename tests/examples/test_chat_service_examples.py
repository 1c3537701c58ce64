"""The two chat-service examples as a user runs them (``python examples/<name>.py``), each in its own process
with a real local Ray cluster and real HTTP: what they print is what docs/service.md tells the reader to expect."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_single_policy_example_records_both_versions_and_refuses_an_unrecordable_request():
    out = _run("chat_service_cpu.py", "--scenarios", "1")
    assert "record=rejected" in out and "temperature=0.7" in out  # served but not recorded
    by_version = ast.literal_eval(out.split("entries by policy version: ", 1)[1].splitlines()[0])
    assert set(by_version) == {0, 1} and all(n > 0 for n in by_version.values())  # before and after the hot reload
    assert '"reloads": 1' in out and '"policy_version": 1' in out


def test_the_tenants_example_keeps_each_tenants_feedback_and_version_its_own():
    out = _run("chat_service_tenants_cpu.py")
    assert "alice on her own turn: 200; alice on bob's turn: 404; bob on his own: 200" in out
    assert "partition sizes: {'alice': 1, 'bob': 1, 'carol': 0}" in out
    assert "carol v0 adapter base model" in out.split("3. new versions", 1)[1]  # no feedback: still the base model
    assert "tenant=alice v1 accepted=1" in out
