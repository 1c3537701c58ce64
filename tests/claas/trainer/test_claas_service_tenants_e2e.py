"""End to end: one multi-tenant CLaaS job, as an operator runs it (slow: each job start takes ~2 minutes on 2 cores).

``python -m claas_verl.main_claas --config-name claas/service_tenants scale=tiny`` serves three tenants (alice, bob,
carol) with the real ``openai`` client. alice and bob give feedback on every reply; carol only chats. The test
checks, over real HTTP:

- every reply names its own tenant, and the version and adapter digest that served it belong to that tenant's
  lineage; each served version's exported adapter file hashes to the digest the trainer recorded;
- one trainer updates alice and bob (each its own versions 1, 2, ...), while carol's adapter keeps its initial bytes
  and carol is served version 0 throughout;
- a SIGTERM takes a final checkpoint; the resumed job serves every tenant the same version and digest, with the same
  scheduler counts and EMA statistics, and trains on;
- a SIGKILL in the middle of training loses only the work after the last checkpoint: the next job resumes every
  tenant exactly as that checkpoint's ``state.json`` records it.
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
from service_job import start_job, stop_job, wait_api

from claas_verl.claas.tenants.adapters import adapter_file_digest

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}
ADMIN = "admin-e2e"
CMD = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/service_tenants", "scale=tiny",
       "claas.service.port=0", "trainer.save_freq=4"]


def _stats(http: httpx.Client) -> dict:
    return http.get("/v1/claas/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()["tenant_training"]


def _chat(info: dict, http: httpx.Client, tenant: str, i: int, feedback: bool) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=info["base_url"], api_key=KEYS[tenant], max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="claas", messages=[{"role": "user", "content": f"fact {i}"}])
    claas = reply.model_extra["claas"]
    if feedback:
        r = http.post("/v1/feedback", json={"request_id": claas["request_id"], "reward": i % 2},
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        assert r.json()["status"] == "accepted", r.text
    return claas


def _quiesce(http: httpx.Client, timeout_s: float = 600) -> dict:
    """With no more feedback, wait until no tenant can be updated (every partition below its b_min after age
    eviction) and the updates stopped; the tenants' stats then."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        stats = http.get("/v1/claas/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        sizes = {t: s["size"] for t, s in stats["buffer"]["tenants"].items()}
        now = (sizes, {t: s["granted"] for t, s in stats["tenant_training"]["tenants"].items()})
        if now == last and all(n < 4 for n in sizes.values()):  # b_min 4 in the tiny tenants recipe
            return stats["tenant_training"]
        last = now
        time.sleep(3)
    raise AssertionError("the trainer did not stop updating once the feedback stopped")


def _resumed(run_dir: Path) -> dict:
    """The tenants of the latest resume record of the trace (written before the resumed job's first update)."""
    records = [json.loads(line) for line in (run_dir / "claas_trace.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "resume"][-1]["tenants"]["tenants"]


def _train_until(info, http, proc, version: int, seen: list, start: int = 0, timeout_s: float = 900) -> int:
    """alice and bob give feedback (carol only chats) until both are served ``version``; returns the next index."""
    deadline, i = time.monotonic() + timeout_s, start
    while min(_stats(http)["tenants"][t]["served_version"] for t in ("alice", "bob")) < version:
        assert proc.poll() is None and time.monotonic() < deadline, "the tenants were not updated in time"
        for tenant in ("alice", "bob", "carol"):
            seen.append(_chat(info, http, tenant, i, feedback=tenant != "carol"))
        i += 1
    return i


def _restart(tmp: Path, run_dir: Path, env: dict, name: str):
    """The same job again on its run directory (``trainer.resume_mode=auto``): (process, log, service info,
    client); the process is killed if its chat API does not come up."""
    log = tmp / f"{name}.log"
    (run_dir / "service.json").unlink()
    proc = start_job([*CMD, "trainer.resume_mode=auto"], env, log)
    try:
        info = wait_api(proc, run_dir, log)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, log, info, httpx.Client(base_url=info["url"], timeout=120)


@pytest.fixture(scope="module")
def tenants_job(tmp_path_factory):
    from claas_verl.tiny import ensure_tiny

    tmp = tmp_path_factory.mktemp("tenants_job")
    out = tmp / "runs"
    env = dict(os.environ, CLAAS_TINY_DIR=str(ensure_tiny().root), CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1",
               CLAAS_ADMIN_KEY=ADMIN)
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    return tmp, out / "claas_tiny_service_tenants", env


def test_tenants_train_apart_serve_verified_versions_and_resume_exactly(tenants_job):
    tmp, run_dir, env = tenants_job
    seen: list[dict] = []
    log = tmp / "job1.log"
    proc = start_job(CMD, env, log)
    try:
        info = wait_api(proc, run_dir, log)
        http = httpx.Client(base_url=info["url"], timeout=120)
        initial = _stats(http)["tenants"]["carol"]["trained_sha256"]
        i = _train_until(info, http, proc, 2, seen)
        before = _quiesce(http)
        metrics = http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
        for tenant in KEYS:  # the alarm series and the per-tenant training counts
            assert f'claas_tenant_probe_failures_total{{tenant="{tenant}"}} 0.0' in metrics
            assert (f'claas_tenant_updates_total{{tenant="{tenant}"}} '
                    f'{float(before["tenants"][tenant]["granted"])}') in metrics
        replies = [_chat(info, http, t, 999, feedback=False) for t in KEYS]
    finally:
        if proc.poll() is None:
            stop_job(proc, log)  # SIGTERM: final checkpoint

    # every reply: its own tenant, a version of that tenant's lineage, the digest of that version's file
    lineage: dict[tuple[str, int], str | None] = {}
    for claas in seen + replies:
        key = (claas["tenant"], claas["policy_version"])
        assert lineage.setdefault(key, claas["adapter_sha256"]) == claas["adapter_sha256"]
    for (tenant, version), digest in lineage.items():
        if version == 0:
            assert digest is None  # version 0: the base model (the initial LoRA has B = 0)
            continue
        path = run_dir / "tenant_adapters" / tenant / f"v{version}"
        if path.exists():  # older versions are deleted once a newer one is served
            assert adapter_file_digest(path) == digest
    t = before["tenants"]
    for tenant in ("alice", "bob"):
        assert t[tenant]["served_version"] == t[tenant]["trained_version"] >= 2
        assert t[tenant]["served_sha256"] == t[tenant]["trained_sha256"] != initial
        assert replies[list(KEYS).index(tenant)]["adapter_sha256"] == t[tenant]["served_sha256"]
    assert t["alice"]["served_sha256"] != t["bob"]["served_sha256"]  # two adapters, not one
    assert t["carol"]["trained_version"] == 0 and t["carol"]["trained_sha256"] == initial  # byte for byte
    assert {c["policy_version"] for c in seen if c["tenant"] == "carol"} == {0}
    assert before["probe_failures_total"] == 0 and t["carol"]["granted"] == 0

    # a graceful stop resumes every tenant exactly, and the job trains on
    proc, log, info, http = _restart(tmp, run_dir, env, "job2")
    try:
        resumed = _resumed(run_dir)
        for tenant in KEYS:
            for key in ("trained_version", "trained_sha256", "served_version", "served_sha256", "granted"):
                assert resumed[tenant][key] == t[tenant][key], (tenant, key)
            claas, last = _chat(info, http, tenant, 1000, feedback=False), replies[list(KEYS).index(tenant)]
            assert (claas["policy_version"], claas["adapter_sha256"]) == (last["policy_version"],
                                                                         last["adapter_sha256"])
        target = max(t[x]["served_version"] for x in ("alice", "bob")) + 2
        _train_until(info, http, proc, target, seen, start=i)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-training: no final checkpoint
        proc.wait(timeout=120)

    # the killed job's work after its last checkpoint is lost; every tenant resumes as that checkpoint recorded
    step = int((run_dir / "latest_checkpointed_iteration.txt").read_text())
    saved = json.loads((run_dir / f"global_step_{step}" / "claas" / "state.json").read_text())["tenants"]
    proc, log, info, http = _restart(tmp, run_dir, env, "job3")
    try:
        after = _resumed(run_dir)
        for tenant in KEYS:
            assert [after[tenant]["trained_version"], after[tenant]["trained_sha256"]] == saved["trained"][tenant]
            assert [after[tenant]["served_version"], after[tenant]["served_sha256"]] == \
                saved["verified"]["served"][tenant]
            assert after[tenant]["granted"] == saved["scheduler"]["granted"][tenant]
        assert step > 4 and after["carol"]["trained_sha256"] == initial
    finally:
        stop_job(proc, log)
    assert Path(run_dir / "service_stats.json").exists()
