"""Byte-level tiny models and prompts for the stage proxy's tests (benchmarks/mopd_stage_proxy.py and its steps);
the ``tok`` fixture is in this folder's conftest.py."""

from __future__ import annotations

from claas_verl.tiny import gym
from claas_verl.tiny.model import build_student

ROWS = [{"prompt": [{"role": "user", "content": w}]} for w in ("cat", "dog", "bird", "fish", "ant", "owl")]


def tiny_model(tok, seed: int):
    """A tiny student over the gym bundle's byte tokenizer, initialised from ``seed``."""
    eos, pad = gym.stop_and_pad_ids(tok)
    return build_student(len(tok), eos, pad, seed)
