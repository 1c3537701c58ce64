"""Two helpers every writer of prompt files shares (the MOPD prompt builder and evaluation, the offline tiny bundles):
a seed that is the same on every machine and Python, and a parquet writer that keeps pyarrow out of import time."""

from __future__ import annotations

import hashlib
from pathlib import Path


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a SHA-256 of the parts (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write rows with pyarrow (imported here so importing this module stays light)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path)
