"""Kill the service-driven CLaaS job (``claas/tiny_service``) with SIGKILL after a checkpoint, start the same command
again, and check over HTTP that it continues from that checkpoint (slow: two Ray job start-ups).

Run 1 chats and gives feedback until the trainer has updated and checkpointed (``trainer.save_freq=1``), then records a
few more turns (accepted by the buffer after the checkpoint) and is killed. Run 2, the same command, must serve
policy version N (the committed checkpoint) before any new update, hold the buffer of ``global_step_N/claas`` (size,
k, inserted count), the EMA statistics of ``state.json``, count the turns accepted after N as discarded, then train
on new feedback (version N+1) and shut down cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
KEY, ADMIN = "sk-resume", "admin-resume"

pytestmark = pytest.mark.slow


def _start(cmd, env, log_path):
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_api(proc, run_dir: Path, log_path: Path) -> dict:
    deadline = time.monotonic() + 900
    while not (run_dir / "service.json").exists():
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, "the chat API did not come up"
        time.sleep(1)
    return json.loads((run_dir / "service.json").read_text())


def _turn(http: httpx.Client, i: int) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = http.post("/v1/chat/completions", headers=auth,
                  json={"model": "claas", "messages": [{"role": "user", "content": f"A short fact #{i}."}]})
    r.raise_for_status()
    rid = r.json()["claas"]["request_id"]
    assert http.post("/v1/feedback", headers=auth, json={"request_id": rid, "reward": i % 2}).json()["status"] == \
        "submitted"


def _trace(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "claas_trace.jsonl").read_text().splitlines(keepends=True)
            if x.endswith("\n")]


def test_killed_service_job_resumes_from_its_checkpoint(tmp_path):
    from claas_verl.replay import load_snapshot
    from claas_verl.tiny import ensure_tiny

    out = tmp_path / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(ensure_tiny().root), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1",
               CLAAS_API_KEY=KEY, CLAAS_ADMIN_KEY=ADMIN)
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    cmd = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/tiny_service",
           "claas.service.port=0", "trainer.save_freq=1"]
    run_dir = out / "claas_tiny_service"

    # ---- run 1: chats until a checkpoint, then 3 more accepted turns, then SIGKILL
    proc = _start(cmd, env, tmp_path / "run1.log")
    try:
        info = _wait_api(proc, run_dir, tmp_path / "run1.log")
        http = httpx.Client(base_url=info["url"], timeout=120)
        i, deadline = 0, time.monotonic() + 600
        while not any(r["event"] == "checkpoint" for r in _trace(run_dir)):
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint from the chats' feedback"
            _turn(http, i)
            i += 1
        for _ in range(3):
            _turn(http, i)
            i += 1
        deadline = time.monotonic() + 60
        while sum(1 for r in _trace(run_dir) if r["event"] == "commit") < i:  # every feedback reached the buffer
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(3)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own lingering Ray agents (the group this test started)
        except ProcessLookupError:
            pass

    n = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    claas_dir = run_dir / f"global_step_{n}" / "claas"
    saved = json.loads((claas_dir / "state.json").read_text())
    snap = load_snapshot(str(claas_dir / "replay_buffer.pkl"))
    killed = _trace(run_dir)
    ref = max(j for j, r in enumerate(killed) if r["event"] == "claas_state" and r["global_steps"] == n)
    accepted_after = sum(r["accepted"] for r in killed[ref:] if r["event"] == "commit")
    assert accepted_after >= 3
    (run_dir / "service.json").unlink()

    # ---- run 2: the same command
    proc = _start(cmd, env, tmp_path / "run2.log")
    try:
        info = _wait_api(proc, run_dir, tmp_path / "run2.log")
        http = httpx.Client(base_url=info["url"], timeout=120)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert http.get("/health").json()["policy_version"] == n
        stats = http.get("/v1/claas/stats", headers=auth).json()
        assert stats["buffer"]["update_count"] == stats["updates"] == n
        assert stats["buffer"]["size"] == len(snap["slots"]) and stats["buffer"]["inserted"] == \
            snap["counters"]["inserted"]
        assert stats["ema"] == saved["ema"]
        resume = stats["resumes"][-1]
        assert resume["global_steps"] == n and resume["discarded"]["entries_accepted"] == accepted_after
        deadline = time.monotonic() + 600
        while http.get("/health").json()["policy_version"] < n + 1:
            assert time.monotonic() < deadline and proc.poll() is None, "no update after the resume"
            _turn(http, i)
            i += 1
        assert http.post("/v1/claas/shutdown", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert proc.wait(timeout=600) == 0, (tmp_path / "run2.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
    final = json.loads((run_dir / "service_stats.json").read_text())
    assert final["updates"] > n and final["resumes"][-1]["global_steps"] == n
    updates = [r["global_steps"] for r in _trace(run_dir)[len(killed):] if r["event"] == "update"]
    assert updates == list(range(n + 1, n + 1 + len(updates)))
