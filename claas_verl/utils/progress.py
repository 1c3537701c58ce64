"""Progress lines with an ETA for long work that would otherwise run silent (bundle builds, evaluation, data
preparation).

One line per report on stderr, never a carriage-return bar: the same output reads well in a terminal and in a CI
or Ray job log. Reports are throttled (the first unit, then at most one every ``every_s`` seconds, and the last),
so a fast loop costs nothing and a slow one says where it is::

    [tiny gym] base SFT: 120/600 steps (20%), 0:45 elapsed, ETA 3:00 | loss 1.234

``CLAAS_PROGRESS_S`` sets the interval (seconds; ``0`` reports every unit, ``off`` silences them).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")
ENV_INTERVAL = "CLAAS_PROGRESS_S"
DEFAULT_EVERY_S = 10.0


def clock(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour)."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _interval(every_s: float | None) -> float | None:
    """Seconds between reports; None when silenced by ``$CLAAS_PROGRESS_S=off``."""
    env = os.environ.get(ENV_INTERVAL)
    if env is not None:
        if env.strip().lower() in ("off", "none", "no", "false"):
            return None
        try:
            return max(float(env), 0.0)
        except ValueError:
            raise ValueError(f"${ENV_INTERVAL}={env!r}: expected seconds between progress lines, or 'off'") from None
    return DEFAULT_EVERY_S if every_s is None else every_s


class Progress:
    """Counts ``total`` units of one task and prints a throttled line with the rate-based ETA (``total=None``: an
    open-ended count, e.g. updates of a stream-driven run, shown without percentage or ETA)."""

    def __init__(self, label: str, total: int | None, unit: str = "steps", every_s: float | None = None,
                 stream: TextIO | None = None, clock_fn=time.monotonic):
        self.label, self.total, self.unit = label, None if total is None else int(total), unit
        self.every_s = _interval(every_s)
        self.stream = stream
        self._now = clock_fn
        self.start = self._now()
        self.done = 0
        self._last_print: float | None = None

    def update(self, n: int = 1, **info) -> None:
        """Count ``n`` more units; ``info`` (e.g. ``loss=1.23``) is shown at the end of the line."""
        self.done += n
        if self.every_s is None:
            return
        now = self._now()
        finished = self.total is not None and self.done >= self.total
        due = self._last_print is None or now - self._last_print >= self.every_s or finished
        if due:
            self._last_print = now
            print(self.line(now, info), file=self.stream or sys.stderr, flush=True)

    def line(self, now: float, info: dict | None = None) -> str:
        elapsed = now - self.start
        if self.total is None:
            return self._with_info(f"{self.label}: {self.done} {self.unit}, {clock(elapsed)} elapsed", info)
        text = f"{self.label}: {self.done}/{self.total} {self.unit}"
        if self.total > 0:
            text += f" ({100 * self.done / self.total:.0f}%)"
        text += f", {clock(elapsed)} elapsed"
        if 0 < self.done < self.total:
            text += f", ETA {clock(elapsed / self.done * (self.total - self.done))}"
        return self._with_info(text, info)

    @staticmethod
    def _with_info(text: str, info: dict | None) -> str:
        if info:
            text += " | " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
        return text


def track(items: Iterable[T], label: str, total: int | None = None, unit: str = "items",
          every_s: float | None = None, stream: TextIO | None = None) -> Iterator[T]:
    """Yield ``items``, reporting progress after each one (``total`` defaults to ``len(items)``)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    progress = Progress(label, len(items) if total is None else total, unit, every_s, stream)
    for item in items:
        yield item
        progress.update()
