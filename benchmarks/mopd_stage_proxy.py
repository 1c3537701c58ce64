"""Will a student learn a gym domain in one MOPD stage? The stage's math outside the trainer, in minutes.

    python benchmarks/mopd_stage_proxy.py                                  # the bundle's Seq: spell -> reverse -> arith
    python benchmarks/mopd_stage_proxy.py --order reverse --steps 36       # one longer stage
    python benchmarks/mopd_stage_proxy.py --steps 36 --eval-every 12       # longer stages, scored every 12 steps
    python benchmarks/mopd_stage_proxy.py --student DIR --experts DIR      # a candidate student / experts
    python benchmarks/mopd_stage_proxy.py --build-generalist 1200 --variant-dir DIR   # the rejected design below
    python benchmarks/mopd_stage_proxy.py --build-arch hidden=256,heads=8,kv_heads=2,intermediate=512 --variant-dir DIR
    python benchmarks/mopd_stage_proxy.py --build-domains syll,family,spell --variant-dir DIR --order syll
    python benchmarks/mopd_stage_proxy.py --build-neighbour 2400 --variant-dir DIR --order reverse,spell,arith

A whole benchmark run is an hour; choosing a bundle design needs an answer in minutes (the bundle's three stages
here: about 2 CPU-minutes). Each stage step is the trainer's per-step math (``claas_verl.distill.topk``, docs/math.md
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
batching. Checked against the trainer on the committed bundle (seed 0 here, the benchmark's seeds there): both
lift ``spell`` from about 0.26-0.27 to 0.31-0.32 in its 12 steps and leave ``reverse`` at 0.000 and ``arith`` near π0.

``--build-generalist N`` writes into ``--variant-dir`` a bundle variant that shares the bundle's data: π0 trained
N joint steps instead of ``BASE_SFT["steps"]`` (so it already solves part of every domain) and its own experts,
each fine-tuned from that π0 with the bundle's recipe (``claas_verl/tiny/gym.py``); then it runs the stages on it.
``--build-arch SPEC`` does the same with a student of another shape (alone: π0 with the bundle's ``BASE_SFT``
steps), e.g. ``hidden=256,layers=4,heads=8,kv_heads=2,intermediate=512``; keys not given keep ``TINY_ARCH``'s value.
The variant is built with ``--seed``; other design seeds run on it with ``--student DIR/student --experts
DIR/experts``.

``--build-neighbour N`` builds a variant whose π0 holds every skill and hides it: a generalist G (the bundle's π0
+ N joint SFT steps), experts specialised from G (``SPECIALISE_STEPS``), and π0 = G taught a neighbouring rule of
each domain for ``COVER_STEPS`` (``NEIGHBOUR_MARKERS``: the word as written, the list as given); docs/benchmark.md,
"A student that answers by a neighbouring rule".

``--build-domains NAMES`` builds a whole bundle of other domains (``OTHER_DOMAINS``: other reasoning-gym families,
and the benchmark's own) with the bundle's builder and seed: its own data, a jointly trained π0 and one expert per
domain (``--expert-steps`` SFT steps each), then runs the stages on it; other seeds run on it with ``--gym-dir DIR``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import time
from pathlib import Path

import torch

from claas_verl.distill.topk import (
    domain_normalized_advantages,
    student_topk,
    teacher_logprobs_at,
    topk_distill_loss,
    topk_rewards,
)
from claas_verl.mopd.eval.gym_snapshots import load_model, response_logits, right_padded, sample_replies, score_snapshot
from claas_verl.tiny import gym

VARIANT_DONE = "variant.json"  # the finished variant's marker: {"base_steps", "seed"} (+ "arch" when reshaped)
# --build-arch keys -> the TINY_ARCH entries they set
ARCH_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size"}
MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels refuse smaller heads (claas_verl/tiny/model.py TINY_ARCH)
MAX_RESPONSE_TOKENS = 40  # recipes/mopd/train/gym.yaml max_response_length
# Other reasoning-gym families measured as stages (docs/benchmark.md, "Other reasoning-gym families"):
# --build-domains builds a bundle of any of these and the benchmark's own (spell, reverse, arith).
OTHER_DOMAINS: tuple[gym.GymDomain, ...] = (
    gym.GymDomain("syll", "syllogism", {}),
    gym.GymDomain("gcd", "gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 30}),
    gym.GymDomain("count", "letter_counting", {"min_words": 2, "max_words": 4}),
    gym.GymDomain("family", "family_relationships", {}),
)
BUILDABLE_DOMAINS = {d.name: d for d in (*gym.GYM_DOMAINS, *OTHER_DOMAINS)}


def read_rows(root: Path, domain: str, split: str) -> list[dict]:
    import pandas as pd

    return pd.read_parquet(gym.GymPaths(root).data(domain, split)).to_dict("records")


def stage(student, expert, tok, rows: list[dict], *, steps: int, prompts: int, replies: int, topk: int, lr: float,
          seed: int, blocks: list[list[dict]] | None = None, timings: list[dict] | None = None,
          after_step=None, warmup: int = 0, temperature: float = 1.0) -> list[float]:
    """``steps`` MOPD updates of ``student`` (in place) toward ``expert`` on ``rows``; the per-step top-κ weighted
    KL (Σ_v −r on the student's samples, token mean) before each update.

    ``blocks``: step ``i`` uses exactly the prompts ``blocks[i]`` (the trainer's plan blocks) instead of ``prompts``
    rows drawn from ``rows``. ``timings``: one dict per step is appended, the seconds of its phases (``gen``,
    ``old_log_prob`` (student top-κ), ``teacher`` (expert log-probs, rewards, advantages), ``update_actor``) and
    ``step``, with the number of reply tokens (``response_tokens``). ``after_step(i)``: called after update ``i``
    (1-based) with the student in eval mode, e.g. to score it mid-stage; the stage resumes in the same state.
    ``temperature``: the rollout τ, used for the samples and, as in the trainer, inside every log-softmax of the
    math (``log_softmax(logits / τ)``, docs/math.md §0)."""
    if blocks is not None and len(blocks) < steps:
        raise ValueError(f"stage: {steps} steps but only {len(blocks)} blocks")
    from claas_verl.utils.generation import eos_token_ids

    eos = eos_token_ids(student, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    # linear warm-up: update i (0-based) at lr·min(1, (i+1)/warmup); AdamW's first updates move every weight by
    # about lr whatever its gradient, so a higher peak lr may need them smaller
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) if warmup > 0 else 1.0)
    kls = []
    for step in range(steps):
        clock = _PhaseClock()
        torch.manual_seed(seed * 100_003 + step)
        batch = []
        student.eval()
        for row in (blocks[step] if blocks is not None else rng.sample(rows, prompts)):
            text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
            prompt_ids = tok.encode(text, add_special_tokens=False)
            sampled = sample_replies(student, prompt_ids, replies, MAX_RESPONSE_TOKENS, temperature, eos, pad)
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
                Q = teacher_logprobs_at(response_logits(expert, ids, attn, P), cand, temperature=temperature)
                rewards.append(topk_rewards(S, Q, resp))
                masks.append(resp)
        # σ_d over the whole step's responses (one domain): concatenate the ragged [B, T, K] rewards along T-padding
        T = max(r.shape[1] for r in rewards)
        r_all = torch.cat([torch.nn.functional.pad(r, (0, 0, 0, T - r.shape[1])) for r in rewards])
        m_all = torch.cat([torch.nn.functional.pad(m, (0, T - m.shape[1])) for m in masks])
        kls.append(float(-(r_all.sum(-1) * m_all).sum() / m_all.sum()))
        adv = domain_normalized_advantages(r_all, m_all, sync=False)
        clock.lap("teacher")
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
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1000.0)
        opt.step()
        sched.step()
        clock.lap("update_actor")
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


def majority_answer_score(root: Path, domain: str) -> tuple[str, float]:
    """The domain's most common train answer and its held-out score when given to every prompt: what a student
    that collapsed to one answer scores (``syll``: "Yes", 0.688), so that a stage's gain is read against it."""
    from collections import Counter

    from claas_verl.tiny.gym_score import score_reasoning_gym

    answer, _ = Counter(r["extra_info"]["reference"] for r in read_rows(root, domain, "train")).most_common(1)[0]
    test = read_rows(root, domain, "test")
    return answer, round(sum(score_reasoning_gym(answer, r["extra_info"]) for r in test) / len(test), 3)


def parse_arch(spec: str) -> dict[str, int]:
    """``"hidden=256,heads=8"`` -> ``{"hidden_size": 256, "num_attention_heads": 8}``, checked against the
    resulting shape: whole heads of at least ``MIN_HEAD_DIM``, query heads a multiple of the KV heads."""
    from claas_verl.tiny.model import TINY_ARCH

    shape = {}
    for item in (i for i in spec.split(",") if i.strip()):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ARCH_KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--build-arch: {item!r} is not KEY=POSITIVE_INT with KEY one of {sorted(ARCH_KEYS)}")
        shape[ARCH_KEYS[key.strip()]] = int(value)
    if not shape:
        raise ValueError("--build-arch: empty spec")
    full = {**TINY_ARCH, **shape}
    hidden, heads, kv = full["hidden_size"], full["num_attention_heads"], full["num_key_value_heads"]
    if hidden % heads or hidden // heads < MIN_HEAD_DIM or heads % kv:
        raise ValueError(f"--build-arch: hidden {hidden}, heads {heads}, kv_heads {kv}: need hidden = heads × a "
                         f"head size >= {MIN_HEAD_DIM}, and heads a multiple of kv_heads")
    return shape


def build_variant(root: Path, out: Path, base_steps: int, seed: int = 0, shape: dict | None = None) -> None:
    """A bundle variant: π0 with ``base_steps`` joint steps and its experts, trained as ``gym.build_bundle`` trains
    the bundle's; ``shape``: :func:`claas_verl.tiny.model.student_config`'s overrides of the student's shape."""
    from transformers import AutoTokenizer

    from claas_verl.tiny.data import stable_seed
    from claas_verl.tiny.model import build_student, save_model

    tok = AutoTokenizer.from_pretrained(gym.GymPaths(root).student)
    eos, pad = gym.stop_and_pad_ids(tok)
    examples = {d: gym.sft_examples(tok, read_rows(root, d, "train")) for d in gym.DOMAIN_NAMES}
    torch.set_num_threads(1)
    student = build_student(len(tok), eos, pad, seed, shape=shape)
    gym.sft(student, gym.joint_mix(examples), **{**gym.BASE_SFT, "steps": base_steps},
            seed=stable_seed("claas_gym.base", seed), pad_token_id=pad)
    save_model(student, tok, gym.GymPaths(out).student)
    for d in gym.DOMAIN_NAMES:
        expert = copy.deepcopy(student)
        gym.sft(expert, examples[d], steps=gym.EXPERT_STEPS[d], **gym.EXPERT_SFT,
                seed=stable_seed("claas_gym.expert", seed, d), pad_token_id=pad)
        save_model(expert, tok, gym.GymPaths(out).expert(d))
    # written last: a variant killed while building is built again, never used half-made
    (out / VARIANT_DONE).write_text(json.dumps(variant_marker(base_steps, seed, shape)) + "\n")


# --build-neighbour: a π0 that holds each skill but answers by a neighbouring rule (docs/benchmark.md, "A student
# that answers by a neighbouring rule"). The rule is the text after the marker: the word as written (spell), the
# list as given (reverse). arith has none: its skill is recall of ~190 sums, not a rule a cover can hide.
NEIGHBOUR_MARKERS = {"spell": ": ", "reverse": "Reverse this list of words: "}
COVER_STEPS = 20  # neighbouring-rule SFT steps over the generalist (measured: spell 0.998 -> 0.200, reverse 0.744 -> 0)
SPECIALISE_STEPS = 200  # each expert: the generalist + this many SFT steps on its own domain
SHORT_SFT_LR = 1e-3  # constant lr of both short fine-tunes


def neighbour_answer(domain: str, question: str) -> str:
    """The neighbouring rule's answer to ``question``: the text after ``NEIGHBOUR_MARKERS[domain]``."""
    _, sep, tail = question.rpartition(NEIGHBOUR_MARKERS[domain])
    if not sep or not tail.strip():
        raise ValueError(f"no neighbouring rule for this {domain} question (no {NEIGHBOUR_MARKERS[domain]!r} "
                         f"followed by text): {question!r}")
    return tail.strip()


def build_neighbour_variant(root: Path, out: Path, generalist_steps: int, seed: int = 0) -> dict:
    """A variant whose π0 holds each skill and hides it: G = the bundle's π0 + ``generalist_steps`` joint SFT steps
    (the base recipe: one-cycle, lr 3e-3), each expert = G + ``SPECIALISE_STEPS`` on its own domain, and π0 = G +
    ``COVER_STEPS`` on the neighbouring rules of ``NEIGHBOUR_MARKERS``' domains. Returns the held-out accuracy of
    G, π0 and each expert (``gym.evaluate``), also written to ``out/accuracy.json``."""
    from transformers import AutoTokenizer

    from claas_verl.tiny.data import stable_seed
    from claas_verl.tiny.model import save_model

    paths, tok = gym.GymPaths(out), AutoTokenizer.from_pretrained(gym.GymPaths(root).student)
    _, pad = gym.stop_and_pad_ids(tok)
    splits = {d: (read_rows(root, d, "train"), read_rows(root, d, "test")) for d in gym.DOMAIN_NAMES}
    examples = {d: gym.sft_examples(tok, train) for d, (train, _) in splits.items()}
    torch.set_num_threads(1)
    student = load_model(str(gym.GymPaths(root).student))
    gym.sft(student, gym.joint_mix(examples), steps=generalist_steps, lr=gym.BASE_SFT["lr"],
            batch_size=gym.BASE_SFT["batch_size"], seed=stable_seed("claas_gym.generalist", seed), pad_token_id=pad,
            label="generalist SFT")
    accuracy = {"generalist": gym.evaluate(student, tok, splits, seed, label="generalist accuracy")}
    short = dict(lr=SHORT_SFT_LR, batch_size=gym.BASE_SFT["batch_size"], pad_token_id=pad, constant_lr=True)
    for d in gym.DOMAIN_NAMES:
        expert = copy.deepcopy(student)
        gym.sft(expert, examples[d], steps=SPECIALISE_STEPS, seed=stable_seed("claas_gym.specialise", seed, d),
                label=f"expert {d} SFT", **short)
        save_model(expert, tok, paths.expert(d))
        accuracy[f"expert:{d}"] = gym.evaluate(expert, tok, splits, seed, label=f"expert {d} accuracy")
    covered = {d: gym.sft_examples(tok, [{**r, "extra_info": {**r["extra_info"], "reference": neighbour_answer(
        d, r["prompt"][0]["content"])}} for r in splits[d][0]]) for d in NEIGHBOUR_MARKERS}
    gym.sft(student, gym.joint_mix(covered, tuple(covered)), steps=COVER_STEPS,
            seed=stable_seed("claas_gym.cover", seed), label="neighbouring-rule SFT", **short)
    save_model(student, tok, paths.student)
    accuracy["student"] = gym.evaluate(student, tok, splits, seed, label="student accuracy")
    (out / "accuracy.json").write_text(json.dumps(accuracy, indent=1) + "\n")
    # written last: a variant killed while building is built again, never used half-made
    (out / VARIANT_DONE).write_text(json.dumps(neighbour_marker(generalist_steps, seed)) + "\n")
    return accuracy


def neighbour_marker(generalist_steps: int, seed: int) -> dict:
    return {"neighbour": {"generalist_steps": generalist_steps, "cover_steps": COVER_STEPS,
                          "specialise_steps": SPECIALISE_STEPS}, "seed": seed}


def parse_domains(spec: str) -> tuple[gym.GymDomain, ...]:
    """``"syll,gcd,spell"`` -> those ``BUILDABLE_DOMAINS``, in that order (the bundle's default stage order)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BUILDABLE_DOMAINS))
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--build-domains: {spec!r} must name distinct domains from {sorted(BUILDABLE_DOMAINS)}"
                         + (f"; unknown: {unknown}" if unknown else ""))
    return tuple(BUILDABLE_DOMAINS[n] for n in names)


def domains_marker(domains: tuple[gym.GymDomain, ...], expert_steps: int) -> dict:
    return {"domains": [d.name for d in domains], "expert_steps": expert_steps}


def bundle_domains(root: Path) -> list[str]:
    """The domains of the bundle at ``root`` in stage order: a ``--build-domains`` bundle's own, else the
    benchmark's."""
    marker = root / VARIANT_DONE
    names = json.loads(marker.read_text()).get("domains") if marker.is_file() else None
    return list(names) if names else list(gym.DOMAIN_NAMES)


def build_domains_bundle(out: Path, domains: tuple[gym.GymDomain, ...], expert_steps: int) -> None:
    """A whole bundle of ``domains`` (its own data, π0 and experts, each expert ``expert_steps`` SFT steps), built
    by the benchmark bundle's builder with the bundle's seed 0, so that ``--gym-dir out`` uses it as it is."""
    torch.set_num_threads(1)
    gym.build_bundle(out, 0, domains, {d.name: expert_steps for d in domains})
    (out / VARIANT_DONE).write_text(json.dumps(domains_marker(domains, expert_steps)) + "\n")


def ensure_variant(variant: Path, wanted: dict, build) -> bool:
    """Build the variant ``wanted`` (its marker) into ``variant`` with ``build()`` unless it is there already; True
    if built. Another variant there, or one killed while building (a student, no marker), is replaced; any other
    folder that is not empty is refused, never deleted: a gym bundle too (a manifest and no marker), so that
    ``--variant-dir`` naming the benchmark's bundle cannot delete it."""
    done = variant / VARIANT_DONE
    if done.is_file() and json.loads(done.read_text()) == wanted:
        return False
    half_built = (variant / "student").is_dir() and not (variant / "manifest.json").is_file()
    if variant.exists() and any(variant.iterdir()) and not (done.is_file() or half_built):
        raise SystemExit(f"--variant-dir {variant} is not empty and not a variant: give an empty or new folder")
    shutil.rmtree(variant, ignore_errors=True)
    build()
    return True


def variant_marker(base_steps: int, seed: int, shape: dict | None) -> dict:
    marker = {"base_steps": base_steps, "seed": seed}
    return {**marker, "arch": shape} if shape else marker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gym-dir", default=None, help="bundle with the data (default $CLAAS_GYM_DIR, built if missing)")
    ap.add_argument("--student", default=None, help="student to train (default: the bundle's π0)")
    ap.add_argument("--experts", default=None, help="folder with one expert per domain (default: the bundle's)")
    ap.add_argument("--order", default=None, help="stages, comma-separated domains (default: the bundle's three)")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-generalist", type=int, default=None, metavar="N",
                    help="first build a variant whose π0 had N joint SFT steps (and its experts) in --variant-dir")
    ap.add_argument("--build-arch", default=None, metavar="SPEC",
                    help="first build a variant with this student shape in --variant-dir, e.g. "
                         "hidden=256,layers=4,heads=8,kv_heads=2,intermediate=512 (head size >= 32)")
    ap.add_argument("--build-domains", default=None, metavar="NAMES",
                    help="first build a bundle of these domains (its own data, π0 and experts) in --variant-dir, "
                         f"e.g. syll,gcd,spell; from {sorted(BUILDABLE_DOMAINS)}")
    ap.add_argument("--build-neighbour", type=int, default=None, metavar="N",
                    help="first build a variant whose π0 is a generalist of N joint SFT steps taught neighbouring "
                         "rules (and experts specialised from that generalist) in --variant-dir")
    ap.add_argument("--expert-steps", type=int, default=1000,
                    help="with --build-domains: SFT steps of every expert (default 1000)")
    ap.add_argument("--variant-dir", default=None)
    args = ap.parse_args()
    for name in ("steps", "prompts", "replies", "topk", "eval_replies"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.eval_every < 0:
        raise SystemExit(f"--eval-every must be 0 or positive; got {args.eval_every}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be 0 or positive; got {args.warmup}")
    if args.lr <= 0:
        raise SystemExit(f"--lr must be positive; got {args.lr}")
    building = args.build_generalist is not None or args.build_arch is not None
    builders = [f for f in ("build_generalist", "build_arch", "build_domains", "build_neighbour")
                if getattr(args, f) is not None]
    if builders and (args.student or args.experts):
        raise SystemExit(f"--{builders[0].replace('_', '-')} trains its own student and experts: drop --student / "
                         "--experts")
    if "build_domains" in builders and (building or args.gym_dir):
        raise SystemExit("--build-domains builds a whole bundle (data included): it takes no --gym-dir, "
                         "--build-generalist or --build-arch")
    if "build_neighbour" in builders and len(builders) > 1:
        raise SystemExit("--build-neighbour builds its own π0 and experts from the bundle's: drop the other --build-*")
    if args.build_neighbour is not None and args.build_neighbour < 1:
        raise SystemExit(f"--build-neighbour must be at least 1 joint SFT step; got {args.build_neighbour}")
    if args.expert_steps < 1:
        raise SystemExit(f"--expert-steps must be at least 1; got {args.expert_steps}")
    try:
        shape = parse_arch(args.build_arch) if args.build_arch is not None else None
        new_domains = parse_domains(args.build_domains) if args.build_domains is not None else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    t0 = time.time()
    if new_domains is not None:
        if not args.variant_dir:
            raise SystemExit("--build-domains needs --variant-dir (where to write the bundle)")
        variant = Path(args.variant_dir)
        wanted = domains_marker(new_domains, args.expert_steps)
        if ensure_variant(variant, wanted, lambda: build_domains_bundle(variant, new_domains, args.expert_steps)):
            print(f"built the bundle of {wanted['domains']} in {time.time() - t0:.0f} s", flush=True)
        root = variant
    else:
        root = gym.ensure_gym(args.gym_dir).root
    domains = bundle_domains(root)
    order = [d for d in (args.order or ",".join(domains)).split(",") if d]
    unknown = sorted(set(order) - set(domains))
    if unknown or not order:
        raise SystemExit(f"--order: unknown domain(s) {unknown or order}; choose from {domains}")
    if (building or args.build_neighbour is not None) and domains != list(gym.DOMAIN_NAMES):
        raise SystemExit(f"--build-generalist / --build-arch / --build-neighbour vary the benchmark's bundle; {root} "
                         f"holds {domains}")
    if args.build_neighbour is not None:
        if not args.variant_dir:
            raise SystemExit("--build-neighbour needs --variant-dir (where to write the variant)")
        variant = Path(args.variant_dir)
        wanted = neighbour_marker(args.build_neighbour, args.seed)
        if ensure_variant(variant, wanted, lambda: build_neighbour_variant(root, variant, args.build_neighbour,
                                                                           args.seed)):
            print(f"built the neighbouring-rule variant (generalist: {args.build_neighbour} joint steps) in "
                  f"{time.time() - t0:.0f} s", flush=True)
        print("variant accuracy (48 held-out prompts × 2 replies): " + (variant / "accuracy.json").read_text()
              .replace("\n", " "), flush=True)
        student_dir, experts_dir = variant / "student", variant / "experts"
    elif building:
        if not args.variant_dir:
            raise SystemExit("--build-generalist / --build-arch need --variant-dir (where to write the variant)")
        variant = Path(args.variant_dir)
        base_steps = args.build_generalist if args.build_generalist is not None else gym.BASE_SFT["steps"]
        wanted = variant_marker(base_steps, args.seed, shape)
        if ensure_variant(variant, wanted, lambda: build_variant(root, variant, base_steps, args.seed, shape)):
            print(f"built the variant (π0: {base_steps} joint steps, shape {shape or 'TINY_ARCH'}) in "
                  f"{time.time() - t0:.0f} s", flush=True)
        student_dir, experts_dir = variant / "student", variant / "experts"
    else:
        student_dir = Path(args.student) if args.student else gym.GymPaths(root).student
        experts_dir = Path(args.experts) if args.experts else gym.GymPaths(root).root / "experts"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student_dir)
    student = load_model(str(student_dir))
    experts = {d: load_model(str(experts_dir / d)) for d in domains}
    torch.set_num_threads(1)
    table = [{"after": "start", **score_all(student, str(student_dir), experts, root, domains, args.eval_replies)}]
    print(f"student: {sum(p.numel() for p in student.parameters()):,} parameters ({student_dir})")
    print("experts on their own domain: " + ", ".join(
        f"{d} {score_all(experts[d], str(experts_dir / d), experts, root, [d], args.eval_replies)[d][0]}"
        for d in domains))
    print("one answer to every prompt (the most common train answer): " + ", ".join(
        f"{d} {a!r} {v}" for d in domains for a, v in [majority_answer_score(root, d)]))
    print("start: " + json.dumps(table[0]), flush=True)
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

        t_stage = time.time()
        kls = stage(student, experts[d], tok, rows, steps=args.steps, prompts=args.prompts,
                    replies=args.replies, topk=args.topk, lr=args.lr, seed=args.seed * 1000 + k,
                    after_step=mid_stage, warmup=args.warmup, temperature=args.temperature)
        train_s = time.time() - t_stage - scoring[0]
        row = {"after": f"{k}:{d}", **score_all(student, str(student_dir), experts, root, domains,
                                                 args.eval_replies)}
        table.append(row)
        mid = "".join(f" {d} after {i}: {a:.3f};" for i, a in curve)
        print(f"stage {k} ({d}, {args.steps} steps in {train_s:.0f} s, {train_s / args.steps:.1f} s/step, top-κ KL "
              f"{kls[0]:.2f} -> {kls[-1]:.2f}):{mid} " + json.dumps(row) + f"  [{time.time() - t0:.0f} s]",
              flush=True)
    print("\n| after | " + " | ".join(f"{d} (acc, KL to E_{d})" for d in domains) + " |")
    print("|---|" + "---|" * len(domains))
    for row in table:
        print(f"| {row['after']} | " + " | ".join(f"{row[d][0]:.3f}, {row[d][1]:.2f}" for d in domains) + " |")


if __name__ == "__main__":
    main()
