"""The teacher side of an aligned MOPD replay step (docs/math.md §B.2.1, §B.3-B.5): the teacher's log-probs Q at the
student's stored ids and its alignment targets, per micro-batch of the update's partition.

:func:`teacher_targets` keeps the targets of the micro-batches that fit ``mopd.signal.target_budget_gib`` in host
RAM (:class:`~claas_verl.align.TeacherTargetStore`; the others are streamed by the student's passes). With
``with_q`` (``mopd.signal.passes: shared``) the same teacher forward of each micro-batch also gives Q, which
replaces verl's separate log-prob pass: one teacher forward per micro-batch instead of two, the floor of
docs/performance.md. Q is ``log_softmax(z/τ)`` at the stored ids on the logits that predict each response token,
as verl's pass computes it on packed rows (``tests/mopd/trainer/test_mopd_teacher_pass.py`` holds the two equal).
"""

from __future__ import annotations

import torch
from verl.utils import tensordict_utils as tu

from claas_verl.align import (
    AlignmentSignals,
    TeacherTargetStore,
    alignment_signals,
    attention_modules,
    target_bytes,
)
from claas_verl.distill import teacher_logprobs_at
from claas_verl.mopd.trainer import alignment
from claas_verl.mopd.trainer import fields as token_fields
from claas_verl.mopd.trainer.balanced_passes import (
    micro_batches,
    response_lengths,
    row_temperatures,
    sequences,
    targets_to,
)
from claas_verl.verl_ext.engine_device import compute_device, engine_autocast


def teacher_targets(teacher, data, cfg: alignment.AuxConfig, groups: list[list[int]], with_q: int = 0):
    """The held targets ``{"fingerprint", "groups", "targets": TeacherTargetStore}`` of the step, and with
    ``with_q = κ`` (> 0) also the teacher's output as verl's log-prob pass returns it (one flattened-rows
    :data:`~claas_verl.mopd.trainer.fields.TEACHER_LP` field, rows in ``data``'s order), else None.

    Without ``with_q`` the kept micro-batches' targets come from one no-grad forward each without logits (verl's
    pass gives Q). With it every micro-batch runs one forward with logits: Q of its rows, and the targets of the
    kept ones.
    """
    micro = micro_batches(data, groups)
    module = teacher.engine.module
    layers = alignment.check_layers(cfg, len(attention_modules(module)))
    device = compute_device()
    autocast = engine_autocast(teacher.engine, device)
    mcfg = module.config

    def forward(i: int, terms: tuple[str, ...], logits: bool):
        with teacher.engine.eval_mode(), torch.no_grad(), autocast:
            mb = micro[i].to(device)
            return mb, *alignment_signals(
                module, mb.input_ids, mb.attention_mask, mb.regions, position_ids=mb.position_ids,
                terms=terms, pooled_layers=layers, hidden_layers=layers, use_cache=False, logits=logits,
            )

    def produce(i: int, terms: tuple[str, ...]) -> AlignmentSignals:
        _, _, sig = forward(i, terms, logits=False)
        return targets_to(sig.as_targets(), "cpu")

    sizes = [
        target_bytes(mb.regions, mb.attention_mask, cfg.terms, pooled_layers=len(layers),
                     hidden_layers=len(layers), num_heads=mcfg.num_attention_heads,
                     num_kv_heads=getattr(mcfg, "num_key_value_heads", None) or mcfg.num_attention_heads,
                     hidden_size=mcfg.hidden_size)
        for mb in micro
    ]
    store = TeacherTargetStore(produce, sizes, cfg.terms, int(cfg.target_budget_gib * 2**30), device=device)
    output = None
    if with_q:
        resp, temps = response_lengths(data), row_temperatures(data)
        ids = token_fields.unpack_rows(data[token_fields.TOPK_IDS], with_q, token_fields.TOPK_IDS).long()
        q = torch.zeros(ids.shape, dtype=torch.float32)
        for i, rows in enumerate(groups):
            mb, out, sig = forward(i, cfg.terms, logits=True)
            index = torch.as_tensor(rows, dtype=torch.long)
            with torch.no_grad(), autocast:
                z = alignment.response_logits(out.logits, mb.attention_mask.sum(-1), resp[index].to(device),
                                              temps[index].to(device))
                R = z.shape[1]
                q[index, :R] = teacher_logprobs_at(z, ids[index, :R].to(device)).float().cpu()
            del out, z
            if i < store.kept:
                store.keep(i, targets_to(sig.as_targets(), "cpu"))
            del sig
        output = tu.get_tensordict(tensor_dict={token_fields.TEACHER_LP: token_fields.pack_rows(q, resp)},
                                   non_tensor_dict={"metrics": {}})
    held = {"fingerprint": alignment.batch_fingerprint(sequences(data)), "groups": groups, "targets": store.fill()}
    return held, output
