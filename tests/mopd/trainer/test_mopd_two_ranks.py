"""The balanced replay step on two training ranks (gloo, FSDP2 over both) equals the one-rank step on the same data.

Two processes (``torch.multiprocessing``, a gloo group, one FSDP2 mesh of 2 shards) each hold half of the update
batch and run ``MOPDTrainingWorker.balanced_engine_step`` on it, with teacher targets from
``MOPDWorker._teacher_targets`` on their own rows, as the colocated MOPD worker does. What two ranks add over one:

* verl's ``prepare_micro_batches(..., same_micro_num_in_dp=True)``: rank 0's rows fit one dynamic-size micro-batch,
  rank 1's need two; both must run two (FSDP's collectives must match);
* the ``TeacherTargetStore``'s kept count: rank 0's budget holds one micro-batch, rank 1's all of them; both keep
  one (all-reduce MIN), so both run the same number of teacher forwards;
* the ``HostBalancer``'s norms and inner products over the shards of both ranks (one all-reduce per pass, docs/math.md
§B.6:
  before clipping), applied to FSDP2's averaged (reduce-scattered) DTensor gradients.

The combined gradient (hence the update) must equal the one-rank step on all four rows within 1e-5 relative: the
responses have equal lengths and equal windows, so the B.7 micro-batch weights make the loss independent of how the
rows are split into micro-batches and ranks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from test_mopd_balanced_step import _batch, _Engine, _tok_loss
from transformers import AutoModelForCausalLM

from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer.workers import MOPDTrainingWorker, MOPDWorker, update_row_groups

PROMPTS = (3, 4, 6, 5)  # rows 0-1 go to rank 0 (11 + 12 tokens: one micro-batch of <= 24), rows 2-3 to rank 1
RESPONSE = 8
MAX_TOKENS = 24
TIMEOUT_S = 600
SIGNAL = {"sats": True, "vr": True, "hidden": True, "ratio": 2.0, "rho": 2.0, "window": 4}


def _data(cfg, rows=(0, 1, 2, 3), **partition):
    """Rows ``rows`` of the one 4-row batch (the same tokens and regions on one rank and on two)."""
    from verl.utils import tensordict_utils as tu

    full = _batch(cfg, seed=3, prompt_lens=PROMPTS, response_lens=(RESPONSE,) * len(PROMPTS))
    data = tu.index_select_tensor_dict(full, list(rows))
    tu.assign_non_tensor(data, **partition)
    return data


class _DPEngine(_Engine):
    """The stand-in engine with verl's data-parallel group (what ``FSDPEngine.get_data_parallel_group`` returns):
    its token pass partitions the batch with it, as verl's ``forward_backward_batch`` does."""

    def __init__(self, model, cfg):
        import torch.distributed as dist

        super().__init__(model, cfg)
        self.dp_group = dist.group.WORLD

    def get_data_parallel_group(self):
        return self.dp_group


def _step(tiny_dir: Path, data, cfg, wrap=None):
    """(stepped gradients, metrics, teacher store, micro-batch groups) of one balanced step."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    engine_cls = _DPEngine if wrap else _Engine
    teacher_worker = type("T", (), {"engine": engine_cls(teacher, cfg)})()
    student = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32)
    if wrap:
        wrap(student)
    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = engine_cls(student, cfg)
    groups = update_row_groups(data, worker.engine.get_data_parallel_group() if wrap else None)
    held = MOPDWorker._teacher_targets(None, teacher_worker, data, cfg, groups)
    worker.mopd_targets = held
    out = worker.balanced_engine_step(data, _tok_loss, cfg)
    metrics = {k: v[0] for k, v in out["metrics"].items() if k.startswith("mopd/") and isinstance(v, list)}
    return worker.engine.stepped, metrics, held["targets"], groups


def _rank_main(rank: int, world: int, init_file: str, tiny_dir: str, out_dir: str, budgets: tuple[float, float]):
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = alignment.aux_config({**SIGNAL, "target_budget_gib": budgets[rank]})
        data = _data(cfg, (2 * rank, 2 * rank + 1), use_dynamic_bsz=True, max_token_len_per_gpu=MAX_TOKENS)

        def wrap(model):
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)

        stepped, metrics, store, groups = _step(Path(tiny_dir), data, cfg, wrap=wrap)
        full = [None if g is None else g.full_tensor() for g in stepped]  # collective: every rank calls it
        rows = [s.tolist() for s in data["input_ids"].unbind()]
        torch.save({"grads": full, "metrics": metrics, "groups": groups, "kept": store.kept, "rows": rows,
                    "teacher_forwards": store.teacher_forwards}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_rank_balanced_step_equals_one_rank(tiny_dir, tmp_path):
    import torch.multiprocessing as mp

    cfg = alignment.aux_config(SIGNAL)
    one = _data(cfg, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    ref, m_ref, ref_store, _ = _step(tiny_dir, one, cfg)
    # rank 0's budget holds one of its micro-batches (one row each; sizes within 25% of each other), rank 1's all
    assert min(ref_store.sizes) > 0.75 * max(ref_store.sizes)
    budgets = (1.5 * max(ref_store.sizes) / 2**30, 1.0)

    ctx = mp.start_processes(_rank_main, args=(2, str(tmp_path / "pg"), str(tiny_dir), str(tmp_path), budgets),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):  # raises when a rank fails; a collective mismatch would hang instead
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two ranks did not finish in {TIMEOUT_S} s (mismatched collectives?)")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    for r, out in enumerate(ranks):  # each rank trained on its own rows of the one-rank batch
        assert out["rows"] == [s.tolist() for s in one["input_ids"].unbind()[2 * r:2 * r + 2]]
    # verl's same_micro_num_in_dp: rank 0's two rows fit one micro-batch of <= 24 tokens, yet both ranks run two
    assert [len(out["groups"]) for out in ranks] == [2, 2]
    # TeacherTargetStore: the smaller budget decides on both ranks (1 kept), and both run 1 + 1 teacher forwards
    assert [out["kept"] for out in ranks] == [1, 1]
    # the kept one, then the streamed one: one forward for every term (mopd.signal.passes: shared)
    assert [out["teacher_forwards"] for out in ranks] == [2, 2]
    # the all-reduced norms are the same on both ranks and equal the one-rank ones
    for key in ("mopd/tok_grad_norm", "mopd/aux_grad_norm", "mopd/balance_scale", "mopd/balanced_grad_norm",
                "mopd/cos_tok_aux", "mopd/cos_u_hid"):
        assert ranks[0]["metrics"][key] == pytest.approx(ranks[1]["metrics"][key], rel=1e-9), key
        assert ranks[0]["metrics"][key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), key
    got = torch.cat([g.flatten() for g in ranks[0]["grads"] if g is not None])
    want = torch.cat([g.flatten() for g in ref if g is not None])
    assert got.shape == want.shape
    rel = float((got - want).norm() / want.norm())
    print(f"combined gradient, two ranks vs one: relative difference {rel:.2e}")
    assert rel < 1e-5, rel
    assert m_ref["mopd/tok_part_norm"] / m_ref["mopd/aux_part_norm"] == pytest.approx(2.0, rel=1e-6)

