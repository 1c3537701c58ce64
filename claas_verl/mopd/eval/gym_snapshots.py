"""Score a saved model on the reasoning-gym bundle: task accuracy and the full-vocabulary KL to a domain's expert.

The continual benchmark (``benchmarks/continual.py``) scores every stage-final snapshot of every run with this one
evaluator, and π0 and the experts with it too, so every method, seed and reference is measured the same way:

* **accuracy**: ``n`` replies per held-out prompt sampled at temperature τ (no top-k / top-p truncation), at most
  ``max_new_tokens`` tokens, scored by reasoning-gym's own scorer (``claas_verl/mopd/data/rewards.py``);
* **KL**: on the same replies (the student's own samples, as the MOPD paper logs it), the token-mean over every reply
token of
  the exact full-vocabulary ``KL(π_s(·|x, y_<t) || π_E(·|x, y_<t)) = Σ_v p_s(v) (log p_s(v) − log p_E(v))`` (the
  trainer's in-run table restricts the sum to the student's top-κ tokens).

The replies of one prompt are sampled as one unpadded batch (no left padding, so no position-id subtleties) with
``torch.manual_seed`` set from ``(seed, domain, tag)``: a snapshot's score is reproducible and independent of which
other models or domains were scored before it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SnapshotScore:
    score: float  # mean reasoning-gym score over every sampled reply
    kl: float | None  # token-mean full-vocabulary KL to the expert (None when no expert was given)
    replies: int  # prompts x samples
    tokens: int  # reply tokens the KL averages over


def sampling_seed(seed: int, *parts: str) -> int:
    """A 31-bit seed from the run seed and labels (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256(",".join([str(int(seed)), *parts]).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    from claas_verl.utils.hf_quiet import hf_progress_bars_off

    with hf_progress_bars_off():  # one "Loading weights" bar per scored model would bury the benchmark's lines
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def sample_replies(model, prompt_ids: list[int], n: int, max_new_tokens: int, temperature: float,
                   eos_ids: list[int], pad_id: int) -> list[list[int]]:
    """``n`` sampled replies to one prompt (token ids, the stop token included when one was produced)."""
    x = torch.tensor([prompt_ids] * n)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                         pad_token_id=pad_id)
    replies = []
    for row in out[:, len(prompt_ids):].tolist():
        reply = []
        for t in row:
            reply.append(t)
            if t in eos_ids:
                break  # what follows is generate's padding of the finished row
        replies.append(reply)
    return replies


def right_padded(prompt_ids: list[int], replies: list[list[int]], pad_id: int):
    """``(input_ids, attention_mask, response_mask)`` of one prompt's non-empty replies, right-padded so every real
    token keeps position 0..L-1; ``response_mask[b, j]`` marks reply token j, ``[B, T]`` with T the longest reply."""
    P, T = len(prompt_ids), max(len(r) for r in replies)
    ids = torch.full((len(replies), P + T), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(len(replies), T)
    for i, r in enumerate(replies):
        ids[i, : P + len(r)] = torch.tensor(prompt_ids + r)
        attn[i, : P + len(r)] = 1
        resp[i, : len(r)] = 1
    return ids, attn, resp


def response_logits(model, ids: torch.Tensor, attn: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[B, T, V]`` float32 logits that predict the T reply tokens (the logits at ``t`` predict token ``t + 1``)."""
    return model(input_ids=ids, attention_mask=attn).logits[:, prompt_len - 1: -1].float()


@torch.no_grad()
def reply_kl_sum(student, expert, prompt_ids: list[int], replies: list[list[int]]) -> tuple[float, int]:
    """``(Σ over reply tokens of KL(p_s || p_E), number of reply tokens)`` for replies to one prompt."""
    kept = [r for r in replies if r]
    if not kept:
        return 0.0, 0
    ids, attn, resp = right_padded(prompt_ids, kept, pad_id=0)  # padding is masked out and never predicted
    P = len(prompt_ids)
    ls = torch.log_softmax(response_logits(student, ids, attn, P), dim=-1)
    le = torch.log_softmax(response_logits(expert, ids, attn, P), dim=-1)
    kl = (ls.exp() * (ls - le)).sum(-1)  # [B, T]
    reply = resp.bool()
    return float(kl[reply].sum()), int(reply.sum())


def score_snapshot(model_path: str, rows: list[dict], *, expert_path: str | None, n: int, max_new_tokens: int,
                   temperature: float, seed: int, tag: str, model=None, expert=None) -> SnapshotScore:
    """Score ``model_path`` on ``rows`` (held-out rows of one domain, verl's RL format: ``prompt``, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``); KL to ``expert_path`` when given.

    ``model`` / ``expert``: already-loaded models to reuse (the paths still name them). ``tag`` labels the sampling
    seed (e.g. ``"student_2/spell"``).
    """
    from transformers import AutoTokenizer

    from claas_verl.mopd.data.rewards import compute_score
    from claas_verl.utils.generation import eos_token_ids

    if not rows:
        raise ValueError(f"no held-out rows to score {model_path} on ({tag})")
    if n < 1 or max_new_tokens < 1 or temperature <= 0:
        raise ValueError(f"n={n}, max_new_tokens={max_new_tokens}, temperature={temperature}: need n >= 1, "
                         "max_new_tokens >= 1 and a sampling temperature > 0")
    tok = AutoTokenizer.from_pretrained(model_path)
    model = model if model is not None else load_model(model_path)
    expert = expert if expert is not None or expert_path is None else load_model(expert_path)
    eos = eos_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    torch.manual_seed(sampling_seed(seed, tag))
    total, count, kl_sum, kl_tokens = 0.0, 0, 0.0, 0
    for row in rows:
        prompt = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        replies = sample_replies(model, prompt_ids, n, max_new_tokens, temperature, eos, pad)
        for reply in replies:
            text = tok.decode(reply, skip_special_tokens=True)
            total += compute_score(row["data_source"], text, row["reward_model"]["ground_truth"],
                                   dict(row["extra_info"]))
            count += 1
        if expert is not None:
            s, t = reply_kl_sum(model, expert, prompt_ids, replies)
            kl_sum, kl_tokens = kl_sum + s, kl_tokens + t
    kl = (kl_sum / kl_tokens if kl_tokens else 0.0) if expert is not None else None
    return SnapshotScore(score=total / count, kl=kl, replies=count, tokens=kl_tokens)


__all__ = ["SnapshotScore", "load_model", "reply_kl_sum", "response_logits", "right_padded", "sample_replies",
           "sampling_seed", "score_snapshot"]
