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

from claas_verl import _moved
from claas_verl.config_resolvers import register_resolvers
from claas_verl.verl_ext import register_when_verl_loads

__version__ = "0.1.0"

# No verl import here: the registrations run the moment verl's core_algos module is
# imported (at once if it already is), in this process and, through the verl.plugins
# entry point, in every Ray worker.
register_when_verl_loads()
# the module paths of the previous layout keep importing for one release (claas_verl/_moved.py)
_moved.install()
register_resolvers()
