"""Will a student learn a gym domain in one MOPD stage? The stage's math outside the trainer, in minutes.

    python benchmarks/mopd_stage_proxy.py                                  # the recipes' Seq: reverse -> spell -> palin
    python benchmarks/mopd_stage_proxy.py --order reverse --steps 36       # one longer stage
    python benchmarks/mopd_stage_proxy.py --steps 36 --eval-every 12       # longer stages, scored every 12 steps
    python benchmarks/mopd_stage_proxy.py --student DIR --experts DIR      # a candidate student / experts
    python benchmarks/mopd_stage_proxy.py --replay-every 3                  # Replay-KL's shared budget (m = 3)

A whole benchmark run is an hour; choosing a bundle design needs an answer in minutes (the bundle's three stages
here: a few CPU-minutes). Each stage step is the trainer's per-step math (``claas_verl.distill.topk``, docs/math.md
§B.2):
``prompts`` train prompts of the domain × ``replies`` replies sampled from the student at τ = 1 (at most 40 tokens,
like ``recipes/mopd/train/gym.yaml``), the student's top-κ candidates and log-probs at θ_old, the expert's log-probs
at them, eq. (4) rewards, per-domain σ normalisation, the eq. (5) loss and one AdamW update (no warm-up unless
``--warmup N``, weight decay 0.01, gradient clip 1000: the recipe's optimiser, fresh every stage). Before and after
every stage the student is scored on every domain with the benchmark's own evaluator
(``claas_verl/mopd/eval/gym_snapshots.py``:
``--eval-replies`` replies per held-out prompt, τ = 1, reasoning-gym's scorer, and the exact KL to each domain's
expert). ``--eval-every N`` also scores the stage's own domain after every N updates (a learning curve in one run;
every step seeds its own samples, so the stage trains exactly as without it); each stage's line gives its training
seconds per step (scoring excluded).

It is a proxy, not the trainer: one process, Hugging Face ``generate`` for the rollouts, no Ray, FSDP or verl
batching. Checked against the trainer on the version-2 bundle (seed 0 here, the benchmark's seeds there): both
lifted ``spell`` from about 0.26-0.27 to 0.31-0.32 in its 12 steps and left ``reverse`` at 0.000.

The bundle designs it chose between (a longer-trained π0, a wider student, other reasoning-gym families, a π0 that
answers by a neighbouring rule) were built by its ``--build-*`` options up to commit 63d8f72; the one chosen is
now the bundle's own recipe (``claas_verl/tiny/gym.py``), and docs/benchmark.md, "How the bundle was chosen",
keeps their measurements.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host import host_signature  # noqa: E402
from benchmarks.mopd_proxy_steps import (  # noqa: E402
    PROBE_PROMPTS,
    PROBE_REPLIES,
    PROBE_SEED,
    FixedProbe,
    Optimisers,
    ReplayArm,
    parameters_copy,
    step_record,
    update_norm,
)
from claas_verl.distill.topk import (  # noqa: E402
    domain_advantages_and_stds,
    student_topk,
    teacher_logprobs_at,
    topk_distill_loss,
    topk_rewards,
)
from claas_verl.metrics.benchmark import run_metrics  # noqa: E402
from claas_verl.mopd.eval.gym_snapshots import (  # noqa: E402
    load_model,
    response_logits,
    right_padded,
    sample_replies,
    score_snapshot,
)
from claas_verl.schedule.budgets import replay_cycle  # noqa: E402
from claas_verl.tiny import gym  # noqa: E402

MAX_RESPONSE_TOKENS = 40  # recipes/mopd/train/gym.yaml max_response_length


def recipe_order() -> list[str]:
    """The gym recipes' stage order (``recipes/mopd/data/gym.yaml``)."""
    from omegaconf import OmegaConf

    from claas_verl.paths import recipes_dir

    return list(OmegaConf.load(Path(recipes_dir()) / "mopd" / "data" / "gym.yaml").mopd.order)


def read_rows(root: Path, domain: str, split: str) -> list[dict]:
    import pandas as pd

    return pd.read_parquet(gym.GymPaths(root).data(domain, split)).to_dict("records")


def stage(student, expert, tok, rows: list[dict], *, steps: int, prompts: int, replies: int, topk: int, lr: float,
          seed: int, blocks: list[list[dict]] | None = None, timings: list[dict] | None = None,
          after_step=None, warmup: int = 0, temperature: float = 1.0,
          replay: list[tuple[torch.nn.Module, list[dict]]] | None = None, replay_every: int = 0,
          replay_kls: list[float] | None = None, replay_std_floor: float = 0.0, arm: ReplayArm | None = None,
          records: list[dict] | None = None, probe: FixedProbe | None = None, stage_no: int = 1,
          domain: str = "new", replay_domains: list[str] | None = None) -> list[float]:
    """``steps`` MOPD updates of ``student`` (in place) toward ``expert`` on ``rows``; the per-step top-κ weighted
    KL (Σ_v −r on the student's samples, token mean) before each update.

    ``blocks``: step ``i`` uses exactly the prompts ``blocks[i]`` (the trainer's plan blocks) instead of ``prompts``
    rows drawn from ``rows``. ``timings``: one dict per step is appended, the seconds of its phases (``gen``,
    ``old_log_prob`` (student top-κ), ``teacher`` (expert log-probs, rewards, advantages), ``update_actor``) and
    ``step``, with the number of reply tokens (``response_tokens``). ``after_step(i)``: called after update ``i``
    (1-based) with the student in eval mode, e.g. to score it mid-stage; the stage resumes in the same state.
    ``temperature``: the rollout τ, used for the samples and, as in the trainer, inside every log-softmax of the
    math (``log_softmax(logits / τ)``, docs/math.md §0).

    ``replay``: (teacher, rows) of the earlier domains; after every ``replay_every`` updates one more update on
    ``prompts`` rows of the next earlier domain in turn (``arm.cycle``: ``claas_verl.schedule.budgets.replay_cycle``),
    toward its teacher (the shared budget, ``claas_verl.schedule.budgets.shared_replay``: docs/math.md §B.8; taught
    by M_{k-1}: §B.1). Replay steps draw their prompts and samples from their own seeds, so the new-domain steps
    see exactly the prompts and seeds they see without replay; they share the stage's optimiser (``arm.optimizer``
    = separate: their own AdamW state, fresh every stage), and neither ``kls`` nor ``timings`` nor ``after_step``
    sees them: ``replay_kls`` gets their KL to their teacher instead. ``replay_std_floor``: replay steps divide
    their rewards by ``max(σ_d, floor)`` (``mopd.train.replay_std_floor``; 0: σ_d, the paper). ``arm``: the
    replay arm's other settings (:class:`ReplayArm`; the default is the paper's replay).

    ``records``: one dict per step, new and replay, in execution order (the trainer's ``steps.jsonl`` fields,
    :func:`benchmarks.mopd_proxy_probe.step_record`; ``global_step`` counts within the stage from 1, the caller
    offsets it); with ``probe`` each also carries the fixed probe's KL after the step. ``stage_no``, ``domain``
    and ``replay_domains`` (the names of ``replay``'s entries) name the steps there; ``block`` is the step's index
    among the stage's steps of its kind (the proxy draws prompts, it has no blocks)."""
    if blocks is not None and len(blocks) < steps:
        raise ValueError(f"stage: {steps} steps but only {len(blocks)} blocks")
    arm = arm or ReplayArm()
    from claas_verl.utils.generation import eos_token_ids

    eos = eos_token_ids(student, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    rng = random.Random(seed)
    opts = Optimisers(student, lr, arm, warmup)
    replay_rng = random.Random(seed + 7_919)
    n_replay = steps // replay_every if replay and replay_every else 0
    cycle = [int(i) for i in replay_cycle([str(i) for i in range(len(replay or []))], n_replay, arm.cycle)]
    plan = []  # (update seed, teacher, prompts, index of the new-domain step or None for a replay step, replay index)
    for step in range(steps):
        plan.append((seed * 100_003 + step, expert, blocks[step] if blocks is not None else rng.sample(rows, prompts),
                     step, None))
        if n_replay and (step + 1) % replay_every == 0:
            r = (step + 1) // replay_every - 1
            old_teacher, old_rows = replay[cycle[r]]
            plan.append((seed * 100_003 + 50_000 + r, old_teacher, replay_rng.sample(old_rows, prompts), None, r))
    kls = []
    for global_step, (update_seed, teacher, step_rows, step, r) in enumerate(plan, 1):
        clock = _PhaseClock()
        torch.manual_seed(update_seed)
        batch = []
        student.eval()
        n_replies = replies if step is not None else (arm.replies or replies)
        for row in step_rows:
            text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
            prompt_ids = tok.encode(text, add_special_tokens=False)
            sampled = sample_replies(student, prompt_ids, n_replies, MAX_RESPONSE_TOKENS, temperature, eos, pad)
            batch.append((prompt_ids, right_padded(prompt_ids, sampled, pad)))
        clock.lap("gen")
        # θ_old candidates and rewards for the whole step first (the trainer's order), then one update
        prepared, top, rewards, masks = [], [], [], []
        with torch.no_grad():
            for prompt_ids, (ids, attn, resp) in batch:
                P = len(prompt_ids)
                cand, S = student_topk(response_logits(student, ids, attn, P), topk, temperature=temperature)
                prepared.append((P, ids, attn, resp, cand))
                top.append(S)
            clock.lap("old_log_prob")
            for (P, ids, attn, resp, cand), S in zip(prepared, top):
                Q = teacher_logprobs_at(response_logits(teacher, ids, attn, P), cand, temperature=temperature)
                rewards.append(topk_rewards(S, Q, resp))
                masks.append(resp)
        # σ_d over the whole step's responses (one domain): concatenate the ragged [B, T, K] rewards along T-padding
        T = max(r.shape[1] for r in rewards)
        r_all = torch.cat([torch.nn.functional.pad(r, (0, 0, 0, T - r.shape[1])) for r in rewards])
        m_all = torch.cat([torch.nn.functional.pad(m, (0, T - m.shape[1])) for m in masks])
        kl = float(-(r_all.sum(-1) * m_all).sum() / m_all.sum())
        if step is not None:
            kls.append(kl)
        elif replay_kls is not None:
            replay_kls.append(kl)
        adv, stds = domain_advantages_and_stds(r_all, m_all, sync=False,
                                               std_floor=replay_std_floor if step is None else 0.0)
        if step is None and arm.weight != 1.0:
            adv = adv * arm.weight  # E4: a constant down-weighting of replay, after σ_d
        clock.lap("teacher")
        before = parameters_copy(student) if records is not None else None
        opt, sched = opts.for_step(replay=step is None)
        student.train()
        opt.zero_grad()
        n_tokens = m_all.sum()
        row0 = 0
        for P, ids, attn, resp, cand in prepared:
            B, Tp = resp.shape
            logits = response_logits(student, ids, attn, P)
            loss = topk_distill_loss(logits, cand, adv[row0: row0 + B, :Tp], resp, global_tokens=n_tokens,
                                     temperature=temperature)
            loss.backward()
            row0 += B
        grad_norm = float(torch.nn.utils.clip_grad_norm_(student.parameters(), 1000.0))
        opt.step()
        sched.step()
        clock.lap("update_actor")
        if records is not None:
            metrics = {"mopd/kl_topk": kl, "mopd/adv_std": stds[0]["std"], "mopd/adv_sigma": stds[0]["scale"],
                       "mopd/reward_count": stds[0]["count"], "actor/grad_norm": grad_norm,
                       "mopd/update_norm": update_norm(before, student), **arm.logged(step is None, n_replies)}
            if probe is not None:
                metrics.update(probe.kl(student))
            kind, name = ("new", domain) if step is not None else ("replay", (replay_domains or [])[cycle[r]]
                                                                  if replay_domains else str(cycle[r]))
            teacher_name = f"expert:{domain}" if step is not None else f"student:{stage_no - 1}"
            records.append(step_record(global_step, stage_no, kind, name, step if step is not None else r,
                                       teacher_name, metrics))
        if step is None:
            continue
        if timings is not None:
            timings.append({**clock.phases, "step": clock.total(), "response_tokens": int(m_all.sum())})
        if after_step is not None:
            student.eval()
            after_step(step + 1)  # every step seeds its own samples: scoring here changes none of the stage's
    student.eval()
    return kls


class _PhaseClock:
    """Seconds per named phase of one step, each lap measured from the previous one."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def score_all(student, student_dir: str, experts: dict, root: Path, domains: list[str], replies: int) -> dict:
    out = {}
    for d in domains:
        s = score_snapshot(student_dir, read_rows(root, d, "test"), expert_path=None, n=replies,
                           max_new_tokens=MAX_RESPONSE_TOKENS, temperature=1.0, seed=0, tag=f"proxy/{d}",
                           model=student, expert=experts[d])
        out[d] = (round(s.score, 3), round(s.kl, 2))
    return out


def stage_probe(reference, tok, root: Path, domains: list[str], prompts: int) -> FixedProbe:
    """The stage's fixed probe: the first ``prompts`` held-out prompts of every domain learned so far (the stage's
    own included), :data:`PROBE_REPLIES` replies each sampled from ``reference`` (M_{k-1}, the student as the stage
    starts) with seed :data:`PROBE_SEED`."""
    from claas_verl.utils.generation import eos_token_ids

    eos = eos_token_ids(reference, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    by_domain = {}
    for d in domains:
        texts = [tok.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False)
                 for r in read_rows(root, d, "test")[:prompts]]
        by_domain[d] = [tok.encode(t, add_special_tokens=False) for t in texts]
    return FixedProbe(reference, by_domain, replies=PROBE_REPLIES, seed=PROBE_SEED,
                      max_new_tokens=MAX_RESPONSE_TOKENS, eos_ids=eos, pad_id=pad)


def run_json(settings: dict, order: list[str], table: list[dict], own_expert: dict[str, float], records: list[dict],
             stage_seconds: list[float], seconds: float) -> dict:
    """The ``--json`` document: the settings, the stage-end table (accuracy, KL to the domain's expert), the
    benchmark's ``run_metrics`` on it (π0 = the start row; Norm's best expert = each domain's own, the only expert
    the proxy scores on it) and the step records."""
    stage_scores = {k: {d: table[k][d][0] for d in order[:k]} for k in range(1, len(order) + 1)}
    base = {d: table[0][d][0] for d in order}
    metrics = run_metrics(stage_scores, order, base=base, experts={"own": own_expert})
    return {"settings": settings, "order": list(order), "table": table, "expert_own_domain": own_expert,
            "stage_scores": stage_scores, "metrics": metrics, "stage_train_seconds": stage_seconds,
            "seconds": round(seconds, 1), "host": host_signature(), "steps": records}


def majority_answer_score(root: Path, domain: str) -> tuple[str, float]:
    """The domain's most common train answer and its held-out score when given to every prompt: what a student
    that collapsed to one answer scores (``syll``: "Yes", 0.688), so that a stage's gain is read against it."""
    from collections import Counter

    from claas_verl.mopd.data.gym_score import score_reasoning_gym

    answer, _ = Counter(r["extra_info"]["reference"] for r in read_rows(root, domain, "train")).most_common(1)[0]
    test = read_rows(root, domain, "test")
    return answer, round(sum(score_reasoning_gym(answer, r["extra_info"]) for r in test) / len(test), 3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gym-dir", default=None, help="bundle with the data (default $CLAAS_GYM_DIR, built if missing)")
    ap.add_argument("--student", default=None, help="student to train (default: the bundle's π0)")
    ap.add_argument("--experts", default=None, help="folder with one expert per domain (default: the bundle's)")
    ap.add_argument("--order", default=None, help="stages, comma-separated domains (default: the recipes')")
    ap.add_argument("--steps", type=int, default=12, help="updates per stage (the benchmark: 12)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (the benchmark's block_size)")
    ap.add_argument("--replies", type=int, default=4, help="replies per prompt")
    ap.add_argument("--topk", type=int, default=128, help="κ (the gym recipes: 128)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="rollout τ of the stages (the gym recipes: 1); scoring stays at τ = 1")
    ap.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="linear lr warm-up over the stage's first N updates (0: none, the recipes')")
    ap.add_argument("--eval-replies", type=int, default=4, help="replies per held-out prompt when scoring")
    ap.add_argument("--eval-every", type=int, default=0, metavar="N",
                    help="also score the stage's own domain after every N updates (0: only at stage ends)")
    ap.add_argument("--replay-every", type=int, default=0, metavar="M",
                    help="from stage 2, one replay step toward M_{k-1} after every M new-domain steps, cycling over "
                         "the earlier domains (Replay-KL, shared budget; the gym recipes: 3); 0: Seq, no replay")
    ap.add_argument("--replay-std-floor", type=float, default=0.0, metavar="S",
                    help="replay steps divide their rewards by max(σ_d, S) (mopd.train.replay_std_floor); 0: the paper")
    ap.add_argument("--replay-replies", type=int, default=None, metavar="R",
                    help="replies per prompt on replay steps only (default: --replies; the plan's E2: 16)")
    ap.add_argument("--beta1", type=float, default=0.9, metavar="B",
                    help="AdamW β1 on every step, Seq included (the recipes: 0.9; the plan's E3a: 0)")
    ap.add_argument("--replay-optimizer", choices=("shared", "separate"), default="shared",
                    help="shared: one AdamW state for every step of a stage (the paper); separate: replay steps keep "
                         "their own AdamW state, fresh every stage")
    ap.add_argument("--replay-weight", type=float, default=1.0, metavar="C",
                    help="replay steps' advantages x C after σ_d (1: the paper)")
    ap.add_argument("--replay-cycle", choices=("forward", "reversed"), default="forward",
                    help="order of a stage's replay steps over the earlier domains: forward (the paper) or reversed "
                         "(the first domain replayed last; differs from forward in stages >= 3)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the run as JSON: settings, the stage-end table, run_metrics (forgetting, final "
                         "average, gains) and one record per step with the trainer's steps.jsonl fields, including "
                         "the fixed probe's KL to M_{k-1} after every step (mopd/probe_kl/<domain>)")
    ap.add_argument("--probe-prompts", type=int, default=PROBE_PROMPTS, metavar="N",
                    help="held-out prompts per domain of the --json probe (the plan: 16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "prompts", "replies", "topk", "eval_replies"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.eval_every < 0:
        raise SystemExit(f"--eval-every must be 0 or positive; got {args.eval_every}")
    if args.replay_every < 0:
        raise SystemExit(f"--replay-every must be 0 (no replay) or positive; got {args.replay_every}")
    if not 0 <= args.replay_std_floor < float("inf"):
        raise SystemExit(f"--replay-std-floor must be 0 (none) or positive; got {args.replay_std_floor}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be 0 or positive; got {args.warmup}")
    if args.lr <= 0:
        raise SystemExit(f"--lr must be positive; got {args.lr}")
    if args.probe_prompts < 1:
        raise SystemExit(f"--probe-prompts must be at least 1; got {args.probe_prompts}")
    try:
        arm = ReplayArm(replies=args.replay_replies, optimizer=args.replay_optimizer, weight=args.replay_weight,
                        cycle=args.replay_cycle, beta1=args.beta1)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not args.replay_every and arm != ReplayArm(beta1=arm.beta1):
        raise SystemExit("--replay-replies/--replay-optimizer/--replay-weight/--replay-cycle change replay steps: "
                         "give --replay-every M too (without it the run is Seq and has none)")
    t0 = time.time()
    root = gym.ensure_gym(args.gym_dir).root
    domains = list(gym.DOMAIN_NAMES)
    order = [d for d in (args.order or ",".join(recipe_order())).split(",") if d]
    unknown = sorted(set(order) - set(domains))
    if unknown or not order:
        raise SystemExit(f"--order: unknown domain(s) {unknown or order}; choose from {domains}")
    student_dir = Path(args.student) if args.student else gym.GymPaths(root).student
    experts_dir = Path(args.experts) if args.experts else gym.GymPaths(root).root / "experts"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student_dir)
    student = load_model(str(student_dir))
    experts = {d: load_model(str(experts_dir / d)) for d in domains}
    torch.set_num_threads(1)
    table = [{"after": "start", **score_all(student, str(student_dir), experts, root, domains, args.eval_replies)}]
    print(f"student: {sum(p.numel() for p in student.parameters()):,} parameters ({student_dir})")
    own = {d: score_all(experts[d], str(experts_dir / d), experts, root, [d], args.eval_replies)[d][0]
           for d in domains}
    print("experts on their own domain: " + ", ".join(f"{d} {own[d]}" for d in domains))
    print("one answer to every prompt (the most common train answer): " + ", ".join(
        f"{d} {a!r} {v}" for d in domains for a, v in [majority_answer_score(root, d)]))
    print("start: " + json.dumps(table[0]), flush=True)
    records: list[dict] = []
    stage_seconds: list[float] = []
    for k, d in enumerate(order, 1):
        rows = read_rows(root, d, "train")
        if args.prompts > len(rows):
            raise SystemExit(f"--prompts {args.prompts}: {d} has only {len(rows)} train prompts")
        curve, scoring = [], [0.0]

        def mid_stage(i, d=d, curve=curve, scoring=scoring):
            if args.eval_every and i % args.eval_every == 0 and i < args.steps:
                t = time.time()
                curve.append((i, score_all(student, str(student_dir), experts, root, [d], args.eval_replies)[d][0]))
                scoring[0] += time.time() - t

        replay = None
        if args.replay_every and k > 1:
            previous = copy.deepcopy(student).eval()  # M_{k-1}, frozen for the whole stage
            replay = [(previous, read_rows(root, old, "train")) for old in order[:k - 1]]
        replay_kls: list[float] = []
        stage_records: list[dict] | None = [] if args.json else None
        probe = stage_probe(student, tok, root, order[:k], args.probe_prompts) if args.json else None
        t_stage = time.time()
        kls = stage(student, experts[d], tok, rows, steps=args.steps, prompts=args.prompts,
                    replies=args.replies, topk=args.topk, lr=args.lr, seed=args.seed * 1000 + k,
                    after_step=mid_stage, warmup=args.warmup, temperature=args.temperature,
                    replay=replay, replay_every=args.replay_every, replay_kls=replay_kls,
                    replay_std_floor=args.replay_std_floor, arm=arm, records=stage_records, probe=probe,
                    stage_no=k, domain=d, replay_domains=list(order[:k - 1]))
        train_s = time.time() - t_stage - scoring[0]
        if stage_records is not None:
            for rec in stage_records:
                rec["global_step"] += len(records)  # the run's step count, from 1, as in the trainer
            records.extend(stage_records)
            stage_seconds.append(round(train_s, 1))
        row = {"after": f"{k}:{d}", **score_all(student, str(student_dir), experts, root, domains,
                                                 args.eval_replies)}
        table.append(row)
        mid = "".join(f" {d} after {i}: {a:.3f};" for i, a in curve)
        n_replay = len(replay_kls)
        if replay_kls:
            mid += " replay KL to M_{k-1}: " + " ".join(f"{x:.2f}" for x in replay_kls) + ";"
        print(f"stage {k} ({d}, {args.steps} steps + {n_replay} replay in {train_s:.0f} s, "
              f"{train_s / (args.steps + n_replay):.1f} s/step, top-κ KL "
              f"{kls[0]:.2f} -> {kls[-1]:.2f}):{mid} " + json.dumps(row) + f"  [{time.time() - t0:.0f} s]",
              flush=True)
    print("\n| after | " + " | ".join(f"{d} (acc, KL to E_{d})" for d in domains) + " |")
    print("|---|" + "---|" * len(domains))
    for row in table:
        print(f"| {row['after']} | " + " | ".join(f"{row[d][0]:.3f}, {row[d][1]:.2f}" for d in domains) + " |")
    if args.json:
        out = run_json(vars(args), order, table, own, records, stage_seconds, time.time() - t0)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}: forgetting {out['metrics']['forgetting']}, final average "
              f"{out['metrics']['final_avg']:.3f}, {len(records)} step records")


if __name__ == "__main__":
    main()
