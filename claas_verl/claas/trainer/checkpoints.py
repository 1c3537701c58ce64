"""Checkpoints and resume of a CLaaS run (the state format and the restart-consistency invariant: resume.py).

verl's own ``_save_checkpoint`` / ``_load_checkpoint`` (``trainer.save_freq``, ``trainer.resume_mode``) save and
load the policy and optimizer; this component adds the CLaaS state (buffer snapshot, k, EMA statistics, SDPO
teacher, stream position, M's rows) to the same ``global_step_N`` folder, at one checkpoint point: after update N
is applied, counted (k = N) and pushed, with the producers' commits (or the chat API's sink) paused. verl's loop
asks for a checkpoint before ``on_step_end`` (k one behind); that request only marks one :attr:`due`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from claas_verl.claas.trainer import resume as rs
from claas_verl.claas.trainer.chat_api import ChatApiWiring
from claas_verl.claas.trainer.checks import select
from claas_verl.claas.trainer.config import ClaasConfig
from claas_verl.claas.trainer.records import RunCounters, RunRecords
from claas_verl.claas.trainer.rollout_side import RolloutSide
from claas_verl.claas.trainer.tenants_side import buffer_summary, buffer_summary_async

if TYPE_CHECKING:  # the split protocol takes checkpoints through this class: annotation only
    from claas_verl.claas.trainer.splits import SplitProtocol


class ClaasCheckpoints:
    """The resumed checkpoint (``resume``, ``resume_dir``, the run's resume history) and the checkpoint point
    (``due``, ``in_progress``, ``last_step``).

    It exists before verl loads a checkpoint (its CLaaS state is read first), so before the rollout side and the
    split protocol, which are built from that state: those two are arguments of the calls that save or restore
    them. ``save_verl(k)`` writes verl's part of checkpoint k; ``save_teacher(claas_dir)`` the SDPO teacher (the
    files written, or None without one)."""

    def __init__(self, config: Any, claas: ClaasConfig, records: RunRecords, counters: RunCounters,
                 chat: ChatApiWiring, *, save_verl: Callable[[int], None],
                 save_teacher: Callable[[str], list | None]):
        self.config = config
        self.claas = claas
        self.records = records
        self.counters = counters
        self.chat = chat
        self._save_verl = save_verl
        self._save_teacher = save_teacher
        self.resume: rs.ClaasState | None = None  # the CLaaS state of the checkpoint this run resumes from
        self.resume_dir: str | None = None
        self.resumes: list[dict] = []  # one record per resume of this run's history
        self.teacher_ema_steps: int | None = None  # EMA steps of the SDPO teacher restored at a resume
        self.teacher_restored: dict | None = None  # ... and rank 0's sha256 of its tensors (and of the student LoRA)
        self.due = False  # verl's loop asked for a checkpoint; taken at the checkpoint point (on_step_end)
        self.in_progress = False
        self.last_step: int | None = None  # step of the latest verl checkpoint this history wrote or loaded
        self.tenants = None  # a multi-tenant job's TenantTraining (its state is saved with every checkpoint)

    @property
    def out_dir(self) -> str:
        return self.config.trainer.default_local_dir

    # ---------------------------------------------------------------- saving
    def take(self, side: RolloutSide, splits: SplitProtocol) -> None:
        """Checkpoint N = k: the CLaaS state into ``global_step_N/claas/`` first, then verl's part, whose tracker file
        (``latest_checkpointed_iteration.txt``, written last) commits it. See the invariant in resume.py."""
        self.due = False
        k = int(buffer_summary(side.replay_actor, side.tenants)["k"])  # with tenants: summed over partitions
        if k != self.counters.updates:
            raise RuntimeError(f"checkpoint point broken: the buffer's k={k} but {self.counters.updates} updates "
                               "were done")
        folder = os.path.join(self.out_dir, f"global_step_{k}")
        claas_dir = os.path.join(folder, rs.CLAAS_DIR)
        os.makedirs(claas_dir, exist_ok=True)
        teacher = self._save_teacher(claas_dir)  # θ_T changes only inside an update (this thread): no pause needed
        state = self._capture_state(k, claas_dir, teacher, side, splits)
        if self.last_step != k:  # a split end at the step of a periodic checkpoint re-writes only the state
            self.in_progress = True
            try:
                self._save_verl(k)
            finally:
                self.in_progress = False
            self.last_step = k
        self.records.trace({"event": "checkpoint", "global_steps": k, "path": folder,
                            "buffer_size": state.buffer["size"], "position": dataclasses.asdict(state.position)})

    def at_shutdown(self, side: RolloutSide, splits: SplitProtocol) -> None:
        """Service-driven runs: the chat API drains first, so every reward it acknowledged is in the buffer that is
        captured. Then a final checkpoint of the last update (whatever ``trainer.save_freq``, once an update was
        done), or a re-capture of the CLaaS state of that checkpoint (the chats accepted since then are kept;
        verl's part is unchanged)."""
        self.chat.drain(self.records.warn)
        if (not self.claas.producer.enabled and self.claas.trains
                and (int(select(self.config, "trainer.save_freq", -1)) > 0 or self.counters.updates > 0)):
            self.take(side, splits)

    def _capture_state(self, k: int, claas_dir: str, teacher: list | None, side: RolloutSide,
                       splits: SplitProtocol) -> rs.ClaasState:
        """Buffer snapshot + state.json, captured with commits paused (producers: their commit lock; chat API: its
        sink drained and gated), so the snapshot, the EMA and the committed-scenario list describe one instant."""
        producer_driven = self.claas.producer.enabled
        split_size = side.stream.split_size if producer_driven else 0

        async def capture() -> rs.ClaasState:
            buffer_file = rs.new_buffer_file()
            await side.replay_actor.save.remote(os.path.join(claas_dir, buffer_file))
            summary = await buffer_summary_async(side.replay_actor, side.tenants)
            if summary["k"] != k:
                raise RuntimeError(f"the buffer's k moved from {k} to {summary['k']} during the checkpoint")
            ema = side.ema.state_dict() if side.ema is not None else None
            prod = side.producer.state_dict()
            j = splits.current_for_checkpoint()
            lo = j * split_size
            position = rs.StreamPosition(split=j, done=[i for i in prod["done"] if lo <= i < lo + split_size],
                                         complete=splits.complete)
            state = rs.ClaasState(
                global_steps=k, updates=self.counters.updates, config=self.identity(), position=position,
                buffer={"file": buffer_file, **summary}, matrix=[list(r) for r in splits.matrix],
                split_records=list(splits.split_records), ema=ema, producer=prod["stats"],
                icl_memory=side.icl_memory.state_dict() if side.icl_memory is not None else None,
                service=self.chat.stats(), sdpo_teacher=teacher, resumes=list(self.resumes),
                tenants=None if self.tenants is None else self.tenants.save(claas_dir))
            rs.save_state(claas_dir, state)
            # Written while commits are paused: commits traced before it are in this snapshot, those after are not.
            self.records.trace({"event": "claas_state", "global_steps": k, "buffer_size": summary["size"]})
            return state

        if producer_driven:
            return side.loop.submit(side.producer.paused(capture)).result()
        with self.chat.sink.paused() if self.chat.sink is not None else contextlib.nullcontext():
            return side.loop.submit(capture()).result()

    def identity(self) -> dict:
        def value(key: str):
            v = OmegaConf.select(self.config, key)
            return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v

        return rs.config_identity(value)

    # ---------------------------------------------------------------- loading
    def _folder_verl_loads(self) -> str | None:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` will load (same rules), or None."""
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path, get_checkpoint_tracker_filename

        mode = self.config.trainer.resume_mode
        if mode == "auto":
            root = os.path.abspath(self.out_dir)
            try:
                return find_latest_ckpt_path(root)
            except ValueError as exc:
                raise rs.ResumeMismatch(
                    f"{get_checkpoint_tracker_filename(root)} is unreadable ({exc}): it names the last complete "
                    "checkpoint; write the highest N of a global_step_N folder holding claas/state.json and actor/ "
                    "into it, or remove it to start afresh") from exc
        if mode == "resume_path":
            return os.path.abspath(self.config.trainer.resume_from_path)
        return None

    def read_before_verl_loads(self) -> None:
        """The CLaaS state of the folder verl is about to load, read and checked first (so a state of another recipe
        or config is refused before anything is loaded)."""
        folder = self._folder_verl_loads()
        if folder is not None:
            n = int(os.path.basename(folder.rstrip("/")).split("global_step_")[-1])
            self.resume_dir = os.path.join(folder, rs.CLAAS_DIR)
            self.resume = rs.load_state(self.resume_dir, self.identity(), global_steps=n)

    def check_verl_loaded(self, global_steps: int) -> None:
        if self.resume is None:
            return
        if global_steps != self.resume.global_steps:
            raise rs.ResumeMismatch(f"verl loaded step {global_steps}, the CLaaS state is of step "
                                    f"{self.resume.global_steps}")
        self.last_step = global_steps

    def restore_run_state(self, side: RolloutSide, splits: SplitProtocol) -> dict:
        """Trainer-side state of the resumed checkpoint (counters, M rows, stream position) into the run's parts, and
        the record of what the killed run did after it (discarded, re-done), read from the trace before this run
        appends to it."""
        r = self.resume
        self.counters.updates = r.updates
        splits.matrix = [list(row) for row in r.matrix]
        splits.split_records = list(r.split_records)
        splits.idx, splits.complete = r.position.split, r.position.complete
        side.producer.load_state_dict({"stats": r.producer, "done": r.position.done})
        discarded = None
        if self.claas.trace:
            discarded = rs.discarded_since(rs.read_trace(self.records.trace_path), r.global_steps)
        split_size = side.stream.split_size
        regenerate = r.position.remaining(split_size) if self.claas.producer.enabled else []
        record = {"event": "resume", "global_steps": r.global_steps, "k": r.buffer["k"],
                  "buffer_size": r.buffer["size"], "buffer_uids": r.buffer["uids"], "ema": r.ema,
                  "position": dataclasses.asdict(r.position), "regenerate": regenerate,
                  "discarded": discarded, "sdpo_teacher_ema_steps": self.teacher_ema_steps,
                  "sdpo_teacher": self.teacher_restored,
                  "path": os.path.dirname(self.resume_dir)}
        self.resumes = [*r.resumes, {k: v for k, v in record.items() if k not in ("event", "buffer_uids")}]
        d = discarded or {}
        where = (f"split {r.position.split + 1} ({len(r.position.done)}/{split_size} scenarios committed, "
                 f"{len(regenerate)} to generate)" if r.position.split >= 0 and not r.position.complete
                 else f"after split {r.position.split + 1}" if r.position.split >= 0 else "service-driven")
        redo = (f"scenarios {d.get('scenarios', '?')}, generated again" if self.claas.producer.enabled
                else "chat turns, not recorded again")
        print(f"[claas] resumed from {os.path.dirname(self.resume_dir)}: k={r.buffer['k']}, buffer "
              f"{r.buffer['size']} entries, {where}; discarded from the killed run: {d.get('updates', '?')} updates, "
              f"{d.get('entries_accepted', '?')} entries accepted after the checkpoint ({redo})", flush=True)
        return record

