"""Crash-safe snapshot files for the replay buffer (no Ray import).

A snapshot is the pickled ``ReplayBuffer.state_dict()``. Writes are atomic: the bytes go to a temporary file in the
SAME directory (``os.replace`` is only atomic within one file system), which is flushed and fsync'ed before it
replaces the target, and the directory is fsync'ed so the rename itself survives a power loss. A crash at any point
leaves either the previous snapshot or the new one, never a torn file.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any


def save_snapshot(path: str, state: Any) -> str:
    """Atomically write ``state`` (pickle protocol 5) to ``path``; return the absolute path."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(state, f, protocol=5)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        # The previous snapshot at `path` is untouched; only our temporary file is removed.
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


def load_snapshot(path: str) -> Any:
    """Read a snapshot written by :func:`save_snapshot` (trusted files only: this is ``pickle.load``)."""
    with open(path, "rb") as f:
        return pickle.load(f)
