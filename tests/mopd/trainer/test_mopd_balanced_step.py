"""The actor worker's balanced multi-pass step (docs/math.md §B.6/B.7) on a stand-in engine, without Ray or FSDP.

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
from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer.workers import MOPDTrainingWorker, MOPDWorker, update_row_groups


class _TokenLoss:
    """A stand-in token loss ℓ_tok(mb): mean NLL over the micro-batch's response window positions (B.7 form).

    Called as ``fn(model, mb)`` by the stand-in engine's token pass (``mopd.signal.passes: separate``), and as
    ``shared_token_loss(logits, data, rows)`` on the response-layout logits of the shared forward (``passes:
    shared``), like ``MOPDLoss``: the two give the same ℓ_tok only if the response logits sit at the right
    positions."""

    def __call__(self, model, mb: alignment.AuxMicroBatch) -> torch.Tensor:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                       use_cache=False).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
        m = mb.regions.window_mask[:, 1:].float()
        return -(lp * m).sum() / m.sum()

    def shared_token_loss(self, logits, data, rows):
        R = logits.shape[1]
        seqs = [data["input_ids"].unbind()[r] for r in rows]
        lens = data["response_mask"].offsets().diff()[rows]
        ids = torch.stack([torch.nn.functional.pad(s[len(s) - int(n):], (0, R - int(n))) for s, n in zip(seqs, lens)])
        m = data[alignment.WINDOW].to_padded_tensor(0)[rows, :R].float()
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
        return -(lp * m).sum() / m.sum(), {}


_tok_loss = _TokenLoss()


class _Engine:
    """verl's engine surface the balanced step uses; its token pass partitions the batch like verl's
    ``forward_backward_batch`` (``prepare_micro_batches`` on the batch's non-tensor keys) and weights each
    micro-batch's ℓ_tok by n_resp(mb)/n_resp (what ``MOPDLoss.update_loss`` does, B.7)."""

    def __init__(self, model, cfg):
        self.module, self.scaler, self.cfg, self.stepped, self.token_groups = model, None, cfg, None, None
        self.dp_group = None  # verl's data-parallel group (several ranks: every rank runs as many micro-batches)

    def optimizer_zero_grad(self):
        self.module.zero_grad(set_to_none=True)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self.token_groups = update_row_groups(data, self.dp_group)
        micro = alignment.aux_micro_batches(*_layout(data), self.token_groups)
        n = sum(mb.n_resp for mb in micro)
        total = 0.0
        for mb in micro:
            loss = loss_function(self.module, mb) * (mb.n_resp / n)
            loss.backward()
            total += float(loss.detach())
        return {"loss": [total], "metrics": {}, "model_output": {}}

    def optimizer_step(self):
        self.stepped = [None if p.grad is None else p.grad.clone() for p in self.module.parameters()]
        return math.sqrt(sum(float(g.pow(2).sum()) for g in self.stepped if g is not None))

    def is_mp_src_rank_with_outputs(self):
        return True

    def eval_mode(self):
        return torch.no_grad()


def _layout(data):
    seqs = [s for s in data["input_ids"].unbind()]
    rid = data[alignment.REGION_IDS].to_padded_tensor(-1)
    win = data[alignment.WINDOW].to_padded_tensor(0)
    return seqs, rid, win, data["response_mask"].offsets().diff()


def _batch(cfg: alignment.AuxConfig, seed=0, prompt_lens=(4, 6, 3), response_lens=(7, 5, 9), **partition):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (n,), generator=g) for n in prompt_lens]
    responses = [torch.randint(3, 60, (n,), generator=g) for n in response_lens]
    responses[0][2] = 7  # a separator inside row 0's window
    responses[-1][-3] = 7
    width = max(len(r) for r in responses)
    padded = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in responses])
    mask = torch.stack([torch.nn.functional.pad(torch.ones(len(r), dtype=torch.long), (0, width - len(r)))
                        for r in responses])
    rid, win = alignment.response_regions(padded, mask, {7}, cfg)
    nest = lambda xs: torch.nested.nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    data = tu.get_tensordict({
        "input_ids": nest([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
        "response_mask": nest([torch.ones(len(r), dtype=torch.long) for r in responses]),
        alignment.REGION_IDS: nest([rid[i, :len(r)] for i, r in enumerate(responses)]),
        alignment.WINDOW: nest([win[i, :len(r)] for i, r in enumerate(responses)]),
    })
    tu.assign_non_tensor_data(data, alignment.AUX_KEY, cfg.to_dict())
    partition = partition or {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": len(prompt_lens)}
    tu.assign_non_tensor(data, **partition)
    return data


def _held(tiny_dir, data, cfg):
    """What mopd_teacher_forward keeps for the colocated student: targets on the update's partition."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    teacher_worker = type("T", (), {"engine": _Engine(teacher, cfg)})()
    return MOPDWorker._teacher_targets(None, teacher_worker, data, cfg, update_row_groups(data))


@pytest.mark.parametrize("passes", ["shared", "separate"])
@pytest.mark.parametrize("ratio", [1.0, 0.5, 3.0])
def test_balanced_step_equals_reference_and_logs_the_ratio(tiny_dir, ratio, passes):
    """Both schedules (``mopd.signal.passes``) give the reference gradient: shared (one forward per micro-batch for
    the token loss and every term) and separate (verl's token pass, then a forward per term)."""
    torch.manual_seed(0)
    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": ratio, "rho": 2.0, "window": 4,
                                "passes": passes})
    student = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    # verl's dynamic token budget: sequences of 11, 11, 12 tokens, at most 24 per micro-batch -> 2 + 1 rows
    data = _batch(cfg, use_dynamic_bsz=True, max_token_len_per_gpu=24)
    held = _held(tiny_dir, data, cfg)
    assert sorted(len(g) for g in held["groups"]) == [1, 2] and held["targets"][0].hidden[0].dtype == torch.bfloat16

    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = _Engine(student, cfg)
    worker.mopd_targets = held
    out = worker.balanced_engine_step(data, _tok_loss, cfg)
    got = worker.engine.stepped
    m = {k: v[0] for k, v in out["metrics"].items() if k.startswith("mopd/") and isinstance(v, list)}
    assert m["mopd/tok_part_norm"] / m["mopd/aux_part_norm"] == pytest.approx(ratio, rel=1e-6)
    assert m["mopd/balance_scale"] == pytest.approx(m["mopd/tok_grad_norm"] / m["mopd/aux_grad_norm"], rel=1e-9)
    assert all(m[f"mopd/{t}_loss"] > 0 for t in ("sats", "vr", "hidden"))
    assert worker.mopd_targets is None  # targets are used once

    # separate: verl's token pass ran on the same micro-batches; shared: the shared forward replaced it
    assert worker.engine.token_groups == (held["groups"] if passes == "separate" else None)
    # reference: the tested building block on the same micro-batches (B.7 weights 2/3 and 1/3), separate passes
    micro = alignment.aux_micro_batches(*_layout(data), held["groups"])
    tgt_of = {id(mb): t for mb, t in zip(micro, held["targets"])}

    def forward(model, mb):
        return alignment_signals(model, mb.input_ids, mb.attention_mask, mb.regions, position_ids=mb.position_ids,
                                 use_cache=False)

    def term(name):
        return lambda out, mb: alignment_losses(out[1], tgt_of[id(mb)], mb.regions)[name].loss

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    ref = balanced_backward(
        ref_model, micro, [len(g) / 3 for g in held["groups"]], forward,
        {"tok": lambda out, mb: _tok_loss(ref_model, mb), "sats": term("sats"), "vr": term("vr"),
         "hid": term("hidden")},
        ratio=ratio, rho=2.0, single_forward=False, sync=False,
    )
    assert m["mopd/balance_scale"] == pytest.approx(ref["balance_scale"], rel=1e-5)
    for g, p in zip(got, ref_model.parameters()):
        if p.grad is None:
            assert g is None or float(g.abs().max()) == 0.0
        else:  # fp32, different summation order (the host direction s is accumulated term by term); the floor
            # is 1e-5 of the largest entry: 1e-6 held on AVX2 machines and missed by 6% on one entry of 65,536 on an
            # AVX-512 one, whose kernels sum in other blocks
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5 * float(p.grad.abs().max()))


def test_carried_balance_reuses_the_multipliers_of_the_exact_step(tiny_dir):
    """``mopd.signal.balance: carried``, refresh 2: exact, carried, exact. On the same batch and weights the carried
    step (one alignment pass of Σ_t α_t·ℓ_t on top of α_tok·g_tok) gives the exact step's gradient."""
    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 0.5, "window": 4,
                                "balance": "carried", "balance_refresh": 2})
    data = _batch(cfg)
    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    grads, metrics = [], []
    # keys: the teacher (no domain from the driver) three times, then a domain of its own, then the teacher again
    for key in (None, None, None, "spell", None):
        worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32), cfg)
        worker.mopd_targets = {**_held(tiny_dir, data, cfg), "teacher": "math"}
        out = worker.balanced_engine_step(data, _tok_loss, cfg, key=key)
        grads.append(worker.engine.stepped)
        metrics.append({k: v[0] for k, v in out["metrics"].items() if k.startswith("mopd/") and isinstance(v, list)})
    assert [m.get("mopd/balance_carried", 0.0) for m in metrics] == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert metrics[1]["mopd/mult_tok"] == 0.5 and metrics[1]["mopd/mult_vr"] > 0
    assert all(metrics[1][f"mopd/{t}_loss"] == pytest.approx(metrics[0][f"mopd/{t}_loss"], rel=1e-5)
               for t in ("sats", "vr", "hidden"))
    for exact, carried, again, *_ in zip(*grads):
        if exact is None:
            assert carried is None or float(carried.abs().max()) == 0.0
            continue
        torch.testing.assert_close(again, exact, rtol=0, atol=0)
        # fp32: the carried pass scales the losses' fp32 intermediates by α_t instead of the finished gradients
        torch.testing.assert_close(carried, exact, rtol=1e-4, atol=1e-5 * float(exact.abs().max()))


def test_carried_multipliers_survive_a_checkpoint_round_trip(tiny_dir):
    """The carried state goes into the run's checkpoint as JSON (``mopd_state.json``): a worker restored from it
    continues refresh 3's cycle (carried, then exact) with the saved multipliers, step for step and bit for bit like
    the worker that never stopped; a worker that lost it would run an exact step first."""
    import json

    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 0.5, "window": 4,
                                "balance": "carried", "balance_refresh": 3})
    data = _batch(cfg)

    def step(worker):
        worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32), cfg)
        worker.mopd_targets = {**_held(tiny_dir, data, cfg), "teacher": "math"}
        out = worker.balanced_engine_step(data, _tok_loss, cfg, key="spell")
        return ({k: v[0] for k, v in out["metrics"].items()
                 if k.startswith("mopd/") and isinstance(v, list) and isinstance(v[0], float)},
                worker.engine.stepped)

    first = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    assert first.carried_state() is None
    before = [step(first) for _ in range(2)]  # exact, carried
    saved = json.loads(json.dumps(first.carried_state()))
    assert saved["uses"] == {"spell": 1} and saved["mults"]["spell"]["mult_vr"] == before[1][0]["mopd/mult_vr"]
    restored = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    restored.load_carried_state(saved)
    fresh = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    went_on = [step(first) for _ in range(2)]
    resumed = [step(restored) for _ in range(2)]
    assert [m.get("mopd/balance_carried", 0.0) for m, _ in went_on] == [1.0, 0.0]
    assert [m.get("mopd/balance_carried", 0.0) for m, _ in resumed] == [1.0, 0.0]
    assert step(fresh)[0].get("mopd/balance_carried", 0.0) == 0.0
    for (m_a, g_a), (m_b, g_b) in zip(went_on, resumed):
        assert m_a == m_b
        for a, b in zip(g_a, g_b):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    restored.load_carried_state(None)
    assert restored.carried_state() is None


def test_balanced_step_refuses_targets_of_another_batch(tiny_dir):
    cfg = alignment.aux_config({"hidden": True, "window": 4})
    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student"), cfg)
    worker.mopd_targets = {"fingerprint": "3:00000000", "groups": [[0, 1, 2]], "targets": []}
    with pytest.raises(ValueError, match="other rows than this update batch"):
        worker.balanced_engine_step(_batch(cfg), _tok_loss, cfg)
    data = _batch(cfg)
    fingerprint = alignment.batch_fingerprint(list(data["input_ids"].unbind()))
    worker.mopd_targets = {"fingerprint": fingerprint, "groups": [[0], [1], [2]], "targets": []}
    with pytest.raises(ValueError, match="micro-batches"):
        worker.balanced_engine_step(data, _tok_loss, cfg)
    worker.mopd_targets = None
    with pytest.raises(ValueError, match="without teacher alignment targets"):
        worker.balanced_engine_step(_batch(cfg), _tok_loss, cfg)


@pytest.mark.parametrize("passes", ["shared", "separate"])
def test_balanced_step_under_fsdp2_matches_the_unsharded_step(tiny_dir, tmp_path, passes):
    """FSDP2 (gloo, one rank, like the CPU recipes): DTensor gradients, all-reduced norms over the shard group, and
    alignment losses that tap q/k/v inside resharded layers (their backward needs the layer's gathered weights);
    with shared passes, several backward passes on one forward's graph."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "ratio": 2.0, "window": 4,
                                "passes": passes})
    data = _batch(cfg, seed=1, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    held = _held(tiny_dir, data, cfg)

    def run(model):
        worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
        worker.engine = _Engine(model, cfg)
        worker.mopd_targets = held
        out = worker.balanced_engine_step(data, _tok_loss, cfg)
        return worker.engine.stepped, {k: v[0] for k, v in out["metrics"].items()
                                       if k.startswith("mopd/") and isinstance(v, list)}

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


@pytest.mark.parametrize("combine", ["fsar", "1:1:1"])
def test_combined_gradient_is_the_same_for_different_micro_batch_partitions(tiny_dir, combine):
    """docs/math.md §B.6/B.7: every term over the same micro-batches, each weighted n_resp(mb)/n_resp. With responses of
    equal length and windows of W tokens (per-micro-batch token means then equal the batch mean), the combined
    gradient must not depend on how verl partitions the step: 4 rows of 1, 2 rows of 2, one of 4, and verl's
    dynamic token budget (Karmarkar-Karp over lengths: a different grouping)."""
    terms = {"sats": True, "vr": True, "hidden": True} if combine == "fsar" else {"sats": True, "hidden": True}
    cfg = alignment.aux_config({**terms, "ratio": 1.0, "window": 4, "combine": combine})
    partitions = [
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1},
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4},
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30},
    ]
    grads, seen = [], []
    for part in partitions:
        data = _batch(cfg, seed=2, prompt_lens=(4, 6, 3, 5), response_lens=(8, 8, 8, 8), **part)
        held = _held(tiny_dir, data, cfg)
        worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
        worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32), cfg)
        worker.mopd_targets = held
        worker.balanced_engine_step(data, _tok_loss, cfg)
        grads.append(worker.engine.stepped)
        seen.append(held["groups"])
    assert len({str(g) for g in seen}) == 4, seen  # four different partitions
    flat = [torch.cat([g.flatten() for g in gs if g is not None]) for gs in grads]
    for other in flat[1:]:  # equal up to float32 reduction order (and the bf16 rounding of the targets)
        assert float((other - flat[0]).norm() / flat[0].norm()) < 1e-5


def test_an_alignment_loss_without_a_gradient_path_raises(tiny_dir):
    cfg = alignment.aux_config({"hidden": True, "window": 4})
    data = _batch(cfg)
    held = _held(tiny_dir, data, cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    micro = alignment.aux_micro_batches(*_layout(data), held["groups"])
    with pytest.raises(ValueError, match="no gradient path"):  # a detached forward stands in for broken taps
        MOPDTrainingWorker._alignment_pass(model, "hidden", micro, [1.0], held["targets"], [0, 1, 2, 3],
                                           torch.device("cpu"), torch.no_grad())


def test_streamed_targets_are_produced_before_the_student_forward(tiny_dir):
    """A streamed micro-batch's teacher forward runs before the student's forward of that micro-batch, so the two
    forwards' activations are never alive together (it ran while the student's graph was held)."""
    cfg = alignment.aux_config({"sats": True, "window": 4})
    data = _batch(cfg, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    held = _held(tiny_dir, data, cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    forwards = []
    model.register_forward_pre_hook(lambda mod, args: forwards.append(1))
    seen = []

    class Streamed:  # a TeacherTargetStore whose every micro-batch is streamed
        def get(self, i, term):
            seen.append((i, len(forwards)))
            return held["targets"][i]

    micro = alignment.aux_micro_batches(*_layout(data), held["groups"])
    MOPDTrainingWorker._alignment_pass(model, "sats", micro, [1 / 3] * 3, Streamed(), [0, 1, 2, 3],
                                       torch.device("cpu"), torch.enable_grad())
    assert seen == [(0, 0), (1, 1), (2, 2)]  # micro-batch i's targets before the student's (i+1)-th forward
