"""The step's math component of the MOPD trainer: verl's keys it depends on, the batch info of each phase, and the
teacher step (rewards, per-domain advantages, logged KL) on a stand-in TransferQueue and worker group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from claas_verl.distill import domain_normalized_advantages, topk_rewards, topk_weighted_kl
from claas_verl.mopd.config_train import TrainConfig
from claas_verl.mopd.trainer import distill_step
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.alignment import AUX_KEY, aux_config
from claas_verl.mopd.trainer.workers import TEACHER_KEY


def _mopd(signal=None, block_size=4, topk=2, replay_std_floor=0.0, **train):
    return SimpleNamespace(block_size=block_size, signal=aux_config(signal or {}),
                           train=TrainConfig(topk=topk, replay_std_floor=replay_std_floor, **train))


def _config(train_batch_size=4, **actor):
    actor = {"ppo_mini_batch_size": 4, "ppo_epochs": 1, "strategy": "fsdp2", "data_loader_seed": 7, **actor}
    return OmegaConf.create({"data": {"train_batch_size": train_batch_size},
                             "actor_rollout_ref": {"rollout": {"temperature": 0.7, "n": 3}, "actor": actor}})


def test_verl_keys_the_step_depends_on_are_checked_with_the_keys_named():
    distill_step.DistillStep(_mopd({"hidden": True}), _config(), {"logic": 0})
    with pytest.raises(ValueError, match=r"data.train_batch_size=8 must equal mopd.block_size=4"):
        distill_step.DistillStep(_mopd(), _config(train_batch_size=8), {})
    with pytest.raises(ValueError, match=r"ppo_mini_batch_size=2 must equal mopd.block_size=4"):
        distill_step.DistillStep(_mopd(), _config(ppo_mini_batch_size=2), {})
    with pytest.raises(ValueError, match=r"mopd.signal enables \['hidden'\].*strategy=fsdp2, got 'fsdp'"):
        distill_step.DistillStep(_mopd({"hidden": True}), _config(strategy="fsdp"), {})
    distill_step.DistillStep(_mopd(), _config(strategy="fsdp"), {})  # token loss only: any engine


def test_the_update_is_one_mini_batch_of_the_whole_step_and_aligned_only_on_replay_steps():
    step = distill_step.DistillStep(_mopd({"hidden": True}), _config(), {"logic": 0})
    info = step.update_info("replay")
    assert "compute_loss" not in info and info[token_fields.PHASE_KEY] == token_fields.PHASE_UPDATE
    assert info[token_fields.TOPK_KEY] == 2
    assert (info["global_batch_size"], info["mini_batch_size"], info["epochs"], info["seed"]) == (12, 12, 1, 7)
    assert info["dataloader_kwargs"] == {"shuffle": False} and info["temperature"] == 0.7
    assert info[AUX_KEY] == step.aux.to_dict()
    # the replay step's domain travels with it: carried balancing keeps its multipliers per domain
    assert step.update_info("replay", "logic")[AUX_KEY] == {**step.aux.to_dict(), "domain": "logic"}
    assert AUX_KEY not in step.update_info("new") and AUX_KEY not in step.update_info("recovery")
    flags = step.flags(token_fields.PHASE_TEACHER)
    assert flags["compute_loss"] and flags["distillation_only"] and not flags["calculate_entropy"]


class _Queue:
    """TransferQueue's ``kv_batch_get`` / ``kv_batch_put`` on one dict of fields."""

    def __init__(self, fields):
        self.fields, self.put = fields, {}

    def kv_batch_get(self, keys, partition_id, select_fields):
        return {k: self.fields[k] for k in select_fields}

    def kv_batch_put(self, keys, partition_id, fields):
        self.put.update(dict(fields.items()))


def test_the_teacher_step_computes_rewards_advantages_and_the_logged_kl(monkeypatch):
    torch.manual_seed(0)
    lens, k = [3, 2], 2
    S = torch.randn(2, 3, k).log_softmax(-1)
    Q = torch.randn(2, 3, k).log_softmax(-1)
    mask_nested = torch.nested.as_nested_tensor([torch.ones(n, dtype=torch.long) for n in lens], layout=torch.jagged)
    queue = _Queue({token_fields.STUDENT_LP: token_fields.pack_rows(S, mask_nested),
                    token_fields.TEACHER_LP: token_fields.pack_rows(Q, mask_nested), "response_mask": mask_nested})
    monkeypatch.setattr(distill_step, "tq", queue)
    seen = {}
    wg = SimpleNamespace(mopd_teacher_forward=lambda b: seen.update(b.extra_info))
    batch = SimpleNamespace(keys=["a", "b"], partition_id="train", extra_info={})
    step = distill_step.DistillStep(_mopd(), _config(), {"logic": 0, "math": 1})
    metrics = {}
    plan_step = {"kind": "new", "teacher": "expert:math", "domain": "math", "stage": 2, "block": 0}
    step.teacher_advantages(batch, wg, plan_step, tokenizer=None, metrics=metrics)

    assert seen[TEACHER_KEY] == "expert:math" and seen[token_fields.PHASE_KEY] == token_fields.PHASE_TEACHER
    assert AUX_KEY not in seen
    assert TEACHER_KEY not in batch.extra_info  # the teacher's name does not travel into the update
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    S, Q = S * mask[..., None], Q * mask[..., None]  # what unpack_rows gives back: zero past each row's end
    A = domain_normalized_advantages(topk_rewards(S, Q, mask), mask, torch.ones(2, dtype=torch.long), sync=False)
    assert torch.allclose(token_fields.unpack_rows(queue.put[token_fields.ADVANTAGES], k), A)
    assert torch.allclose(queue.put["advantages"].to_padded_tensor(0), A.sum(-1) * mask)
    assert metrics["mopd/kl_topk"] == pytest.approx(float(topk_weighted_kl(S, Q, mask)))
    assert (metrics["mopd/stage"], metrics["mopd/block"], metrics["mopd/reward_count"]) == (2, 0, 10)


@pytest.mark.parametrize("kinds", [("replay",), ("replay", "recovery"), ("new",)])
@pytest.mark.parametrize("kind", ["new", "replay", "recovery"])
def test_the_std_floor_applies_to_the_step_kinds_it_names(monkeypatch, kind, kinds):
    # rewards of a student next to its teacher: σ_d is about 0.01, far below a floor of 5, which then divides the
    # rewards of a step of a kind in std_floor_kinds (A = r / 5; by default replay only) and leaves every other
    # kind at the paper's r / σ_d
    A, metrics, r = _near_teacher_step(monkeypatch, _mopd(replay_std_floor=5.0, std_floor_kinds=kinds), kind)
    mask = torch.ones(2, 3)
    sigma = float(r.double().flatten().std())
    assert sigma < 0.05 and metrics["mopd/adv_std"] == pytest.approx(sigma, rel=1e-6)
    if kind in kinds:
        assert metrics["mopd/adv_sigma"] == 5.0
        torch.testing.assert_close(A, r / 5.0, rtol=1e-6, atol=0)
    else:
        assert metrics["mopd/adv_sigma"] == pytest.approx(sigma, rel=1e-6)
        torch.testing.assert_close(A, domain_normalized_advantages(r, mask, sync=False))


def _near_teacher_step(monkeypatch, mopd, kind):
    """A teacher step on a student next to its teacher; returns (advantages, metrics, rewards)."""
    torch.manual_seed(1)
    S = torch.randn(2, 3, 2).log_softmax(-1)
    Q = S + 0.01 * torch.randn(2, 3, 2)
    mask_nested = torch.nested.as_nested_tensor([torch.ones(3, dtype=torch.long)] * 2, layout=torch.jagged)
    queue = _Queue({token_fields.STUDENT_LP: token_fields.pack_rows(S, mask_nested),
                    token_fields.TEACHER_LP: token_fields.pack_rows(Q, mask_nested), "response_mask": mask_nested})
    monkeypatch.setattr(distill_step, "tq", queue)
    wg = SimpleNamespace(mopd_teacher_forward=lambda b: None)
    batch = SimpleNamespace(keys=["a", "b"], partition_id="train", extra_info={})
    metrics = {}
    distill_step.DistillStep(mopd, _config(), {"logic": 0}).teacher_advantages(
        batch, wg, {"kind": kind, "teacher": "student:1", "domain": "logic", "stage": 2, "block": 0},
        tokenizer=None, metrics=metrics)
    A = token_fields.unpack_rows(queue.put[token_fields.ADVANTAGES], 2)
    return A, metrics, topk_rewards(S, Q, torch.ones(2, 3))


@pytest.mark.parametrize("kind", ["new", "replay", "recovery"])
def test_the_replay_weight_multiplies_replay_advantages_after_sigma(monkeypatch, kind):
    # c = 0.25: a replay step's A = 0.25 · r / σ_d; new-domain and recovery steps keep r / σ_d; the weight is logged
    A, metrics, r = _near_teacher_step(monkeypatch, _mopd(replay_weight=0.25), kind)
    paper = domain_normalized_advantages(r, torch.ones(2, 3), sync=False)
    torch.testing.assert_close(A, paper * (0.25 if kind == "replay" else 1.0), rtol=1e-6, atol=0)
    assert metrics["mopd/replay_weight"] == (0.25 if kind == "replay" else 1.0)


def test_the_paper_defaults_change_no_bit_and_log_no_arm_field(monkeypatch):
    # every replay-arm key at its default: A is exactly r / σ_d, the update is verl's rollout.n batch, no arm field
    A, metrics, r = _near_teacher_step(monkeypatch, _mopd(), "replay")
    torch.testing.assert_close(A, domain_normalized_advantages(r, torch.ones(2, 3), sync=False), rtol=0, atol=0)
    assert not {"mopd/replay_weight", "mopd/responses_per_prompt", "mopd/optimizer_state"} & set(metrics)
    step = distill_step.DistillStep(_mopd(), _config(), {"logic": 0})
    assert step.responses_per_prompt("replay") is None and step.update_info("replay")["global_batch_size"] == 12
    t = torch.randn(2, 3, 2)
    assert distill_step.replay_weighted(t, "replay", 1.0) is t


def test_replay_steps_sample_their_own_reply_count_and_update_on_the_whole_step():
    # 4 prompts per block, rollout.n = 3, replay steps 6 replies: the update's one mini-batch is 4·6 = 24 rows there
    step = distill_step.DistillStep(_mopd(responses_per_prompt=3, replay_responses_per_prompt=6), _config(),
                                    {"logic": 0})
    assert (step.responses_per_prompt("new"), step.responses_per_prompt("replay")) == (None, 6)
    assert step.update_info("new")["global_batch_size"] == 12
    assert (step.update_info("replay")["global_batch_size"], step.update_info("replay")["mini_batch_size"]) == (24, 24)
    assert step.step_log("replay") == {"mopd/responses_per_prompt": 6}
    assert step.step_log("new") == {"mopd/responses_per_prompt": 3}


def test_a_separate_replay_state_is_swapped_in_for_replay_updates_only():
    calls = []
    wg = SimpleNamespace(mopd_optimizer_state=lambda which: calls.append(which),
                         update_actor=lambda b: calls.append("update") or {"metrics": {"grad_norm": [1.0]}})
    step = distill_step.DistillStep(_mopd(replay_optimizer="separate"), _config(), {"logic": 0})
    for kind in ("new", "replay", "new"):
        step.update_actor(SimpleNamespace(extra_info={}), wg, kind, {})
    assert calls == ["update", "replay", "update", "main", "update"]
    assert step.step_log("replay") == {"mopd/optimizer_state": 1}
    assert step.step_log("new") == {"mopd/optimizer_state": 0}
