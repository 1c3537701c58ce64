"""Crash-safe snapshot files for the replay buffer (no Ray import).

A snapshot is the pickled ``ReplayBuffer.state_dict()``, written with :func:`claas_verl.utils.files.atomic_write`
(a crash leaves the previous file or the new one, never a torn one). What a crash can leave behind is a
``<name>.<random>.tmp`` next to it, which no reader opens (readers open only the final name).
"""

from __future__ import annotations

import pickle
from typing import Any

from claas_verl.utils.files import atomic_write

__all__ = ["atomic_write", "load_snapshot", "save_snapshot"]


def save_snapshot(path: str, state: Any) -> str:
    """Atomically write ``state`` (pickle protocol 5) to ``path``; return the absolute path."""
    return atomic_write(path, lambda f: pickle.dump(state, f, protocol=5))


def load_snapshot(path: str) -> Any:
    """Read a snapshot written by :func:`save_snapshot` (trusted files only: this is ``pickle.load``)."""
    with open(path, "rb") as f:
        return pickle.load(f)
