"""Generation helpers shared by the CPU rollout, the chat service's HF backend and the evaluators (no verl, no Ray)."""

from __future__ import annotations


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """Every id that ends a generation: the model's generation config and config, plus the tokenizer's EOS."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else list(eos))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
