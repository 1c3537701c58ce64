"""Exact, deterministic byte accounting of the tensors a block of code allocates (any device, CPU included).

:class:`LiveBytes` is a ``TorchDispatchMode``: every storage that an operator returns and that none of its inputs
already held (a fresh allocation, not a view or an in-place result) is counted from its creation until its last
reference dies, forward and backward alike (CPU autograd runs on the calling thread, inside the mode). ``peak``
is the most bytes alive at once; unlike a caching allocator's counters or the process RSS it has no rounding,
no allocator slack and no dependence on what ran before, so a formula can be checked against it exactly::

    with LiveBytes() as mem:
        loss = model(ids).logits.float().logsumexp(-1).sum()
        loss.backward()
    mem.peak, mem.now   # bytes: most alive at once, still alive at exit

Tensors that existed before the block (parameters, inputs) are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated inside the ``with`` block: ``now`` (alive) and ``peak`` (most at once)."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {ptr for ptr, _, _ in map(_storage, tree_flatten((args, kwargs))[0]) if ptr is not None}
        for t in tree_flatten(out)[0]:
            ptr, n, storage = _storage(t)
            if ptr is None:
                continue
            if n == 0 or ptr in inputs or ptr in self._live:
                continue
            self._live[ptr] = n
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, ptr, n)
        return out

    def _free(self, ptr: int, n: int) -> None:
        if self._live.get(ptr) == n:
            del self._live[ptr]
            self.now -= n


def _storage(t):
    """``(data_ptr, nbytes, storage)`` of a plain tensor's storage; ``(None, 0, None)`` for anything else (a
    non-tensor, or a wrapper subclass such as a nested or distributed tensor, whose own storage holds nothing:
    its inner tensors are allocated, and counted, by the operators it dispatches to)."""
    if not isinstance(t, torch.Tensor):
        return None, 0, None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), storage
    except (RuntimeError, NotImplementedError):
        return None, 0, None
