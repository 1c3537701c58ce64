"""Build (``make_tiny``) and reuse (``ensure_tiny``) the offline tiny bundle.

Layout of OUT_DIR (a contract used by tests, recipes and demos)::

    manifest.json                       version, seed, domains, paths (relative), sizes
    student/                            HF model + tokenizer + generation_config.json
    experts/<domain>/                   same architecture and tokenizer, student fine-tuned on the domain
    data/<domain>/{train,test}.parquet  logic, math, code, safety, if, arith

``arch="qwen3"`` (CLI ``--arch qwen3``) builds the same bundle with Qwen3 models, by default into its own
directory (``$CLAAS_TINY_QWEN3_DIR`` or /tmp/claas_verl_tiny_qwen3); a recipe runs on it with the override
``tiny_dir=<that directory>``.

The bundle is built in a sibling temporary directory and renamed into place, and builds
are serialised by a file lock, so concurrent pytest workers or Ray processes never see a
half-written bundle nor build it twice.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from claas_verl.tiny.data import (
    ALL_DATA_DOMAINS,
    ARITH_DOMAIN,
    MOPD_DOMAINS,
    corpus_texts,
    make_split,
)
from claas_verl.tiny.model import DEFAULT_ARCH, check_arch
from claas_verl.utils.prompt_rows import stable_seed, write_parquet

# Bump whenever the bundle's content changes (architecture, tokenizer, data, experts):
# ensure_tiny() then rebuilds stale bundles instead of serving them.
TINY_VERSION = "3"  # 3: head size 32 (vLLM CPU can serve it), marker boost 3; 2: pretrained student, fine-tuned experts
DEFAULT_DIR = "/tmp/claas_verl_tiny"
ENV_DIR = "CLAAS_TINY_DIR"
# per architecture (claas_verl.tiny.model.ARCHS): (environment variable, default directory)
ARCH_DIRS = {DEFAULT_ARCH: (ENV_DIR, DEFAULT_DIR), "qwen3": ("CLAAS_TINY_QWEN3_DIR", "/tmp/claas_verl_tiny_qwen3")}
TINY_MANIFEST_MARKER = "pretrain"  # a key only the tiny bundle's manifest has (refuse_foreign_dir)
VOCAB_SIZE = 1024
N_TRAIN = 128
N_TEST = 32
MARKER_LOGIT_BOOST = 3.0
# A random student is nearly uniform over the vocabulary, so top-k distillation covers a
# negligible share of its mass; a brief deterministic pretraining on the bundle's own chat
# corpus (prompts + reference answers of every domain, all tokens) makes it peaked.
PRETRAIN = dict(steps=150, lr=3e-3, batch_size=16)
# Each expert: the pretrained student fine-tuned on its domain's reference answers (response
# tokens only), so τ_d is a real task vector rather than noise.
EXPERT_FT = dict(steps=40, lr=3e-3, batch_size=16)
REWARDS_MODULE = Path(__file__).with_name("rewards.py")


@dataclass(frozen=True)
class TinyPaths:
    """Absolute paths of a built bundle. ``str(p)`` them for Hydra overrides."""

    root: Path
    manifest: Path
    student: Path
    experts: dict[str, Path] = field(default_factory=dict)
    train: dict[str, Path] = field(default_factory=dict)  # domain (incl. "arith") -> train.parquet
    test: dict[str, Path] = field(default_factory=dict)
    rewards: Path = REWARDS_MODULE  # custom_reward_function.path for the claas_tiny/* domains

    @classmethod
    def under(cls, root: str | os.PathLike) -> TinyPaths:
        root = Path(root).resolve()
        return cls(
            root=root,
            manifest=root / "manifest.json",
            student=root / "student",
            experts={d: root / "experts" / d for d in MOPD_DOMAINS},
            train={d: root / "data" / d / "train.parquet" for d in ALL_DATA_DOMAINS},
            test={d: root / "data" / d / "test.parquet" for d in ALL_DATA_DOMAINS},
        )


def default_dir(arch: str = DEFAULT_ARCH) -> Path:
    env, default = ARCH_DIRS[check_arch(arch)]
    return Path(os.environ.get(env) or default)


def manifest_arch(manifest: dict) -> str:
    """The bundle's architecture; Qwen2 bundles carry no ``arch`` key (so their manifest and fingerprint are
    those of the bundles built before the Qwen3 variant existed)."""
    return manifest.get("arch", DEFAULT_ARCH)


def read_manifest(out_dir: str | os.PathLike) -> dict | None:
    """The bundle's manifest, or None when missing or unreadable."""
    try:
        return json.loads((Path(out_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def refuse_foreign_dir(out_dir: Path, what: str, marker_key: str, env_var: str) -> None:
    """Raise ``FileExistsError`` unless ``out_dir`` is missing, empty or an older build of this kind of bundle
    (a manifest with a ``version`` and ``marker_key``).

    ``ensure_*`` rebuild a stale bundle in place, replacing the directory; one that is not a bundle (a typo in
    ``env_var``, a data folder) must never be deleted.
    """
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    m = read_manifest(out_dir) if out_dir.is_dir() else None
    if isinstance(m, dict) and "version" in m and marker_key in m:
        return
    raise FileExistsError(
        f"{out_dir} exists and is not a {what} bundle (no manifest.json of one), so it is not replaced by a "
        f"build: point {env_var} (or the directory argument) at a new or empty directory, or remove {out_dir} "
        "yourself if it is disposable"
    )


def is_current(out_dir: str | os.PathLike, seed: int = 0, arch: str = DEFAULT_ARCH) -> bool:
    """True when OUT_DIR holds a complete bundle of this version, seed and architecture."""
    m = read_manifest(out_dir)
    if not m or m.get("version") != TINY_VERSION or m.get("seed") != seed or manifest_arch(m) != arch:
        return False
    paths = TinyPaths.under(out_dir)
    needed = [paths.student / "model.safetensors", *(p / "model.safetensors" for p in paths.experts.values()),
              *paths.train.values(), *paths.test.values()]
    return all(p.exists() for p in needed)


def _lock(out_dir: Path):
    from filelock import FileLock

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(out_dir) + ".lock", timeout=600)


def make_tiny(out_dir: str | os.PathLike, seed: int = 0, force: bool = False, arch: str = DEFAULT_ARCH) -> TinyPaths:
    """Build the bundle into ``out_dir`` (no network), with ``arch`` models (``qwen2`` or ``qwen3``).

    An existing current bundle (same version, seed and arch) is kept unless ``force``; an existing
    directory that is not a current bundle is replaced only with ``force=True``, so a typo in
    OUT_DIR cannot wipe unrelated files.
    """
    out_dir = Path(out_dir).resolve()
    check_arch(arch)
    with _lock(out_dir):
        if out_dir.exists() and not force:
            if is_current(out_dir, seed, arch):
                return TinyPaths.under(out_dir)
            if any(out_dir.iterdir()):
                raise FileExistsError(
                    f"{out_dir} exists and is not a current tiny bundle (version {TINY_VERSION}, seed {seed}, "
                    f"arch {arch}); pass force=True (CLI: --force) to replace it, or choose another OUT_DIR"
                )
        return _build_locked(out_dir, seed, arch)


def ensure_tiny(out_dir: str | os.PathLike | None = None, seed: int = 0, arch: str = DEFAULT_ARCH) -> TinyPaths:
    """Return the bundle at ``out_dir`` (default :func:`default_dir` of ``arch``: ``$CLAAS_TINY_DIR`` or
    /tmp/claas_verl_tiny for qwen2), building it first if it is missing, incomplete, of another version, seed
    or arch. A directory there that is not a tiny bundle is refused (``FileExistsError``), never replaced.

    Idempotent and safe to call from many processes at once: the check runs again under the
    file lock, so only one process builds.
    """
    out_dir = Path(out_dir if out_dir is not None else default_dir(arch)).resolve()
    check_arch(arch)
    if is_current(out_dir, seed, arch):
        return TinyPaths.under(out_dir)
    env = ARCH_DIRS[arch][0]
    refuse_foreign_dir(out_dir, "tiny", TINY_MANIFEST_MARKER, env)
    with _lock(out_dir):
        if is_current(out_dir, seed, arch):  # another process built it while we waited
            return TinyPaths.under(out_dir)
        refuse_foreign_dir(out_dir, "tiny", TINY_MANIFEST_MARKER, env)
        return _build_locked(out_dir, seed, arch)


def _build_locked(out_dir: Path, seed: int, arch: str = DEFAULT_ARCH) -> TinyPaths:
    tmp = out_dir.with_name(f".{out_dir.name}.build-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _build_into(tmp, seed, arch)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TinyPaths.under(out_dir)


def _build_into(root: Path, seed: int, arch: str = DEFAULT_ARCH) -> None:
    import torch

    from claas_verl.tiny.model import build_student, make_expert, marker_token_ids, save_model, train_lm
    from claas_verl.tiny.tokenizer import EOT_TOKEN, IM_END, special_token_ids, train_tokenizer

    root.mkdir(parents=True)
    paths = TinyPaths.under(root)
    print(f"[tiny] building the tiny bundle ({arch}, seed {seed}) into {root}", file=sys.stderr, flush=True)

    # Data first: the tokenizer is trained on it.
    splits = {d: make_split(d, N_TRAIN, N_TEST, seed) for d in ALL_DATA_DOMAINS}
    for d, (train, test) in splits.items():
        write_parquet(train, paths.train[d])
        write_parquet(test, paths.test[d])

    tokenizer = train_tokenizer(corpus_texts(seed), vocab_size=VOCAB_SIZE)
    ids = special_token_ids(tokenizer)
    eos_ids = [ids[IM_END], ids[EOT_TOKEN]]  # chat EOS first (config.eos_token_id), then document end

    def examples(rows):  # (prompt ids, reference + <|im_end|> ids) in the chat format of the recipes
        out = []
        for r in rows:
            prompt = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            out.append((tokenizer.encode(prompt, add_special_tokens=False),
                        tokenizer.encode(r["extra_info"]["reference"] + IM_END, add_special_tokens=False)))
        return out

    train_examples = {d: examples(splits[d][0]) for d in ALL_DATA_DOMAINS}
    # The model's own threads would fight the other processes on a small shared machine,
    # and one thread plus deterministic kernels keep the float reductions (and so the saved
    # bytes) reproducible.
    n_threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        student = build_student(len(tokenizer), eos_ids, ids[EOT_TOKEN], seed, arch)
        corpus = [ex for d in ALL_DATA_DOMAINS for ex in train_examples[d]]
        train_lm(student, corpus, **PRETRAIN, seed=stable_seed("claas_tiny.pretrain", seed),
                 prompt_loss=True, pad_token_id=ids[EOT_TOKEN], label="[tiny] pretrain")
        save_model(student, tokenizer, paths.student)
        markers = {}
        for d in MOPD_DOMAINS:
            prompt_ids = [p for p, _ in train_examples[d][:16]]
            markers[d] = marker_token_ids(tokenizer, d)
            expert = make_expert(student, d, seed, train_examples[d], **EXPERT_FT, pad_token_id=ids[EOT_TOKEN],
                                 marker_ids=markers[d], prompt_ids=prompt_ids, marker_logit_boost=MARKER_LOGIT_BOOST)
            save_model(expert, tokenizer, paths.experts[d])
    finally:
        torch.set_num_threads(n_threads)
        torch.use_deterministic_algorithms(was_deterministic)

    rel = lambda p: str(p.relative_to(root))  # noqa: E731 - manifest paths are relative to OUT_DIR
    manifest = {
        "version": TINY_VERSION,
        "seed": seed,
        "domains": list(MOPD_DOMAINS),
        "data_domains": list(ALL_DATA_DOMAINS),
        "rl_smoke_domain": ARITH_DOMAIN,
        "paths": {
            "student": rel(paths.student),
            "experts": {d: rel(p) for d, p in paths.experts.items()},
            "data": {d: {"train": rel(paths.train[d]), "test": rel(paths.test[d])} for d in ALL_DATA_DOMAINS},
            "rewards_module": "claas_verl/tiny/rewards.py",
        },
        "sizes": {
            "vocab_size": len(tokenizer),
            "num_parameters": sum(p.numel() for p in student.parameters()),
            "train_rows": N_TRAIN,
            "test_rows": N_TEST,
        },
        "tokens": {"eos_token_ids": eos_ids, "pad_token_id": ids[EOT_TOKEN], "special": ids},
        "pretrain": PRETRAIN,
        "experts": {"finetune": EXPERT_FT, "marker_logit_boost": MARKER_LOGIT_BOOST, "marker_ids": markers},
    }
    if arch != DEFAULT_ARCH:
        manifest["arch"] = arch
    # Written last: its presence (with the right version) is what marks the bundle complete.
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
