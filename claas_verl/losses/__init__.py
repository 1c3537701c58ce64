"""CLaaS losses and advantages (docs/math.md §A.2, A.3), pure torch: no verl, no Ray.

verl registrations of these functions live in ``claas_verl.claas.verl_losses``.
"""

from claas_verl.losses.advantages import (
    RPP_ADV_MODES,
    EmaRewardStats,
    discounted_returns,
    ema_advantages,
    global_whiten_advantages,
    sequence_rewards,
)
from claas_verl.losses.sdpo import (
    FEEDBACK_TEMPLATE,
    REPROMPT_TEMPLATE,
    EmaTeacher,
    ema_update_,
    generalized_jsd,
    reprompt,
    sdpo_is_weight,
    sdpo_loss,
    self_distillation_mask,
    teacher_messages,
    topk_with_tail,
)
from claas_verl.losses.seq_is import (
    RATIO_MODES,
    behaviour_seq_logprob,
    seq_is_clipped_loss,
    sequence_log_ratio,
    token_log_ratio,
)

__all__ = [
    "RPP_ADV_MODES", "EmaRewardStats", "discounted_returns", "ema_advantages", "global_whiten_advantages",
    "sequence_rewards", "FEEDBACK_TEMPLATE", "REPROMPT_TEMPLATE", "EmaTeacher", "ema_update_",
    "generalized_jsd", "reprompt", "sdpo_is_weight", "sdpo_loss", "self_distillation_mask", "teacher_messages",
    "topk_with_tail", "RATIO_MODES", "behaviour_seq_logprob", "seq_is_clipped_loss", "sequence_log_ratio",
    "token_log_ratio",
]
