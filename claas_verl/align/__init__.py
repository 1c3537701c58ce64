"""Alignment terms of continual MOPD (docs/math.md §B.3-B.7): step regions, q/k/v capture, pooled rows, losses,
gradient-norm balancing and the multi-pass balanced update."""

from claas_verl.align.balance import ZERO_NORM, balance, combine_aux, combine_one_one_one, grad_norm
from claas_verl.align.capture import AttentionCapture, CapturedQKV, apply_rope, attention_modules
from claas_verl.align.hidden_term import hidden_alignment_loss, window_states
from claas_verl.align.multipass import balanced_backward, microbatch_weights
from claas_verl.align.pooled_attention import PooledRows, naive_pooled_attention_rows, pooled_attention_rows
from claas_verl.align.regions import (
    DEFAULT_WINDOW,
    StepRegions,
    response_window_mask,
    separator_token_ids,
    step_regions,
)
from claas_verl.align.sats import PAPER_SATS_LAYERS, default_sats_layers, pooled_rows_loss, sats_loss, sats_rows
from claas_verl.align.signals import AlignmentSignals, alignment_losses, alignment_signals
from claas_verl.align.target_store import TeacherTargetStore, target_bytes
from claas_verl.align.targets import TermValue, to_bf16_target
from claas_verl.align.value_relation import value_relation_loss, value_relation_rows

__all__ = [
    "ZERO_NORM",
    "balance",
    "balanced_backward",
    "combine_aux",
    "combine_one_one_one",
    "grad_norm",
    "microbatch_weights",
    "DEFAULT_WINDOW",
    "PAPER_SATS_LAYERS",
    "AlignmentSignals",
    "AttentionCapture",
    "CapturedQKV",
    "PooledRows",
    "StepRegions",
    "TeacherTargetStore",
    "TermValue",
    "alignment_losses",
    "alignment_signals",
    "apply_rope",
    "attention_modules",
    "default_sats_layers",
    "hidden_alignment_loss",
    "naive_pooled_attention_rows",
    "pooled_attention_rows",
    "pooled_rows_loss",
    "response_window_mask",
    "sats_loss",
    "sats_rows",
    "separator_token_ids",
    "step_regions",
    "target_bytes",
    "to_bf16_target",
    "value_relation_loss",
    "value_relation_rows",
    "window_states",
]
