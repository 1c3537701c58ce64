"""The CLaaS chat service on CPU: tiny model, a ReplayBufferActor, graded multi-turn chats, one LoRA hot-reload.

    python examples/chat_service_cpu.py [--scenarios 3] [--max-tokens 24]

What it shows (CLaaS paper §3: agents talk to the inference server, every turn feeds the replay buffer):
1. A ChatService (OpenAI-compatible HTTP API on 127.0.0.1) over the in-process HFBackend, writing to a Ray
   ReplayBufferActor; rewards come from the rule-following environment's verifiers (a grader callback).
2. Multi-turn scenarios played over HTTP like any OpenAI client would (scenario/step ids in the request metadata);
   each assistant turn becomes one replay entry with ℓ^b = Σ sampled-token log-probs and P = policy version.
3. A request at temperature 0.7: served, but its entry is rejected (docs/math.md §0) with the reason in
``claas.reason``.
4. A hot-reload of a (random) LoRA adapter as policy version 1; later turns are recorded with P = 1.
On the GPU, swap HFBackend for ``OpenAIBackend("http://vllm:8000", "<served-model-name>")``.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import ray
import torch

from claas_verl.claas.envs import grade_response, make_environment
from claas_verl.claas.replay import make_replay_actor
from claas_verl.claas.service import ChatService, ClaasServiceClient, HFBackend, ServiceConfig, build_app
from claas_verl.claas.service.server import ServiceThread
from claas_verl.claas.service.templating import user_context
from claas_verl.tiny import ensure_tiny
from claas_verl.tiny.adapters import random_lora_adapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)

    tiny = ensure_tiny()
    env = make_environment("rule_following", num_scenarios=args.scenarios + 1, seed=0, num_turns=2)
    scenarios = list(env.scenarios())

    def grader(request):
        # scenario_id is the scenario's index in this stream; the verifier sees the visible text and user messages.
        return grade_response(scenarios[request.scenario_id].verifier, request.response_text,
                              user_context(request.messages))

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    actor = make_replay_actor(b_max=64, b_min=4, a_max=2, seed=0, max_restarts=0)
    backend = HFBackend(tiny.student, default_max_tokens=args.max_tokens, seed=0)
    adapters = tempfile.mkdtemp(prefix="claas_adapters_")  # the only directory adapters may be loaded from
    admin = "example-admin-key"  # adapter loads over HTTP need the admin key
    service = ChatService(backend, actor, grader=grader,
                          config=ServiceConfig(grade_inline=True, admin_key=admin, adapter_root=adapters,
                                               allow_keyless=True))

    with ServiceThread(build_app(service)) as server, ClaasServiceClient(server.url, admin_key=admin) as client:
        print(f"chat service at {server.url}/v1 serving {client.health()}")

        def play(index: int) -> None:
            scenario = scenarios[index]
            replies: list[str] = []
            for turn in range(scenario.num_turns):
                messages = scenario.messages(turn, replies)
                resp = client.chat(messages, scenario_id=index, step_idx=turn)
                c, text = resp["claas"], resp["choices"][0]["message"]["content"]
                print(f"  scenario {index} turn {turn}: P={c['policy_version']} n={c['n_tokens']:>2} "
                      f"ℓ^b={c['behaviour_logprob']:8.3f} -> {c['record']:9s} {text[:40]!r}")
                replies.append(text)

        print("1) graded multi-turn scenarios with the base policy (version 0)")
        for i in range(args.scenarios):
            play(i)

        print("2) a request at temperature 0.7 is served but not recorded")
        resp = client.chat(scenarios[0].messages(0, []), scenario_id=0, temperature=0.7)
        print(f"  record={resp['claas']['record']}: {resp['claas']['reason']}")

        print("3) the trainer publishes update 1: buffer.on_update(), then hot-reload the adapter as version 1")
        ray.get(actor.on_update.remote())
        with tempfile.TemporaryDirectory(dir=adapters) as tmp:
            random_lora_adapter(tiny.student, tmp)  # stands in for an adapter the trainer publishes after an update
            print("  ", client.load_adapter(tmp, policy_version=1))
        play(args.scenarios)

        service.recorder.sink.flush(60)
        stats = client.stats()
    buffer_stats = ray.get(actor.stats.remote())
    entries = ray.get(actor.entries.remote())
    print("service stats:", json.dumps({k: v for k, v in stats.items() if v}, default=str))
    print("buffer stats:", json.dumps({k: buffer_stats[k] for k in ("size", "inserted", "dropped_none")
                                       if k in buffer_stats}))
    print("entries by policy version:", {p: sum(e.P == p for e in entries) for p in sorted({e.P for e in entries})})
    ray.shutdown()


if __name__ == "__main__":
    main()
