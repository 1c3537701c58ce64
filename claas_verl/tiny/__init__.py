"""Offline tiny models and data for tests, demos and tiny CPU recipes.

``make_tiny(out_dir, seed=0, force=False)`` builds, with no network, in ~40 s on one core,
a tiny Qwen2 student (briefly pretrained, so peaked), one expert per MOPD domain (the student
fine-tuned on that domain), a locally trained byte-level BPE
tokenizer with a ChatML + thinking chat template, and verl-format parquet data;
``ensure_tiny()`` returns an existing bundle or builds it once (file-locked).
CLI: ``python -m claas_verl.tiny make OUT_DIR [--seed N] [--force]``.

Heavy libraries (torch, transformers, tokenizers, pyarrow) are imported only when building.
"""

from claas_verl.tiny.build import (
    TINY_VERSION,
    TinyPaths,
    default_dir,
    ensure_tiny,
    is_current,
    make_tiny,
    read_manifest,
)
from claas_verl.tiny.data import ALL_DATA_DOMAINS, ARITH_DOMAIN, GSM8K_DATA_SOURCE, MOPD_DOMAINS

__all__ = [
    "ALL_DATA_DOMAINS",
    "ARITH_DOMAIN",
    "GSM8K_DATA_SOURCE",
    "MOPD_DOMAINS",
    "TINY_VERSION",
    "TinyPaths",
    "default_dir",
    "ensure_tiny",
    "is_current",
    "make_tiny",
    "read_manifest",
]
