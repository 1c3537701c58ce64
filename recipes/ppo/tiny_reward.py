"""Reward for the tiny GRPO recipe: verl's GSM8K score plus a small dense shaping term.

A randomly initialised tiny model never writes ``#### <answer>``, so the exact-match
score alone is 0 for every sample, every GRPO advantage is 0 and nothing trains.
The shaping term, 0.1 × the fraction of the response's characters that are ASCII
letters or digits, varies between any two random responses, so a group of samples
has a non-zero spread from step 1 (a digits-only term is 0 for most random 16-token
responses, which left whole steps without signal). Used via
``reward.custom_reward_function.path=recipes/ppo/tiny_reward.py`` (name ``compute_score``).
"""

from verl.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    exact = float(default_compute_score(data_source, solution_str, ground_truth, extra_info))
    alnum = sum(ch.isascii() and ch.isalnum() for ch in solution_str) / max(1, len(solution_str))
    return exact + 0.1 * alnum
