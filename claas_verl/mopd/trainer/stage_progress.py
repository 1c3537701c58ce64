"""The console line of a continual MOPD run: one per executed step, with the stage's position and ETA."""

from __future__ import annotations

import time
from typing import Any

from claas_verl.mopd.trainer.plan_steps import step_index
from claas_verl.utils.progress import clock


class StageProgress:
    """One console line per executed step with the stage's position and ETA (the rate of this process's steps in
    the stage)::

        [mopd] step 26/72 stage 2/3: 14/36 steps (39%), 1:05 elapsed, ETA 1:40 | replay reverse block 3, kl_topk 0.12

    ``[mopd] step N/L`` opens the line (``benchmarks/bench_mopd_step.py`` times the steps by it)."""

    def __init__(self, plan_steps: list[dict], bounds: dict[int, tuple[int, int]], clock_fn=time.monotonic):
        self.plan_steps, self.bounds = plan_steps, bounds
        self._clock = clock_fn
        self._stage: int | None = None
        self._start = 0.0
        self._ran = 0  # steps of the stage this process ran (a resumed stage counts from the resume)

    def begin(self, stage: int) -> None:
        """``stage``'s first step in this process (a new stage, or the first step after a resume) starts now."""
        self._stage, self._start, self._ran = stage, self._clock(), 0

    def line(self, global_step: int, metrics: dict[str, Any]) -> str:
        i = step_index(global_step, len(self.plan_steps))
        step = self.plan_steps[i]
        first, last = self.bounds[step["stage"]]
        if self._stage != step["stage"]:
            self.begin(step["stage"])
        now = self._clock()
        self._ran += 1
        done, total = i - first + 1, last - first + 1
        elapsed = now - self._start
        eta = f", ETA {clock(elapsed / self._ran * (total - done))}" if done < total else ""
        return (f"[mopd] step {global_step}/{len(self.plan_steps)} stage {step['stage']}/{max(self.bounds)}: "
                f"{done}/{total} steps ({100 * done / total:.0f}%), {clock(elapsed)} elapsed{eta} | "
                f"{step['kind']} {step['domain']} block {step['block']} teacher {step['teacher']}, "
                f"kl_topk {metrics.get('mopd/kl_topk', float('nan')):.4f}, "
                f"sigma {metrics.get('mopd/adv_sigma', float('nan')):.4g}")
