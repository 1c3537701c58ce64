"""Evenly spread block indices (docs/math.md §B.8, "Helper").

``spread(n, N)`` picks ``n`` of the ``N`` blocks ``0..N-1`` as evenly as possible, first and last
included. numpy's ``round`` rounds half to even, which Table 7 of the MOPD paper needs (math, b=3: the pool
``spread(9, 21)`` holds 2.5→2, 7.5→8, 12.5→12, 17.5→18); rounding half up would not reproduce it.
"""

from __future__ import annotations

import numpy as np


def spread(n: int, num_blocks: int) -> list[int]:
    """Return ``n`` evenly spread block indices in ``[0, num_blocks)``, ascending (repeats when n > N).

    docs/math.md §B.8: ``[]`` if n == 0, ``[0]`` if n == 1, else ``round_half_even(linspace(0, N-1, n))``.
    """
    if n < 0:
        raise ValueError(f"spread: n must be >= 0, got {n}")
    if num_blocks < 1:
        raise ValueError(f"spread: the number of blocks must be >= 1, got {num_blocks}")
    if n == 0:
        return []
    if n == 1:
        return [0]
    return [int(v) for v in np.round(np.linspace(0, num_blocks - 1, n)).astype(int)]
