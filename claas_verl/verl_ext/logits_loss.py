"""verl's "loss that is also a logits processor" seam, shared by MOPD's and CLaaS SDPO's losses.

A top-K distillation loss needs each response token's full-vocabulary log-probs at K chosen ids, with grad
(MOPD: docs/math.md §B.2; CLaaS SDPO: docs/math.md §A.3.3). verl's FSDP engine shows a model's full logits only to
a loss function's logits-processor form: when a batch carries the non-tensor ``distillation_use_topk=True``,
``FSDPEngineWithLMHead.forward_step`` runs, per micro-batch and in this order on the same micro-batch object:

1. ``prepare_model_outputs``, which calls the installed loss function as a **logits processor**
   ``fn(student_logits=[1, N, V], data=micro_batch)`` on the packed, temperature-scaled logits; it must return a
   dict of per-packed-token ``[1, N]`` tensors (verl asserts one value per token) that verl carries, field by
   field, through its output handling (nested wrap, detach, per-micro-batch split/concat, dynamic-batch reorder);
2. the **loss** ``fn(model_output=..., data=micro_batch, dp_group=...)`` returning ``(loss, metrics)``.

K values per token would be K such fields, and verl's per-field handling of them costs more than the forward at
K = 128. :class:`LogitsProcessorLoss` therefore hands its outputs past verl: :meth:`~LogitsProcessorLoss.process_logits`
returns packed ``[1, N, W]`` tensors, which the processor form keeps on the loss object (a **hand-off**) and the
loss form of the same micro-batch receives (:meth:`~LogitsProcessorLoss.compute_loss`'s ``packed``, with grad).
verl carries ONE int64 field, :data:`SLOT_FIELD`: each packed position's row in the concatenation of the forward's
kept outputs. A forward-only pass that needs the outputs back (:meth:`~LogitsProcessorLoss.collecting`) reads them
through that field after verl's micro-batch reorder (:func:`gather_response_rows`), so verl's own bookkeeping
decides which row is which. The logits are verl's own forward's; only where the K values travel changes.

The base class also refuses Ulysses sequence parallelism (the processor's packed positions would be one rank's
shard) and moves K values per token between the layouts (:mod:`claas_verl.verl_ext.packed_batch`,
:mod:`claas_verl.verl_ext.topk_fields`): stored flattened-rows ids -> packed ``[1, N, K]`` ids for the processor
(:meth:`~LogitsProcessorLoss.stored_packed_ids`), and packed processor outputs -> response layout ``[B, T_r, K]``
with grad for the loss (:meth:`~LogitsProcessorLoss.response_rows`).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, NamedTuple

import torch

from claas_verl.verl_ext.packed_batch import gather_packed_to_response, packed_lengths, scatter_response_to_packed
from claas_verl.verl_ext.topk_fields import pack_row_list, unpack_rows

SP_SETTING = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
# the one field verl carries for a hand-off processor: packed position -> row of the forward's kept outputs
SLOT_FIELD = "claas_lp_slot"


def non_tensor(data, key: str, default=None):
    """A non-tensor entry of a verl batch (``tensordict_utils.get_non_tensor_data``)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


class _HandOff(NamedTuple):
    """The processor's outputs for one micro-batch, waiting for the loss call of the same micro-batch."""

    data: Any  # the micro-batch object verl passed to the processor (the loss call must get the same one)
    rows: int  # packed positions of the processor's logits (verl's packed tokens + its tail padding)
    packed: dict  # name -> [1, rows, W] tensor (with grad in a training forward)


class LogitsProcessorLoss(abc.ABC):
    """Base of a loss installed with ``TrainingWorker.set_loss_fn`` that also runs as verl's logits processor.

    Subclasses implement :meth:`process_logits` (form 1: packed ``[1, N, W]`` outputs) and :meth:`compute_loss`
    (form 2, receiving them) and may override :meth:`check_batch` (run before either form). ``needed_by`` names
    the loss in errors.
    """

    needed_by: str = "this loss"
    _pending: _HandOff | None = None  # set by the processor form, taken by the next loss form
    _kept: list | None = None  # per micro-batch, in call order: {name: [rows, W]} (inside collecting())

    def __call__(self, model_output=None, data=None, dp_group=None, student_logits=None, **_: Any):
        self.check_batch(data)
        if student_logits is not None:
            if student_logits.dim() != 3 or student_logits.shape[0] != 1:
                raise ValueError(f"{self.needed_by}: expected packed logits [1, N, V] from verl's engine, got "
                                 f"{tuple(student_logits.shape)}")
            sp = int(non_tensor(data, "sp_size", 1) or 1)
            if sp > 1:
                raise ValueError(f"{self.needed_by} does not support Ulysses sequence parallelism (sp_size={sp}); "
                                 f"set {SP_SETTING}=1")
            return self._hand_off(self.process_logits(student_logits, data), data, int(student_logits.shape[1]))
        return self.compute_loss(model_output, data, dp_group, packed=self._take(data))

    def check_batch(self, data) -> None:  # noqa: B027 (an optional hook: most losses need no batch check)
        """Validate the batch before either call form (default: nothing)."""

    @abc.abstractmethod
    def process_logits(self, logits: torch.Tensor, data) -> dict[str, torch.Tensor]:
        """Packed ``[1, N, V]`` logits -> ``{name: [1, N, W]}`` per-token outputs (handed to the loss form)."""

    @abc.abstractmethod
    def compute_loss(self, model_output, data, dp_group=None, packed: dict | None = None):
        """``(loss, metrics)``; ``packed`` holds this micro-batch's :meth:`process_logits` outputs."""

    # ------------------------------------------------------------------ the hand-off past verl's output handling
    def _hand_off(self, packed: dict, data, rows: int) -> dict[str, torch.Tensor]:
        for name, x in packed.items():
            if x.dim() != 3 or x.shape[:2] != (1, rows):
                raise ValueError(f"{self.needed_by}: processor output {name} has shape {tuple(x.shape)}, "
                                 f"expected [1, {rows}, W]")
        offset = 0
        if self._kept is not None:
            offset = sum(next(iter(m.values())).shape[0] for m in self._kept if m)
            self._kept.append({name: x[0].detach() for name, x in packed.items()})
        self._pending = _HandOff(data, rows, packed)
        device = next(iter(packed.values())).device if packed else None
        return {SLOT_FIELD: (offset + torch.arange(rows, device=device))[None]}

    def _take(self, data) -> dict:
        held, self._pending = self._pending, None
        if held is None or held.data is not data:
            raise ValueError(
                f"{self.needed_by}: the loss call found no processor output of its own micro-batch (verl's "
                "FSDPEngineWithLMHead.forward_step runs the logits processor, then the loss, on one micro-batch; "
                "is distillation_use_topk set on this batch, and does the installed verl keep that order?)"
            )
        tokens = int(data["input_ids"].values().shape[0])
        if held.rows < tokens:
            raise ValueError(f"{self.needed_by}: the processor saw {held.rows} packed positions but the loss's "
                             f"micro-batch holds {tokens} tokens")
        return held.packed

    @contextlib.contextmanager
    def collecting(self):
        """Keep every micro-batch's processor outputs of the forward run inside (detached, in call order);
        yields a dict filled on exit with ``{name: [rows of all micro-batches, W]}``, which
        :func:`gather_response_rows` reads through the forward's :data:`SLOT_FIELD`. Cleared on exit."""
        self._kept, self._pending, result = [], None, {}
        try:
            yield result
            kept = [m for m in self._kept if m]
            for name in (kept[0] if kept else {}):
                result[name] = torch.cat([m[name] for m in kept]) if len(kept) > 1 else kept[0][name]
        finally:
            self._kept, self._pending = None, None

    # ------------------------------------------------------------------ layouts
    def lengths(self, data) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sequence lengths [B], response lengths [B])`` of the micro-batch; refuses a padded batch."""
        return packed_lengths(data, self.needed_by)

    def stored_packed_ids(self, data, field: str, k: int, total: int, device, setting: str = "k") -> torch.Tensor:
        """Stored flattened-rows ids ``data[field]`` (nested ``[B, T_b·K]``) -> packed ``[1, total, K]`` int64.

        Response token t of row b lands at the packed position predicting it; every other position holds id 0
        (its values are never read by the loss)."""
        seq, resp = self.lengths(data)
        stored = unpack_rows(data[field], k, field, setting).long()  # [B, T_r, K]
        if stored.shape[:2] != (resp.shape[0], int(resp.max()) if resp.numel() else 0):
            raise ValueError(f"{field} holds {tuple(stored.shape[:2])} response positions but the micro-batch has "
                             f"response lengths {resp.tolist()}: it was written for another batch")
        return scatter_response_to_packed(stored.to(device), seq, resp, total)[None]

    def response_rows(self, packed: torch.Tensor, data, width: int | None = None) -> torch.Tensor:
        """A processor output ``[1, N, W]`` -> response layout ``[B, T_r, W]``, zero padded; differentiable."""
        seq, resp = self.lengths(data)
        return gather_packed_to_response(packed[0], seq, resp, width)


def gather_response_rows(kept: torch.Tensor, slots, response_mask) -> torch.Tensor:
    """The forward's kept outputs ``[rows, W]`` -> the flattened-rows field ``[B, T_b·W]`` of its response tokens.

    ``slots`` is the forward's :data:`SLOT_FIELD` as verl returns it (nested ``[B, L_b]``, rows in the batch's
    order after verl's micro-batch reorder); response token t of row b is predicted at sequence position
    ``L_b − T_b − 1 + t`` (verl's ``response_from_nested`` shift). Copies only; the result is on the host."""
    lens = response_mask.offsets().diff().tolist()
    offsets = slots.offsets()
    if len(lens) != offsets.numel() - 1:
        raise ValueError(f"the forward returned {offsets.numel() - 1} rows for a batch of {len(lens)}")
    ends = offsets[1:].tolist()
    local = torch.cat([torch.arange(e - t - 1, e - 1) for t, e in zip(lens, ends, strict=True)]).long()
    index = slots.values()[local].long()
    return pack_row_list(list(kept[index.to(kept.device)].cpu().split(lens)))
