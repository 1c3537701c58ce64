"""Read local dataset files (JSONL, JSON, Parquet, CSV) into lists of dicts, with clear shape errors.

Every converter and benchmark loader goes through :func:`read_records` and :func:`require_columns`, so a
file of the wrong shape fails with the file's path and the missing column(s) named, before anything
is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def read_records(path: str | Path) -> list[dict]:
    """Rows of a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file (or of every such file in a directory,
    in name order) as plain dicts."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory (datasets are read from local paths only)")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES)
        if not files:
            raise ValueError(f"{p}: directory holds no {'/'.join(SUFFIXES)} file")
        return [r for f in files for r in read_records(f)]
    if p.suffix == ".jsonl":
        rows = []
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{p}:{n}: not a JSON line ({e})") from e
        return _dicts(rows, p)
    if p.suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(data, dict):  # {"examples": [...]} (BBH's own files) or {"data": [...]}
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{p}: a JSON object must hold exactly one list of rows, found {len(lists)}")
            data = lists[0]
        return _dicts(data, p)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix == ".csv":
        import pandas as pd

        return pd.read_csv(p, keep_default_na=False).to_dict(orient="records")
    raise ValueError(f"{p}: unsupported file type {p.suffix!r}; use one of {SUFFIXES}")


def _dicts(rows: object, p: Path) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{p}: expected a list of JSON objects (one row each)")
    return rows


def require_columns(rows: Sequence[dict], columns: Iterable[str], path: str | Path, what: str) -> None:
    """Raise naming ``path``, the first offending row and the missing column(s) if any row lacks one."""
    if not rows:
        raise ValueError(f"{path}: {what} file has no rows")
    columns = list(columns)
    for i, r in enumerate(rows):
        missing = [c for c in columns if c not in r]
        if missing:
            raise ValueError(
                f"{path}: {what} file lacks column(s) {missing} (row {i} has {sorted(r)}); "
                f"expected columns {columns}"
            )


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return p
