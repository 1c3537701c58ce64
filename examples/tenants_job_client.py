"""Talk to a running multi-tenant CLaaS job with the ``openai`` client: three tenants, two teaching opposite rules.

Start the job first (CPU, tiny model; docs/service.md, "Training one adapter per tenant")::

    python -m claas_verl.tiny make /tmp/claas_verl_tiny
    CLAAS_ADMIN_KEY=admin CLAAS_OUT_DIR=/tmp/claas_runs python -m claas_verl.main_claas \
        --config-name claas/service_tenants scale=tiny

then, in another shell::

    python examples/tenants_job_client.py --run-dir /tmp/claas_runs/claas_tiny_service_tenants [--rounds 40]

alice rewards replies that start with a capital letter, bob replies without any capital letter, carol only chats.
Each tenant is a plain ``OpenAI(base_url=..., api_key=<its key>)``; every reply's ``claas`` object names the tenant,
the version of that tenant's adapter that served it and the adapter's SHA-256. Feedback (``POST /v1/feedback``,
not part of the OpenAI API) trains only the giver's adapter: alice's and bob's versions advance, carol stays at
version 0. At the end the admin stats show each tenant's trained and served version, updates and waits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
from openai import OpenAI

from claas_verl.claas.envs.rule_following import CapitalStartRule, LowercaseRule

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}  # recipes/claas/at_scale/service_tenants_tiny.yaml
RULES = {"alice": CapitalStartRule(), "bob": LowercaseRule()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="the job's run directory (holds service.json)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--admin-key", default="admin")
    args = ap.parse_args()
    info = json.loads((args.run_dir / "service.json").read_text())
    clients = {t: OpenAI(base_url=info["base_url"], api_key=k, max_retries=0, timeout=120) for t, k in KEYS.items()}
    http = httpx.Client(base_url=info["url"], timeout=120)
    for i in range(args.rounds):
        for tenant, client in clients.items():
            reply = client.chat.completions.create(
                model="claas", max_tokens=16, messages=[{"role": "user", "content": f"Tell me a fact ({i})."}])
            claas, text = reply.model_extra["claas"], reply.choices[0].message.content
            rule = RULES.get(tenant)
            if rule is not None:  # carol gives no feedback: her adapter never changes
                reward = float(rule.violation(text) is None)
                http.post("/v1/feedback", json={"request_id": claas["request_id"], "reward": reward},
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"}).raise_for_status()
            digest = (claas["adapter_sha256"] or "base")[:12]
            print(f"{tenant:5s} v{claas['policy_version']:<3d} {digest:12s} {text!r}")
    stats = http.get("/v1/claas/stats", headers={"Authorization": f"Bearer {args.admin_key}"}).json()
    for tenant, s in stats["tenant_training"]["tenants"].items():
        print(f"{tenant}: trained v{s['trained_version']}, served v{s['served_version']}, updates {s['granted']}, "
              f"worst wait {s['worst_wait']} (bound {stats['tenant_training']['bound']})")


if __name__ == "__main__":
    main()
