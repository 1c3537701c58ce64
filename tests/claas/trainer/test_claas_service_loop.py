"""End to end: CLaaS as a live service, as a user runs it (slow: starting the Ray job takes ~2 minutes on 2 cores).

``python -m claas_verl.main_claas --config-name claas/service scale=tiny`` starts the rollout server, the chat API
and the
trainer in one Ray job. The test talks to it with the real ``openai`` client (plain and streamed), gives feedback on
every turn until the trainer updated the adapter, and checks that

- ``/health`` reports the new version only once it is served, and the next reply carries it (``claas`` object);
- the buffer's ``k`` is the number of updates and equals the announced version; every update pushed a new adapter;
- every completed turn reached the buffer once, and the EMA baseline saw exactly the accepted rewards;
- a SIGTERM to the driver ends the job cleanly (the chat API's admin shutdown: intake stops, the trainer takes a
  final checkpoint) with ``service_stats.json``.
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

REPO = Path(__file__).resolve().parents[3]
KEY, ADMIN = "sk-e2e", "admin-e2e"


@pytest.mark.slow
def test_service_loop_trains_on_chats_and_serves_the_new_adapter(tmp_path):
    from openai import OpenAI

    from claas_verl.tiny import ensure_tiny

    out = tmp_path / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(ensure_tiny().root), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1",
               CLAAS_API_KEY=KEY, CLAAS_ADMIN_KEY=ADMIN)
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/service",
                             "scale=tiny",
                             "claas.service.port=0", "claas.trace_served_weights=true"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    run_dir = out / "claas_tiny_service"
    try:
        deadline = time.monotonic() + 900
        while not (run_dir / "service.json").exists():
            assert proc.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the chat API did not come up"
            time.sleep(1)
        info = json.loads((run_dir / "service.json").read_text())
        client = OpenAI(base_url=info["base_url"], api_key=KEY, max_retries=0, timeout=120)
        auth = {"Authorization": f"Bearer {KEY}"}
        http = httpx.Client(base_url=info["url"], timeout=120)
        assert http.get("/health").json()["policy_version"] == 0
        served = []
        deadline = time.monotonic() + 600
        i = 0
        while http.get("/health").json()["policy_version"] < 1:
            assert time.monotonic() < deadline and proc.poll() is None, "no update from the chats' feedback"
            kwargs = {"stream": True} if i % 3 == 2 else {}
            messages = [{"role": "user", "content": f"Tell me a short fact #{i}."}]
            if kwargs:
                chunks = list(client.chat.completions.create(model="claas", messages=messages, **kwargs))
                claas = chunks[-1].model_extra["claas"]  # the final chunk has the record status
            else:
                claas = client.chat.completions.create(model="claas", messages=messages).model_extra["claas"]
            assert claas["record"] == "pending_feedback", claas
            r = http.post("/v1/feedback", json={"request_id": claas["request_id"], "reward": i % 2}, headers=auth)
            assert r.json()["status"] == "accepted"
            served.append(claas["policy_version"])
            i += 1
        version = http.get("/health").json()["policy_version"]
        nxt = client.chat.completions.create(model="claas", messages=[{"role": "user", "content": "And now?"}])
        assert nxt.model_extra["claas"]["policy_version"] >= version >= 1
        assert served[0] == 0 and served == sorted(served)
        stats = http.get("/v1/claas/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert "turns" not in http.get("/v1/claas/stats", headers=auth).json()  # a user key sees its own counts
        assert http.post("/v1/claas/shutdown", headers=auth).status_code == 401  # API key is not the admin key
        proc.send_signal(signal.SIGTERM)  # to the driver: intake stops, the trainer drains and checkpoints
        assert proc.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        log.close()

    turns = stats["turns"]
    assert turns["completed"] == i and turns["accepted"] == i and turns["pending"] == 1  # the last reply
    assert stats["buffer"]["inserted"] == i and stats["buffer"]["update_count"] == stats["updates"] >= version
    assert stats["ema"]["count"] == i  # docs/math.md §A.3.1: the EMA saw every accepted reward, once
    trace = [json.loads(x) for x in (run_dir / "claas_trace.jsonl").read_text().splitlines()]
    updates = [u for u in trace if u["event"] == "update"]
    prints = [u["served_fingerprint_0"] for u in updates]
    assert len(set(prints)) == len(prints) and [u["served_version_0"] for u in updates] == sorted(
        u["served_version_0"] for u in updates)
    final = json.loads((run_dir / "service_stats.json").read_text())
    assert final["updates"] == len(updates) and final["service"]["turns"]["completed"] == i
    assert not final["service"]["accepting"]  # intake stopped before the final capture
    checkpoint = json.loads((run_dir / f"global_step_{len(updates)}" / "claas" / "state.json").read_text())
    # captured after intake stopped: every reward the API acknowledged is in the final checkpoint's buffer
    assert checkpoint["global_steps"] == len(updates) and checkpoint["service"]["accepted"] == i
