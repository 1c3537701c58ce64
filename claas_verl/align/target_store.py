"""Teacher alignment targets of one step, held in host RAM up to a byte budget (docs/math.md §B.3-B.5, B.7).

A replay step of an FSAR recipe needs, per response, the teacher's bf16 pooled SATS rows ``[H, R, Tk]`` and VR
rows ``[G, R, Tk]`` of every pooled layer and the window hidden states ``[|W|, D]`` of every layer: about 0.75 GB
per response at 18.4k keys (Qwen3-1.7B-sized teacher). Holding a whole block's targets is unbounded in the block
size. :class:`TeacherTargetStore` bounds it:

* the targets of the first micro-batches, up to ``max_bytes`` in all, are computed once (:meth:`fill`, one
  teacher forward per kept micro-batch, all terms) and kept;
* every other micro-batch is *streamed*: :meth:`get` runs the teacher forward for that micro-batch and the one
  requested term when the student's pass reaches it, and keeps nothing. The student's passes run term by term
  (separate passes, docs/math.md §B.7), so a streamed micro-batch costs one teacher forward per term instead of one.

Resident target bytes never exceed ``max_bytes`` plus one micro-batch's targets of one term (the one in use).
The kept set is decided from exact sizes predicted from shapes (:func:`target_bytes`) before any forward, and
with ``sync`` every rank keeps the same number of micro-batches (an all-reduce MIN), so every rank runs the same
number of teacher forwards (FSDP's all-gathers must match across ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from claas_verl.align.regions import StepRegions
from claas_verl.align.signals import TERMS, AlignmentSignals

BF16_BYTES = 2


def target_bytes(
    regions: StepRegions,
    attention_mask: torch.Tensor,
    terms: Iterable[str],
    *,
    pooled_layers: int,
    hidden_layers: int,
    num_heads: int,
    num_kv_heads: int,
    hidden_size: int,
) -> int:
    """Exact bytes of ``alignment_signals(...).as_targets()`` for one micro-batch (bf16), from shapes only.

    SATS: ``|L|·b·H·R_max·Tk``; VR: ``|L|·b·G·R_max·Tk``; hidden: ``|L_h|·N_W·D`` elements, 2 bytes each, with
    ``R_max = max num_regions``, ``Tk = key_end − key_start`` (first real key of any row to last window query + 1,
    as :func:`claas_verl.align.pooled_attention.pooled_attention_rows` lays out its key axis), ``N_W = Σ window``.
    """
    terms = set(terms)
    if not terms <= set(TERMS):
        raise ValueError(f"terms={sorted(terms)} must be a subset of {TERMS}")
    b = int(attention_mask.shape[0])
    total = 0
    if terms & {"sats", "vr"}:
        real = attention_mask.bool()
        is_q = regions.region_ids >= 0
        t = real.shape[1]
        key_start = int(torch.where(real.any(-1), real.long().argmax(-1), t).min()) if b else 0
        ar = torch.arange(t, device=real.device)
        key_end = int(torch.where(is_q, ar, -1).max()) + 1 if bool(is_q.any()) else key_start
        tk = key_end - min(key_start, key_end)
        r_max = int(regions.num_regions.max()) if regions.num_regions.numel() else 0
        per_head = pooled_layers * b * r_max * tk
        total += per_head * (num_heads * ("sats" in terms) + num_kv_heads * ("vr" in terms))
    if "hidden" in terms:
        total += hidden_layers * int(regions.window_mask.bool().sum()) * hidden_size
    return total * BF16_BYTES


def signals_bytes(sig: AlignmentSignals) -> int:
    """Bytes held by the tensors of ``sig``."""
    n = sum(v.rows.numel() * v.rows.element_size() for v in (*sig.sats.values(), *sig.vr.values()))
    return n + sum(v.numel() * v.element_size() for v in sig.hidden.values())


def _only(sig: AlignmentSignals, term: str) -> AlignmentSignals:
    return AlignmentSignals(
        sats=sig.sats if term == "sats" else {},
        vr=sig.vr if term == "vr" else {},
        hidden=sig.hidden if term == "hidden" else {},
    )


class TeacherTargetStore:
    """Targets of ``len(sizes)`` micro-batches: a kept prefix within ``max_bytes``, the rest streamed on demand.

    Args:
        produce: ``produce(i, terms) -> AlignmentSignals``: the teacher forward of micro-batch ``i`` for ``terms``,
            returning detached bf16 host targets (``alignment_signals(...).as_targets()`` moved to CPU).
        sizes: predicted bytes of micro-batch ``i``'s targets for all ``terms`` (:func:`target_bytes`).
        terms: the step's alignment terms (subset of ``("sats", "vr", "hidden")``).
        max_bytes: budget of kept targets (``mopd.signal.target_budget_gib``); 0 streams everything.
        sync, group, device: agree on the kept count across the ranks of ``group`` (all-reduce MIN on a tensor on
            ``device``). ``sync=None``: iff ``torch.distributed`` is initialised with more than one rank.
    """

    def __init__(
        self,
        produce: Callable[[int, tuple[str, ...]], AlignmentSignals],
        sizes: Sequence[int],
        terms: Iterable[str],
        max_bytes: int,
        *,
        sync: bool | None = None,
        group=None,
        device=None,
    ):
        self.terms = tuple(t for t in TERMS if t in set(terms))
        if not self.terms:
            raise ValueError("TeacherTargetStore needs at least one alignment term")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (mopd.signal.target_budget_gib); got {max_bytes}")
        self._produce = produce
        self.sizes = [int(x) for x in sizes]
        self.max_bytes = int(max_bytes)
        keep, used = 0, 0
        for size in self.sizes:
            if used + size > self.max_bytes:
                break
            keep, used = keep + 1, used + size
        self.kept = _agree_min(keep, sync, group, device)
        self._held: dict[int, AlignmentSignals] = {}
        self.teacher_forwards = 0  # forwards run by this store (fill + streamed)
        self.peak_bytes = 0  # most target bytes alive in this store at once (kept + the streamed one)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def held_bytes(self) -> int:
        return sum(signals_bytes(s) for s in self._held.values())

    def fill(self) -> TeacherTargetStore:
        """Compute and keep the targets of the first :attr:`kept` micro-batches (all terms)."""
        for i in range(self.kept):
            if i not in self._held:
                self._held[i] = self._run(i, self.terms)
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return self

    def keep(self, i: int, sig: AlignmentSignals) -> None:
        """Keep targets of micro-batch ``i`` (< :attr:`kept`) that a forward run for something else produced (the
        MOPD teacher's shared log-prob and target forward); :meth:`fill` then skips it."""
        if not 0 <= i < self.kept:
            raise IndexError(f"micro-batch {i} is not one of the {self.kept} kept ones (budget max_bytes)")
        self._held[i] = sig
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def get(self, i: int, term: str) -> AlignmentSignals:
        """Targets of micro-batch ``i`` for ``term`` only: kept ones from RAM, others by a fresh teacher forward."""
        if term not in self.terms:
            raise ValueError(f"term {term!r} is not one of this step's terms {self.terms}")
        if not 0 <= i < len(self.sizes):
            raise IndexError(f"micro-batch {i} of a store of {len(self.sizes)}")
        if i in self._held:
            return _only(self._held[i], term)
        sig = self._run(i, (term,))
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + signals_bytes(sig))
        return sig

    def __getitem__(self, i: int) -> AlignmentSignals:
        """All terms' targets of micro-batch ``i`` (kept, or one streamed forward for every term)."""
        if not 0 <= i < len(self.sizes):
            raise IndexError(f"micro-batch {i} of a store of {len(self.sizes)}")
        if i in self._held:
            return self._held[i]
        sig = self._run(i, self.terms)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + signals_bytes(sig))
        return sig

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def release(self) -> None:
        self._held.clear()

    def _run(self, i: int, terms: tuple[str, ...]) -> AlignmentSignals:
        self.teacher_forwards += 1
        return self._produce(i, terms)


def _agree_min(n: int, sync: bool | None, group, device) -> int:
    dist = torch.distributed
    ready = dist.is_available() and dist.is_initialized()
    if sync and not ready:
        raise ValueError("sync=True needs an initialised torch.distributed process group")
    if sync is None:
        sync = ready and dist.get_world_size(group) > 1
    if not sync:
        return n
    t = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t)
