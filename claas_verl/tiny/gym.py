"""The continual benchmark's offline bundle: reasoning-gym tasks, a tiny student and one expert per task.

``make_gym(out_dir)`` / ``ensure_gym()`` build, with no network, on CPU:

* three domains whose prompts, answers and scorers all come from ``reasoning-gym`` (no task here is written by
  this project): ``spell`` (``spell_backward``, 3-5 letters), ``reverse`` (``word_sequence_reversal``, 3 words)
  and ``palin`` (``palindrome_generation``, 3-5 letters). Every answer is scored by the task's own
  ``score_answer`` (``claas_verl/mopd/data/rewards.py``, ``answer_format: plain``: the whole reply is the answer).
* a byte tokenizer (every character one token; ChatML): reversal and palindromes work on letters, which merges
  would hide from a model this small;
* a tiny Qwen2 student (the tiny bundle's shape), built in four fine-tunes of one model (docs/benchmark.md, "A
  student that answers by a neighbouring rule"):

  1. a short joint fine-tune of a random model on every domain (``BASE_SFT``: the chat format, answer shapes);
  2. the generalist G: a long joint fine-tune (``GENERALIST_SFT``) until it solves every domain;
  3. each expert: G fine-tuned on its own domain (``SPECIALISE_SFT``);
  4. π0: G fine-tuned briefly on a *neighbouring rule* of each domain (``COVER_SFT``, ``neighbour_answer``): the
     word as written instead of backward, the list as given instead of reversed, the letters as given instead of
     a palindrome. π0 holds every skill and hides it, as the pretrained students of MOPD half-know a domain:
     a stage of a few dozen on-policy steps brings the domain back. A 0.17 M-parameter model cannot learn word
     reversal from scratch in that budget by any method (measured: 240 SFT steps on the gold answers leave it at
     0.000).

**Interference is designed in.** All three domains rewrite the letters or words they are given, with conflicting
rules: ``spell`` reverses the letters of a word, ``reverse`` the order of three words and must keep every word's
letters in order, ``palin`` must mirror letters around a centre. The model is small and fully fine-tuned, so
distilling one domain overwrites what serves the others: sequential distillation forgets, and replay, fixed shares
and recovery have something to protect. The manifest records the measured accuracy of G, π0 and every expert on
every domain (sampled at τ = 1 like the trainer's evaluation), which the benchmark's ``Norm`` uses.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from claas_verl.tiny.shipped import BundlePaths, bundle_dir, put_in_place, shipped
from claas_verl.utils.progress import Progress, track

GYM_VERSION = "3"  # 3: palin replaces arith; π0 answers by neighbouring rules (2: arith expert 3000 steps)
DEFAULT_GYM_DIR = "/tmp/claas_verl_gym"
ENV_GYM_DIR = "CLAAS_GYM_DIR"
LOG = "[tiny gym]"  # prefix of the build's progress lines (stderr)
GYM_MANIFEST_MARKER = "base_sft"  # a key only the gym bundle's manifest has (build.refuse_foreign_dir)


@dataclass(frozen=True)
class GymDomain:
    name: str
    task: str  # reasoning_gym dataset name
    config: dict  # its config overrides (difficulty)


GYM_DOMAINS: tuple[GymDomain, ...] = (
    GymDomain("spell", "spell_backward", {"min_word_len": 3, "max_word_len": 5}),
    GymDomain("reverse", "word_sequence_reversal", {"min_words": 3, "max_words": 3}),
    GymDomain("palin", "palindrome_generation", {"min_length": 3, "max_length": 5}),
)
DOMAIN_NAMES: tuple[str, ...] = tuple(d.name for d in GYM_DOMAINS)
# Rows drawn per domain from reasoning-gym (one seeded dataset per domain): the first N_TEST distinct questions
# are the held-out split, the rest (questions not in the test split) the train split.
POOL_SIZE = 3000
N_TEST = 48
N_TRAIN = 2048
# Four fine-tunes of one model (module docstring), AdamW on the response tokens. The two joint ones are one-cycle
# at lr 3e-3 from a random and from a half-trained model; the two short ones run every step at lr 1e-3 (a warm-up
# from ~0 would waste most of their steps). Measured on 2 CPU cores: ~45 min in all, most of it the generalist.
BASE_SFT = dict(steps=250, lr=3e-3, batch_size=32)
GENERALIST_SFT = dict(steps=2400, lr=3e-3, batch_size=32)  # G (seed 0): reverse 0.906, spell 1.000, palin 0.721
SPECIALISE_SFT = dict(steps=200, lr=1e-3, batch_size=32, constant_lr=True)
COVER_SFT = dict(steps=20, lr=1e-3, batch_size=32, constant_lr=True)  # π0: reverse 0.000, spell 0.175, palin 0.168
# The neighbouring rule of each domain answers with the text after its marker, as given.
NEIGHBOUR_MARKERS = {"spell": ": ", "reverse": "Reverse this list of words: ", "palin": "following letters: "}
# Accuracy of G, π0 and the experts in the manifest: this many held-out prompts × samples at τ = 1.
ACC_PROMPTS = N_TEST
ACC_SAMPLES = 2
MAX_RESPONSE_TOKENS = 48


def default_gym_dir() -> Path:
    return bundle_dir(ENV_GYM_DIR, DEFAULT_GYM_DIR)


@dataclass(frozen=True)
class GymPaths(BundlePaths):
    """The gym bundle's files: the student, the experts, the data (the manifest and student from BundlePaths)."""

    def expert(self, domain: str) -> Path:
        return self.root / "experts" / domain

    def data(self, domain: str, split: str) -> Path:
        return self.root / "data" / domain / f"{split}.parquet"


def gym_rows(domain: GymDomain, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, test) rows of ``domain`` in verl's RL format; test questions are distinct and never in train.

    ``data_source`` is ``reasoning_gym/<task>`` and ``extra_info.meta`` holds what the reward function needs to
    rebuild the entry and score it with reasoning-gym (task, config, size, seed, index, plain answers).
    """
    import reasoning_gym

    from claas_verl.utils.prompt_rows import stable_seed

    ds_seed = stable_seed("claas_gym.data", seed, domain.name) % (2**31)
    ds = reasoning_gym.create_dataset(domain.task, size=POOL_SIZE, seed=ds_seed, **domain.config)
    seen: set[str] = set()
    test: list[dict] = []
    train: list[dict] = []
    for i in range(len(ds)):
        entry = ds[i]
        q = entry["question"]
        if q in seen:
            continue
        seen.add(q)
        split = "test" if len(test) < N_TEST else "train"
        rows = test if split == "test" else train
        if split == "train" and len(train) >= N_TRAIN:
            break
        meta = {"task": domain.task, "config": domain.config, "size": POOL_SIZE, "seed": ds_seed, "index": i,
                "answer_format": "plain"}
        rows.append({
            "data_source": f"reasoning_gym/{domain.task}",
            "prompt": [{"role": "user", "content": q}],
            "ability": domain.name,
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": len(rows), "domain": domain.name,
                           "reference": str(entry["answer"]), "meta": json.dumps(meta, sort_keys=True)},
        })
    if len(test) < N_TEST or len(train) < 128:
        raise ValueError(f"reasoning-gym {domain.task} {domain.config} gave {len(seen)} distinct questions; "
                         f"the bundle needs {N_TEST} held-out + at least 128 train")
    return train, test


def byte_tokenizer():
    """ChatML tokenizer whose vocabulary is the 256 bytes plus the tiny bundle's five added tokens (no merges)."""
    from claas_verl.tiny.tokenizer import train_tokenizer

    # A one-character corpus has no pair to merge: the BPE keeps only its byte alphabet.
    return train_tokenizer(["a"], vocab_size=262)


def is_current(out_dir: str | os.PathLike, seed: int = 0) -> bool:
    try:
        m = json.loads(GymPaths(Path(out_dir)).manifest.read_text())
    except (OSError, ValueError):
        return False
    return m.get("version") == GYM_VERSION and m.get("seed") == seed


def ensure_gym(out_dir: str | os.PathLike | None = None, seed: int = 0, build: bool = False) -> GymPaths:
    """The bundle at ``out_dir`` (default ``$CLAAS_GYM_DIR`` or /tmp/claas_verl_gym), made first if missing or
    stale: unpacked from the repository's shipped copy of this version and seed when there is one
    (:mod:`claas_verl.tiny.shipped`, fingerprint checked), else built (about 40 minutes on 2 cores); ``build=True``
    always builds. File-locked and made in a temporary sibling that is renamed into place (like ``ensure_tiny``);
    a directory there that is not a gym bundle is refused (``FileExistsError``), never replaced."""
    from filelock import FileLock

    from claas_verl.tiny.build import refuse_foreign_dir

    out_dir = Path(out_dir if out_dir is not None else default_gym_dir()).resolve()
    if is_current(out_dir, seed):
        return GymPaths(out_dir)
    refuse_foreign_dir(out_dir, "gym", GYM_MANIFEST_MARKER, ENV_GYM_DIR)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock", timeout=3600):
        if is_current(out_dir, seed):
            return GymPaths(out_dir)
        refuse_foreign_dir(out_dir, "gym", GYM_MANIFEST_MARKER, ENV_GYM_DIR)
        ship = None if build else shipped("gym", GYM_VERSION, seed)
        put_in_place(out_dir, ship, lambda tmp: build_bundle(tmp, seed), LOG)
    return GymPaths(out_dir)


def neighbour_answer(domain: str, question: str) -> str:
    """π0's answer to ``question`` by the neighbouring rule of ``domain``: the text after
    ``NEIGHBOUR_MARKERS[domain]`` as given (``palin``: its comma-separated letters joined, in their order)."""
    marker = NEIGHBOUR_MARKERS.get(domain)
    if marker is None:
        raise ValueError(f"no neighbouring rule for domain {domain!r}: the bundle's π0 needs one per domain "
                         f"(NEIGHBOUR_MARKERS has {sorted(NEIGHBOUR_MARKERS)})")
    _, sep, tail = question.rpartition(marker)
    tail = tail.strip()
    if not sep or not tail:
        raise ValueError(f"no neighbouring rule for this {domain} question (no {marker!r} followed by text): "
                         f"{question!r}")
    return "".join(tail.split(", ")) if domain == "palin" else tail


def neighbour_rows(domain: str, rows: list[dict]) -> list[dict]:
    """``rows`` with each reference replaced by the neighbouring rule's answer (what π0 is taught to reply)."""
    return [{**r, "extra_info": {**r["extra_info"], "reference": neighbour_answer(domain, r["prompt"][0]["content"])}}
            for r in rows]


def build_bundle(root: Path, seed: int, domains: tuple[GymDomain, ...] = GYM_DOMAINS) -> None:
    """The bundle of ``domains`` (default: the benchmark's; each needs a ``NEIGHBOUR_MARKERS`` rule) into the new
    folder ``root``: data, the four fine-tunes of the module docstring, and the manifest with every model's
    held-out accuracy."""
    import copy
    import time

    import torch

    from claas_verl.tiny.model import build_student, save_model
    from claas_verl.utils.prompt_rows import stable_seed, write_parquet

    missing = [d.name for d in domains if d.name not in NEIGHBOUR_MARKERS]
    if missing:
        raise ValueError(f"domain(s) {missing} have no neighbouring rule (NEIGHBOUR_MARKERS) for π0")
    t0 = time.time()
    paths = GymPaths(root)
    root.mkdir(parents=True)
    tok = byte_tokenizer()
    eos, pad = stop_and_pad_ids(tok)

    print(f"{LOG} building the gym bundle into {root} (seed {seed}; about 45 min on 2 CPU cores)", file=sys.stderr,
          flush=True)
    splits = {d.name: gym_rows(d, seed) for d in track(domains, f"{LOG} reasoning-gym data", unit="domains")}
    for name, (train, test) in splits.items():
        write_parquet(train, paths.data(name, "train"))
        write_parquet(test, paths.data(name, "test"))

    names = tuple(splits)
    examples = {name: sft_examples(tok, train) for name, (train, _) in splits.items()}
    covered = {name: sft_examples(tok, neighbour_rows(name, train)) for name, (train, _) in splits.items()}
    # One thread: intra-op threads spin-wait on a busy 2-core machine (measured 4x slower there), and one thread
    # keeps the float reductions, and so the saved weights, reproducible.
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_student(len(tok), eos, pad, seed)
        sft(model, joint_mix(examples, names), **BASE_SFT, seed=stable_seed("claas_gym.base", seed),
            pad_token_id=pad, label=f"{LOG} base SFT")
        sft(model, joint_mix(examples, names), **GENERALIST_SFT, seed=stable_seed("claas_gym.generalist", seed),
            pad_token_id=pad, label=f"{LOG} generalist SFT")
        accuracy = {"generalist": evaluate(model, tok, splits, seed, label=f"{LOG} generalist accuracy")}
        for name in names:
            expert = copy.deepcopy(model)
            sft(expert, examples[name], **SPECIALISE_SFT, seed=stable_seed("claas_gym.specialise", seed, name),
                pad_token_id=pad, label=f"{LOG} expert {name} SFT")
            save_model(expert, tok, paths.expert(name))
            accuracy[f"expert:{name}"] = evaluate(expert, tok, splits, seed, label=f"{LOG} expert {name} accuracy")
        sft(model, joint_mix(covered, names), **COVER_SFT, seed=stable_seed("claas_gym.cover", seed),
            pad_token_id=pad, label=f"{LOG} neighbouring-rule SFT")
        save_model(model, tok, paths.student)
        accuracy["student"] = evaluate(model, tok, splits, seed, label=f"{LOG} student accuracy")
    finally:
        torch.set_num_threads(n_threads)
    manifest = {
        "version": GYM_VERSION,
        "seed": seed,
        "domains": {d.name: {"task": d.task, "config": d.config} for d in domains},
        "sizes": {"vocab_size": len(tok), "num_parameters": sum(p.numel() for p in model.parameters()),
                  "train_rows": {n: len(s[0]) for n, s in splits.items()}, "test_rows": N_TEST},
        "base_sft": BASE_SFT,
        "generalist_sft": GENERALIST_SFT,
        "expert_sft": SPECIALISE_SFT,
        "cover_sft": {**COVER_SFT, "neighbour_markers": {n: NEIGHBOUR_MARKERS[n] for n in names}},
        # accuracy[model][domain]: mean reasoning-gym score of ACC_SAMPLES replies at τ = 1 on ACC_PROMPTS
        # held-out prompts (the same protocol as the trainer's stage-end evaluation)
        "accuracy": accuracy,
        "accuracy_protocol": {"prompts": ACC_PROMPTS, "samples": ACC_SAMPLES, "temperature": 1.0},
        "build_seconds": round(time.time() - t0, 1),
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def stop_and_pad_ids(tok) -> tuple[list[int], int]:
    """``([<|im_end|>, <|endoftext|>], <|endoftext|>)``: the ids that end a reply and the padding id."""
    from claas_verl.tiny.tokenizer import EOT_TOKEN, IM_END, special_token_ids

    ids = special_token_ids(tok)
    return [ids[IM_END], ids[EOT_TOKEN]], ids[EOT_TOKEN]


def sft_examples(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, reference ids + <|im_end|>)`` of each row: what ``sft`` trains on."""
    from claas_verl.tiny.tokenizer import IM_END

    out = []
    for row in rows:
        prompt = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        out.append((tok.encode(prompt, add_special_tokens=False),
                    tok.encode(row["extra_info"]["reference"] + IM_END, add_special_tokens=False)))
    return out


def joint_mix(examples: dict[str, list], order: tuple[str, ...] = DOMAIN_NAMES) -> list:
    """A joint training mix: every domain equally often, each domain's examples cycled up to the largest domain's
    count, domains in ``order``."""
    per = max(len(v) for v in examples.values())
    return [examples[name][i % len(examples[name])] for name in order for i in range(per)]


def sft(model, examples, steps: int, lr: float, batch_size: int, seed: int, pad_token_id: int,
        label: str = f"{LOG} SFT", constant_lr: bool = False) -> float:
    """One-cycle AdamW next-token training on the response tokens, in place; returns the last loss. Progress lines
    (``label``: step, ETA, loss) go to stderr. ``constant_lr``: every step at ``lr`` instead (a short fine-tune of
    a trained model, where a warm-up from ~0 would waste most of its steps)."""
    import torch

    from claas_verl.tiny.sft import sft_step

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0) if constant_lr else
             torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1))
    model.train()
    loss = torch.tensor(float("nan"))
    progress = Progress(label, steps, "steps")
    for _ in range(steps):
        loss = sft_step(model, opt, examples, gen, batch_size, pad_token_id)
        sched.step()
        progress.update(loss=float(loss.detach()))
    model.eval()
    return float(loss.detach())


def evaluate(model, tok, splits, seed: int, label: str = f"{LOG} accuracy") -> dict[str, float]:
    """Mean reasoning-gym score per domain of sampled replies (τ = 1) on the held-out prompts (one batched,
    left-padded ``generate`` per domain; a progress line per domain)."""
    import torch

    from claas_verl.mopd.data.gym_score import score_reasoning_gym
    from claas_verl.tiny.tokenizer import IM_END
    from claas_verl.utils.prompt_rows import stable_seed

    out = {}
    eos = tok.convert_tokens_to_ids(IM_END)
    for name, (_, test) in track(splits.items(), label, total=len(splits), unit="domains"):
        rows = test[:ACC_PROMPTS]
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
        enc = tok([t for t in texts for _ in range(ACC_SAMPLES)], return_tensors="pt", padding=True,
                  add_special_tokens=False)  # the tokenizer pads on the left
        torch.manual_seed(stable_seed("claas_gym.eval", seed, name) % (2**31))
        with torch.no_grad():
            y = model.generate(**enc, max_new_tokens=MAX_RESPONSE_TOKENS, do_sample=True, temperature=1.0,
                               top_p=1.0, top_k=0, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        replies = tok.batch_decode(y[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        total = 0.0
        for i, text in enumerate(replies):
            row = rows[i // ACC_SAMPLES]
            total += score_reasoning_gym(text.rsplit("</think>", 1)[-1], row["extra_info"])
        out[name] = round(total / len(replies), 4)
    return out
