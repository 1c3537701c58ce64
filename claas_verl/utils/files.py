"""Crash-safe file writes, one way for the whole package (replay snapshots, CLaaS and MOPD resume state).

The bytes go to a temporary file in the SAME directory (``os.replace`` is atomic only within one file system), are
flushed and fsync'ed, then replace the target, and the directory is fsync'ed so the rename itself survives a power
loss. A crash leaves the previous file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO, Any


def atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> str:
    """Atomically create or replace ``path`` with what ``write(f)`` writes to a binary file object; return the
    absolute path. If ``write`` raises (or the process dies), the previous file at ``path`` is untouched."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        # The previous file at `path` is untouched; only our temporary file is removed.
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def atomic_write_text(path: str, text: str) -> str:
    """:func:`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))
