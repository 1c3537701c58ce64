"""Checks of the verl and ``mopd.train`` keys that a continual MOPD step depends on. Pure python.

(``mopd.train.teacher_dtype`` is checked by its schema, :mod:`claas_verl.mopd.config_train`.)
"""

from __future__ import annotations


def check_one_update_per_step(block_size: int, ppo_mini_batch_size, ppo_epochs) -> None:
    """docs/math.md §B.1: every plan step makes exactly ONE optimizer update (one epoch, one mini-batch of the block).

    verl runs ``ppo_epochs × block/ppo_mini_batch_size`` AdamW steps per ``update_actor``; anything but one
    mini-batch of the whole block and one epoch would silently take several steps per plan step.
    """
    if ppo_mini_batch_size is None or int(ppo_mini_batch_size) != int(block_size):
        raise ValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={ppo_mini_batch_size} must equal mopd.block_size="
            f"{block_size}: one optimizer update per plan step (docs/math.md §B.1); "
            "a smaller value makes verl run several "
            "AdamW steps per step (the MOPD recipes set it to ${mopd.block_size})"
        )
    if ppo_epochs is None or int(ppo_epochs) != 1:
        raise ValueError(f"actor_rollout_ref.actor.ppo_epochs (mopd.train.ppo_epochs)={ppo_epochs} must be 1: one "
                         "optimizer update per plan step (docs/math.md §B.1)")
