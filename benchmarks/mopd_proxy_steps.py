"""The stage proxy's replay arms and per-step log (``benchmarks/mopd_stage_proxy.py``; benchmarks/plans/mopd_replay.md).

* :class:`ReplayArm`: how replay steps differ from the paper's (replies, optimizer state, weight, cycle order) and
  the AdamW β1 of every step; :class:`Optimisers` holds the stage's AdamW state(s).

The per-step log (``--json``), with the field names of the trainer's ``steps.jsonl`` ("Per-step log" of the plan):

* :class:`FixedProbe`: at a stage start, 16 held-out prompts × 2 replies per domain learned so far (the stage's own
  domain included), sampled from M_{k−1} (the student as the stage starts; M_0 = π0) with seed 0 and frozen for the
  stage, with M_{k−1}'s full-vocabulary log-probabilities on them. After every step, ``mopd/probe_kl/<domain>``:
  the exact KL(student ‖ M_{k−1}) = Σ_v p_s(v) (log p_s(v) − log p_{k−1}(v)) at τ = 1, token mean over the probe's
  reply tokens of that domain. The sequences never change within a stage, so a change between two steps is the
  update's alone.
* :func:`update_norm`: ‖θ_after − θ_before‖ over every trained parameter.
* :func:`step_record`: one step as the trainer writes it (plan fields, ``global_step``, ``metrics``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from claas_verl.mopd.eval.gym_snapshots import response_logits, right_padded, sample_replies

OPTIMIZER_STATES = ("shared", "separate")


@dataclass(frozen=True)
class ReplayArm:
    """The settings a replay arm of the plan varies; the defaults are the paper's replay (and Seq's β1).

    ``replies``: replies per prompt on replay steps (None: the new-domain steps' count; E2). ``optimizer``: shared
    (one AdamW state for every step of the stage, the paper) | separate (replay steps keep their own AdamW state,
    fresh every stage; E3b). ``weight``: replay advantages × this constant, after σ_d (E4). ``cycle``: forward |
    reversed order of the replay steps over the earlier domains (``claas_verl.schedule.budgets.replay_cycle``;
    E5). ``beta1``: AdamW's β1 on every step, Seq included (E3a)."""

    replies: int | None = None
    optimizer: str = "shared"
    weight: float = 1.0
    cycle: str = "forward"
    beta1: float = 0.9

    def __post_init__(self):
        if self.replies is not None and self.replies < 1:
            raise ValueError(f"--replay-replies must be at least 1; got {self.replies}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"--replay-optimizer must be one of {list(OPTIMIZER_STATES)}; got {self.optimizer!r}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"--replay-weight must be a finite number > 0; got {self.weight}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"--beta1 must be in [0, 1); got {self.beta1}")

    def logged(self, replay: bool, replies: int) -> dict[str, float | int | str]:
        """The arm's per-step fields, only where the arm sets them (the plan: "logged when the arm's key is set")."""
        out: dict[str, float | int | str] = {}
        if self.replies is not None:
            out["mopd/responses_per_prompt"] = replies
        if self.optimizer != "shared":
            out["mopd/optimizer_state"] = int(replay)  # 0: the stage's AdamW state, 1: the replay steps' own
        if self.weight != 1.0:
            out["mopd/replay_weight"] = self.weight if replay else 1.0
        return out


class Optimisers:
    """The stage's AdamW state(s): the recipe's optimiser (weight decay 0.01, betas (β1, 0.999)), fresh every stage,
    and with ``arm.optimizer == "separate"`` a second, independent state used by replay steps only (built on the
    first replay step). Each state has its own linear warm-up over its own updates (``warmup`` 0: none)."""

    def __init__(self, model, lr: float, arm: ReplayArm, warmup: int = 0):
        self.model, self.lr, self.arm, self.warmup = model, lr, arm, warmup
        self.main = self._build()
        self.replay = None

    def _build(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, betas=(self.arm.beta1, 0.999), weight_decay=0.01)
        # linear warm-up: update i (0-based) at lr·min(1, (i+1)/warmup); AdamW's first updates move every weight by
        # about lr whatever its gradient, so a higher peak lr may need them smaller
        w = self.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / w) if w > 0 else 1.0)
        return opt, sched

    def for_step(self, replay: bool):
        if replay and self.arm.optimizer == "separate":
            if self.replay is None:
                self.replay = self._build()
            return self.replay
        return self.main


PROBE_PROMPTS = 16  # held-out prompts per domain (the plan's probe)
PROBE_REPLIES = 2  # replies per probe prompt
PROBE_SEED = 0  # the probe's sampling seed at every stage start


def full_kl_token_mean(student_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """``(Σ_{masked tokens} KL(p_s ‖ p_ref), number of masked tokens)`` over the full vocabulary.

    ``student_logp``, ``ref_logp``: ``[B, T, V]`` log-probabilities (each row a log_softmax); ``mask``: ``[B, T]``.
    KL(p_s ‖ p_ref) = Σ_v p_s(v) (log p_s(v) − log p_ref(v)) per token, ≥ 0, exactly 0 when the rows are equal.
    """
    if student_logp.shape != ref_logp.shape or student_logp.shape[:2] != mask.shape:
        raise ValueError(f"shapes {tuple(student_logp.shape)}, {tuple(ref_logp.shape)}, mask {tuple(mask.shape)}")
    kl = (student_logp.exp() * (student_logp - ref_logp)).sum(-1)  # [B, T]
    return float((kl * mask).sum()), int(mask.sum())


class FixedProbe:
    """The stage's frozen probe sequences per domain and M_{k−1}'s log-probabilities on them (see the module doc).

    ``prompts_by_domain``: {domain: [prompt token ids, ...]} (the first ``prompts`` held-out prompts of each domain
    learned so far). Sampling uses ``torch.manual_seed(seed)`` once, then the domains in the given order, so the same
    reference model and prompts give the same sequences.
    """

    def __init__(self, reference, prompts_by_domain: dict[str, list[list[int]]], *, replies: int = PROBE_REPLIES,
                 seed: int = PROBE_SEED, max_new_tokens: int, eos_ids: list[int], pad_id: int):
        if replies < 1:
            raise ValueError(f"probe replies must be at least 1; got {replies}")
        self.pad_id = pad_id
        self.items: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        was_training = reference.training
        reference.eval()
        torch.manual_seed(seed)
        with torch.no_grad():
            for domain, prompts in prompts_by_domain.items():
                rows = []
                for prompt_ids in prompts:
                    replies_ids = [r for r in sample_replies(reference, prompt_ids, replies, max_new_tokens, 1.0,
                                                             eos_ids, pad_id) if r]
                    if not replies_ids:
                        continue
                    ids, attn, resp = right_padded(prompt_ids, replies_ids, pad_id)
                    P = len(prompt_ids)
                    ref = torch.log_softmax(response_logits(reference, ids, attn, P), dim=-1)
                    rows.append((P, ids, attn, resp, ref))
                if not rows:
                    raise ValueError(f"probe: every reply of domain {domain!r} is empty")
                self.items[domain] = rows
        reference.train(was_training)

    @property
    def domains(self) -> list[str]:
        return list(self.items)

    def sequences(self, domain: str) -> list[torch.Tensor]:
        """The frozen token ids of ``domain``'s probe (for checks that they do not change)."""
        return [ids for _, ids, _, _, _ in self.items[domain]]

    @torch.no_grad()
    def kl(self, student) -> dict[str, float]:
        """{``mopd/probe_kl/<domain>``: exact KL(student ‖ M_{k−1}), token mean} for every probe domain."""
        was_training = student.training
        student.eval()
        out = {}
        for domain, rows in self.items.items():
            total, tokens = 0.0, 0
            for P, ids, attn, resp, ref in rows:
                logp = torch.log_softmax(response_logits(student, ids, attn, P), dim=-1)
                s, n = full_kl_token_mean(logp, ref, resp)
                total, tokens = total + s, tokens + n
            out[f"mopd/probe_kl/{domain}"] = total / tokens
        student.train(was_training)
        return out


def parameters_copy(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def update_norm(before: list[torch.Tensor], model) -> float:
    """‖θ_after − θ_before‖₂ over every trained parameter (``mopd/update_norm``)."""
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    if len(after) != len(before):
        raise ValueError(f"{len(before)} parameters before the update, {len(after)} after")
    return math.sqrt(math.fsum(float(((a - b) ** 2).sum()) for a, b in zip(after, before)))


def step_record(global_step: int, stage: int, kind: str, domain: str, block: int, teacher: str,
                metrics: dict[str, float | int | str]) -> dict:
    """One step in the trainer's ``steps.jsonl`` shape (``claas_verl/mopd/trainer/audit_trail.py``)."""
    clean = {}
    for k, v in sorted(metrics.items()):
        if isinstance(v, float) and not math.isfinite(v):
            v = None  # JSON has no NaN/inf (the trainer's audit trail writes null too)
        clean[k] = v
    return {"stage": stage, "kind": kind, "domain": domain, "block": block, "teacher": teacher,
            "global_step": global_step, "metrics": clean}
