"""claas_verl.utils.generation: the sampler of the CPU rollout and the chat service's HF backend."""

from __future__ import annotations

import math

import torch

from claas_verl.utils.generation import sample_next_token


def test_sample_logprob_is_log_softmax_at_temperature():
    # logits [0, ln 3] at τ = 0.5 → scaled [0, 2 ln 3] → probs [1/10, 9/10]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    g = torch.Generator().manual_seed(0)
    token, logp = sample_next_token(logits, temperature=0.5, generator=g)
    expected = math.log(0.1) if int(token) == 0 else math.log(0.9)
    assert abs(float(logp) - expected) < 1e-6


def test_greedy_and_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    token, logp = sample_next_token(logits, temperature=0.0)
    assert int(token) == 1
    assert abs(float(logp) - float(torch.log_softmax(logits, -1)[0, 1])) < 1e-6
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next_token(logits, 1.0, top_k=1, generator=g)[0]) for _ in range(20)}
    assert draws == {1}
