"""Every recipe name of the copy-per-variant layout and its spelling since recipes became deltas (docs/recipes.md).

A spelling is what follows ``--config-name``: the recipe, then command-line overrides. The scale (``scale=gym`` or
``scale=tiny``) is a group chosen on the command line, and a value that one file used to hold is an override.
"""

from __future__ import annotations

# old name -> new spelling; a kept recipe maps to itself
SPELLINGS: dict[str, str] = {
    # MOPD, paper scale (the default)
    "mopd/seq": "mopd/seq",
    "mopd/seq_recovery": "mopd/seq_recovery",
    "mopd/seq_recovery70": "mopd/seq_recovery mopd.recovery.blocks_per_domain=14",
    "mopd/seq_expert_recovery": "mopd/seq_expert_recovery",
    "mopd/replay_kl": "mopd/replay_kl",
    "mopd/replay_kl_fixed": "mopd/replay_kl_fixed",
    "mopd/replay_kl_b3": "mopd/replay_kl_fixed mopd.replay.b=3",
    "mopd/replay_kl_recovery": "mopd/replay_kl_recovery",
    "mopd/replay_kl_expert_recovery": "mopd/replay_kl_expert_recovery",
    "mopd/replay_kl_oprd": "mopd/replay_kl_oprd",
    "mopd/replay_kl_oprd_recovery": "mopd/replay_kl_oprd_recovery",
    "mopd/replay_kl_sats": "mopd/replay_kl_sats",
    "mopd/replay_kl_sats_recovery": "mopd/replay_kl_sats_recovery",
    "mopd/fsar": "mopd/fsar",
    "mopd/fsar_b3": "mopd/fsar mopd.replay.b=3",
    "mopd/fsar_recovery": "mopd/fsar_recovery",
    "mopd/fsar_shared": "mopd/fsar_shared",
    "mopd/fsar_shared_recovery": "mopd/fsar_shared_recovery",
    "mopd/joint": "mopd/joint",
    "mopd/joint2": "mopd/joint mopd.joint.passes=2",
    # MOPD, the continual benchmark's scale
    "mopd/gym_seq": "mopd/seq scale=gym",
    "mopd/gym_seq_recovery": "mopd/seq_recovery scale=gym mopd.recovery.blocks_per_domain=2",
    "mopd/gym_replay_kl": "mopd/replay_kl scale=gym",
    "mopd/gym_replay_kl_floor": "mopd/replay_kl scale=gym mopd.train.replay_std_floor=0.3",
    "mopd/gym_replay_kl_fixed": "mopd/replay_kl_fixed scale=gym mopd.replay.b=3",
    "mopd/gym_replay_kl_experts": "mopd/replay_kl_experts scale=gym",
    "mopd/gym_fsar_shared": "mopd/fsar_shared scale=gym mopd.signal.window=16",
    "mopd/gym_joint": "mopd/joint scale=gym",
    # MOPD, tiny CPU scale
    "mopd/tiny_seq": "mopd/seq scale=tiny",
    "mopd/tiny_seq_recovery": "mopd/seq_recovery scale=tiny mopd.recovery.blocks_per_domain=2",
    "mopd/tiny_replay_kl": "mopd/replay_kl scale=tiny",
    "mopd/tiny_replay_kl_fixed": "mopd/replay_kl_fixed scale=tiny mopd.replay.b=2",
    "mopd/tiny_fsar_shared": "mopd/fsar_shared scale=tiny mopd.signal.window=16",
    "mopd/tiny_joint": "mopd/joint scale=tiny",
    "mopd/tiny_segments": "mopd/segments scale=tiny",
    # CLaaS
    "claas/icl": "claas/icl",
    "claas/ppo": "claas/ppo",
    "claas/reinforce_pp": "claas/reinforce_pp",
    "claas/sdpo": "claas/sdpo",
    "claas/service": "claas/service",
    "claas/tiny_icl": "claas/icl scale=tiny",
    "claas/tiny_ppo": "claas/ppo scale=tiny",
    "claas/tiny_reinforce_pp": "claas/reinforce_pp scale=tiny",
    "claas/tiny_sdpo": "claas/sdpo scale=tiny",
    "claas/tiny_service": "claas/service scale=tiny",
    "claas/tiny_no_update": "claas/no_update scale=tiny",
}


def split(spelling: str) -> tuple[str, list[str]]:
    """``"mopd/seq scale=tiny"`` -> ``("mopd/seq", ["scale=tiny"])``."""
    name, *overrides = spelling.split()
    return name, overrides
