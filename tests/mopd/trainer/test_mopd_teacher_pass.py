"""The teacher side of an aligned replay step (``claas_verl.mopd.trainer.teacher_pass``): with
``mopd.signal.passes: shared`` one teacher forward per micro-batch gives both the log-probs Q at the student's stored
ids (what verl's log-prob pass returns) and the alignment targets (what the separate target forward keeps)."""

from __future__ import annotations

import pytest
import torch
from test_mopd_balanced_step import _batch, _Engine
from transformers import AutoModelForCausalLM
from verl.utils import tensordict_utils as tu

from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.teacher_pass import teacher_targets
from claas_verl.mopd.trainer.workers import update_row_groups

K, TAU = 3, 0.8


def _with_ids(data, seed=5):
    g = torch.Generator().manual_seed(seed)
    lens = data["response_mask"].offsets().diff()
    ids = torch.randint(0, 60, (len(lens), int(lens.max()), K), generator=g)
    data[token_fields.TOPK_IDS] = token_fields.pack_rows(ids, lens)
    tu.assign_non_tensor(data, temperature=TAU)
    return ids, lens


@pytest.mark.parametrize("budget", [16.0, 0.0])
def test_one_teacher_forward_gives_q_and_the_targets(tiny_dir, budget):
    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "window": 4, "passes": "shared",
                                "target_budget_gib": budget})
    data = _batch(cfg, use_dynamic_bsz=True, max_token_len_per_gpu=24)  # two micro-batches: rows {0, 1} and {2}
    ids, lens = _with_ids(data)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    worker = type("T", (), {"engine": _Engine(teacher, cfg)})()
    groups = update_row_groups(data)
    assert sorted(len(g) for g in groups) == [1, 2]
    calls = []
    teacher.register_forward_pre_hook(lambda mod, args: calls.append(1))
    held, output = teacher_targets(worker, data, cfg, groups, with_q=K)
    assert len(calls) == len(groups)  # one forward per micro-batch, whatever the budget
    q = token_fields.unpack_rows(output[token_fields.TEACHER_LP], K, token_fields.TEACHER_LP)
    seqs = list(data["input_ids"].unbind())
    for b, seq in enumerate(seqs):  # Q by hand: each row alone, logits at L-R-1+t predict response token t
        with torch.no_grad():
            z = teacher(input_ids=seq[None]).logits[0]
        L, R = len(seq), int(lens[b])
        want = torch.log_softmax(z[L - R - 1:L - 1] / TAU, -1).gather(-1, ids[b, :R])
        torch.testing.assert_close(q[b, :R], want, rtol=1e-5, atol=1e-5)

    calls.clear()
    separate, none = teacher_targets(worker, data, cfg, groups)  # what passes=separate keeps (verl's pass gives Q)
    assert none is None and len(calls) == held["targets"].kept
    assert held["groups"] == separate["groups"] and held["fingerprint"] == separate["fingerprint"]
    assert held["targets"].kept == (len(groups) if budget else 0)
    for i in range(len(groups)):
        a, b = held["targets"][i], separate["targets"][i]  # kept ones from RAM, streamed ones recomputed
        for name in ("sats", "vr", "hidden"):
            got, want = getattr(a, name), getattr(b, name)
            assert sorted(got) == sorted(want)
            for layer in got:
                x, y = got[layer], want[layer]
                x, y = (x.rows, y.rows) if hasattr(x, "rows") else (x, y)
                torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=0)


def test_keep_refuses_a_micro_batch_beyond_the_budget():
    from claas_verl.align import AlignmentSignals, TeacherTargetStore

    store = TeacherTargetStore(lambda i, t: AlignmentSignals(), [10, 10], ("hidden",), 15)
    assert store.kept == 1
    store.keep(0, AlignmentSignals())
    with pytest.raises(IndexError, match="not one of the 1 kept"):
        store.keep(1, AlignmentSignals())
