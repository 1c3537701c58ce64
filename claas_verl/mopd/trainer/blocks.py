"""The prompts of a continual MOPD run: one dataset per domain, a plan step's block as verl's batch, its row order.

Block ``b`` of domain ``d`` is rows ``b·size .. (b+1)·size-1`` of ``mopd.domains.<d>.prompts`` (docs/math.md §B.1);
the held-out ``test_prompts`` feed the forgetting evaluation (:mod:`claas_verl.mopd.trainer.forgetting`).
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
import transfer_queue as tq
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn

from claas_verl.mopd.config import MopdConfig


def prompt_batch(dataset, rows, global_steps: int, rollout_n: int | None = None):
    """verl's prompt batch (a TensorDict) of ``dataset``'s ``rows``, one fresh uid per row, tagged with the step;
    ``rollout_n``: replies per prompt for these rows (verl's agent loop reads ``__rollout_n__`` per prompt), None:
    ``actor_rollout_ref.rollout.n``."""
    batch_dict = collate_fn([dataset[i] for i in rows])
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
    if rollout_n is not None:
        batch_dict["__rollout_n__"] = torch.full((len(rows),), int(rollout_n), dtype=torch.long)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    return batch


def load_domains(config, mopd: MopdConfig, plan, tokenizer, processor) -> tuple[dict, dict]:
    """``(train, held_out)``: each domain's prompt dataset (checked to hold the plan's blocks) and, where the recipe
    names ``test_prompts``, its held-out one; ``config.data`` holds verl's dataset settings."""
    from verl.trainer.ppo.utils import create_rl_dataset

    block_size = mopd.block_size
    train, held_out = {}, {}
    for d in plan.order:
        spec = mopd.domains[d]
        ds = create_rl_dataset(spec.prompts, config.data, tokenizer, processor, is_train=True)
        need = plan.num_blocks[d] * block_size
        if len(ds) < need:
            raise ValueError(
                f"mopd.domains.{d}.prompts: {len(ds)} usable prompts but the plan needs {need} "
                f"({plan.num_blocks[d]} blocks of {block_size}); were prompts dropped by "
                "data.filter_overlong_prompts / data.max_prompt_length?"
            )
        train[d] = ds
        if spec.test_prompts:
            held_out[d] = create_rl_dataset(spec.test_prompts, config.data, tokenizer, processor, is_train=False)
    return train, held_out


def block_batch(datasets: dict, step: dict, block_size: int, global_steps: int, rollout_n: int | None = None):
    """The plan step's block of its domain's prompts (``rollout_n``: as in :func:`prompt_batch`)."""
    rows = range(step["block"] * block_size, (step["block"] + 1) * block_size)
    return prompt_batch(datasets[step["domain"]], rows, global_steps, rollout_n)


def canonical_row_order(batch, wg):
    """Sort the step's rows by their token ids inside each data-parallel rank's share of worker group ``wg`` (in
    place).

    verl's async rollout returns the responses in completion order, and the docs/math.md §B.7 loss (per-micro-batch
    means) depends on which responses share a micro-batch; a content order makes the update a function of
    the samples alone (same seeds -> same step; an exact resume). Each rank keeps the rows verl's
    ``_balance_batch`` gave it (contiguous equal shares), so its token balance is unchanged.
    """
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
    rows = [r.cpu().long().numpy().tobytes() for r in data["input_ids"].unbind()]
    ranks = wg._dispatch_info.get("actor") if hasattr(wg, "_dispatch_info") else None
    dp = max(ranks) + 1 if ranks else 1
    n = len(rows)
    if n % dp:
        raise ValueError(f"{n} rows do not split evenly over {dp} data-parallel ranks")
    share = n // dp
    order = []
    for c in range(dp):
        order += sorted(range(c * share, (c + 1) * share), key=lambda i: (len(rows[i]), rows[i]))
    batch.reorder(order)
    return batch
