"""Per-domain MOPD prompt files from the raw datasets (MOPD paper §5.1 and App. C, "Data and schedule", "Prompt
formats",
"Overlap between training and evaluation prompts").

For each domain the converter yields candidate prompts in a seeded order; the builder keeps a candidate when

1. its user turn is new (exact duplicates, e.g. DAPO-Math-17k's repeated rows, are dropped),
2. it fits in ``max_prompt_tokens`` (2048) under the student's chat template (MOPD paper: removed beforehand, so no
   block loses prompts during training), and
3. it does not overlap an evaluation prompt: after lower-casing and collapsing white space (symbols kept), the
   training question is neither identical to, nor contained in, nor contains an evaluation question,

until the domain's ``num_blocks × block_size`` prompts are found. Rows are written in verl's RL parquet format
(the columns ``RLHFDataset`` reads, as :mod:`claas_verl.tiny.data` writes them): ``data_source``, ``prompt``
(chat messages: one user turn), ``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": str}``) and
``extra_info`` (``split``, ``index``, ``domain``, ``block``, ``source``, ``source_id``, ``meta`` JSON). Row i
belongs to block ``i // block_size``; every file holds one domain, so every block holds one domain.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from claas_verl.mopd.data.io import read_records, require_columns
from claas_verl.utils.progress import Progress

# MOPD paper App. C: 20 logic blocks and 21 blocks of every later domain, 32 prompts each.
PAPER_BLOCKS: dict[str, int] = {"logic": 20, "math": 21, "code": 21, "safety": 21, "if": 21}
BLOCK_SIZE = 32
MAX_PROMPT_TOKENS = 2048
SAFETY_PER_SOURCE = 336  # MOPD paper: 336 STAR-1 harmful + 336 STAR-benign-915
LOGIC_SEED = 0  # reasoning-gym seed of the training prompts (GYM evaluation uses 4242)
ABILITY = {"logic": "logic", "math": "math", "code": "code", "safety": "safety", "if": "instruction_following"}


@dataclass
class Candidate:
    content: str  # the user turn
    question: str  # the text compared with evaluation prompts
    ground_truth: str
    data_source: str
    source: str
    source_id: str
    meta: dict = field(default_factory=dict)


def normalize(text: str) -> str:
    """the MOPD paper's overlap normalisation: lower-case, white space collapsed to single spaces, symbols kept."""
    return re.sub(r"\s+", " ", str(text)).strip().lower()


class OverlapIndex:
    """Evaluation questions, normalised; :meth:`hit` is True when a training question is identical to, contained
    in, or contains one of them."""

    def __init__(self, questions: list[str]):
        self.evals = sorted({q for q in (normalize(x) for x in questions) if q}, key=len)
        self.exact = set(self.evals)
        self.blob = "\x00".join(self.evals)

    def __len__(self) -> int:
        return len(self.evals)

    def hit(self, question: str) -> bool:
        t = normalize(question)
        if not t:
            return False
        if t in self.exact or t in self.blob:
            return True
        for e in self.evals:  # sorted by length: stop at the first longer than t
            if len(e) > len(t):
                return False
            if e in t:
                return True
        return False


def _shuffled(n: int, seed: int, domain: str) -> list[int]:
    from claas_verl.utils.prompt_rows import stable_seed

    order = list(range(n))
    random.Random(stable_seed("claas_verl.mopd.data.mopd", seed, domain)).shuffle(order)
    return order


# ============================================================================ converters
def logic_candidates(n: int, seed: int = LOGIC_SEED, tasks: tuple[str, ...] | None = None) -> Iterator[Candidate]:
    """Reasoning Gym, generated offline; MOPD paper: the default instruction (answer in <answer> tags) in the user turn
    before the question. ``n`` candidates spread evenly over the tasks, in a seeded order."""
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from claas_verl.mopd.eval.benchmarks import GYM_TASKS

    tasks = tasks or GYM_TASKS
    per_task = -(-n // len(tasks))
    pool = []
    for task in tasks:
        ds = reasoning_gym.create_dataset(task, size=per_task, seed=seed)
        pool += [(task, i, ds[i]) for i in range(per_task)]
    instruction = SYSTEM_PROMPTS["default"].strip()
    for k in _shuffled(len(pool), seed, "logic"):
        task, i, e = pool[k]
        yield Candidate(f"{instruction}\n\n{e['question']}", e["question"], str(e["answer"]), f"reasoning_gym/{task}",
                        "reasoning_gym", f"{task}/{i}", {"task": task, "size": per_task, "seed": seed, "index": i})


def _user_text(prompt, path, i: int) -> str:
    if isinstance(prompt, str):
        return prompt
    turns = [m.get("content") for m in (prompt or []) if isinstance(m, dict) and m.get("role") == "user"]
    if not turns or not isinstance(turns[0], str):
        raise ValueError(f"{path}: row {i}: 'prompt' must be a string or chat messages with a user turn")
    return turns[0]


def math_candidates(path: str | Path, seed: int) -> Iterator[Candidate]:
    """DAPO-Math-17k (verl parquet: ``prompt`` messages, ``reward_model.ground_truth``); MOPD paper: its instruction to
    put the answer on its own line after "Answer:" is kept (the user turn is used as is)."""
    rows = read_records(path)
    require_columns(rows, ("prompt", "reward_model"), path, "DAPO-Math-17k")
    for k in _shuffled(len(rows), seed, "math"):
        r = rows[k]
        rm = r["reward_model"]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise ValueError(f"{path}: row {k}: column 'reward_model' must be a dict with 'ground_truth'")
        text = _user_text(r["prompt"], path, k)
        ident = (r.get("extra_info") or {}).get("index", k) if isinstance(r.get("extra_info"), dict) else k
        yield Candidate(text, text, str(rm["ground_truth"]), str(r.get("data_source") or "math_dapo"),
                        "DAPO-Math-17k", str(ident))


def code_candidates(path: str | Path, seed: int) -> Iterator[Candidate]:
    """OpenCodeReasoning (``id``, ``input`` = problem statement); MOPD paper: the prompt is the statement. Rows whose
    ``input`` is "-" (the split that points into other datasets) are skipped."""
    rows = read_records(path)
    require_columns(rows, ("id", "input"), path, "OpenCodeReasoning")
    for k in _shuffled(len(rows), seed, "code"):
        r = rows[k]
        text = str(r["input"]).strip()
        if text in ("", "-"):
            continue
        yield Candidate(text, text, "", "nvidia/OpenCodeReasoning", "OpenCodeReasoning", str(r["id"]),
                        {k2: r[k2] for k2 in ("source", "difficulty") if k2 in r})


def safety_candidates(harmful: str | Path, benign: str | Path, seed: int,
                      per_source: int = SAFETY_PER_SOURCE) -> Callable[[Callable[[Candidate], bool]], list]:
    """STAR-1 harmful and STAR-benign-915 (``question``); MOPD paper: 336 of each, mixed. Returns a selector that keeps
    ``per_source`` accepted prompts of each file (a shared pool would not keep the 336 + 336 split)."""
    sources = []
    for path, label, name in ((harmful, "refuse", "STAR-1"), (benign, "comply", "STAR-benign-915")):
        rows = read_records(path)
        require_columns(rows, ("question",), path, name)
        sources.append((path, label, name, rows))

    def select(accept: Callable[[Candidate], bool]) -> list[Candidate]:
        picked = []
        for path, label, name, rows in sources:
            got = []
            for k in _shuffled(len(rows), seed, f"safety/{name}"):
                r = rows[k]
                c = Candidate(str(r["question"]), str(r["question"]), label, f"star1/{label}", name,
                              str(r.get("id", k)), {k2: r[k2] for k2 in ("category", "source") if k2 in r})
                if accept(c):
                    got.append(c)
                    if len(got) == per_source:
                        break
            if len(got) < per_source:
                raise ValueError(f"{path}: only {len(got)} usable {name} prompts, {per_source} needed")
            picked += got
        return [picked[k] for k in _shuffled(len(picked), seed, "safety/mix")]

    return select


def if_candidates(path: str | Path, seed: int) -> Iterator[Candidate]:
    """UltraData-SFT instruction-following subset: the first user turn of ``messages`` (or ``prompt``); MOPD paper: 672
    drawn with seed 0. Verifier fields (``instruction_id_list``, ``kwargs``), when present, become the ground truth."""
    rows = read_records(path)
    if not rows:
        raise ValueError(f"{path}: UltraData-SFT instruction-following file has no rows")
    col = next((c for c in ("messages", "prompt", "instruction") if c in rows[0]), None)
    if col is None:
        raise ValueError(f"{path}: UltraData-SFT instruction-following file lacks column 'messages' (or 'prompt'); "
                         f"row 0 has {sorted(rows[0])}")
    require_columns(rows, (col,), path, "UltraData-SFT instruction-following")
    for k in _shuffled(len(rows), seed, "if"):
        r = rows[k]
        text = _user_text(r[col], path, k)
        truth = {c: r[c] for c in ("instruction_id_list", "kwargs") if c in r}
        yield Candidate(text, text, json.dumps(truth, sort_keys=True, default=str) if truth else "",
                        "ultradata/if", "UltraData-SFT-if", str(r.get("id", k)))


# ============================================================================ builder
@dataclass
class DomainReport:
    rows: int = 0
    blocks: int = 0
    seen: int = 0
    duplicate: int = 0
    too_long: int = 0
    overlap: int = 0
    source: str = ""


class Filter:
    """Duplicate, length and overlap checks of one domain, with counts."""

    def __init__(self, count_tokens: Callable[[list[dict]], int], max_tokens: int, overlap: OverlapIndex,
                 report: DomainReport):
        self.count_tokens, self.max_tokens, self.overlap, self.report = count_tokens, max_tokens, overlap, report
        self.seen: set[str] = set()

    def __call__(self, c: Candidate) -> bool:
        self.report.seen += 1
        if c.content in self.seen:
            self.report.duplicate += 1
            return False
        self.seen.add(c.content)
        if self.count_tokens([{"role": "user", "content": c.content}]) > self.max_tokens:
            self.report.too_long += 1
            return False
        if self.overlap.hit(c.question):
            self.report.overlap += 1
            return False
        return True


def take(cands: Iterator[Candidate], accept: Callable[[Candidate], bool], n: int, domain: str, src: str) -> list:
    """The first ``n`` accepted candidates (progress lines on stderr: the chat template tokenises each one)."""
    out = []
    progress = Progress(f"[data] {domain}", n, "prompts")
    for c in cands:
        if accept(c):
            out.append(c)
            progress.update()
            if len(out) == n:
                return out
    raise ValueError(f"domain {domain}: only {len(out)} usable prompts in {src}, {n} needed "
                     "(after removing duplicates, prompts over the token limit and evaluation overlaps)")


def to_rows(domain: str, cands: list[Candidate], block_size: int) -> list[dict]:
    return [{
        "data_source": c.data_source,
        "prompt": [{"role": "user", "content": c.content}],
        "ability": ABILITY[domain],
        "reward_model": {"style": "rule", "ground_truth": c.ground_truth},
        "extra_info": {"split": "train", "index": i, "domain": domain, "block": i // block_size, "source": c.source,
                       "source_id": c.source_id, "meta": json.dumps(c.meta, sort_keys=True)},
    } for i, c in enumerate(cands)]


def token_counter(tokenizer_path: str) -> Callable[[list[dict]], int]:
    """Prompt length in tokens under the student's chat template (with the generation prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    if not tok.chat_template:
        raise ValueError(f"--tokenizer {tokenizer_path}: the tokenizer has no chat template")

    def count(messages: list[dict]) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


def build(out: str | Path, sources: dict[str, dict], count_tokens: Callable[[list[dict]], int],
          overlap: OverlapIndex, blocks: dict[str, int], block_size: int = BLOCK_SIZE,
          max_tokens: int = MAX_PROMPT_TOKENS, seed: int = 0) -> dict[str, DomainReport]:
    """Write ``out/<domain>/train.parquet`` for each domain of ``sources`` and ``out/manifest.json``.

    ``sources[domain]``: logic ``{"seed", "tasks"}``; math/code/if ``{"path"}``; safety ``{"harmful",
    "benign"}``. Every domain is checked and converted before any file is written.
    """
    from claas_verl.utils.prompt_rows import write_parquet

    unknown = sorted(set(sources) - set(ABILITY))
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}; choose from {list(ABILITY)}")
    built: dict[str, list[dict]] = {}
    reports: dict[str, DomainReport] = {}
    for domain in [d for d in ABILITY if d in sources]:
        src = sources[domain]
        need = blocks[domain] * block_size
        rep = reports[domain] = DomainReport()
        accept = Filter(count_tokens, max_tokens, overlap, rep)
        if domain == "logic":
            rep.source = f"reasoning-gym seed {src.get('seed', LOGIC_SEED)}"
            # Three candidates per needed prompt: room for the length and overlap filters.
            cands = take(logic_candidates(3 * need, src.get("seed", LOGIC_SEED), src.get("tasks")), accept, need,
                         domain, rep.source)
        elif domain == "safety":
            rep.source = f"{src['harmful']} + {src['benign']}"
            if need % 2:
                raise ValueError(f"safety: {need} prompts cannot be split evenly between harmful and benign "
                                 "(MOPD paper: 336 + 336); use an even number of blocks × block size")
            cands = safety_candidates(src["harmful"], src["benign"], seed, need // 2)(accept)
        else:
            rep.source = str(src["path"])
            gen = {"math": math_candidates, "code": code_candidates, "if": if_candidates}[domain]
            cands = take(gen(src["path"], seed), accept, need, domain, rep.source)
        built[domain] = to_rows(domain, cands, block_size)
        rep.rows, rep.blocks = len(built[domain]), len(built[domain]) // block_size
    out = Path(out)
    for domain, rows in built.items():
        write_parquet(rows, out / domain / "train.parquet")
    manifest = {"block_size": block_size, "max_prompt_tokens": max_tokens, "seed": seed,
                "eval_prompts_checked": len(overlap),
                "domains": {d: vars(r) for d, r in reports.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return reports
