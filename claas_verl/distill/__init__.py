"""Token channel of continual MOPD (docs/math.md §B.2): student top-k, teacher log-probs, rewards, per-domain
advantages, loss.

Pure torch; no verl or Ray imports. The verl registration lives in :mod:`claas_verl.mopd.verl_losses`.
"""

from claas_verl.distill.topk import (
    DEFAULT_CHUNK_SIZE,
    MIN_DOMAIN_STD,
    domain_advantages_and_stds,
    domain_moments,
    domain_normalized_advantages,
    domain_stds,
    stds_from_moments,
    student_topk,
    teacher_logprobs_at,
    topk_binned_kl,
    topk_distill_loss,
    topk_distill_loss_from_logprobs,
    topk_logprobs,
    topk_rewards,
    topk_weighted_kl,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MIN_DOMAIN_STD",
    "domain_advantages_and_stds",
    "domain_moments",
    "domain_normalized_advantages",
    "domain_stds",
    "stds_from_moments",
    "student_topk",
    "teacher_logprobs_at",
    "topk_distill_loss",
    "topk_distill_loss_from_logprobs",
    "topk_logprobs",
    "topk_binned_kl",
    "topk_rewards",
    "topk_weighted_kl",
]
