"""The tiny bundle's verl reward function (``TinyPaths.rewards``, the manifest's ``rewards_module``)::

    custom_reward_function:
      path: <repo>/claas_verl/tiny/rewards.py     # or str(TinyPaths.rewards)
      name: compute_score

The rules live with the system whose recipes score with them, :mod:`claas_verl.mopd.data.rule_rewards` (tiny may
import from there, never the other way); this file is the path a built bundle names.
"""

from claas_verl.mopd.data.rule_rewards import compute_score, strip_thinking

__all__ = ["compute_score", "strip_thinking"]
