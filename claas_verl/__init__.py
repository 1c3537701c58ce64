"""claas_verl: continual learning for LLMs on veRL and Ray.

Two systems share this package:

* CLaaS — an asynchronous replay-buffer actor feeding a LoRA trainer with
  sequence-level importance-sampling-corrected losses (``claas_verl.claas.replay``,
  ``claas_verl.losses``);
* continual multi-teacher on-policy distillation (MOPD) — top-k per-domain
  normalised distillation, alignment terms with gradient-norm balancing and
  stage schedulers (``claas_verl.distill``, ``claas_verl.align``,
  ``claas_verl.schedule``).

Importing the package is light (no verl, Ray or CUDA import) and makes
claas_verl's losses appear in verl's registries as soon as verl's ``core_algos``
is imported, so ``get_policy_loss_fn("claas_seq_is")`` works after
``import claas_verl`` in any order.
"""

from __future__ import annotations

# The edge's job: import both systems. Each system's package schedules its own verl names (losses, advantage
# estimators) for the moment verl's core_algos module is imported (at once if it already is), without importing
# verl itself; the verl.plugins entry point imports this package first, so the names exist in every Ray worker too.
import claas_verl.claas  # noqa: F401  (schedules claas_seq_is, claas_seq_is_product, claas_rpp_ema, ...)
import claas_verl.mopd  # noqa: F401  (schedules claas_topk_distill)
from claas_verl.config_resolvers import register_resolvers

__version__ = "0.1.0"

register_resolvers()
