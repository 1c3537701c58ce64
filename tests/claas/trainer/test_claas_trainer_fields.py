"""Replay entries -> TransferQueue fields (claas_verl.claas.trainer.tq_fields), checked through the registered loss."""

from __future__ import annotations

import math

import pytest
import torch

from claas_verl.claas.replay import ReplayEntry
from claas_verl.claas.trainer import entry_fields, entry_tag, replay_key


def _entry(**kw) -> ReplayEntry:
    base = dict(scenario_id=3, step_idx=1, prompt_ids=[5, 6, 7], response_ids=[8, 9, 2], behaviour_logprob=-2.5,
                reward=1.0, P=4, feedback=None)
    base.update(kw)
    return ReplayEntry(**base)


def test_fields_carry_behaviour_logprob_reward_and_versions():
    e = _entry()
    f = entry_fields(e, data_source="claas/test")
    assert f["prompts"].tolist() == [5, 6, 7] and f["responses"].tolist() == [8, 9, 2]
    assert f["input_ids"].tolist() == [5, 6, 7, 8, 9, 2] and f["position_ids"].tolist() == [0, 1, 2, 3, 4, 5]
    assert f["response_mask"].tolist() == [1, 1, 1] and f["loss_mask"].tolist() == [1, 1, 1]
    # ℓb sits on the first response token: Σ_j m·old = -2.5 exactly, 0 elsewhere.
    assert f["rollout_log_probs"].tolist() == [-2.5, 0.0, 0.0]
    # the reward goes on the last valid token (verl convention): [0, 0, 1].
    assert f["rm_scores"].tolist() == [0.0, 0.0, 1.0]
    assert f["extra_fields"]["min_global_steps"] == f["extra_fields"]["max_global_steps"] == 4
    assert f["uid"] == e.uid and f["data_source"] == "claas/test"
    assert f["num_turns"] == 5  # step 1: system + 2 user + 1 assistant in context + the reply
    tag = entry_tag(e)
    assert tag == {"status": "success", "prompt_len": 3, "response_len": 3, "seq_len": 6, "global_steps": 4,
                   "min_global_steps": 4, "max_global_steps": 4}


def test_replay_keys_are_fresh_and_in_verl_key_shape():
    keys = {replay_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(len(k.rsplit("_", 2)) == 3 for k in keys)


def test_rejects_scenario_entries():
    with pytest.raises(ValueError, match="ReplayEntry"):
        entry_fields({"not": "an entry"})


def test_registered_claas_seq_is_sees_the_exact_sequence_ratio():
    """Through verl's registry: with Σ logp = ℓb the ratio is 1 and the loss is the REINFORCE surrogate −A."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import claas_verl.claas.verl_losses  # noqa: F401  (registers claas_seq_is)

    e1 = _entry(behaviour_logprob=-3.0, response_ids=[8, 9, 2])
    e2 = _entry(behaviour_logprob=-1.0, response_ids=[4, 2], reward=0.0)
    rows = [entry_fields(e) for e in (e1, e2)]
    T = 3
    old = torch.zeros(2, T)
    mask = torch.zeros(2, T)
    for i, f in enumerate(rows):
        n = f["responses"].numel()
        old[i, :n] = f["rollout_log_probs"]
        mask[i, :n] = 1
    # current policy: e1 tokens -1 each (Σ = -3 = ℓb), e2 tokens -0.5 each (Σ = -1 = ℓb) -> both ratios exactly 1
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    adv = torch.tensor([[0.5] * T, [-2.0] * T]) * mask
    loss_fn = get_policy_loss_fn("claas_seq_is")
    cfg = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "global_batch_info": {}}
    loss, _ = loss_fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask.bool(),
                      loss_agg_mode="token-mean", config=cfg)
    # token-mean of -A·1 over 5 valid tokens: (3·(-0.5) + 2·2.0) / 5 = 2.5 / 5 = 0.5
    assert math.isclose(float(loss.detach()), 0.5, rel_tol=1e-6)


def test_scenario_entry_is_one_sequence_with_observations_masked():
    from claas_verl.claas.replay import ScenarioEntry

    s0 = _entry(step_idx=0, prompt_ids=[5, 6], response_ids=[8, 2], behaviour_logprob=-1.0, reward=1.0, P=3)
    s1 = _entry(step_idx=1, prompt_ids=[5, 6, 8, 2, 40, 41], response_ids=[9, 9, 2], behaviour_logprob=-2.0,
                reward=0.0, P=4)
    sc = ScenarioEntry(steps=[s0, s1], P=3)  # the buffer sets P = min over the steps at insertion
    f = entry_fields(sc)
    assert f["prompts"].tolist() == [5, 6] and f["responses"].tolist() == [8, 2, 40, 41, 9, 9, 2]
    assert f["response_mask"].tolist() == [1, 1, 0, 0, 1, 1, 1] == f["loss_mask"].tolist()
    # Σ_j m·old = Σ_t ℓb_t (docs/math.md §A.1.5), each on its step's first sampled token; the scenario reward min_t r_t
    # = 0
    # on the last token of the last step.
    assert f["rollout_log_probs"].tolist() == [-1.0, 0.0, 0.0, 0.0, -2.0, 0.0, 0.0]
    assert f["rm_scores"].tolist() == [0.0] * 7 and sc.reward == 0.0
    assert f["extra_fields"]["min_global_steps"] == 3
    assert entry_tag(sc)["response_len"] == 7 and entry_tag(sc)["seq_len"] == 9
    with pytest.raises(ValueError, match="SDPO"):
        entry_fields(sc, sdpo=True)
    bad = ScenarioEntry(steps=[s0, _entry(step_idx=1, prompt_ids=[5, 6, 8, 3, 40], response_ids=[9, 2])])
    with pytest.raises(ValueError, match=r"steps\[1\].prompt_ids do not extend"):
        entry_fields(bad)
