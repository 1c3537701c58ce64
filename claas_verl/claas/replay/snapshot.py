"""Crash-safe snapshot files for the replay buffer (no Ray import).

A snapshot is the pickled ``ReplayBuffer.state_dict()``. Writes are atomic (:func:`atomic_write`): the bytes go to a
temporary file in the SAME directory (``os.replace`` is only atomic within one file system), which is flushed and
fsync'ed before it replaces the target, and the directory is fsync'ed so the rename itself survives a power loss. A
crash at any point leaves either the previous file or the new one, never a torn file; what a crash can leave behind
is a ``<name>.<random>.tmp`` next to it, which no reader opens (readers open only the final name).
"""

from __future__ import annotations

import os
import pickle
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


def save_snapshot(path: str, state: Any) -> str:
    """Atomically write ``state`` (pickle protocol 5) to ``path``; return the absolute path."""
    return atomic_write(path, lambda f: pickle.dump(state, f, protocol=5))


def load_snapshot(path: str) -> Any:
    """Read a snapshot written by :func:`save_snapshot` (trusted files only: this is ``pickle.load``)."""
    with open(path, "rb") as f:
        return pickle.load(f)
