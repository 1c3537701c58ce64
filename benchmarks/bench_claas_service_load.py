"""The CLaaS loop under load: 64 concurrent agents chat and give feedback while the trainer updates.

Starts ``python -m claas_verl.main_claas --config-name claas/service scale=tiny`` (the rollout server, the chat API and
the trainer in one Ray job, CPU), then runs ``--clients`` concurrent ``openai.AsyncOpenAI`` clients for
``--duration-s`` seconds. Each client loops: chat (every 4th one streamed) -> ``POST /v1/feedback`` with a 0/1
reward (every 5th feedback is ``null``: a grader error, dropped by docs/math.md §A.1.4). It prints

- throughput (completed chat+feedback turns per second) and chat / feedback latency p50 / p99;
- the updates done and the policy versions that served the turns;
- the accounting check: nothing lost or recorded twice. A feedback is answered ``accepted`` only once the buffer
  holds the entry, so the entries the buffer inserted must equal the feedback the clients saw ``accepted``; those
  it refused (stale on arrival, duplicate) are answered ``refused`` and counted by the service; reward-null turns
  never reach it; no uid twice.

    python benchmarks/bench_claas_service_load.py [--clients 64] [--duration-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEY, ADMIN = "sk-bench", "admin-bench"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def agent(idx: int, client, http, stop_at: float, out: dict) -> None:
    rng = random.Random(idx)
    n = 0
    while time.monotonic() < stop_at:
        messages = [{"role": "user", "content": f"Agent {idx} asks question {n}: what is {idx} + {n}?"}]
        t0 = time.perf_counter()
        try:
            if n % 4 == 3:
                stream = await client.chat.completions.create(model="claas", messages=messages, stream=True)
                claas = None
                async for chunk in stream:  # the final chunk carries the complete claas object (record status)
                    claas = chunk.model_extra["claas"]
            else:
                claas = (await client.chat.completions.create(model="claas", messages=messages)).model_extra["claas"]
        except Exception as exc:  # noqa: BLE001 - counted: a benchmark must report failures, not die on them
            out["chat_errors"][type(exc).__name__] += 1
            n += 1
            continue
        out["chat_s"].append(time.perf_counter() - t0)
        out["versions"][claas["policy_version"]] += 1
        out["record"][claas["record"]] += 1
        out["request_ids"].append(claas["request_id"])
        reward = None if n % 5 == 4 else rng.randint(0, 1)
        t1 = time.perf_counter()
        try:
            r = await http.post("/v1/feedback", json={"request_id": claas["request_id"], "reward": reward})
        except Exception as exc:  # noqa: BLE001 - the outcome is unknown to the client: counted, checked below
            out["feedback"][f"lost_{type(exc).__name__}"] += 1
            n += 1
            continue
        out["feedback_s"].append(time.perf_counter() - t1)
        out["feedback"][r.json().get("status", f"http_{r.status_code}")] += 1
        n += 1


async def drive(info: dict, clients: int, duration_s: float) -> dict:
    import httpx
    from openai import AsyncOpenAI

    out = {"chat_s": [], "feedback_s": [], "versions": collections.Counter(), "record": collections.Counter(),
           "feedback": collections.Counter(), "chat_errors": collections.Counter(), "request_ids": []}
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    client = AsyncOpenAI(base_url=info["base_url"], api_key=KEY, max_retries=0, timeout=600,
                         http_client=httpx.AsyncClient(limits=limits, timeout=600))
    async with httpx.AsyncClient(base_url=info["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=600,
                                 limits=limits) as http:
        t0 = time.monotonic()
        await asyncio.gather(*[agent(i, client, http, t0 + duration_s, out) for i in range(clients)])
        out["wall_s"] = time.monotonic() - t0
    await client.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="claas_service_load_"))
    env = dict(os.environ, CLAAS_OUT_DIR=str(tmp), PYTHONUNBUFFERED="1", CLAAS_API_KEY=KEY, CLAAS_ADMIN_KEY=ADMIN)
    env.setdefault("RAY_raylet_start_wait_time_s", "180")
    log = open(tmp / "job.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/service",
                             "scale=tiny",
                             "claas.service.port=0", f"claas.producer.max_new_tokens={args.max_tokens}"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp / "claas_tiny_service"
    try:
        t_start = time.monotonic()
        while not (run_dir / "service.json").exists():
            if proc.poll() is not None:
                sys.exit(f"the job exited during start-up; log: {tmp / 'job.log'}")
            time.sleep(1)
        info = json.loads((run_dir / "service.json").read_text())
        print(f"loop up after {time.monotonic() - t_start:.0f}s at {info['base_url']}; "
              f"{args.clients} clients for {args.duration_s:.0f}s", flush=True)
        res = asyncio.run(drive(info, args.clients, args.duration_s))
        if proc.poll() is not None:  # e.g. the node ran out of memory: say so instead of a connection error
            sys.exit(f"the job died during the run (exit {proc.returncode}); log: {tmp / 'job.log'}; "
                     f"client side before that: {len(res['feedback_s'])} turns, errors {dict(res['chat_errors'])}")
        auth = {"Authorization": f"Bearer {ADMIN}"}  # the admin view of the stats (a user key sees its own)
        deadline = time.monotonic() + 60
        while True:  # the sink's writes in flight land in the buffer
            stats = httpx.get(f"{info['url']}/v1/claas/stats", headers=auth, timeout=60).json()
            if stats["sink"]["in_flight"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        httpx.post(f"{info['url']}/v1/claas/shutdown", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        log.close()

    turns, buf = stats["turns"], stats["buffer"]
    done = len(res["feedback_s"])
    print(f"\nthroughput: {done / res['wall_s']:.2f} turns/s ({done} chat+feedback turns in {res['wall_s']:.0f}s, "
          f"{args.clients} clients, max_tokens {args.max_tokens})")
    print(f"chat latency     p50 {pct(res['chat_s'], 0.5):.2f}s  p99 {pct(res['chat_s'], 0.99):.2f}s")
    fb = res["feedback_s"]
    print(f"feedback latency p50 {pct(fb, 0.5) * 1e3:.1f}ms  p99 {pct(fb, 0.99) * 1e3:.1f}ms")
    print(f"updates: {stats['updates']}; turns served per policy version: {dict(sorted(res['versions'].items()))}")
    print(f"client errors: {dict(res['chat_errors']) or 'none'}; feedback statuses: {dict(res['feedback'])}")
    accepted, refused = res["feedback"]["accepted"], res["feedback"]["refused"]
    print(f"service turns: {json.dumps({k: v for k, v in turns.items() if k != 'dropped'})}")
    print(f"service drops: {json.dumps({k: v for k, v in turns['dropped'].items() if v})}")
    print(f"accounting: buffer inserted {buf['inserted']} = feedback answered accepted {accepted}; refused by the "
          f"buffer {refused} = stale on arrival {buf['dropped_stale']} + duplicate {buf['dropped_duplicate']}")
    lost = sum(v for k, v in res["feedback"].items() if k.startswith("lost_") or k.startswith("http_"))
    ok = (buf["inserted"] == accepted == turns["accepted"] and lost == 0
          and refused == turns["dropped"]["buffer_refused"] == buf["dropped_stale"] + buf["dropped_duplicate"]
          and buf["dropped_duplicate"] == 0 and len(set(res["request_ids"])) == len(res["request_ids"])
          and turns["dropped"]["reward_none"] == res["feedback"]["dropped"])
    print("nothing lost or recorded twice:", "OK" if ok else "MISMATCH", f"(run dir {tmp})")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
