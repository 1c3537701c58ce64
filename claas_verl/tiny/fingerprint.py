"""A built bundle's identity: which weights and data a benchmark record was made with.

The benchmarks keep finished runs and reuse them when asked again with the same ``--out``. A run is only the same
run when it trained and was scored on the same bundle: after a rebuild with other settings (a new bundle version,
another seed, another ``CLAAS_GYM_DIR``) a reused record would mix an old student with new experts and data.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# What makes a bundle what it is: its weights, its data and the tokenizer/config files beside the weights. Files a
# run may leave in the directory (locks, caches) are not part of it.
_CONTENT_SUFFIXES = (".safetensors", ".parquet", ".json", ".jinja")
# Manifest keys that differ between two builds of the same bundle (wall-clock time)
_VOLATILE_MANIFEST_KEYS = ("build_seconds",)


def bundle_fingerprint(root: str | os.PathLike) -> str:
    """16 hex digits of a sha256 over every content file under ``root`` (relative path and bytes, in path order),
    the manifest read without its build time.

    Bundles build deterministically (one thread, seeded), so two builds of one version and seed on one machine
    give one fingerprint; any changed weight, data row or setting gives another.
    """
    root = Path(root)
    manifest = root / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} is missing: {root} is not a built bundle (build it with "
                                "`python -m claas_verl.tiny make DIR` or `python -m claas_verl.tiny gym DIR`)")
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_CONTENT_SUFFIXES)):
        rel = path.relative_to(root).as_posix()
        if rel == "manifest.json":
            data = {k: v for k, v in json.loads(path.read_text()).items() if k not in _VOLATILE_MANIFEST_KEYS}
            content = json.dumps(data, sort_keys=True).encode()
        else:
            content = path.read_bytes()
        digest.update(rel.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
    return digest.hexdigest()[:16]
