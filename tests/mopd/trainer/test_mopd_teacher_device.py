"""Teacher alignment targets are computed where verl's engine computes, never where the teacher's weights rest.

verl builds teachers as forward-only FSDP2 engines with CPU offload: ``module.parameters()`` report the host while
every layer runs on the accelerator. The stand-in below has the same shape on a CPU-only machine: its parameters
rest on the ``meta`` device and it computes on the CPU (verl's CPU platform) with a private copy of the weights.
The targets must equal those of the plain model under the engine's autocast (bf16 for docs/math.md §B.1 teachers).
"""

from __future__ import annotations

import torch
from test_mopd_balanced_step import _batch, _Engine, _layout
from torch import nn
from transformers import AutoModelForCausalLM

from claas_verl.align import alignment_signals
from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer.workers import MOPDWorker, update_row_groups
from claas_verl.verl_ext.engine_device import compute_device


class _WeightsRestElsewhere(nn.Module):
    """A causal LM whose registered parameters rest on ``meta`` but whose forward computes with host copies."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.compute_state = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.config = model.config
        self.lm = model.to("meta")

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        kwargs.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      logits_to_keep=logits_to_keep)
        return torch.func.functional_call(self.lm, self.compute_state, args=(), kwargs=kwargs)


def test_targets_use_the_engines_compute_device_and_autocast(tiny_dir):
    cfg = alignment.aux_config({"sats": True, "vr": True, "hidden": True, "window": 4})
    data = _batch(cfg, seed=3, prompt_lens=(4, 6, 3, 5), response_lens=(7, 5, 9, 8), use_dynamic_bsz=False,
                  micro_batch_size_per_gpu=2)
    groups = update_row_groups(data)
    path = tiny_dir / "experts" / "math"
    teacher = _WeightsRestElsewhere(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    assert next(teacher.parameters()).device.type == "meta" and compute_device().type == "cpu"
    engine = _Engine(teacher, cfg)
    engine._autocast_dtype = torch.bfloat16  # mopd.train.teacher_dtype=fp32_bf16_autocast (docs/math.md §B.1)
    held = MOPDWorker._teacher_targets(None, type("T", (), {"engine": engine})(), data, cfg, groups)

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = list(range(reference.config.num_hidden_layers))
    for mb, got in zip(alignment.aux_micro_batches(*_layout(data), groups), held["targets"]):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _, sig = alignment_signals(reference, mb.input_ids, mb.attention_mask, mb.regions,
                                       position_ids=mb.position_ids, pooled_layers=layers, hidden_layers=layers,
                                       use_cache=False, logits=False)
        want = sig.as_targets()
        for name in ("sats", "vr"):
            for layer, rows in getattr(want, name).items():
                torch.testing.assert_close(getattr(got, name)[layer].rows, rows.rows, rtol=0, atol=0)
        for layer, states in want.hidden.items():
            assert got.hidden[layer].device.type == "cpu"
            torch.testing.assert_close(got.hidden[layer], states, rtol=0, atol=0)
