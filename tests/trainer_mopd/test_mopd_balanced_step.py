"""The actor worker's balanced multi-pass step (SPEC B.6/B.7) on a stand-in engine, without Ray or FSDP.

``MOPDTrainingWorker.balanced_engine_step`` runs the engine's token pass, one pass per alignment term against the
teacher targets that ``MOPDWorker.mopd_teacher_forward`` keeps in the process, writes the balanced gradient
and calls the engine's optimizer step. Its gradient must equal the reference ``claas_verl.align.balanced_backward``
on the same micro-batch (separate passes), and the logged parts must be in the configured ratio r.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.utils import tensordict_utils as tu

from claas_verl.align import alignment_losses, alignment_signals, balanced_backward
from claas_verl.trainer.mopd import alignment as A
from claas_verl.trainer.mopd.workers import MOPDTrainingWorker, MOPDWorker


def _tok_loss(model, mb: A.AuxMicroBatch) -> torch.Tensor:
    """A stand-in token loss: mean NLL of the response tokens (window positions) under the model."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                   use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
    m = mb.regions.window_mask[:, 1:].float()
    return -(lp * m).sum() / m.sum()


class _Engine:
    def __init__(self, model, cfg):
        self.module, self.scaler, self.cfg, self.stepped = model, None, cfg, None

    def optimizer_zero_grad(self):
        self.module.zero_grad(set_to_none=True)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        (mb,) = A.aux_micro_batches(*_layout(data), micro_batch_size=64)
        loss = loss_function(self.module, mb)
        loss.backward()
        return {"loss": [float(loss.detach())], "metrics": {}, "model_output": {}}

    def optimizer_step(self):
        self.stepped = [None if p.grad is None else p.grad.clone() for p in self.module.parameters()]
        return math.sqrt(sum(float(g.pow(2).sum()) for g in self.stepped if g is not None))

    def is_mp_src_rank_with_outputs(self):
        return True

    def eval_mode(self):
        return torch.no_grad()


def _layout(data):
    seqs = [s for s in data["input_ids"].unbind()]
    rid = data[A.REGION_IDS].to_padded_tensor(-1)
    win = data[A.WINDOW].to_padded_tensor(0)
    return seqs, rid, win, data["response_mask"].offsets().diff()


def _batch(cfg: A.AuxConfig, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (n,), generator=g) for n in (4, 6, 3)]
    responses = [torch.randint(3, 60, (n,), generator=g) for n in (7, 5, 9)]
    responses[0][2] = 7  # a separator inside row 0's window
    width = max(len(r) for r in responses)
    padded = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in responses])
    mask = torch.stack([torch.nn.functional.pad(torch.ones(len(r), dtype=torch.long), (0, width - len(r)))
                        for r in responses])
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


@pytest.mark.parametrize("ratio", [1.0, 0.5, 3.0])
def test_balanced_step_equals_reference_and_logs_the_ratio(tiny_dir, ratio):
    torch.manual_seed(0)
    cfg = A.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": ratio, "rho": 2.0, "window": 4},
                       micro_batch_size=64)
    student = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    data = _batch(cfg)

    # teacher side (what mopd_teacher_forward keeps for the colocated student)
    teacher_worker = type("T", (), {"engine": _Engine(teacher, cfg)})()
    held = MOPDWorker._teacher_targets(None, teacher_worker, data, cfg)
    assert len(held["targets"]) == 1 and held["targets"][0].hidden[0].dtype == torch.bfloat16

    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = _Engine(student, cfg)
    worker.mopd_targets = held
    out = worker.balanced_engine_step(data, _tok_loss, cfg)
    got = worker.engine.stepped
    m = {k: v[0] for k, v in out["metrics"].items() if k.startswith("mopd/")}
    assert m["mopd/tok_part_norm"] / m["mopd/aux_part_norm"] == pytest.approx(ratio, rel=1e-6)
    assert m["mopd/balance_scale"] == pytest.approx(m["mopd/tok_grad_norm"] / m["mopd/aux_grad_norm"], rel=1e-9)
    assert all(m[f"mopd/{t}_loss"] > 0 for t in ("sats", "vr", "hidden"))
    assert worker.mopd_targets is None  # targets are used once

    # reference: the tested building block on the same micro-batch, separate passes
    (mb,) = A.aux_micro_batches(*_layout(data), micro_batch_size=64)
    (tgt,) = held["targets"]

    def forward(model, mb):
        return alignment_signals(model, mb.input_ids, mb.attention_mask, mb.regions, position_ids=mb.position_ids,
                                 use_cache=False)

    def term(name):
        return lambda out, mb: alignment_losses(out[1], tgt, mb.regions)[name].loss

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    ref = balanced_backward(
        ref_model, [mb], [1.0], forward,
        {"tok": lambda out, mb: _tok_loss(ref_model, mb), "sats": term("sats"), "vr": term("vr"),
         "hid": term("hidden")},
        ratio=ratio, rho=2.0, single_forward=False, sync=False,
    )
    assert m["mopd/balance_scale"] == pytest.approx(ref["balance_scale"], rel=1e-5)
    for g, p in zip(got, ref_model.parameters()):
        if p.grad is None:
            assert g is None or float(g.abs().max()) == 0.0
        else:
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)


def test_balanced_step_refuses_targets_of_another_batch(tiny_dir):
    cfg = A.aux_config({"hidden": True, "window": 4}, micro_batch_size=64)
    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student"), cfg)
    worker.mopd_targets = {"fingerprint": "3:00000000", "targets": []}
    with pytest.raises(ValueError, match="other rows than this update batch"):
        worker.balanced_engine_step(_batch(cfg), _tok_loss, cfg)
    worker.mopd_targets = None
    with pytest.raises(ValueError, match="without teacher alignment targets"):
        worker.balanced_engine_step(_batch(cfg), _tok_loss, cfg)


def test_balanced_step_under_fsdp2_matches_the_unsharded_step(tiny_dir, tmp_path):
    """FSDP2 (gloo, one rank, like the CPU recipes): DTensor gradients, all-reduced norms over the shard group, and
    alignment losses that tap q/k/v inside resharded layers (their backward needs the layer's gathered weights)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    cfg = A.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 2.0, "window": 4}, micro_batch_size=2)
    data = _batch(cfg, seed=1)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    held = MOPDWorker._teacher_targets(None, type("T", (), {"engine": _Engine(teacher, cfg)})(), data, cfg)

    def run(model):
        worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
        worker.engine = _Engine(model, cfg)
        worker.mopd_targets = held
        out = worker.balanced_engine_step(data, _tok_loss, cfg)
        return worker.engine.stepped, {k: v[0] for k, v in out["metrics"].items() if k.startswith("mopd/")}

    plain, m_plain = run(AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sharded, m_sharded = run(model)
    finally:
        dist.destroy_process_group()
    assert m_sharded["mopd/tok_part_norm"] / m_sharded["mopd/aux_part_norm"] == pytest.approx(2.0, rel=1e-6)
    assert m_sharded["mopd/balance_scale"] == pytest.approx(m_plain["mopd/balance_scale"], rel=1e-5)
    for a, b in zip(plain, sharded):
        if a is not None:
            torch.testing.assert_close(b.full_tensor(), a, rtol=1e-4, atol=1e-7)
