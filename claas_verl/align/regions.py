"""Reasoning-step regions on the last W response tokens (docs/math.md §B.3 window, B.4 regions).

Regions are computed once per rollout (on the driver) from the response token ids and
shared by the student and the teacher, so both pool over exactly the same query rows.

- Window ``W_b``: the last ``min(W, n_b)`` valid response positions (``m=1``) of response b.
- A step ends at a *separator* token: one whose single-token text contains a blank line
  (``"\\n\\n" in tokenizer.decode([id])``) or the ``</think>`` id (docs/math.md §E.9 [CHOICE]).
- The window is partitioned: a new region starts at the window start and after every
  separator; the final region ends at the last valid token even without a separator.
  ``drop_trailing=True`` drops that final fragment when it does not end with a separator.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

DEFAULT_WINDOW = 2000
THINK_END_TOKEN = "</think>"

# id(tokenizer) -> (tokenizer, ids). The tokenizer itself is kept so that its id cannot be
# reused by another object while the entry lives (tokenizers live for the whole run anyway).
_SEPARATOR_CACHE: dict[int, tuple[object, frozenset[int]]] = {}


def separator_token_ids(tokenizer, think_end_token: str | None = THINK_END_TOKEN) -> frozenset[int]:
    """Ids that end a reasoning step (docs/math.md §B.4): every id whose decoded text has ``"\\n\\n"``, plus
    ``</think>``.

    Decodes the whole vocabulary once per tokenizer object and caches the result.
    ``tokenizer`` needs ``decode(list[int]) -> str`` and either ``__len__`` or ``vocab_size``;
    ``convert_tokens_to_ids`` is used for ``think_end_token`` when present. A think-end token
    that maps to the unknown id (or to None) is treated as absent.
    """
    key = id(tokenizer)
    cached = _SEPARATOR_CACHE.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    try:
        vocab = len(tokenizer)  # HF: includes added tokens such as </think>
    except TypeError:
        vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is None:
        raise ValueError("tokenizer has neither __len__ nor vocab_size; pass separator ids explicitly")
    ids = {i for i in range(int(vocab)) if "\n\n" in tokenizer.decode([i])}
    if think_end_token is not None and hasattr(tokenizer, "convert_tokens_to_ids"):
        tid = tokenizer.convert_tokens_to_ids(think_end_token)
        unk = getattr(tokenizer, "unk_token_id", None)
        if tid is not None and tid != unk:
            ids.add(int(tid))
    result = frozenset(ids)
    _SEPARATOR_CACHE[key] = (tokenizer, result)
    return result


def response_window_mask(response_mask: torch.Tensor, window: int = DEFAULT_WINDOW) -> torch.Tensor:
    """``[B, T_r]`` bool: the last ``min(window, n_b)`` positions with ``m=1`` of each row (docs/math.md §B.3
    ``W_b``)."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1 (docs/math.md §B.3 default 2000)")
    m = response_mask.bool()
    # number of valid tokens at or after t; the window keeps those with count <= W
    after = m.long().flip(-1).cumsum(-1).flip(-1)
    return m & (after <= window)


@dataclass(frozen=True)
class StepRegions:
    """Region assignment of a batch, shared by student and teacher.

    Attributes:
        region_ids: ``[B, T]`` long; region index ``0..R_b-1`` on window positions that belong
            to a region, ``-1`` elsewhere (prompt, padding, outside the window, dropped fragment).
        window_mask: ``[B, T]`` bool; the window ``W_b`` (queries of SATS/VR, positions of ℓ_hid).
        num_regions: ``[B]`` long; ``R_b`` (``|R_y|`` of docs/math.md §B.4).
    """

    region_ids: torch.Tensor
    window_mask: torch.Tensor
    num_regions: torch.Tensor

    def pad_left(self, prompt_length: int) -> StepRegions:
        """Shift to absolute positions of ``input_ids = cat(prompt[B, prompt_length], response)``."""
        b = self.region_ids.shape[0]
        dev = self.region_ids.device
        rid = torch.cat([torch.full((b, prompt_length), -1, dtype=torch.long, device=dev), self.region_ids], 1)
        win = torch.cat([torch.zeros((b, prompt_length), dtype=torch.bool, device=dev), self.window_mask], 1)
        return StepRegions(rid, win, self.num_regions)

    def to(self, device) -> StepRegions:
        return StepRegions(self.region_ids.to(device), self.window_mask.to(device), self.num_regions.to(device))

    def spans(self) -> list[list[tuple[int, int]]]:
        """Per response, the regions as inclusive ``(start, end)`` positions (for inspection and logging)."""
        out = []
        for rid in self.region_ids.tolist():
            spans: dict[int, list[int]] = {}
            for t, r in enumerate(rid):
                if r >= 0:
                    spans.setdefault(r, [t, t])[1] = t
            out.append([tuple(spans[r]) for r in sorted(spans)])
        return out


def step_regions(
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    separator_ids: Iterable[int] | torch.Tensor,
    window: int = DEFAULT_WINDOW,
    drop_trailing: bool = False,
) -> StepRegions:
    """Partition each response's window into reasoning-step regions (docs/math.md §B.4).

    Args:
        response_ids: ``[B, T_r]`` response token ids.
        response_mask: ``[B, T_r]`` 1 on generated tokens (incl. EOS), 0 on padding.
        separator_ids: ids ending a step, e.g. :func:`separator_token_ids` of the tokenizer.
        window: ``W`` (default 2000, docs/math.md §B.4).
        drop_trailing: drop the final region when it does not end with a separator
            (docs/math.md §B.4 [CHOICE] flag; default keeps it).

    Returns:
        :class:`StepRegions` in response coordinates; use ``.pad_left(prompt_length)`` for the
        concatenated prompt+response sequence.
    """
    if response_ids.shape != response_mask.shape or response_ids.dim() != 2:
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [B, T_r]"
        )
    win = response_window_mask(response_mask, window)
    sep = torch.as_tensor(sorted(separator_ids) if not torch.is_tensor(separator_ids) else separator_ids,
                          dtype=response_ids.dtype, device=response_ids.device)
    is_sep = torch.isin(response_ids, sep) & win
    # region of t = number of separators strictly before t inside the window
    rid = is_sep.long().cumsum(-1) - is_sep.long()
    n_win = win.long().sum(-1)
    # the last window token's region closes the partition; a separator there closes it cleanly
    last_pos = torch.where(win, torch.arange(win.shape[1], device=win.device), -1).amax(-1)
    has = n_win > 0
    last_idx = last_pos.clamp(min=0)[:, None]
    last_rid = rid.gather(1, last_idx).squeeze(1)
    last_is_sep = is_sep.gather(1, last_idx).squeeze(1)
    num = torch.where(has, last_rid + 1, torch.zeros_like(last_rid))
    rid = torch.where(win, rid, torch.full_like(rid, -1))
    if drop_trailing:
        drop = has & ~last_is_sep
        rid = torch.where(drop[:, None] & (rid == last_rid[:, None]), torch.full_like(rid, -1), rid)
        num = num - drop.long()
    return StepRegions(rid, win, num)
