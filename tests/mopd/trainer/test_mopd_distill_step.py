"""The step's math component of the MOPD trainer: verl's keys it depends on, the batch info of each phase, and the
teacher step (rewards, per-domain advantages, logged KL) on a stand-in TransferQueue and worker group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from claas_verl.distill import domain_normalized_advantages, topk_rewards, topk_weighted_kl
from claas_verl.mopd.trainer import distill_step
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.alignment import AUX_KEY, aux_config
from claas_verl.mopd.trainer.workers import TEACHER_KEY


def _mopd(signal=None, block_size=4, topk=2, replay_std_floor=0.0):
    return SimpleNamespace(block_size=block_size, train=SimpleNamespace(topk=topk, replay_std_floor=replay_std_floor),
                           signal=aux_config(signal or {}))


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


@pytest.mark.parametrize("kind", ["new", "replay", "recovery"])
def test_the_std_floor_applies_to_replay_steps_only(monkeypatch, kind):
    # rewards of a student next to its teacher: σ_d is about 0.01, far below a floor of 5, which then divides a
    # replay step's rewards (A = r / 5) and leaves every other kind at the paper's r / σ_d
    torch.manual_seed(1)
    S = torch.randn(2, 3, 2).log_softmax(-1)
    Q = S + 0.01 * torch.randn(2, 3, 2)
    mask_nested = torch.nested.as_nested_tensor([torch.ones(3, dtype=torch.long)] * 2, layout=torch.jagged)
    queue = _Queue({token_fields.STUDENT_LP: token_fields.pack_rows(S, mask_nested),
                    token_fields.TEACHER_LP: token_fields.pack_rows(Q, mask_nested), "response_mask": mask_nested})
    monkeypatch.setattr(distill_step, "tq", queue)
    wg = SimpleNamespace(mopd_teacher_forward=lambda b: None)
    batch = SimpleNamespace(keys=["a", "b"], partition_id="train", extra_info={})
    step = distill_step.DistillStep(_mopd(replay_std_floor=5.0), _config(), {"logic": 0})
    metrics = {}
    step.teacher_advantages(batch, wg, {"kind": kind, "teacher": "student:1", "domain": "logic", "stage": 2,
                                        "block": 0}, tokenizer=None, metrics=metrics)
    mask = torch.ones(2, 3)
    r = topk_rewards(S, Q, mask)
    sigma = float(r.double().flatten().std())
    assert sigma < 0.05 and metrics["mopd/adv_std"] == pytest.approx(sigma, rel=1e-6)
    A = token_fields.unpack_rows(queue.put[token_fields.ADVANTAGES], 2)
    if kind == "replay":
        assert metrics["mopd/adv_sigma"] == 5.0
        torch.testing.assert_close(A, r / 5.0, rtol=1e-6, atol=0)
    else:
        assert metrics["mopd/adv_sigma"] == pytest.approx(sigma, rel=1e-6)
        torch.testing.assert_close(A, domain_normalized_advantages(r, mask, sync=False))
