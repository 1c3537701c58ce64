"""Generation helpers shared by the CPU rollout, the chat service's HF backend and the evaluators (no verl, no Ray)."""

from __future__ import annotations

import torch


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


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0, generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return ``(token_ids [B], log_probs [B])``.

    ``logits``: ``[B, V]`` fp32 next-token logits. The log-prob is that of the
    *sampling distribution at temperature τ*, ``log_softmax(logits / τ)[token]``,
    before top-k / top-p truncation (what a trainer's recomputed old log-prob at τ
    matches). ``temperature <= 0`` means greedy decoding; its log-prob is then the
    model's own, ``log_softmax(logits)[argmax]`` (τ = 1), since τ → 0 is degenerate.
    """
    logits = logits.float()
    if temperature <= 0:
        token = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        return token, logp
    scaled = logits / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    filtered = scaled.clone()
    if top_k is not None and 0 < top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass *before* it already reaches top_p (the first token always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1)
