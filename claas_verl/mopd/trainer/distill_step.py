"""The math of one continual MOPD step on verl's batch (docs/math.md §B.2-B.7), called from the trainer's hooks.

:class:`DistillStep` holds what the step needs from the config (κ, the alignment terms, the update's batch
geometry) and the tokenizer's step separators; every method drives the worker group ``wg`` (verl's
``actor_rollout_wg``) through TransferQueue: the student's top-κ forward (B.2.1), a teacher's log-probs at those ids,
the rewards of eq. (4) with the per-domain advantages (B.2.2), the step regions of the alignment terms (B.4), and
the one optimizer update (B.2.3, B.6/B.7).
"""

from __future__ import annotations

import torch
import transfer_queue as tq
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict
from verl.workers.utils.padding import response_to_nested

from claas_verl.align import separator_token_ids
from claas_verl.distill import (
    domain_advantages_and_stds,
    topk_binned_kl,
    topk_rewards,
    topk_weighted_kl,
)
from claas_verl.mopd.config import MopdConfig
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.alignment import AUX_KEY, DOMAIN_KEY, region_fields
from claas_verl.mopd.trainer.blocks import canonical_row_order
from claas_verl.mopd.trainer.config_checks import check_one_update_per_step
from claas_verl.mopd.trainer.workers import TEACHER_KEY
from claas_verl.verl_ext.packed_batch import padded


def check_verl_config(mopd: MopdConfig, config) -> None:
    """verl's keys that a MOPD step depends on: one block per step, one optimizer update per step, and the
    balanced update's engine."""
    if config.data.train_batch_size != mopd.block_size:
        raise ValueError(
            f"data.train_batch_size={config.data.train_batch_size} must equal mopd.block_size="
            f"{mopd.block_size}: every step trains exactly one block"
        )
    actor = config.actor_rollout_ref.actor
    check_one_update_per_step(mopd.block_size, actor.get("ppo_mini_batch_size"), actor.get("ppo_epochs"))
    if mopd.signal.enabled and actor.get("strategy") not in ("fsdp2",):
        raise ValueError(f"mopd.signal enables {list(mopd.signal.terms)}: the balanced update needs "
                         f"actor_rollout_ref.actor.strategy=fsdp2, got {actor.get('strategy')!r}")


def replay_weighted(A: torch.Tensor, kind: str, weight: float) -> torch.Tensor:
    """``A · weight`` on a replay step (``mopd.train.replay_weight``, after σ_d), ``A`` itself otherwise (and at 1,
    the paper, so the default changes no bit)."""
    return A * weight if kind == "replay" and weight != 1.0 else A


class DistillStep:
    """One step's student forward, teacher forward, advantages and update (see the module doc)."""

    def __init__(self, mopd: MopdConfig, config, domain_index: dict[str, int]):
        check_verl_config(mopd, config)
        self.topk = mopd.train.topk
        self.replay_std_floor = mopd.train.replay_std_floor
        self.std_floor_kinds = mopd.train.std_floor_kinds
        # the replay arms of benchmarks/plans/mopd_replay.md (defaults: the paper's replay)
        self.replay_weight = mopd.train.replay_weight
        self.replay_optimizer = mopd.train.replay_optimizer
        self.replay_responses = mopd.train.replay_responses_per_prompt
        self.block_size = mopd.block_size
        # replay steps of FSAR/SATS/OPRD recipes: alignment terms + balanced update (docs/math.md §B.3-B.7)
        self.aux = mopd.signal
        self.domain_index = domain_index
        self.temperature = config.actor_rollout_ref.rollout.temperature
        # the update: one epoch, one mini-batch (the whole step batch: the block's prompts times n responses)
        self.n = config.actor_rollout_ref.rollout.n
        self.mini_batch = config.actor_rollout_ref.actor.ppo_mini_batch_size * self.n
        self.seed = config.actor_rollout_ref.actor.data_loader_seed
        self.separators = None  # the tokenizer's step separators (docs/math.md §B.4), on the first aligned step

    def responses_per_prompt(self, kind: str) -> int | None:
        """Replies per prompt a step of ``kind`` asks the rollout for; None: verl's ``rollout.n`` (every step
        unless ``mopd.train.replay_responses_per_prompt`` is set, and then only replay steps differ)."""
        return self.replay_responses if kind == "replay" else None

    def step_log(self, kind: str) -> dict:
        """The replay arm's per-step fields, only for the keys set away from the paper (the plan's "Per-step log")."""
        out = {}
        if self.replay_responses is not None:
            out["mopd/responses_per_prompt"] = self.responses_per_prompt(kind) or self.n
        if self.replay_weight != 1.0:
            out["mopd/replay_weight"] = self.replay_weight if kind == "replay" else 1.0
        if self.replay_optimizer != "shared":
            out["mopd/optimizer_state"] = int(kind == "replay")  # 0: the stage's AdamW state, 1: the replay steps'
        return out

    def flags(self, phase: str) -> dict:
        return {
            "calculate_entropy": False,
            "compute_loss": True,  # the logits processor IS the loss function; verl only calls it then
            "distillation_use_topk": True,
            "distillation_only": True,  # no sampled-token log-probs needed
            "temperature": self.temperature,
            token_fields.PHASE_KEY: phase,
            token_fields.TOPK_KEY: self.topk,
        }

    def student_topk(self, batch, wg):
        """Pre-update forward of the training model: store the student's top-κ ids and log-probs S (B.2.1).

        The worker writes them as two flattened-rows fields, ``token_fields.TOPK_IDS`` and ``token_fields.STUDENT_LP``
        (:func:`claas_verl.mopd.trainer.workers.fold_topk_outputs`).
        """
        canonical_row_order(batch, wg)
        batch.extra_info.update(self.flags(token_fields.PHASE_STUDENT_TOPK))
        wg.compute_log_prob(batch)
        return batch

    def teacher_q(self, batch, wg, teacher: str):
        """Teacher ``teacher``'s top-k log-probs Q at the student's ids, with the student's S and the response mask."""
        batch.extra_info.update(self.flags(token_fields.PHASE_TEACHER))
        batch.extra_info[TEACHER_KEY] = teacher
        wg.mopd_teacher_forward(batch)
        batch.extra_info.pop(TEACHER_KEY, None)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=[token_fields.TEACHER_LP, token_fields.STUDENT_LP, "response_mask"])
        mask_nested = data["response_mask"]
        Q = token_fields.unpack_rows(data[token_fields.TEACHER_LP], self.topk, token_fields.TEACHER_LP).float()
        Sx = token_fields.unpack_rows(data[token_fields.STUDENT_LP], self.topk, token_fields.STUDENT_LP).float()
        mask = padded(mask_nested).float()
        return Sx, Q, mask, mask_nested

    def teacher_advantages(self, batch, wg, step: dict, tokenizer, metrics: dict):
        """Teacher Q at the student's ids, rewards r (eq. 4), per-domain advantages A (B.2.2), logged KL."""
        if self.aux.applies_to(step["kind"]):
            self.store_regions(batch, tokenizer, metrics)
            batch.extra_info[AUX_KEY] = self.aux.to_dict()  # the teacher also returns its alignment targets
        try:
            Sx, Q, mask, mask_nested = self.teacher_q(batch, wg, step["teacher"])
        finally:
            batch.extra_info.pop(AUX_KEY, None)
        r = topk_rewards(Sx, Q, mask)
        # one domain per step (B.2.2): every response of the block belongs to the step's domain
        dom = torch.full((r.shape[0],), self.domain_index[step["domain"]], dtype=torch.long)
        floor = self.replay_std_floor if step["kind"] in self.std_floor_kinds else 0.0
        A, stds = domain_advantages_and_stds(r, mask, dom, sync=False, std_floor=floor)  # σ_d once per step
        A = replay_weighted(A, step["kind"], self.replay_weight)
        stats = stds[self.domain_index[step["domain"]]]
        out = {token_fields.ADVANTAGES: token_fields.pack_rows(A, mask_nested)}
        # verl's metrics read 2-D advantages/returns: Σ_v A[t, v] per token
        per_token = A.sum(-1)
        out["advantages"] = response_to_nested(per_token, mask_nested)
        out["returns"] = response_to_nested(per_token, mask_nested)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict(out))
        metrics.update({
            "mopd/kl_topk": float(topk_weighted_kl(Sx, Q, mask)),
            "mopd/kl_binned": float(topk_binned_kl(Sx, Q, mask)),
            "mopd/adv_sigma": stats["scale"],  # the σ divided by: σ_d, or the floor (std_floor_kinds)
            "mopd/adv_std": stats["std"],
            "mopd/reward_count": stats["count"],
            "mopd/stage": step["stage"],
            "mopd/block": step["block"],
            **self.step_log(step["kind"]),
        })
        return batch

    def store_regions(self, batch, tokenizer, metrics: dict):
        """Step regions computed ONCE here from the response ids, shared by teacher and student (docs/math.md §B.4)."""
        if self.separators is None:
            self.separators = separator_token_ids(tokenizer)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["input_ids", "response_mask"])
        # regions from the response ids themselves (not response_from_nested, which shifts ids by one)
        out, rid, win = region_fields(data["input_ids"], data["response_mask"], self.separators, self.aux)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=tu.get_tensordict(out))
        metrics["mopd/regions_per_response"] = float((rid.amax(-1) + 1).clamp(min=0).float().mean())
        metrics["mopd/window_tokens"] = float(win.sum())

    def update_info(self, kind: str, domain: str | None = None) -> dict:
        """The update's batch info: one epoch, one mini-batch (the whole step batch), no shuffling. An aligned step
        names its ``domain`` in the aux dict: carried balancing keeps its multipliers per domain."""
        info = self.flags(token_fields.PHASE_UPDATE)
        info.pop("compute_loss")
        n = self.responses_per_prompt(kind)
        mini_batch = self.mini_batch if n is None else self.block_size * n  # the whole step batch either way
        info.update({
            "global_batch_size": mini_batch,
            "mini_batch_size": mini_batch,
            "epochs": 1,
            "seed": self.seed,
            "dataloader_kwargs": {"shuffle": False},
        })
        if self.aux.applies_to(kind):
            info[AUX_KEY] = self.aux.to_dict()  # balanced multi-pass update in the actor worker (docs/math.md §B.6/B.7)
            if domain is not None:
                info[AUX_KEY][DOMAIN_KEY] = domain
        return info

    def update_actor(self, batch, wg, kind: str, metrics: dict, domain: str | None = None):
        """One optimizer update with the MOPD loss; the worker's metrics under ``actor/``. A replay step under
        ``mopd.train.replay_optimizer=separate`` steps with the replay steps' own AdamW state
        (:func:`claas_verl.mopd.trainer.verl_couplings.use_optimizer_state`), the stage's state back afterwards."""
        batch.extra_info.update(self.update_info(kind, domain))
        own_state = self.replay_optimizer == "separate" and kind == "replay"
        try:
            if own_state:
                wg.mopd_optimizer_state("replay")
            output = wg.update_actor(batch)
        finally:
            batch.extra_info.pop(AUX_KEY, None)
            if own_state:
                wg.mopd_optimizer_state("main")
        out = rename_dict(output["metrics"], "actor/")
        if "actor/mfu" in out:
            out["perf/mfu/actor"] = out.pop("actor/mfu")
        metrics.update(reduce_metrics(out))
        return batch


__all__ = ["DistillStep", "check_verl_config", "replay_weighted"]
