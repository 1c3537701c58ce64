"""Try a CLaaS rule stream in minutes: REINFORCE on the tiny model in one process, no Ray and no verl.

A design aid for the CLaaS half of the continual benchmark (``benchmarks/continual_claas.py``), as
``benchmarks/mopd_stage_proxy.py`` is for the MOPD half. It is not the trainer, but it keeps the trainer's knobs that
decide whether a rule is learnable: one-rule scenarios of the rule-following environment, 12-token replies sampled at
τ = 1, the rule's grader as the reward, a LoRA policy (r = 16, α = 32, all linear layers, lr 1e-3, the tiny recipes'
settings), M = 4 replies per update, a REINFORCE++ advantage with the EMA baseline (``claas.rpp`` defaults:
β = 0.9, b0 = 0.5, v0 = 0.25, v_min = 0.01; docs/math.md §A.3.1) and a token-mean loss. It leaves out the
replay buffer, the importance-sampling clip and the multi-turn context (each prompt is the system prompt and one
user turn).

For a stream (``--stream``, one rule family per split) it prints, after every split, each rule's pass rate on
``--eval-samples`` fresh replies per rule (the rows of a per-rule M), with π0's row first:

    python benchmarks/claas_rule_probe.py --stream capital_start,capital_start,end_punctuation,end_punctuation,\
end_punctuation --updates-per-split 3 --seed 1

``--rules`` adds rules that are evaluated but never trained (to see whether training one rule drags another).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from claas_verl.claas.envs.rule_following import make_rule_scenario  # noqa: E402


def rule_pool(family: str, n: int, num_turns: int = 2, seed: int = 0) -> list:
    """``n`` one-rule scenarios of ``family`` (the environment's generator with ``families=(family,)``)."""
    return [make_rule_scenario(seed, i, num_turns, 1, 1, (family,)) for i in range(n)]


def prompts_of(scenarios, rng: random.Random, n: int) -> list[tuple]:
    """``n`` (scenario, turn, messages) draws: the system prompt and one user turn."""
    out = []
    for _ in range(n):
        sc = rng.choice(scenarios)
        t = rng.randrange(sc.num_turns)
        out.append((sc, t, [{"role": "system", "content": sc.system_prompt},
                            {"role": "user", "content": sc.user_turns[t]}]))
    return out


class Policy:
    def __init__(self, model_dir: str, lr: float, seed: int):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                     lora_dropout=0.0))
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)

    def sample(self, messages_list: list[list[dict]], max_new_tokens: int):
        torch = self.torch
        texts = [self.tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages_list]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                      max_new_tokens=max_new_tokens, pad_token_id=self.tok.pad_token_id)
        gen = out[:, enc["input_ids"].shape[1]:]
        return enc, gen, [self.tok.decode(g, skip_special_tokens=True) for g in gen]

    def update(self, enc, gen, advantages: list[float]) -> None:
        torch = self.torch
        ids = torch.cat([enc["input_ids"], gen], dim=1)
        eos, pad = self.tok.eos_token_id, self.tok.pad_token_id
        # reply mask: generated tokens up to and including the first EOS
        mask = torch.ones_like(gen, dtype=torch.float32)
        for i in range(gen.shape[0]):
            hits = ((gen[i] == eos) | (gen[i] == pad)).nonzero()
            if len(hits):
                mask[i, int(hits[0]) + 1:] = 0.0
        attn = torch.cat([enc["attention_mask"], mask.long().clamp(min=1)], dim=1)
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, enc["input_ids"].shape[1] - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        adv = torch.tensor(advantages, dtype=torch.float32).unsqueeze(1)
        loss = -(adv * logp * mask).sum() / mask.sum().clamp(min=1.0)  # token-mean over the batch
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def pass_rates(policy: Policy, pools: dict, rng: random.Random, n: int, max_new_tokens: int) -> dict:
    out = {}
    for fam, pool in pools.items():
        draws = prompts_of(pool, rng, n)
        _, _, texts = policy.sample([m for _, _, m in draws], max_new_tokens)
        out[fam] = sum(sc.grade(t, turn).reward == 1.0 for (sc, turn, _), t in zip(draws, texts)) / n
    return out


def run(stream: list[str], rules: list[str], updates_per_split: int, batch: int, lr: float, seed: int,
        eval_samples: int, max_new_tokens: int, model_dir: str) -> dict:
    families = list(dict.fromkeys(stream + rules))
    pools = {f: rule_pool(f, 40) for f in families}
    policy = Policy(model_dir, lr, seed)
    rng = random.Random(seed)
    eval_rng = random.Random(10_000 + seed)
    b, v = 0.5, 0.25  # REINFORCE++ EMA statistics (claas.rpp: b0, v0)
    beta, v_min = 0.9, 0.01
    rows = [pass_rates(policy, pools, eval_rng, eval_samples, max_new_tokens)]
    print("pi0      ", " ".join(f"{f}={rows[0][f]:.2f}" for f in families), flush=True)
    rewards = []
    for j, fam in enumerate(stream):
        for _ in range(updates_per_split):
            draws = prompts_of(pools[fam], rng, batch)
            enc, gen, texts = policy.sample([m for _, _, m in draws], max_new_tokens)
            r = [float(sc.grade(t, turn).reward or 0.0) for (sc, turn, _), t in zip(draws, texts)]
            for x in r:  # the trainer's EMA is updated with every inserted reward before the update draws them
                b = beta * b + (1 - beta) * x
                v = beta * v + (1 - beta) * (x - b) ** 2
            policy.update(enc, gen, [(x - b) / math.sqrt(max(v, v_min)) for x in r])
            rewards.append(sum(r) / len(r))
        rows.append(pass_rates(policy, pools, eval_rng, eval_samples, max_new_tokens))
        print(f"after {j + 1} ({fam})", " ".join(f"{f}={rows[-1][f]:.2f}" for f in families), flush=True)
    return {"stream": stream, "families": families, "rows": rows, "rewards": rewards, "seed": seed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stream", required=True, help="comma-separated rule family per split")
    p.add_argument("--rules", default="", help="comma-separated families evaluated but not trained")
    p.add_argument("--updates-per-split", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="1")
    p.add_argument("--eval-samples", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--model-dir", default="/tmp/claas_verl_tiny/student")
    p.add_argument("--out", default=None, help="write the runs as JSON here")
    a = p.parse_args(argv)
    stream = [s for s in a.stream.split(",") if s]
    rules = [s for s in a.rules.split(",") if s]
    runs = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        t0 = time.time()
        runs.append(run(stream, rules, a.updates_per_split, a.batch, a.lr, seed, a.eval_samples,
                        a.max_new_tokens, a.model_dir))
        print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
