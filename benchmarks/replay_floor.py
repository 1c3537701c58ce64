"""The aligned replay step at its floor: FLOP model, the four schedules at a realistic layer shape, and agreement.

Used by ``benchmarks/bench_replay_step.py --realistic`` (CPU) and by the ``replay_step_ratios`` check of
``benchmarks/gpu_acceptance.py`` (GPU). One replay step on one response (docs/math.md §B.1-B.7), four schedules:

* ``tok``: token only: student top-κ forward (no grad), teacher log-prob forward, advantages, one token forward +
  backward, clip, AdamW;
* ``worker``: what ``MOPDTrainingWorker.balanced_engine_step`` runs with ``mopd.signal.passes: separate``: the token
  pass, then a teacher target forward (no logits) and per term one student forward (that term's signals, no
  logits) + backward, then ``combine_aux`` + ``balance``;
* ``exact``: the floor schedule of exact balancing, which the worker runs with ``mopd.signal.passes: shared``
  (the default; ``claas_verl/mopd/trainer/balanced_passes.py`` and ``teacher_pass.py``): ONE teacher forward
  gives the log-probs and the targets, ONE student forward gives the logits and every signal, then one backward
  per term on that graph
  (``balanced_backward(single_forward=True)``: a term read at layer ℓ back-propagates through layers ≤ ℓ only and
  never through the LM head, because autograd only visits the nodes the term depends on);
* ``carried``: the same forwards, then ONE backward of ``Σ_t α_t·ℓ_t`` with the multipliers of an earlier exact
  step (``balanced_backward(multipliers=...)``, :mod:`claas_verl.align.carried`).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from claas_verl.align import (
    alignment_losses,
    alignment_signals,
    balance,
    balanced_backward,
    combine_aux,
    step_regions,
)
from claas_verl.align.carried import gradient_cosine, multiplier_errors
from claas_verl.distill import (
    domain_normalized_advantages,
    student_topk,
    teacher_logprobs_at,
    topk_distill_loss,
    topk_rewards,
)

KAPPA = 16
SCHEDULES = ("tok", "worker", "exact", "carried")
LABELS = {"tok": "token only", "worker": "exact, separate", "exact": "exact, floor (shared)", "carried": "carried"}
PHASES = ("student_topk", "teacher_logp", "teacher_targets", "advantages", "update", "clip+adamw")
TERMS = ("sats", "vr", "hidden")

# ----------------------------------------------------------------------------------------------------------------
# the FLOP floor


def layer_flops(hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int, tokens: int) -> dict[str, float]:
    """Forward FLOPs per token of one decoder layer: its matmuls (2 per multiply-add) and causal attention at
    mean context T/2. ``qk``/``v`` are the projections a pooled term reads (SATS: q, k; VR: v)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    parts = {"qk": 2 * hidden * (q + kv), "v": 2 * hidden * kv, "o": 2 * q * hidden, "mlp": 2 * 3 * hidden * mlp,
             "attn": 2 * 2 * (tokens / 2) * q}
    parts["layer"] = sum(parts.values())
    return parts


def floor_flops(shape: dict, tokens: int, layers_by_term: dict[str, list[int]], head_trainable: bool = True) -> dict:
    """FLOPs of one replay step on ``tokens`` tokens at its floor (docs/performance.md, "The floor").

    ``shape``: hidden, mlp, heads, kv_heads, head_dim, layers, vocab. A backward is twice its forward (input and
    weight gradients; the input gradient only for a frozen LM head). Token only = student top-κ forward + teacher
    forward + token forward + token backward (decoder and head). Exact floor = token only + one backward per term
    through the layers up to the deepest layer it reads (a pooled term: the layers below it and, in that layer,
    the projections it reads; the hidden term: the layers up to and including it); no LM head, no forward.
    Carried floor = token only: its one backward of Σ α_t·ℓ_t visits every layer once. The pooled rows and the
    losses themselves (O(W·T) per head) are left out.
    """
    lf = layer_flops(shape["hidden"], shape["mlp"], shape["heads"], shape["kv_heads"], shape["head_dim"], tokens)
    L, per_layer = shape["layers"], lf["layer"] * tokens
    head = 2 * shape["hidden"] * shape["vocab"] * tokens
    fwd = L * per_layer + head
    tok_bwd = 2 * L * per_layer + (2 if head_trainable else 1) * head
    token_only = 3 * fwd + tok_bwd
    term_bwd = {}
    for term, layers in layers_by_term.items():
        top = max(layers)
        if term == "hidden":
            term_bwd[term] = 2 * (top + 1) * per_layer
        else:
            read = lf["qk"] if term == "sats" else lf["v"]
            term_bwd[term] = 2 * top * per_layer + 2 * read * tokens
    exact = token_only + sum(term_bwd.values())
    return {"token_only": token_only, "forward": fwd, "tok_backward": tok_bwd, "term_backward": term_bwd,
            "exact_floor": exact, "exact_ratio": exact / token_only, "carried_ratio": 1.0}


REAL_SHAPE = dict(hidden=2048, mlp=6144, heads=16, kv_heads=8, head_dim=128, vocab=151_936)  # Qwen3-1.7B
SHAPE_8B = dict(hidden=4096, mlp=12288, heads=32, kv_heads=8, head_dim=128, vocab=151_936, layers=36)  # Qwen3-8B
# the aligned layers of the recipes (recipes/mopd/signal/*.yaml), for 28 layers
RECIPE_LAYERS = {"fsar": {t: list(range(28)) for t in ("sats", "vr", "hidden")},
                 "kl_sats": {"sats": [6, 13, 20, 27]}, "kl_oprd": {"hidden": list(range(28))}}


def print_floor(tokens: int) -> None:
    """The FLOP floor of the recipes at 28 Qwen3-1.7B layers (frozen LM head, as measured here) and at Qwen3-8B."""
    print(f"floor (FLOPs, {tokens} tokens; docs/performance.md): exact = token only + one backward per term through "
          "the layers it reads; carried = token only")
    for name, by_term in RECIPE_LAYERS.items():
        f17 = floor_flops({**REAL_SHAPE, "layers": 28}, tokens, by_term, head_trainable=False)
        by8 = {t: [round(x * 35 / 27) for x in ls] for t, ls in by_term.items()}  # the same depth fractions
        f8 = floor_flops(SHAPE_8B, tokens, by8, head_trainable=True)
        per = ", ".join(f"{t} {v / 1e12:.2f}" for t, v in f17["term_backward"].items())
        print(f"  {name:8s} 1.7B x 28: token only {f17['token_only'] / 1e12:.2f} TFLOP, term backwards {per} -> "
              f"exact floor {f17['exact_ratio']:.2f}x | 8B x 36 (head trained): {f8['exact_ratio']:.2f}x")


def fsar_layers(layers: int) -> dict:
    """FSAR at ``layers`` layers: every term on every layer."""
    return {t: list(range(layers)) for t in ("sats", "vr", "hidden")}


def amortized(exact: float, carried: float, refresh: int) -> float:
    """The mean ratio of carried balancing with an exact step every ``refresh`` replay steps."""
    return (exact + (refresh - 1) * carried) / refresh


# ----------------------------------------------------------------------------------------------------------------
# one replay step


def _at_response(logits: torch.Tensor, prompt: int) -> torch.Tensor:
    return logits[:, prompt - 1: -1]  # logits[:, t] predicts token t+1


def prepare(schedule: str, student, teacher, block, prompt: int, sep_ids, window: int, t: dict, tick) -> dict:
    """Student top-κ, teacher log-probs (and targets), advantages: what the update of ``schedule`` needs."""
    ids, am, pos = block
    n = student.config.num_hidden_layers
    kw = dict(input_ids=ids, attention_mask=am, position_ids=pos)
    mask = am[:, prompt:]
    d = {"kw": kw, "mask": mask, "prompt": prompt, "layers": range(n)}
    with tick(t, "student_topk"), torch.no_grad():
        d["ids"], S = student_topk(_at_response(student(**kw).logits, prompt), KAPPA)
    if schedule != "tok":
        d["regions"] = step_regions(ids[:, prompt:], mask, sep_ids, window).pad_left(prompt)
    if schedule in ("exact", "carried"):
        with tick(t, "teacher_logp"), torch.no_grad():  # one teacher forward: log-probs AND alignment targets
            out, sig = alignment_signals(teacher, ids, am, d["regions"], position_ids=pos, pooled_layers=range(n),
                                         hidden_layers=range(n))
            Q = teacher_logprobs_at(_at_response(out.logits, prompt), d["ids"])
            d["targets"] = sig.as_targets()
            del out, sig
    else:
        with tick(t, "teacher_logp"), torch.no_grad():
            Q = teacher_logprobs_at(_at_response(teacher(**kw).logits, prompt), d["ids"])
        if schedule == "worker":
            with tick(t, "teacher_targets"), torch.no_grad():
                _, sig = alignment_signals(teacher, ids, am, d["regions"], position_ids=pos, pooled_layers=range(n),
                                           hidden_layers=range(n), logits=False)
                d["targets"] = sig.as_targets()
                del sig
    with tick(t, "advantages"):
        d["A"] = domain_normalized_advantages(topk_rewards(S, Q, mask), mask)
    return d


def _tok_loss(logits, d):
    return topk_distill_loss(_at_response(logits, d["prompt"]), d["ids"], d["A"], d["mask"])


def update(schedule: str, student, d: dict, t: dict, tick, mults: dict | None = None) -> dict:
    """The gradient of ``schedule`` into ``.grad`` (no clip, no step); returns its balancing metrics."""
    params = [p for p in student.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    if schedule == "tok":
        with tick(t, "update"):
            _tok_loss(student(**d["kw"]).logits, d).backward()
        return {}
    kw, regions, layers = d["kw"], d.get("regions"), d["layers"]
    if schedule == "worker":
        with tick(t, "update"):
            _tok_loss(student(**kw).logits, d).backward()
            grads = {"tok": [p.grad for p in params]}
            for term in TERMS:
                for p in params:
                    p.grad = None
                _, sig = alignment_signals(student, kw["input_ids"], kw["attention_mask"], regions,
                                           position_ids=kw["position_ids"], terms=[term], pooled_layers=layers,
                                           hidden_layers=layers, logits=False)
                alignment_losses(sig, d["targets"], regions)[term].loss.backward()
                grads[term] = [p.grad for p in params]
                del sig
            g_aux, _ = combine_aux(grads["sats"], grads["vr"], grads["hidden"], 2.0, sync=False)
            g, info = balance(grads["tok"], g_aux, 1.0, sync=False)
            for p, gi in zip(params, g):
                p.grad = gi
        return info
    cache: dict = {}

    def forward(model, mb):
        return alignment_signals(model, kw["input_ids"], kw["attention_mask"], regions,
                                 position_ids=kw["position_ids"], pooled_layers=layers, hidden_layers=layers)

    def term(name):
        def loss(out, mb):
            if cache.get("sig") is not out[1]:  # the three alignment losses of one forward, computed once
                cache.update(sig=out[1], values=alignment_losses(out[1], d["targets"], regions))
            return cache["values"][name].loss
        return loss

    losses = {"tok": lambda out, mb: _tok_loss(out[0].logits, d), "sats": term("sats"), "vr": term("vr"),
              "hid": term("hidden")}
    with tick(t, "update"):
        m = balanced_backward(student, [d], [1.0], forward, losses, ratio=1.0, rho=2.0, single_forward=True,
                              multipliers=mults if schedule == "carried" else None, sync=False)
    cache.clear()
    return m


def step(schedule: str, student, teacher, opt, block, prompt: int, sep_ids, window: int, tick,
         mults: dict | None = None) -> tuple[dict, dict]:
    """One whole replay step of ``schedule``: (seconds per phase with ``total``, balancing metrics)."""
    t: dict[str, float] = {}
    d = prepare(schedule, student, teacher, block, prompt, sep_ids, window, t, tick)
    metrics = update(schedule, student, d, t, tick, mults)
    with tick(t, "clip+adamw"):
        torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], 1000.0)
        opt.step()
    opt.zero_grad(set_to_none=True)
    t["total"] = sum(t.get(k, 0.0) for k in PHASES)
    return t, metrics


def mults_of(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("mult_")}


def agreement(student, teacher, blocks, prompt: int, sep_ids, window: int) -> dict:
    """Carried vs exact at one set of weights: multipliers of the step on ``blocks[0]`` carried to ``blocks[1]``.

    Returns per-term relative error of the scale (|α_carried − α_exact|/α_exact), the cosine and norm ratio of the
    carried to the exact combined gradient on ``blocks[1]``, and the exact floor schedule against the worker's
    schedule on ``blocks[1]`` (largest |difference| over the largest |gradient| entry, per parameter, and cosine).
    """
    @contextlib.contextmanager
    def tick(t, key):
        yield

    def run(schedule, block, mults=None):
        model = copy.deepcopy(student)
        d = prepare(schedule, model, teacher, block, prompt, sep_ids, window, {}, tick)
        m = update(schedule, model, d, {}, tick, mults)
        return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters() if p.requires_grad], m

    _, m0 = run("exact", blocks[0])
    g1, m1 = run("exact", blocks[1])
    gc, _ = run("carried", blocks[1], mults_of(m0))
    gw, _ = run("worker", blocks[1])

    def norm(g):
        return math.sqrt(sum(float(x.double().pow(2).sum()) for x in g if x is not None))

    rel = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(g1, gw)
              if a is not None and b is not None)
    return {"scale_rel_err": multiplier_errors(mults_of(m0), mults_of(m1)),
            "cos_carried_exact": gradient_cosine(gc, g1), "norm_carried_over_exact": norm(gc) / norm(g1),
            "floor_vs_worker_max_rel": rel, "cos_floor_worker": gradient_cosine(g1, gw)}


# ----------------------------------------------------------------------------------------------------------------
# the GPU acceptance check (benchmarks/gpu_acceptance.py: replay_step_ratios)


@contextlib.contextmanager
def count_host_syncs(counts: dict, key: str):
    """Count the host syncs of a block on CUDA (``torch.cuda.set_sync_debug_mode("warn")``: one warning per
    synchronizing call); on CPU there is no device to wait for and the count stays None."""
    import warnings

    if not torch.cuda.is_available():
        counts.setdefault(key, None)
        yield
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts[key] = (counts.get(key) or 0) + sum("synchroniz" in str(w.message) for w in seen)


@contextlib.contextmanager
def _uncounted():
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def check_replay_ratios(sizes, reps: int | None = None) -> dict:
    """Both ratios and the host syncs per step, on one device.

    1. The MOPD worker's own step (``MOPDTrainingWorker.balanced_engine_step``) on an FSDP2 student of
       ``sizes.qwen3_tied`` (Qwen3-1.7B width on a GPU) with gradient checkpointing and bf16 compute: token only
       (the engine's token pass and step), ``balance: exact`` with ``passes: shared`` (the default) and
       ``separate``, and ``balance: carried`` (after one exact step), each
       with the student top-κ and teacher log-prob forwards and, for the aligned steps, the teacher's targets.
    2. The schedules of this module (token only, the exact floor, carried) on an unsharded fp32 student of the
       same width, on a 4,096-token response (the floor keeps the graph of every term: full length does not fit).

    Seconds: median of ``reps`` (3 on a GPU, 1 on CPU) after one warm-up, CUDA-synchronised. Host syncs per
    step: the worker's code and the engine stand-in's token pass (its optimizer-step stand-in is not verl's and is
    left out).
    """
    import statistics
    import time

    from benchmarks import gpu_acceptance as ga

    reps = reps or (3 if torch.cuda.is_available() else 1)  # CPU mode: the code paths, not the timings
    from claas_verl.mopd.trainer import alignment
    from claas_verl.mopd.trainer import fields as token_fields
    from claas_verl.mopd.trainer.teacher_pass import teacher_targets
    from claas_verl.mopd.trainer.workers import MOPDTrainingWorker, update_row_groups
    from claas_verl.verl_ext.engine_device import engine_autocast

    shape, device = sizes.qwen3_tied, ga._device()
    signal = {"sats": True, "vr": True, "hidden": True, "ratio": 1.0, "window": sizes.window}
    cfgs = {"exact": alignment.aux_config({**signal, "balance": "exact", "passes": "shared"}),
            "exact, separate": alignment.aux_config({**signal, "balance": "exact", "passes": "separate"}),
            "carried": alignment.aux_config({**signal, "balance": "carried", "balance_refresh": 10_000})}
    data = ga.replay_batch(sizes, cfgs["exact"], seed=1)
    lens = data["response_mask"].offsets().diff()
    data[token_fields.TOPK_IDS] = token_fields.pack_rows(  # the student's stored ids the teacher's Q is taken at
        torch.randint(0, shape.vocab, (len(lens), int(lens.max()), KAPPA), generator=torch.Generator().manual_seed(3)),
        lens)
    groups = update_row_groups(data)
    numbers: dict = {"shape": shape.name, "tokens": sizes.prompt + sizes.response, "attn": ga.attn_implementation()}
    seconds: dict[str, list] = {}
    syncs: dict[str, int | None] = {}

    def timed(name, fn, rep):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        counts: dict = {}
        t0 = time.perf_counter()
        with count_host_syncs(counts, name):
            out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if rep > 0:
            seconds.setdefault(name, []).append(time.perf_counter() - t0)
            syncs[name] = counts[name]
        return out

    def worker_part():
        teacher = ga.build_model(shape, "qwen3", torch.bfloat16, seed=1).to(device).eval().requires_grad_(False)
        teacher_worker = type("T", (), {"engine": ga.Engine(teacher)})()
        student = ga.build_model(shape, "qwen3", torch.float32).to(device).train()
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ga.shard(student, offload=False, bf16_compute=True)
        engine = ga.Engine(student, autocast_dtype=torch.bfloat16)
        step_of_engine = engine.optimizer_step

        def optimizer_step():
            with _uncounted():
                return step_of_engine()

        engine.optimizer_step = optimizer_step
        worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
        worker.engine, worker.mopd_targets = engine, None
        mb = alignment.aux_micro_batches(
            [s for s in data["input_ids"].unbind()], data[alignment.REGION_IDS].to_padded_tensor(-1),
            data[alignment.WINDOW].to_padded_tensor(0), data["response_mask"].offsets().diff(), groups)[0].to(device)
        kw = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                  use_cache=False)

        def forwards(teacher_too: bool = True):  # the student's top-κ and (verl's pass) the teacher's log-probs
            with torch.no_grad(), engine_autocast(engine, device):
                ids, _ = student_topk(student(**kw).logits[:, :-1], KAPPA)
                if teacher_too:
                    teacher_logprobs_at(teacher(**kw).logits[:, :-1], ids)

        def token_only():
            forwards()
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(data, None)
            return engine.optimizer_step()

        def aligned(mode):
            def run():
                shared = cfgs[mode].passes == "shared"
                forwards(teacher_too=not shared)  # shared: one teacher forward gives Q and the targets
                held, _ = teacher_targets(teacher_worker, data, cfgs[mode], groups, with_q=KAPPA if shared else 0)
                worker.mopd_targets = {**held, "teacher": "t"}
                return worker.balanced_engine_step(data, engine, cfgs[mode])  # the engine's stand-in token loss
            return run

        for rep in range(reps + 1):
            timed("worker: token only", token_only, rep)
            timed("worker: exact", aligned("exact"), rep)
            timed("worker: exact, separate", aligned("exact, separate"), rep)
            out = timed("worker: carried", aligned("carried"), rep)  # rep 0 is exact and records the multipliers
        numbers["carried_step_was_carried"] = out["metrics"].get("mopd/balance_carried", [0.0])[0] == 1.0

    def floor_part():  # the floor schedules on an unsharded fp32 student, at most 4,096 tokens
        student = ga.build_model(shape, "qwen3", torch.float32).to(device).train()
        teacher = ga.build_model(shape, "qwen3", torch.float32, seed=1).to(device).eval().requires_grad_(False)
        prompt, w = min(sizes.prompt, 2048), min(sizes.window, 2048)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(10, 1000, (1, prompt + w), generator=g)
        ids[0, prompt + 19::20] = ga.SEP
        block = (ids.to(device), torch.ones_like(ids).to(device), torch.arange(prompt + w).unsqueeze(0).to(device))

        @contextlib.contextmanager
        def tick(t, key):
            yield

        mults = None
        for rep in range(reps + 1):
            for s in ("tok", "exact", "carried"):
                model = copy.deepcopy(student)
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
                _, m = timed(f"floor: {s}", lambda s=s, model=model, opt=opt, mults=mults: step(
                    s, model, teacher, opt, block, prompt, {ga.SEP}, w, tick, mults=mults), rep)
                mults = mults_of(m) if s == "exact" else mults
                del model, opt

    with ga.process_group():
        worker_part()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        floor_part()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    numbers["seconds"] = med
    numbers["host_syncs_per_step"] = syncs
    numbers["ratios"] = {
        "worker exact / token only": med["worker: exact"] / med["worker: token only"],
        "worker exact, separate passes / token only": med["worker: exact, separate"] / med["worker: token only"],
        "worker carried / token only": med["worker: carried"] / med["worker: token only"],
        "floor exact / token only": med["floor: exact"] / med["floor: tok"],
        "floor carried / token only": med["floor: carried"] / med["floor: tok"],
    }
    numbers["meets_targets"] = {"exact <= 2.0": numbers["ratios"]["floor exact / token only"] <= 2.0,
                                "trainer exact <= 2.0": numbers["ratios"]["worker exact / token only"] <= 2.0,
                                "carried <= 1.3": numbers["ratios"]["floor carried / token only"] <= 1.3}
    numbers["ok"] = numbers["carried_step_was_carried"] and all(math.isfinite(v) for v in med.values())
    return numbers
