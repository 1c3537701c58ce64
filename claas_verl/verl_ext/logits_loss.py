"""verl's "loss that is also a logits processor" seam, shared by MOPD's and CLaaS SDPO's losses.

A top-K distillation loss needs each response token's full-vocabulary log-probs at K chosen ids, with grad
(MOPD: docs/math.md §B.2; CLaaS SDPO: docs/math.md §A.3.3). verl's FSDP engine shows a model's full logits only to
a loss function's logits-processor form: when a batch carries the non-tensor ``distillation_use_topk=True``,
``FSDPEngineWithLMHead.prepare_model_outputs`` calls the installed loss function twice per micro-batch:

1. as a **logits processor** ``fn(student_logits=[1, N, V], data=micro_batch)`` on the packed, temperature-scaled
   logits, which must return a dict of per-packed-token ``[1, N]`` tensors (verl asserts one value per token);
2. as the **loss** ``fn(model_output=..., data=micro_batch, dp_group=...)`` returning ``(loss, metrics)``, where
   ``model_output`` holds the processor's fields as nested ``[B, L_b]`` tensors over the packed sequences.

:class:`LogitsProcessorLoss` dispatches the two forms, refuses Ulysses sequence parallelism (the processor's
packed positions would be one rank's shard), and moves K values per token between the layouts
(:mod:`claas_verl.verl_ext.packed_batch`, :mod:`claas_verl.verl_ext.topk_fields`): stored flattened-rows ids ->
packed ``[1, N, K]`` ids for the processor (:meth:`~LogitsProcessorLoss.stored_packed_ids`), and K packed
processor outputs -> response layout ``[B, T_r, K]`` with grad for the loss
(:meth:`~LogitsProcessorLoss.response_stack`).
"""

from __future__ import annotations

from typing import Any

import torch

from claas_verl.verl_ext.packed_batch import gather_packed_to_response, packed_lengths, scatter_response_to_packed
from claas_verl.verl_ext.topk_fields import unpack_rows

SP_SETTING = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def non_tensor(data, key: str, default=None):
    """A non-tensor entry of a verl batch (``tensordict_utils.get_non_tensor_data``)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


class LogitsProcessorLoss:
    """Base of a loss installed with ``TrainingWorker.set_loss_fn`` that also runs as verl's logits processor.

    Subclasses implement :meth:`process_logits` (form 1) and :meth:`compute_loss` (form 2) and may override
    :meth:`check_batch` (run before either form). ``needed_by`` names the loss in errors.
    """

    needed_by: str = "this loss"

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
            return self.process_logits(student_logits, data)
        return self.compute_loss(model_output, data, dp_group)

    def check_batch(self, data) -> None:
        """Validate the batch before either call form (default: nothing)."""

    def process_logits(self, logits: torch.Tensor, data) -> dict[str, torch.Tensor]:
        """Packed ``[1, N, V]`` logits -> per-token ``[1, N]`` fields."""
        raise NotImplementedError

    def compute_loss(self, model_output, data, dp_group=None):
        """The processor's fields (``model_output``) -> ``(loss, metrics)``."""
        raise NotImplementedError

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

    def response_stack(self, model_output, fields: list[str], data, width: int | None = None) -> torch.Tensor:
        """The processor's packed outputs ``fields`` (each nested ``[B, L_b]``) -> ``[B, T_r, len(fields)]``,
        zero padded; differentiable (``values()`` keeps the autograd graph)."""
        seq, resp = self.lengths(data)
        packed = torch.stack([model_output[n].values() for n in fields], dim=-1)
        return gather_packed_to_response(packed, seq, resp, width)
