"""Time of one continual-MOPD replay step on the tiny model, token loss only vs FSAR. Prints figures.

    python benchmarks/bench_replay_step.py --quick          # < 60 s on a shared 2-core machine
    python benchmarks/bench_replay_step.py                  # 8 x (64 prompt + 256 response), W in {128, 256}
    python benchmarks/bench_replay_step.py --breakdown      # + forward / per-term backward split of one update
    python benchmarks/bench_replay_step.py --profile        # + torch.profiler tables of one update per variant
    python benchmarks/bench_replay_step.py --realistic      # Qwen3-1.7B layer shape, V = 151,936 (see below)

One replay step (docs/math.md §B.1-B.7) on a block of ``--batch`` sequences (prompts x n responses), split into
``--micro-batches`` micro-batches weighted n_resp(mb)/n_resp_total (B.7):

1. student top-k: pre-update student forward (no_grad) -> ``student_topk`` (κ = 16), S;
2. teacher forward (no_grad, T = a frozen tiny expert standing in for M_{k-1}) -> ``teacher_logprobs_at`` Q;
   for the FSAR variants the same forward also yields the bf16 alignment targets (``alignment_signals`` +
   ``.as_targets()``: pooled SATS/VR rows on every layer, window hidden states of every layer);
3. advantages: ``topk_rewards`` -> ``domain_normalized_advantages`` over the whole block;
4. update, then ``clip_grad_norm_(1000)`` and one AdamW step (β = (0.9, 0.999), wd 0.01, lr 1e-5):
   (a) token only: per micro-batch one forward + backward of ℓ_tok (a new-domain step, no balancing);
   (b) FSAR, one shared forward: ``balanced_backward(..., single_forward=True)`` with tok/sats/vr/hid closures;
   (c) FSAR, separate passes (the MOPD paper's schedule): the same with ``single_forward=False``;
   (d) FSAR carried: one forward and one backward of Σ α_t·ℓ_t, α the multipliers of (b)'s step just before.

Figures: the median of ``--reps`` repetitions after ``--warmup`` warm-up repetitions, the variants interleaved
within each repetition so machine noise hits them alike; phase split (student top-k, teacher, advantages,
update); ratios to (a) for the whole step and the update alone. ``--agreement`` adds carried vs exact along a short
exact-balanced run (per-term scale error and cosine, multipliers 1-3 steps old).

Departures from the paper's setting (CPU stand-in): everything is fp32; the responses are random token ids with a
step separator about every ``--step-len`` tokens; the tiny model has 4 layers ("all layers" = 4). Threads:
``--threads`` (default 1). Clock: process CPU time by default (``--clock wall`` for elapsed time), because on a
shared machine wall time mostly measures the other jobs. In (c) every pass computes every signal, so (c) is an
upper bound of the MOPD paper's schedule.

Realistic shape (``--realistic``): a random-init Qwen3 with the MOPD paper's student layer shape (hidden 2048,
16 heads, 8 KV heads, head size 128, MLP 6144, vocabulary 151,936, tied embeddings) but ``--layers`` layers
(default 1 and 2), one response of ``--prompt`` + W tokens, W in ``--windows`` (default 512 1024), every layer
aligned. The schedules of ``benchmarks/replay_floor.py``: token only, the worker's exact schedule (separate passes),
the exact floor (one shared forward, one backward per term) and carried, printed beside their FLOP floor. The tied
embedding / LM head is frozen in the student (its 311M-parameter gradient and AdamW state would need ~5 GB more);
this removes one ``[N, V] x [V, D]`` matmul from the token backward only. With two layer counts the script fits
time = a + b·layers per phase and extrapolates the ratios to the 28 layers of Qwen3-1.7B.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from claas_verl.align import (
    alignment_signals,
    balanced_backward,
    hidden_alignment_loss,
    microbatch_weights,
    pooled_rows_loss,
    separator_token_ids,
    step_regions,
)
from claas_verl.distill import (
    domain_normalized_advantages,
    student_topk,
    teacher_logprobs_at,
    topk_distill_loss,
    topk_rewards,
)
from claas_verl.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks import replay_floor as rf  # noqa: E402

KAPPA = 16
TARGET_RATIO = 2.0
VARIANTS = ("tok", "fsar_1fwd", "fsar_sep", "fsar_carried")
LABELS = {"tok": "(a) token only", "fsar_1fwd": "(b) FSAR one forward", "fsar_sep": "(c) FSAR separate passes",
          "fsar_carried": "(d) FSAR carried"}
PHASES = ("student_topk", "teacher", "advantages", "update")

# Process CPU time by default: with one torch thread it counts only the cycles this process got, so the other
# jobs on a shared machine inflate it far less than wall time (--clock wall for the elapsed time).
_now = time.process_time


@contextlib.contextmanager
def _tick(acc: dict, key: str):
    t0 = _now()
    try:
        yield
    finally:
        acc[key] = acc.get(key, 0.0) + _now() - t0


# ----------------------------------------------------------------------------------------------------------------
# inputs


def make_block(batch: int, prompt: int, response: int, vocab: int, sep_ids: list[int], step_len: int, seed: int):
    """A block of left-padded prompts + right-padded responses with a separator about every ``step_len`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt + response), generator=gen)
    am = torch.ones_like(ids)
    for b in range(batch):
        am[b, : int(torch.randint(0, prompt // 4 + 1, (1,), generator=gen))] = 0  # left padding of the prompt
        n_resp = int(torch.randint(response * 3 // 4, response + 1, (1,), generator=gen))
        am[b, prompt + n_resp :] = 0  # right padding of the response
    # separators never fall on padding (step_regions only looks inside the window of valid tokens anyway)
    sep = torch.rand(batch, response, generator=gen) < 1.0 / step_len
    sep_tok = torch.tensor(sep_ids)[torch.randint(0, len(sep_ids), (batch, response), generator=gen)]
    resp = ids[:, prompt:]
    resp[sep] = sep_tok[sep]
    ids = ids.masked_fill(am == 0, 0)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    return ids, am, pos


def split_micro_batches(ids, am, pos, n_mb: int) -> list[dict]:
    b = ids.shape[0]
    if not 1 <= n_mb <= b:
        raise ValueError(f"--micro-batches={n_mb} must be in [1, --batch={b}]")
    bounds = [round(i * b / n_mb) for i in range(n_mb + 1)]
    return [
        {"input_ids": ids[s:e], "attention_mask": am[s:e], "position_ids": pos[s:e], "n_resp": e - s}
        for s, e in zip(bounds[:-1], bounds[1:])
    ]


# ----------------------------------------------------------------------------------------------------------------
# one replay step


def _logits_at_response(logits: torch.Tensor, prompt: int) -> torch.Tensor:
    """``logits[:, t]`` predicts token t+1: the response positions are ``prompt-1 .. T-2``."""
    return logits[:, prompt - 1 : -1]


def prepare(student, teacher, mbs, prompt: int, sep_ids, window: int, fsar: bool, timer: dict) -> None:
    """Phases 1-3 of the step; stores ids/A/mask (and regions, teacher targets for FSAR) in each micro-batch."""
    terms = ("sats", "vr", "hidden")
    t0 = _now()
    with torch.no_grad():
        for mb in mbs:
            out = student(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                          position_ids=mb["position_ids"])
            mb["ids"], mb["S"] = student_topk(_logits_at_response(out.logits, prompt), KAPPA)
            mb["mask"] = mb["attention_mask"][:, prompt:]
            if fsar:
                # regions are computed once on the driver and shared by student and teacher (B.4)
                mb["regions"] = step_regions(mb["input_ids"][:, prompt:], mb["mask"], sep_ids, window).pad_left(prompt)
            del out
    t1 = _now()
    with torch.no_grad():
        for mb in mbs:
            if fsar:
                n_layers = teacher.config.num_hidden_layers
                out, sig = alignment_signals(
                    teacher, mb["input_ids"], mb["attention_mask"], mb["regions"], position_ids=mb["position_ids"],
                    terms=terms, pooled_layers=range(n_layers), hidden_layers=range(n_layers),
                )
                mb["targets"] = sig.as_targets()
            else:
                out = teacher(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                              position_ids=mb["position_ids"])
            mb["Q"] = teacher_logprobs_at(_logits_at_response(out.logits, prompt), mb["ids"])
            del out
    t2 = _now()
    # B.2.2: σ_d over every candidate of the whole block (one domain per replay block)
    S = torch.cat([mb["S"] for mb in mbs])
    Q = torch.cat([mb["Q"] for mb in mbs])
    mask = torch.cat([mb["mask"] for mb in mbs])
    A = domain_normalized_advantages(topk_rewards(S, Q, mask), mask)
    start = 0
    for mb in mbs:
        mb["A"] = A[start : start + mb["n_resp"]]
        start += mb["n_resp"]
    t3 = _now()
    timer["student_topk"], timer["teacher"], timer["advantages"] = t1 - t0, t2 - t1, t3 - t2


def _tok_loss(prompt: int):
    def loss(out, mb):
        logits = out.logits if not isinstance(out, tuple) else out[0].logits
        return topk_distill_loss(_logits_at_response(logits, prompt), mb["ids"], mb["A"], mb["mask"])

    return loss


def _fsar_closures(prompt: int) -> dict:
    """tok/sats/vr/hid closures over the ``(model_output, AlignmentSignals)`` of ONE shared forward."""

    def sats(out, mb):
        s, t = out[1].sats, mb["targets"].sats
        return pooled_rows_loss([s[k] for k in sorted(s)], [t[k] for k in sorted(s)], mb["regions"].num_regions).loss

    def vr(out, mb):
        s, t = out[1].vr, mb["targets"].vr
        return pooled_rows_loss([s[k] for k in sorted(s)], [t[k] for k in sorted(s)], mb["regions"].num_regions).loss

    def hid(out, mb):
        s, t = out[1].hidden, mb["targets"].hidden
        return hidden_alignment_loss([s[k] for k in sorted(s)], [t[k] for k in sorted(s)],
                                     mb["regions"].window_mask).loss

    return {"tok": _tok_loss(prompt), "sats": sats, "vr": vr, "hid": hid}


# Set from --no-recompute: keep the pooled rows' chunk softmax for the backward instead of recomputing it.
RECOMPUTE = True


def _fsar_forward(model, mb):
    n = model.config.num_hidden_layers
    return alignment_signals(
        model, mb["input_ids"], mb["attention_mask"], mb["regions"], position_ids=mb["position_ids"],
        pooled_layers=range(n), hidden_layers=range(n), recompute=RECOMPUTE,
    )


def update(variant: str, model, opt, mbs, prompt: int, mults: dict | None = None) -> dict:
    """Phase 4: gradient into ``.grad``, clip at 1000, one AdamW step. Returns balancing metrics (FSAR)."""
    weights = microbatch_weights([mb["n_resp"] for mb in mbs])
    opt.zero_grad(set_to_none=True)
    metrics = {}
    if variant == "tok":
        loss_fn = _tok_loss(prompt)
        for mb, w in zip(mbs, weights):
            out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                        position_ids=mb["position_ids"])
            (loss_fn(out, mb) * w).backward()
            del out
    else:
        metrics = balanced_backward(model, mbs, weights, _fsar_forward, _fsar_closures(prompt), ratio=1.0, rho=2.0,
                                    single_forward=variant != "fsar_sep",
                                    multipliers=mults if variant == "fsar_carried" else None)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
    opt.step()
    return metrics


def replay_step(variant: str, models: dict, opts: dict, teacher, block, args, sep_ids, window: int,
                mults: dict | None = None) -> tuple[dict, dict]:
    mbs = split_micro_batches(*block, args.micro_batches)
    timer: dict[str, float] = {}
    model = models[variant]
    prepare(model, teacher, mbs, args.prompt, sep_ids, window, variant != "tok", timer)
    t0 = _now()
    metrics = update(variant, model, opts[variant], mbs, args.prompt, mults)
    timer["update"] = _now() - t0
    timer["total"] = sum(timer[p] for p in PHASES)
    return timer, metrics


# ----------------------------------------------------------------------------------------------------------------
# driver


def load_models(paths, teacher_domain: str):
    student = AutoModelForCausalLM.from_pretrained(paths.student, attn_implementation="sdpa").float()
    teacher = AutoModelForCausalLM.from_pretrained(paths.experts[teacher_domain], attn_implementation="sdpa").float()
    teacher.eval().requires_grad_(False)
    student.train()  # dropout is 0 in the tiny config: train() only matters for modules that check it
    return student, teacher


def run_window(window: int, student, teacher, block, args, sep_ids) -> dict[str, dict[str, float]]:
    # each variant updates its own copy with its own AdamW state, so the variants do not perturb each other
    models = {v: copy.deepcopy(student) for v in VARIANTS}
    opts = {v: torch.optim.AdamW(models[v].parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01)
            for v in VARIANTS}
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    mults = None
    for rep in range(args.warmup + args.reps):
        for v in VARIANTS:  # (d) reuses the multipliers of (b)'s step just before it (same block)
            t, m = replay_step(v, models, opts, teacher, block, args, sep_ids, window, mults)
            mults = rf.mults_of(m) if v == "fsar_1fwd" else mults
            if rep >= args.warmup:
                samples[v].append(t)
    return {v: {k: statistics.median(s[k] for s in samples[v]) for k in (*PHASES, "total")} for v in VARIANTS}


def print_window(window: int, med: dict, block, args) -> None:
    am = block[1]
    n_resp_tokens = int(am[:, args.prompt :].sum())
    print(f"\nW = {window}: {args.batch} sequences, {n_resp_tokens} response tokens "
          f"(prompt {args.prompt}, response <= {args.response}), {args.micro_batches} micro-batch(es); "
          f"median of {args.reps} after {args.warmup} warm-up")
    head = f"{'variant':28s}" + "".join(f"{p:>14s}" for p in (*PHASES, "total"))
    print(head)
    for v in VARIANTS:
        print(f"{LABELS[v]:28s}" + "".join(f"{med[v][p] * 1e3:12.1f}ms" for p in (*PHASES, "total")))
    a = med["tok"]
    for v in ("fsar_1fwd", "fsar_sep", "fsar_carried"):
        step, upd = med[v]["total"] / a["total"], med[v]["update"] / a["update"]
        verdict = "meets" if step <= TARGET_RATIO else "misses"
        print(f"{LABELS[v]:28s} / (a): replay step {step:5.2f}x ({verdict} target <= {TARGET_RATIO:.1f}x), "
              f"update {upd:5.2f}x, teacher {med[v]['teacher'] / a['teacher']:5.2f}x")


def breakdown_update(student, teacher, block, args, sep_ids, window: int) -> None:
    """Where one FSAR update's time goes: the single-forward schedule of ``balanced_backward`` re-timed piece by piece.

    Summed over the micro-batches, median of ``--reps``: plain forward and token backward (the whole of update (a)),
    the forward with hidden states only, with every signal (capture + pooled SATS/VR rows), each term's backward on
    the shared graph (in ``balanced_backward``'s order), and the pooled rows alone with and without recomputation.
    """
    from claas_verl.align import balance, combine_aux, pooled_attention_rows
    from claas_verl.align.capture import AttentionCapture

    model = copy.deepcopy(student)
    mbs = split_micro_batches(*block, args.micro_batches)
    prepare(model, teacher, mbs, args.prompt, sep_ids, window, True, {})
    weights = microbatch_weights([mb["n_resp"] for mb in mbs])
    closures = _fsar_closures(args.prompt)
    params = [p for p in model.parameters() if p.requires_grad]
    n = model.config.num_hidden_layers
    keys = ("fwd plain", "bwd tok (plain graph)", "fwd hidden states only", "fwd all signals",
            "bwd tok", "bwd sats", "bwd vr", "bwd hid", "combine+balance",
            "pooled rows fwd+bwd, recompute", "pooled rows fwd+bwd, stored")
    samples = {k: [] for k in keys}

    for rep in range(args.warmup + args.reps):
        t = dict.fromkeys(keys, 0.0)
        acc = {k: [torch.zeros_like(p) for p in params] for k in ("tok", "sats", "vr", "hid")}
        for mb, w in zip(mbs, weights):
            kw = dict(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"])
            with _tick(t, "fwd plain"):
                out = model(**kw)
            with _tick(t, "bwd tok (plain graph)"):
                (closures["tok"](out, mb) * w).backward()
            del out
            model.zero_grad(set_to_none=True)
            with _tick(t, "fwd hidden states only"):
                out = alignment_signals(model, mb["input_ids"], mb["attention_mask"], mb["regions"],
                                        position_ids=mb["position_ids"], terms=("hidden",), hidden_layers=range(n))
            del out
            with _tick(t, "fwd all signals"):
                out = _fsar_forward(model, mb)
            for j, term in enumerate(("tok", "sats", "vr", "hid")):
                with _tick(t, f"bwd {term}"):
                    (closures[term](out, mb) * w).backward(retain_graph=j < 3)
                for a, p in zip(acc[term], params):
                    if p.grad is not None:
                        a.add_(p.grad)
                        p.grad = None
            del out
            # the pooled rows alone (all layers, SATS + VR) on this micro-batch's captured q/k/v
            with AttentionCapture(model, list(range(n))) as cap:
                model(**kw)
            qkv = cap.result()
            rid, num = mb["regions"].region_ids, mb["regions"].num_regions
            for recompute, key in ((True, "pooled rows fwd+bwd, recompute"), (False, "pooled rows fwd+bwd, stored")):
                with _tick(t, key):
                    total = 0.0
                    for layer in range(n):
                        q, k, v = (x.detach().requires_grad_() for x in
                                   (qkv.queries[layer], qkv.keys[layer], qkv.values[layer]))
                        for qq, kk in ((q, k), (v, v)):
                            rows = pooled_attention_rows(qq, kk, mb["attention_mask"], rid, num, recompute=recompute)
                            total = total + rows.rows.pow(2).sum()
                    total.backward()
        with _tick(t, "combine+balance"):
            balance(acc["tok"], combine_aux(acc["sats"], acc["vr"], acc["hid"], 2.0)[0], 1.0)
        if rep >= args.warmup:
            for k in keys:
                samples[k].append(t[k])
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nbreakdown of one FSAR update, W = {window} (sum over micro-batches, median of {args.reps}):")
    for k in keys:
        print(f"  {k:34s} {med[k] * 1e3:9.1f} ms")
    plain = med["fwd plain"] + med["bwd tok (plain graph)"]
    fsar = med["fwd all signals"] + sum(med[f"bwd {x}"] for x in ("tok", "sats", "vr", "hid")) + med["combine+balance"]
    print(f"  token-only fwd+bwd {plain * 1e3:.1f} ms; FSAR one-forward fwd+4 bwd+balance {fsar * 1e3:.1f} ms "
          f"({fsar / plain:.2f}x); signals add {(med['fwd all signals'] - med['fwd hidden states only']) * 1e3:.1f} ms "
          f"to the forward")


def profile_update(student, teacher, block, args, sep_ids, window: int, variant: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    models = {variant: copy.deepcopy(student)}
    opts = {variant: torch.optim.AdamW(models[variant].parameters(), lr=1e-5, weight_decay=0.01)}
    mbs = split_micro_batches(*block, args.micro_batches)
    prepare(models[variant], teacher, mbs, args.prompt, sep_ids, window, variant != "tok", {})
    update(variant, models[variant], opts[variant], mbs, args.prompt)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update(variant, models[variant], opts[variant], mbs, args.prompt)
    print(f"\nprofile of one update, {LABELS[variant]}, W = {window} (self CPU time):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def agreement_trajectory(student, teacher, args, sep_ids, window: int) -> None:
    """Carried vs exact along a short exact-balanced training run of the tiny model, one new block per step.

    At each step the exact gradient is compared with the carried one (one backward of Σ α_t·ℓ_t) whose
    multipliers are those of 1, 2 or 3 steps earlier (what ``balance_refresh`` = 2, 3, 4 carries at most):
    per-term relative error of the scale, and the cosine of the combined gradients. The run steps on the exact one.
    """
    from claas_verl.align.carried import gradient_cosine, multiplier_errors

    model = copy.deepcopy(student)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.01)
    closures, history = _fsar_closures(args.prompt), []
    found: dict[int, list] = {1: [], 2: [], 3: []}
    for step in range(args.agreement_steps):
        block = make_block(args.batch, args.prompt, args.response, student.config.vocab_size, sep_ids,
                           args.step_len, 100 + step)
        mbs = split_micro_batches(*block, args.micro_batches)
        prepare(model, teacher, mbs, args.prompt, sep_ids, window, True, {})
        weights = microbatch_weights([mb["n_resp"] for mb in mbs])
        m = balanced_backward(model, mbs, weights, _fsar_forward, closures, ratio=1.0, rho=2.0)
        g = [p.grad for p in params]
        for lag, rows in found.items():
            if len(history) >= lag:
                balanced_backward(model, mbs, weights, _fsar_forward, closures, multipliers=history[-lag])
                rows.append((multiplier_errors(history[-lag], m), gradient_cosine([p.grad for p in params], g)))
        for p, gi in zip(params, g):
            p.grad = gi
        torch.nn.utils.clip_grad_norm_(params, 1000.0)
        opt.step()
        history.append(rf.mults_of(m))
    print(f"\ncarried vs exact on the tiny model, {args.agreement_steps} exact steps at lr 1e-5, W = {window}:")
    for lag, rows in found.items():
        if not rows:
            continue
        errs = {t: [r[0][t] for r in rows] for t in ("sats", "vr", "hid")}
        cos = [r[1] for r in rows]
        print(f"  multipliers {lag} step(s) old ({len(rows)} steps): scale rel. error median/max " + ", ".join(
            f"{t} {statistics.median(v):.3f}/{max(v):.3f}" for t, v in errs.items())
            + f"; cos(carried, exact) median {statistics.median(cos):.4f}, min {min(cos):.4f}")


# ----------------------------------------------------------------------------------------------------------------
# realistic layer shape

def realistic_models(layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151_936, max_position_embeddings=8192,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    student = Qwen3ForCausalLM(cfg).float().train()
    torch.manual_seed(1)
    teacher = Qwen3ForCausalLM(cfg).float().eval().requires_grad_(False)
    student.get_input_embeddings().weight.requires_grad_(False)  # tied with lm_head: see the module docstring
    return student, teacher


def run_realistic(args, sep_ids) -> None:
    schedules = [s for s in rf.SCHEDULES if s in args.schedules]
    if "carried" in schedules and "exact" not in schedules:
        raise ValueError("--schedules: carried takes its multipliers from the exact step; add exact")
    print(f"\nrealistic layer shape: Qwen3 hidden 2048, 16 heads / 8 KV heads x 128, MLP 6144, V = 151,936, tied "
          f"embeddings (frozen in the student), fp32, 1 response of {args.prompt} prompt + W tokens, κ = {KAPPA}, "
          f"all layers aligned (FSAR), clock = {args.clock}, median of {args.reps} after {args.warmup} warm-up")
    fits: dict[int, dict[int, dict]] = {}
    for layers in args.layers:
        student, teacher = realistic_models(layers)
        for w in args.windows:
            if layers == args.layers[0]:
                rf.print_floor(args.prompt + w)
            block = make_block(1, args.prompt, w, 151_936, sep_ids, args.step_len, 0)
            block[1][:, args.prompt:] = 1  # the whole response is real: the window holds exactly W tokens
            samples: dict[str, list[dict]] = {s: [] for s in schedules}
            for rep in range(args.warmup + args.reps):
                mults = None
                for s in schedules:  # exact runs before carried: carried reuses its multipliers
                    model = copy.deepcopy(student)
                    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                            weight_decay=0.01)
                    t, m = rf.step(s, model, teacher, opt, block, args.prompt, sep_ids, w, _tick, mults=mults)
                    mults = rf.mults_of(m) if s == "exact" else mults
                    del model, opt
                    if rep >= args.warmup:
                        samples[s].append(t)
            med = {s: {k: statistics.median(x.get(k, 0.0) for x in v) for k in (*rf.PHASES, "total")}
                   for s, v in samples.items()}
            fits.setdefault(w, {})[layers] = med
            floor = rf.floor_flops({**rf.REAL_SHAPE, "layers": layers}, args.prompt + w, rf.fsar_layers(layers),
                                   head_trainable=False)
            print(f"\nlayers = {layers}, W = {w}:")
            print(f"{'schedule':20s}" + "".join(f"{k:>16s}" for k in (*rf.PHASES, "total")))
            for s in schedules:
                print(f"{rf.LABELS[s]:20s}" + "".join(f"{med[s][k]:15.2f}s" for k in (*rf.PHASES, "total")))
            tok = med["tok"]["total"]
            print("  / token only: " + ", ".join(f"{rf.LABELS[s]} {med[s]['total'] / tok:.2f}x" for s in schedules
                                                if s != "tok") + f" (FLOP floor: exact {floor['exact_ratio']:.2f}x, "
                  f"carried 1.00x)")
            if args.agreement and layers == args.layers[0] and w == args.windows[0]:
                blocks = [make_block(1, args.prompt, w, 151_936, sep_ids, args.step_len, seed) for seed in (1, 2)]
                for b in blocks:
                    b[1][:, args.prompt:] = 1
                agree = rf.agreement(student, teacher, blocks, args.prompt, sep_ids, w)
                print(f"  agreement (multipliers of one block carried to the next, same weights): {agree}")
        del student, teacher
    if len(args.layers) < 2:
        return
    lo, hi = sorted(args.layers)[:2]
    for w, by_layers in fits.items():
        if lo not in by_layers or hi not in by_layers:
            continue
        ext = {}
        for s in schedules:
            ext[s] = sum(max(by_layers[lo][s][k] + (by_layers[hi][s][k] - by_layers[lo][s][k]) / (hi - lo) * (28 - lo),
                             0.0) for k in rf.PHASES)
        floor = rf.floor_flops({**rf.REAL_SHAPE, "layers": 28}, args.prompt + w, rf.RECIPE_LAYERS["fsar"],
                               head_trainable=False)
        ratios = {s: ext[s] / ext["tok"] for s in schedules}
        line = ", ".join(f"{rf.LABELS[s]} {ratios[s]:.2f}x" for s in schedules if s != "tok")
        print(f"W = {w}: extrapolated to 28 layers (per-phase linear fit over {lo} and {hi} layers): token only "
              f"{ext['tok']:.1f}s; {line}; FLOP floor exact {floor['exact_ratio']:.2f}x, carried 1.00x")
        if "carried" in ratios:
            print("  carried with an exact step every K replay steps: " + ", ".join(
                f"K={k} {rf.amortized(ratios['exact'], ratios['carried'], k):.2f}x" for k in (2, 4, 8)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # defaults: full run / --quick; an explicit flag always wins over both
    full = dict(batch=8, prompt=64, response=256, micro_batches=2, windows=[128, 256], reps=5, warmup=1)
    quick = dict(batch=4, prompt=32, response=128, micro_batches=2, windows=[32, 128], reps=3, warmup=1)
    ap.add_argument("--batch", type=int, help="sequences per replay block (prompts x n responses); 8 (quick 4)")
    ap.add_argument("--prompt", type=int, help="prompt length, left-padded; 64 (quick 32)")
    ap.add_argument("--response", type=int, help="max response length, right-padded; 256 (quick 128)")
    ap.add_argument("--micro-batches", type=int, help="micro-batches per block; 2")
    ap.add_argument("--windows", type=int, nargs="+", help="window sizes W (docs/math.md §B.3); 128 256 (quick 32 128)")
    ap.add_argument("--reps", type=int, help="timed repetitions; 5 (quick 3)")
    ap.add_argument("--warmup", type=int, help="untimed repetitions first; 1")
    ap.add_argument("--step-len", type=int, default=32, help="mean tokens per reasoning step")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--no-recompute", action="store_true",
                    help="student pooled rows keep their chunk softmax for the backward (faster where it fits)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: process CPU time (robust on a shared machine; with --threads > 1 it sums threads); "
                         "wall: elapsed time")
    ap.add_argument("--teacher-domain", default="math")
    ap.add_argument("--quick", action="store_true", help="smaller block and fewer repetitions (< 60 s)")
    ap.add_argument("--breakdown", action="store_true", help="also time forward / per-term backward of one update")
    ap.add_argument("--profile", action="store_true", help="also profile one update of (a), (b) and (c)")
    ap.add_argument("--profile-rows", type=int, default=18)
    ap.add_argument("--realistic", action="store_true",
                    help="only the realistic layer shape (hidden 2048, V = 151,936); defaults W 512 1024, layers 2 4")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="layer counts of --realistic")
    ap.add_argument("--schedules", nargs="+", default=list(rf.SCHEDULES), choices=rf.SCHEDULES,
                    help="schedules of --realistic (benchmarks/replay_floor.py); carried needs exact")
    ap.add_argument("--agreement", action="store_true",
                    help="carried vs exact agreement: the tiny model's trajectory, or (--realistic) one pair of "
                         "blocks at the first layer count and W")
    ap.add_argument("--agreement-steps", type=int, default=8, help="exact steps of the tiny trajectory")
    args = ap.parse_args(argv)
    if args.realistic:
        full = dict(batch=1, prompt=64, response=0, micro_batches=1, windows=[512, 1024], reps=1, warmup=0)
        quick = dict(full, windows=[256], prompt=32)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    global _now
    _now = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    global RECOMPUTE
    RECOMPUTE = not args.no_recompute
    torch.manual_seed(0)

    paths = ensure_tiny()
    tokenizer = AutoTokenizer.from_pretrained(paths.student)
    sep_ids = sorted(separator_token_ids(tokenizer))
    if not sep_ids:
        raise ValueError("the tiny tokenizer has no step separator id (blank line or </think>)")
    if args.realistic:
        run_realistic(args, sep_ids)
        return
    student, teacher = load_models(paths, args.teacher_domain)
    block = make_block(args.batch, args.prompt, args.response, student.config.vocab_size, sep_ids, args.step_len, 0)
    print(f"tiny Qwen2 ({student.config.num_hidden_layers} layers, hidden {student.config.hidden_size}, "
          f"vocab {student.config.vocab_size}, {sum(p.numel() for p in student.parameters())} params), "
          f"teacher = expert '{args.teacher_domain}', κ = {KAPPA}, torch threads = {torch.get_num_threads()}, "
          f"fp32, separators {sep_ids}, clock = {args.clock}")
    for w in args.windows:
        med = run_window(w, student, teacher, block, args, sep_ids)
        print_window(w, med, block, args)
    if args.breakdown:
        breakdown_update(student, teacher, block, args, sep_ids, max(args.windows))
    if args.agreement:
        agreement_trajectory(student, teacher, args, sep_ids, max(args.windows))
    if args.profile:
        for v in VARIANTS[:3]:
            profile_update(student, teacher, block, args, sep_ids, max(args.windows), v)


if __name__ == "__main__":
    main()
