"""The continual benchmark's methods: a stable name per method, and the recipe spelling that runs it.

A method's name is what ``--recipes`` takes and what ``results.json`` records (``"recipe"``) and labels its run
directories with (``runs/<name with / as _>_s<seed>``). The names predate the recipes as deltas, when each scale
and each one-knob variant was its own file (``mopd/gym_replay_kl_floor``); they stay, so that the committed results
read and resume as before, and each maps to its spelling now: a recipe and its command-line overrides
(docs/recipes.md). Any recipe under recipes/ is also a method of its own name, run as written.
"""

from __future__ import annotations

# name -> "recipe override ..." (the same composed config as the old recipe file of that name)
SPELLINGS: dict[str, str] = {
    "mopd/gym_seq": "mopd/seq scale=gym",
    "mopd/gym_replay_kl": "mopd/replay_kl scale=gym",
    "mopd/gym_replay_kl_floor": "mopd/replay_kl scale=gym mopd.train.replay_std_floor=0.3",
    "mopd/gym_replay_kl_experts": "mopd/replay_kl_experts scale=gym",
    "mopd/gym_replay_kl_fixed": "mopd/replay_kl_fixed scale=gym mopd.replay.b=3",
    "mopd/gym_seq_recovery": "mopd/seq_recovery scale=gym mopd.recovery.blocks_per_domain=2",
    "mopd/gym_fsar_shared": "mopd/fsar_shared scale=gym mopd.signal.window=16",
    "mopd/gym_joint": "mopd/joint scale=gym",
    "claas/tiny_reinforce_pp": "claas/reinforce_pp scale=tiny",
    "claas/tiny_ppo": "claas/ppo scale=tiny",
    "claas/tiny_sdpo": "claas/sdpo scale=tiny",
    "claas/tiny_icl": "claas/icl scale=tiny",
    "claas/tiny_no_update": "claas/no_update scale=tiny",
}

# --quick: one seed of Seq, Replay-KL as the MOPD paper specifies it (replay toward M_{k-1}, rewards / sigma_d) and the
# same replay with its sigma floored at 0.3 (mopd.train.replay_std_floor, a deviation; docs/benchmark.md "Replay
# steps near their teacher"), every stage whole: each stage's gain and the forgetting, side by side. On
# bundle version 3 a job takes 176-380 s on 2 cores two at a time; docs/benchmark.md "The quick run" has the totals.
# Version 2's quick run cut the plan (its jobs took 400-500 s); a cut goes here, as key=value overrides.
QUICK_MOPD_OVERRIDES: list[str] = []

# MOPD method labels of the report
LABELS = {"mopd/gym_seq": "Seq", "mopd/gym_replay_kl": "Replay-KL (shared)",
          "mopd/gym_replay_kl_fixed": "Replay-KL (fixed share)", "mopd/gym_seq_recovery": "Seq + recovery",
          "mopd/gym_fsar_shared": "FSAR (shared)", "mopd/gym_joint": "Joint MOPD",
          "mopd/gym_replay_kl_experts": "Replay toward the experts (shared)",
          "mopd/gym_replay_kl_floor": "Replay-KL, replay σ floored at 0.3 (shared)"}


def config_name(method: str) -> str:
    """The recipe (Hydra ``--config-name``) that runs ``method``."""
    return SPELLINGS.get(method, method).split()[0]


def method_overrides(method: str) -> list[str]:
    """The command-line overrides that make ``config_name(method)`` the method (``[]`` for a recipe as written)."""
    return SPELLINGS.get(method, method).split()[1:]


def spelled(method: str) -> str:
    """``method`` as a command line spells it: ``mopd/seq scale=gym`` for ``mopd/gym_seq``."""
    return SPELLINGS.get(method, method)
