"""OmegaConf resolvers that recipes use, registered by ``import claas_verl`` (also in every Ray worker).

``${claas_verl.per_rank:N,nnodes,gpus_per_node}``: the share of ``N`` entries one data-parallel training rank gets,
``N // (nnodes * gpus_per_node)``. The tiny recipes set ``ppo_micro_batch_size_per_gpu`` with it so one rank's share
of an update is one micro-batch whatever ``trainer.n_gpus_per_node`` is; a count that does not split evenly is
refused by the trainer's config check, which names the key.
"""

from __future__ import annotations

from omegaconf import OmegaConf


def per_rank(entries, nnodes, gpus_per_node) -> int:
    ranks = int(nnodes) * int(gpus_per_node)
    if ranks < 1:
        raise ValueError(f"claas_verl.per_rank: trainer.nnodes * trainer.n_gpus_per_node = {ranks}; it must be >= 1")
    return max(1, int(entries) // ranks)


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("claas_verl.per_rank", per_rank, replace=True)
