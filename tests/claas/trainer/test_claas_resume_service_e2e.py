"""Kill the service-driven CLaaS job (``claas/service scale=tiny``) with SIGKILL after a checkpoint, start the same
command
again, and check over HTTP that it continues from that checkpoint (slow: two Ray job start-ups).

Run 1 chats and gives feedback until the trainer has updated and checkpointed (``trainer.save_freq=2``), then records a
few more turns and is killed once the buffer accepted them. Run 2, the same command, must restore k = N (the committed
checkpoint), the buffer of ``global_step_N/claas`` (entry uids; its insert count carries on), the EMA statistics of
``state.json``, count the turns accepted after N as discarded (snapshot + discarded = every turn the killed run's
buffer accepted), continue its updates at N+1, serve the new version, and leave a checkpoint at shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_job import start_job, wait_api

KEY, ADMIN = "sk-resume", "admin-resume"

pytestmark = pytest.mark.slow






def _turn(http: httpx.Client, i: int) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = http.post("/v1/chat/completions", headers=auth,
                  json={"model": "claas", "messages": [{"role": "user", "content": f"A short fact #{i}."}]})
    r.raise_for_status()
    rid = r.json()["claas"]["request_id"]
    assert http.post("/v1/feedback", headers=auth, json={"request_id": rid, "reward": i % 2}).json()["status"] == \
        "accepted"


def _trace(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "claas_trace.jsonl").read_text().splitlines(keepends=True)
            if x.endswith("\n")]


def test_killed_service_job_resumes_from_its_checkpoint(tmp_path):
    from claas_verl.claas.replay import load_snapshot
    from claas_verl.tiny import ensure_tiny

    out = tmp_path / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(ensure_tiny().root), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1",
               CLAAS_API_KEY=KEY, CLAAS_ADMIN_KEY=ADMIN)
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    cmd = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/service", "scale=tiny",
           "claas.service.port=0", "trainer.save_freq=2"]
    run_dir = out / "claas_tiny_service"

    # ---- run 1: chats until a checkpoint, then 3 more accepted turns, then SIGKILL
    proc = start_job(cmd, env, tmp_path / "run1.log")
    try:
        info = wait_api(proc, run_dir, tmp_path / "run1.log")
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
    snap = load_snapshot(str(claas_dir / saved["buffer"]["file"]))
    killed = _trace(run_dir)
    ref = max(j for j, r in enumerate(killed) if r["event"] == "claas_state" and r["global_steps"] == n)
    accepted_after = sum(r["accepted"] for r in killed[ref:] if r["event"] == "commit")
    # every accepted turn of the killed run is either in the snapshot or counted as discarded
    assert snap["counters"]["inserted"] + accepted_after == sum(r["accepted"] for r in killed if r["event"] == "commit")
    (run_dir / "service.json").unlink()

    # ---- run 2: the same command (it may train at once: the restored buffer can hold B_min entries)
    proc = start_job(cmd, env, tmp_path / "run2.log")
    try:
        info = wait_api(proc, run_dir, tmp_path / "run2.log")
        http = httpx.Client(base_url=info["url"], timeout=120)
        resume = next(r for r in _trace(run_dir)[len(killed):] if r["event"] == "resume")
        assert resume["global_steps"] == resume["k"] == n
        assert resume["buffer_uids"] == [slot[0].uid for slot in snap["slots"]] == saved["buffer"]["uids"]
        assert resume["ema"] == saved["ema"]
        assert resume["discarded"]["entries_accepted"] == accepted_after
        assert http.get("/health").json()["policy_version"] >= n
        deadline = time.monotonic() + 600
        while http.get("/health").json()["policy_version"] < n + 1:
            assert time.monotonic() < deadline and proc.poll() is None, "no update after the resume"
            _turn(http, i)
            i += 1
        stats = http.get("/v1/claas/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert stats["buffer"]["update_count"] == stats["updates"] == stats["policy_version"] > n
        assert stats["resumes"][-1]["global_steps"] == n
        assert http.post("/v1/claas/shutdown", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert proc.wait(timeout=600) == 0, (tmp_path / "run2.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
    final = json.loads((run_dir / "service_stats.json").read_text())
    after = _trace(run_dir)[len(killed):]
    updates = [r["global_steps"] for r in after if r["event"] == "update"]
    assert updates == list(range(n + 1, n + 1 + len(updates)))  # k continues at N+1, no gap, no repeat
    assert final["updates"] == n + len(updates) and final["resumes"][-1]["global_steps"] == n
    # the buffer continued from the snapshot: its insert count = the snapshot's + what run 2 accepted
    assert final["service"]["buffer"]["inserted"] == snap["counters"]["inserted"] + sum(
        r["accepted"] for r in after if r["event"] == "commit")
    # the shutdown left a checkpoint of the last update to resume from
    assert int((run_dir / "latest_checkpointed_iteration.txt").read_text()) == final["updates"]
