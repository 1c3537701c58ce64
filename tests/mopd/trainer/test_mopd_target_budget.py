"""The worker's teacher targets respect ``mopd.signal.target_budget_gib`` and a streamed step equals a kept one."""

from __future__ import annotations

import pytest
import torch
from test_mopd_balanced_step import _batch, _Engine, _tok_loss
from transformers import AutoModelForCausalLM

from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer.workers import MOPDTrainingWorker, MOPDWorker, update_row_groups


def _step(tiny_dir, budget_gib, passes):
    signal = {"sats": True, "vr": True, "hidden": True, "window": 4, "target_budget_gib": budget_gib,
              "passes": passes}
    cfg = alignment.aux_config(signal)
    assert alignment.AuxConfig.from_dict(cfg.to_dict()) == cfg
    data = _batch(cfg, seed=1, prompt_lens=(4, 6, 3, 5), response_lens=(7, 5, 9, 8),
                  use_dynamic_bsz=False, micro_batch_size_per_gpu=1)  # four micro-batches of one response
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir / "experts" / "math", dtype=torch.float32)
    teacher_worker = type("T", (), {"engine": _Engine(teacher, cfg)})()
    held = MOPDWorker._teacher_targets(None, teacher_worker, data, cfg, update_row_groups(data))
    store = held["targets"]
    worker = MOPDTrainingWorker.__new__(MOPDTrainingWorker)
    worker.engine = _Engine(AutoModelForCausalLM.from_pretrained(tiny_dir / "student", dtype=torch.float32), cfg)
    worker.mopd_targets = held
    worker.balanced_engine_step(data, _tok_loss, cfg)
    return store, worker.engine.stepped


@pytest.mark.parametrize("passes", ["shared", "separate"])
def test_budget_bounds_resident_targets_and_streaming_gives_the_same_step(tiny_dir, passes):
    full, g_full = _step(tiny_dir, 1.0, passes)
    assert full.kept == 4 and full.teacher_forwards == 4  # everything fits in 1 GiB: one forward per micro-batch
    budget = (full.sizes[0] + full.sizes[1]) / 2**30  # room for the first two of four micro-batches
    bounded, g_bounded = _step(tiny_dir, budget, passes)
    assert bounded.kept == 2 and bounded.held_bytes <= budget * 2**30
    assert bounded.peak_bytes <= budget * 2**30 + max(bounded.sizes[2:])
    # the two streamed micro-batches: one forward for every term (shared), one per term (separate passes)
    assert bounded.teacher_forwards == 2 + 2 * (1 if passes == "shared" else 3)
    for a, b in zip(g_full, g_bounded):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_budget_key_is_validated():
    import pytest

    with pytest.raises(ValueError, match="target_budget_gib"):
        alignment.aux_config({"hidden": True, "target_budget_gib": -1})
