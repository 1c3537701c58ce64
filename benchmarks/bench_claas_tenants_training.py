"""Tenants with contradicting rules, trained by one CLaaS job, over real HTTP (plan: benchmarks/plans/claas_tenants.md).

Starts ``python -m claas_verl.main_claas --config-name claas/service_tenants scale=tiny`` and drives it: alice rewards
replies that start with a capital letter, bob replies without any capital letter (the two rules contradict), carol
only chats. Each tenant's served version is probed on held-out prompts before and after the training phase; then the
same load runs against a job with alice alone, for throughput and latency under the same total load.

    python benchmarks/bench_claas_tenants_training.py [--chats 200] [--out DIR]

Prints and writes (``DIR/result.json``, ``DIR/report.md``): per tenant the served version, its own rule's and the
other rule's pass rate before and after (95% Wilson intervals), updates granted and worst wait against the bound,
whether carol's adapter kept its bytes; per job chats/s and latency p50/p95 during the training phase.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
ADMIN = "admin-bench"
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}
TOPICS = ["the sea", "a mountain", "bread", "music", "a city", "the moon", "trains", "coffee", "rain", "a garden",
          "winter", "books", "a river", "the sky", "cats", "a market"]
TOKENS = 16  # tokens of one reply (--tokens)
PROBE_TOPICS = ["a forest", "the desert", "tea", "a bridge", "snow", "a library", "the wind", "apples"]


def rules():
    from claas_verl.claas.envs.rule_following import CapitalStartRule, LowercaseRule

    return {"alice": CapitalStartRule(), "bob": LowercaseRule()}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


class Job:
    """One tenants job: started in its own session, its chat API's address, stopped with SIGTERM."""

    def __init__(self, out: Path, name: str, overrides: list[str]):
        from claas_verl.tiny import ensure_tiny

        self.run_dir = out / "runs" / "claas_tiny_service_tenants"
        out.mkdir(parents=True, exist_ok=True)
        self.log = out / f"{name}.log"
        env = dict(os.environ, CLAAS_TINY_DIR=str(ensure_tiny().root), CLAAS_OUT_DIR=str(out / "runs"),
                   PYTHONUNBUFFERED="1", CLAAS_ADMIN_KEY=ADMIN)
        env.setdefault("RAY_raylet_start_wait_time_s", "180")
        cmd = [sys.executable, "-m", "claas_verl.main_claas", "--config-name", "claas/service_tenants", "scale=tiny",
               "claas.service.port=0", "trainer.save_freq=-1", "trainer.resume_mode=disable", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 900
        while not (self.run_dir / "service.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job did not serve; log tail:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)
        self.url = json.loads((self.run_dir / "service.json").read_text())["url"]

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/claas/stats", headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=60).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def chat(http: httpx.Client, url: str, key: str, content: str, tokens: int) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                  json={"messages": [{"role": "user", "content": content}], "max_tokens": tokens})
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def probe(job: Job, tenants, prompts: int, samples: int, tokens: int) -> dict:
    """Each tenant's served replies on held-out prompts: both rules' pass counts, the versions that served."""
    judge = rules()
    out = {}
    with httpx.Client(timeout=600) as http:
        for tenant in tenants:
            passes = dict.fromkeys(judge, 0)
            versions = set()
            n = 0
            for i in range(prompts):
                text = f"Tell me about {PROBE_TOPICS[i % len(PROBE_TOPICS)]} ({i})."
                for _ in range(samples):
                    reply, _ = chat(http, job.url, KEYS[tenant], text, tokens)
                    versions.add(reply["claas"]["policy_version"])
                    content = reply["choices"][0]["message"]["content"]
                    for rule_of, rule in judge.items():
                        passes[rule_of] += rule.violation(content) is None
                    n += 1
            out[tenant] = {"n": n, "passes": passes, "versions": sorted(versions)}
    return out


def load_plan(chats: int, one_key: str | None = None) -> list[tuple[str, str, object, list[int]]]:
    """(tenant label, key, rule or None, chat indices) per client thread: alice and bob ``chats`` chats each from 2
    threads, rewarded by their rule; carol a quarter as many from 1 thread, no feedback. ``one_key``: every client
    uses that key (the one-tenant job under the same load)."""
    judge = rules()
    out = []
    for tenant in ("alice", "bob", "carol"):
        n, threads = (chats, 2) if tenant in judge else (chats // 4, 1)
        out += [(tenant, one_key or KEYS[tenant], judge.get(tenant), [i for i in range(n) if i % threads == t])
                for t in range(threads)]
    return out


def train(job: Job, plan) -> dict:
    """Run the client threads of ``plan`` (:func:`load_plan`) concurrently; chats/s and latency."""

    def client(item):
        _, key, rule, indices = item
        lat = []
        with httpx.Client(timeout=600) as http:
            for i in indices:
                reply, dt = chat(http, job.url, key, f"Tell me about {TOPICS[i % len(TOPICS)]} ({i}).", TOKENS)
                lat.append(dt)
                if rule is not None:
                    reward = float(rule.violation(reply["choices"][0]["message"]["content"]) is None)
                    http.post(f"{job.url}/v1/feedback", headers={"Authorization": f"Bearer {key}"},
                              json={"request_id": reply["id"], "reward": reward}).raise_for_status()
        return lat

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(plan)) as pool:
        lat = sorted(x for part in pool.map(client, plan) for x in part)
    wall = time.perf_counter() - t0
    return {"chats": len(lat), "wall_s": wall, "chats_per_s": len(lat) / wall,
            "p50_ms": 1e3 * statistics.median(lat), "p95_ms": 1e3 * lat[int(0.95 * (len(lat) - 1))],
            "load": os.getloadavg()[0]}


def quiesce(job: Job, timeout_s: float = 900) -> dict:
    """Wait until the updates stop (every partition below its b_min once the feedback stopped)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        s = job.stats()
        now = {t: v["granted"] for t, v in s["tenant_training"]["tenants"].items()}
        if now == last:
            return s["tenant_training"]
        last = now
        time.sleep(10)
    raise RuntimeError("the updates did not stop")


def rate(p: dict, rule_of: str) -> str:
    k, n = p["passes"][rule_of], p["n"]
    lo, hi = wilson(k, n)
    return f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=200, help="training chats of alice and of bob")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("/tmp/claas_bench_tenants_training"))
    args = ap.parse_args()
    global TOKENS
    TOKENS = args.tokens
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"settings": vars(args) | {"out": str(args.out)}}

    job = Job(args.out / "three", "three_tenants", [])
    try:
        start = job.stats()["tenant_training"]
        result["before"] = probe(job, ("alice", "bob"), args.prompts, args.samples, args.tokens)
        result["load_three"] = train(job, load_plan(args.chats))
        result["training"] = quiesce(job)
        result["after"] = probe(job, ("alice", "bob"), args.prompts, args.samples, args.tokens)
        carol = result["training"]["tenants"]["carol"]
        result["carol_bytes_kept"] = (carol["trained_sha256"] == start["tenants"]["carol"]["trained_sha256"]
                                      and carol["trained_version"] == carol["served_version"] == 0)
    finally:
        job.stop()

    # the same total load on a job with one tenant (alice), every client on alice's key
    one = Job(args.out / "one", "one_tenant", ["~claas.service.tenants.bob", "~claas.service.tenants.carol"])
    try:
        result["load_one"] = train(one, load_plan(args.chats, one_key=KEYS["alice"]))
    finally:
        one.stop()

    (args.out / "result.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    report = render(result)
    (args.out / "report.md").write_text(report)
    print(report)


def render(r: dict) -> str:
    t = r["training"]
    lines = ["| tenant | served version | updates | worst wait (bound) | own rule before | own rule after | "
             "other rule before | other rule after |", "|---|---|---|---|---|---|---|---|"]
    other = {"alice": "bob", "bob": "alice"}
    for tenant in ("alice", "bob"):
        s = t["tenants"][tenant]
        lines.append(f"| {tenant} | {s['served_version']} | {s['granted']} | {s['worst_wait']} ({t['bound']}) | "
                     f"{rate(r['before'][tenant], tenant)} | {rate(r['after'][tenant], tenant)} | "
                     f"{rate(r['before'][tenant], other[tenant])} | {rate(r['after'][tenant], other[tenant])} |")
    c = t["tenants"]["carol"]
    lines += ["", f"carol (no feedback): updates {c['granted']}, served version {c['served_version']}, adapter bytes "
              f"kept: {r['carol_bytes_kept']}; probe failures: {t['probe_failures_total']}.", "",
              "| job | chats | chats/s | p50 ms | p95 ms | load (1 min) |", "|---|---|---|---|---|---|"]
    for name, key in (("three tenants", "load_three"), ("one tenant, same load", "load_one")):
        x = r[key]
        lines.append(f"| {name} | {x['chats']} | {x['chats_per_s']:.2f} | {x['p50_ms']:.0f} | {x['p95_ms']:.0f} | "
                     f"{x['load']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
