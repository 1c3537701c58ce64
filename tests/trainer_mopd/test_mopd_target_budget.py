"""The worker's teacher targets respect ``mopd.signal.target_budget_gib`` and a streamed step equals a kept one."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM
from verl.utils import tensordict_utils as tu

from claas_verl.trainer.mopd import alignment as A
from claas_verl.trainer.mopd.workers import MOPDTrainingWorker, MOPDWorker


def _layout(data):
    return ([s for s in data["input_ids"].unbind()], data[A.REGION_IDS].to_padded_tensor(-1),
            data[A.WINDOW].to_padded_tensor(0), data["response_mask"].offsets().diff())


class _Engine:
    """Stand-in engine: the token pass is a plain NLL on the window, the optimizer step records the gradient."""

    def __init__(self, model):
        self.module, self.scaler, self.stepped = model, None, None

    def optimizer_zero_grad(self):
        self.module.zero_grad(set_to_none=True)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        for mb in A.aux_micro_batches(*_layout(data), micro_batch_size=64):
            out = self.module(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
            lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
            m = mb.regions.window_mask[:, 1:].float()
            (-(lp * m).sum() / m.sum()).backward()
        return {"loss": [0.0], "metrics": {}, "model_output": {}}

    def optimizer_step(self):
        self.stepped = [None if p.grad is None else p.grad.clone() for p in self.module.parameters()]
        return math.sqrt(sum(float(g.pow(2).sum()) for g in self.stepped if g is not None))

    def is_mp_src_rank_with_outputs(self):
        return True

    def eval_mode(self):
        return torch.no_grad()


def _batch(cfg):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (n,), generator=g) for n in (4, 6, 3, 5)]
    responses = [torch.randint(3, 60, (n,), generator=g) for n in (7, 5, 9, 8)]
    for r in responses:
        r[2] = 7  # a separator inside each window
    width = max(len(r) for r in responses)
    padded = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in responses])
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in responses])[:, None]).long()
    rid, win = A.response_regions(padded, mask, {7}, cfg)
    nest = lambda xs: torch.nested.nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    data = tu.get_tensordict({
        "input_ids": nest([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
        "response_mask": nest([torch.ones(len(r), dtype=torch.long) for r in responses]),
        A.REGION_IDS: nest([rid[i, :len(r)] for i, r in enumerate(responses)]),
        A.WINDOW: nest([win[i, :len(r)] for i, r in enumerate(responses)]),
    })
    tu.assign_non_tensor_data(data, A.AUX_KEY, cfg.to_dict())
    return data


def _step(tiny_dir, budget_gib):
    signal = {"sats": True, "vr": True, "hidden": True, "window": 4, "target_budget_gib": budget_gib}
    cfg = A.aux_config(signal, micro_batch_size=1)
    assert A.AuxConfig.from_dict(cfg.to_dict()) == cfg
    data = _batch(cfg)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    held = MOPDWorker._teacher_targets(None, type("T", (), {"engine": _Engine(teacher)})(), data, cfg)
    store = held["targets"]
    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32))
    worker.mopd_targets = held
    worker.balanced_engine_step(data, None, cfg)
    return store, worker.engine.stepped


def test_budget_bounds_resident_targets_and_streaming_gives_the_same_step(tiny_dir):
    full, g_full = _step(tiny_dir, 1.0)
    assert full.kept == 4 and full.teacher_forwards == 4  # everything fits in 1 GiB: one forward per micro-batch
    budget = (full.sizes[0] + full.sizes[1]) / 2**30  # room for the first two of four micro-batches
    bounded, g_bounded = _step(tiny_dir, budget)
    assert bounded.kept == 2 and bounded.held_bytes <= budget * 2**30
    assert bounded.peak_bytes <= budget * 2**30 + max(bounded.sizes[2:])
    assert bounded.teacher_forwards == 2 + 2 * 3  # the two streamed micro-batches: one forward per term
    for a, b in zip(g_full, g_bounded):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_budget_key_is_validated():
    import pytest

    with pytest.raises(ValueError, match="target_budget_gib"):
        A.aux_config({"hidden": True, "target_budget_gib": -1})
