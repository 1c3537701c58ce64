"""One supervised fine-tuning step on (prompt ids, reply ids) pairs: the shared inner step of the gym experts' and
the reader student's builds (``claas_verl/tiny/gym.py``, ``reader.py``). Both bundles are fingerprinted, so this
step's order of operations (draw, pad, forward, zero_grad, backward, clip at 1, step) is part of their recipe."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_batch(batch: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` [B, T] of prompt + reply pairs; the loss sees
    the reply tokens only (prompt and padding labels are -100)."""
    width = max(len(a) + len(b) for a, b in batch)
    x = torch.full((len(batch), width), pad_token_id)
    att = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for row, (a, b) in enumerate(batch):
        seq = torch.tensor(list(a) + list(b))
        x[row, : len(seq)] = seq
        att[row, : len(seq)] = 1
        labels[row, len(a): len(seq)] = seq[len(a):]
    return x, att, labels


def sft_step(model, opt: torch.optim.Optimizer, examples: Sequence, gen: torch.Generator, batch_size: int,
             pad_token_id: int) -> torch.Tensor:
    """Draw ``batch_size`` examples with ``gen``, one AdamW step on their reply tokens' mean NLL (gradient norm
    clipped at 1). Returns the loss before the step."""
    idx = torch.randperm(len(examples), generator=gen)[:batch_size].tolist()
    x, att, labels = padded_batch([examples[i] for i in idx], pad_token_id)
    loss = model(input_ids=x, attention_mask=att, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss
