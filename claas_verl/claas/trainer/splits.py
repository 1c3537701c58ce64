"""The split protocol of a scenario-driven CLaaS run (docs/math.md §A.1.6, CLaaS paper §4).

For split j, its rollouts run with training concurrent; when they end, training continues until ``|B| < B_min``;
checkpoint j is saved; the served policy is evaluated on every split (row j of M); then split j+1 starts.
Service-driven runs (no producers) have no splits: they wait for the chat API to fill the buffer.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import ray

from claas_verl.claas.trainer.chat_api import ChatApiWiring
from claas_verl.claas.trainer.checkpoints import ClaasCheckpoints
from claas_verl.claas.trainer.config import ClaasConfig
from claas_verl.claas.trainer.records import RunCounters, RunRecords
from claas_verl.claas.trainer.rollout_side import RolloutSide


class SplitProtocol:
    """Which split runs (``idx``, ``complete``), its producers' future, and M's rows with their split records.

    A split's end takes checkpoint j through ``checkpoints`` (which records this protocol's position in it)."""

    def __init__(self, claas: ClaasConfig, side: RolloutSide, chat: ChatApiWiring, records: RunRecords,
                 counters: RunCounters, out_dir: str, checkpoints: ClaasCheckpoints):
        self.claas = claas
        self.side = side
        self.chat = chat
        self.records = records
        self.counters = counters
        self.out_dir = out_dir
        self.checkpoints = checkpoints
        self.future: concurrent.futures.Future | None = None
        self.idx = -1
        self.complete = False  # the current split's rollouts ended and its training ran until |B| < B_min
        self.matrix: list[list[float]] = []
        self.split_records: list[dict] = []

    @property
    def stream(self):
        return self.side.stream

    def begin(self, position) -> None:
        """At the start of verl's loop: continue the split a resumed checkpoint was in, or start the next one."""
        pos = position
        if pos is not None and pos.split >= 0 and not pos.complete:
            self.start(pos.split, skip=pos.done)  # the split in progress: its uncommitted scenarios
            return
        if pos is not None and pos.split >= 0 and len(self.matrix) <= pos.split:
            self.record_row(pos.split)  # killed after checkpoint j, before row j of M was evaluated
        self.start_next()

    def start_next(self) -> None:
        if not self.claas.producer.enabled:
            return  # service-driven: no scenario stream
        if self.idx + 1 >= self.stream.num_splits:
            self.idx = self.stream.num_splits
            self.future = None
            return
        self.start(self.idx + 1)

    def start(self, j: int, skip=()) -> None:
        """Run split j's rollouts in the background, except the global scenario indices in ``skip`` (committed
        before the checkpoint a resumed run starts from). The trace's ``global_steps`` is the number of updates
        done, as in every other trace event (verl's own counter is the next step's, one more)."""
        self.idx, self.complete = j, False
        scenarios = self.stream.split(j)
        offset = j * self.stream.split_size
        self.future = self.side.loop.submit(self.side.producer.run_split(scenarios, index_offset=offset, skip=skip))
        self.records.trace({"event": "split_start", "split": j + 1, "global_steps": self.counters.updates,
                            "skip": sorted(skip)})

    def advance_until_ready(self) -> bool:
        """Block until an update is possible (True) or the whole stream is done (False), running split ends.

        Event-driven: waits on the replay actor's ``wait_ready`` (an asyncio condition notified by ``add``)
        and on the current split's producer future, whichever completes first.
        """
        t0 = time.perf_counter()
        replay = self.side.replay_actor
        try:
            if not self.claas.producer.enabled:
                return self.chat.wait_ready(replay)
            while self.future is not None:
                if self.future.done() and self.future.exception() is not None:
                    # dead producers fail the run at once, with their cause, never training on without them
                    raise RuntimeError("the rollout producers died") from self.future.exception()
                if self.claas.trains:
                    ref = replay.wait_ready.remote()
                    ready = ref.future()
                    concurrent.futures.wait([ready, self.future], return_when=concurrent.futures.FIRST_COMPLETED)
                    if ready.done():
                        if ready.result():
                            return True
                    else:
                        try:
                            ray.cancel(ref)  # the split ended first: drop the waiter parked in the actor
                        except Exception:  # noqa: BLE001 - a parked waiter is harmless
                            pass
                self.future.result()  # the split's rollouts ended (re-raises a producer error)
                # docs/math.md §A.1.6 step 2: keep training until |B| < B_min, then checkpoint and move on.
                if self.claas.trains and ray.get(replay.ready.remote()):
                    return True
                self._finish()
                self.start_next()
            return False
        finally:
            self.counters.last_wait_s = time.perf_counter() - t0
            self.counters.wait_s += self.counters.last_wait_s

    def _finish(self) -> None:
        j = self.idx
        self.complete = True
        k = self.counters.updates
        self.split_records.append({"split": j + 1, "global_steps": k, "updates": k,
                                   "checkpoint": os.path.join(self.out_dir, f"global_step_{k}") if self.claas.trains
                                   else None})
        if self.claas.trains:
            # checkpoint j: verl's actor (+critic) and the CLaaS state at global_step_{k}
            self.checkpoints.take(self.side, self)
        split_dir = os.path.join(self.out_dir, f"claas_split_{j + 1}")
        os.makedirs(split_dir, exist_ok=True)  # the split's record; the buffer itself is in the checkpoint (resume)
        state = {**self.split_records[-1], "producer": self.side.producer.stats.as_dict(),
                 "buffer": self.side.buffer_stats()}
        if self.side.ema is not None:
            state["ema"] = self.side.ema.state_dict()
        if self.side.icl_memory is not None:
            state["icl_memory"] = self.side.icl_memory.state_dict()
        with open(os.path.join(split_dir, "state.json"), "w") as f:
            json.dump(state, f, indent=2, default=str)
        self.record_row(j)

    def record_row(self, j: int) -> None:
        """Row j of M (evaluated after checkpoint j, so a run killed in between evaluates it when resumed)."""
        row = self._evaluate_row() if self.claas.eval.enabled else [float("nan")] * self.stream.num_splits
        self.matrix.append(row)
        self.records.trace({"event": "split_end", "split": j + 1, "global_steps": self.counters.updates, "M_row": row,
                            "buffer_size": self.side.buffer_size()})
        print(f"[claas] split {j + 1}/{self.stream.num_splits} done at update {self.counters.updates}: "
              f"M[{j + 1},:] = " + ", ".join(f"{v:.3f}" for v in row), flush=True)

    def _evaluate_row(self) -> list[float]:
        """Row j of M: the policy served right after checkpoint j, on every split k (docs/math.md §A.4)."""
        e = self.claas.eval
        row = []
        for k in range(self.stream.num_splits):
            res = self.side.loop.submit(self.side.producer.evaluate(
                self.stream.split(k), n_samples=e.n_samples, temperature=e.temperature,
                max_new_tokens=e.max_new_tokens)).result()
            row.append(res["pass_rate"])
        return row

    def current_for_checkpoint(self) -> int:
        """The split a checkpoint records as in progress (-1: none, or service-driven)."""
        if self.claas.producer.enabled and self.idx < self.stream.num_splits:
            return self.idx
        return -1
