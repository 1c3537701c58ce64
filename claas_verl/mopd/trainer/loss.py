"""The loss function installed on the MOPD student and teacher engines (one callable, three phases).

A :class:`claas_verl.verl_ext.logits_loss.LogitsProcessorLoss`: with ``distillation_use_topk=True`` verl's FSDP
engine calls it first as a logits processor on the packed logits ``[1, N, V]`` (packed ``[1, N, κ]`` outputs,
handed to the loss of the same micro-batch past verl's per-field output handling), then as the loss
``(loss, metrics)``.

The non-tensor ``mopd_phase`` of the batch says what the forward is for:

* ``student_topk`` (pre-update forward of the training model, docs/math.md §B.2.1): return the student's κ most
  probable ids and their full-vocabulary log-probs ``S`` (``token_fields.TOPK_IDS``,
  ``token_fields.STUDENT_LP``); loss 0.
* ``teacher`` (a teacher engine): return the teacher's full-vocabulary log-probs ``Q`` at the student's stored
  ids (``token_fields.TEACHER_LP``); loss 0.
* ``update`` (the optimizer step): return the differentiable ``log π_θ`` at the stored ids (``token_fields.CURRENT_LP``,
  chunked and checkpointed, so no ``[tokens, V]`` fp32 copy is kept), then the ``claas_topk_distill`` policy
  loss of docs/math.md §B.2.3 on its response-layout ``[B, T, κ]`` rows, through verl's policy-loss registry: the
  token mean over the micro-batch, weighted ``n_resp(mb)/n_resp`` (docs/math.md §B.7).

The forward-only outputs reach the worker through :meth:`LogitsProcessorLoss.collecting`; the stored ids and
advantages are one flattened-rows field each (:mod:`claas_verl.verl_ext.topk_fields`, names in
:mod:`claas_verl.mopd.trainer.fields`).
"""

from __future__ import annotations

from typing import Any

import torch

from claas_verl.distill import DEFAULT_CHUNK_SIZE, student_topk, teacher_logprobs_at, topk_logprobs
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.verl_ext.logits_loss import LogitsProcessorLoss, non_tensor
from claas_verl.verl_ext.packed_batch import padded


def microbatch_weight(n_resp_mb: int, global_batch_size, dp_size) -> float:
    """B.7 weight ``n_resp(mb) / n_resp(rank)`` of a micro-batch; ``global_batch_size`` = responses of the update
    batch over all ``dp_size`` ranks (verl splits them evenly)."""
    total, dp = int(global_batch_size), int(dp_size)
    if total < 1 or dp < 1 or total % dp:
        raise ValueError(f"global_batch_size={total} responses must split evenly over dp_size={dp} ranks (B.7)")
    return n_resp_mb * dp / total


def _topk(data) -> int:
    k = int(non_tensor(data, token_fields.TOPK_KEY, 0) or 0)
    if k < 1:
        raise ValueError(f"batch non-tensor {token_fields.TOPK_KEY!r} ({token_fields.TOPK_SETTING}) must be >= 1, "
                         f"got {k}")
    return k


class MOPDLoss(LogitsProcessorLoss):
    """Callable loss/logits-processor of the MOPD trainer; see the module docstring.

    Args:
        actor_config: verl ``ActorConfig`` of the student (its ``global_batch_info``, ``loss_agg_mode`` and
            ``ppo_epochs`` are used by the update loss); ``None`` on teacher engines.
        chunk_size: packed positions per chunk for every ``[chunk, V]`` temporary.
    """

    needed_by = "the MOPD loss"

    def __init__(self, actor_config: Any = None, chunk_size: int = DEFAULT_CHUNK_SIZE):
        self.actor_config = actor_config
        self.chunk_size = chunk_size

    def check_batch(self, data) -> None:
        phase = non_tensor(data, token_fields.PHASE_KEY)
        if phase not in token_fields.PHASES:
            raise ValueError(
                f"batch non-tensor {token_fields.PHASE_KEY!r} must be one of {token_fields.PHASES}, got {phase!r}: "
                "the MOPD loss only runs inside the MOPD trainer, which sets it on every forward"
            )

    def compute_loss(self, model_output, data, dp_group=None, packed: dict | None = None):
        if non_tensor(data, token_fields.PHASE_KEY) != token_fields.PHASE_UPDATE:
            return torch.zeros((), device=data["input_ids"].values().device), {}
        return self.update_loss(packed, data)

    # ------------------------------------------------------------------ phase 1: logits processor
    def process_logits(self, logits: torch.Tensor, data) -> dict[str, torch.Tensor]:
        phase = non_tensor(data, token_fields.PHASE_KEY)
        k = _topk(data)
        # logits are already divided by the rollout temperature by verl (τ enters once: temperature=1 here)
        if phase == token_fields.PHASE_STUDENT_TOPK:
            ids, logp = student_topk(logits, k, chunk_size=self.chunk_size)
            return {token_fields.TOPK_IDS: ids, token_fields.STUDENT_LP: logp}
        packed_ids = self.stored_packed_ids(data, token_fields.TOPK_IDS, k, logits.shape[1], logits.device,
                                            token_fields.TOPK_SETTING)
        if phase == token_fields.PHASE_TEACHER:
            q = teacher_logprobs_at(logits, packed_ids, chunk_size=self.chunk_size)
            return {token_fields.TEACHER_LP: q}
        lp = topk_logprobs(logits, packed_ids, chunk_size=self.chunk_size)  # differentiable, checkpointed
        return {token_fields.CURRENT_LP: lp}

    # ------------------------------------------------------------------ phase 2: the update loss
    def update_loss(self, packed: dict, data):
        from verl.utils.metric import AggregationType, Metric

        self._check_update_config()
        k = _topk(data)
        _, resp = self.lengths(data)
        if token_fields.CURRENT_LP not in packed:
            raise ValueError(f"MOPD update: the micro-batch's processor outputs {sorted(packed)} lack "
                             f"{token_fields.CURRENT_LP} (was it run with "
                             f"{token_fields.PHASE_KEY}={token_fields.PHASE_UPDATE!r}?)")
        logp = self.response_rows(packed[token_fields.CURRENT_LP], data)  # [B, T_r, K], with grad
        adv = token_fields.unpack_rows(data[token_fields.ADVANTAGES], k, token_fields.ADVANTAGES).to(logp.device)
        mask = padded(data["response_mask"]).to(logp.device).bool()
        # docs/math.md §B.7: ℓ_tok(mb) = token mean over THIS micro-batch's valid positions, weighted n_resp(mb)/n_resp
        # (n_resp = this rank's responses; the FSDP gradient average over ranks then gives n_resp(mb)/n_total).
        # The alignment passes of a balanced step use the same micro-batches and weights.
        weight = microbatch_weight(int(resp.shape[0]), data["global_batch_size"], data["dp_size"])
        loss, pg_metrics = self.token_loss(logp, adv, mask)
        loss = loss * weight
        # the registered loss read its metrics in one transfer; the token loss is the only other value (one more)
        metrics = {"mopd/tok_loss": Metric(value=loss.detach(), aggregation=AggregationType.SUM)}
        metrics.update(Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN))
        return loss, metrics

    def _check_update_config(self):
        cfg = self.actor_config
        if cfg is None:
            raise ValueError("MOPDLoss(actor_config=None) is a teacher loss and cannot run an update")
        if cfg.loss_agg_mode != "token-mean":
            raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={cfg.loss_agg_mode!r}: the MOPD token loss is "
                             "the per-micro-batch token mean of docs/math.md §B.2.3/B.7; set it to token-mean")
        return cfg

    def token_loss(self, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
        """ℓ_tok(mb) of docs/math.md §B.2.3, unweighted: the ``claas_topk_distill`` policy loss (verl's registry) as
        the token mean over one micro-batch's valid positions.

        Args:
            logp: ``[b, T_r, K]`` log π_θ at the stored ids, with grad; adv: ``[b, T_r, K]`` advantages;
            mask: ``[b, T_r]`` bool response mask.

        Returns:
            ``(loss, pg_metrics)``; the caller weights the loss ``n_resp(mb)/n_resp`` (B.7).
        """
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        cfg = self._check_update_config()
        if adv.shape != logp.shape or mask.shape != logp.shape[:2]:
            raise ValueError(
                f"MOPD update: advantages {tuple(adv.shape)}, log-probs {tuple(logp.shape)} and response_mask "
                f"{tuple(mask.shape)} disagree; the stored fields were written for another batch layout"
            )
        cfg.global_batch_info["dp_size"] = 1
        cfg.global_batch_info["batch_num_tokens"] = mask.sum().clamp(min=1)  # a tensor: no host sync (utils.masked)
        cfg.global_batch_info["global_batch_size"] = int(logp.shape[0])
        cfg.global_batch_info["loss_scale_factor"] = cfg.loss_scale_factor
        loss_fn = get_policy_loss_fn("claas_topk_distill")
        return loss_fn(old_log_prob=None, log_prob=logp, advantages=adv, response_mask=mask,
                       loss_agg_mode=cfg.loss_agg_mode, config=cfg)

    def shared_token_loss(self, logits: torch.Tensor, data, rows: list[int]):
        """ℓ_tok(mb) (unweighted, with its metrics) from the balanced step's shared forward
        (``mopd.signal.passes: shared``): the same loss as :meth:`update_loss` on the rows ``rows`` of the update batch
        ``data``, from response-layout logits instead of verl's packed processor logits.

        Args:
            logits: ``[b, R, V]`` temperature-scaled logits of the micro-batch's rows at the positions predicting
                their response tokens (:func:`claas_verl.mopd.trainer.alignment.response_logits`), ``R`` = the
                longest response of these rows.
        """
        from verl.utils.metric import AggregationType, Metric

        self._check_update_config()
        k = _topk(data)
        R = logits.shape[1]

        def of_rows(name: str) -> torch.Tensor:  # these rows only: a step's micro-batches must not each unpack all
            x = data[name]
            return torch.nested.as_nested_tensor([x.unbind()[r] for r in rows], layout=torch.jagged)

        ids = token_fields.unpack_rows(of_rows(token_fields.TOPK_IDS), k, token_fields.TOPK_IDS)[:, :R]
        adv = token_fields.unpack_rows(of_rows(token_fields.ADVANTAGES), k, token_fields.ADVANTAGES)[:, :R]
        mask = padded(of_rows("response_mask"))[:, :R]
        logp = topk_logprobs(logits, ids.to(logits.device).long(), chunk_size=self.chunk_size)
        loss, pg_metrics = self.token_loss(logp, adv.to(logp.device), mask.to(logp.device).bool())
        return loss, Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN)
