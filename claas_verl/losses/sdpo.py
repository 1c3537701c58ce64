"""SDPO for replayed CLaaS entries: EMA teacher, feedback re-prompt, top-K generalised JSD (docs/math.md §A.3.3).

Torch only. Pieces:

- :func:`reprompt` / :func:`teacher_messages`: build the teacher context x' from the verifier feedback
  with the exact SDPO templates; :func:`self_distillation_mask`: 1 iff feedback exists.
- :func:`topk_with_tail` and :func:`generalized_jsd`: the per-token divergence over the student's
  top-K plus one tail bucket, GJS_α with α = 0 forward KL(T‖S), α = 1 reverse KL(S‖T), 0.5 JSD.
- :func:`sdpo_is_weight`: w_e = min(ρ[e], is_clip) from the SEQUENCE ratio of A.2.2 (CLaaS stores no
  per-token old log-probs), with ρ against the behaviour policy or the EMA teacher.
- :func:`sdpo_loss`: ``gjs`` (default) or ``pg+jsd`` modes; no host sync per call (NaN/inf checks only with
  ``CLAAS_VERL_DEBUG_CHECKS=1``, :mod:`claas_verl.utils.host_sync`; metrics are 0-dim tensors).
- :class:`EmaTeacher`: θ_T ← (1−τ)·θ_T + τ·θ over LoRA tensors or all parameters.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from claas_verl.losses.seq_is import check_same_shape, seq_is_clipped_loss, sequence_log_ratio
from claas_verl.utils.host_sync import check_finite
from claas_verl.utils.masked import agg_loss, masked_mean

# Exact SDPO strings (docs/math.md §A.3.3; the SDPO YAML uses `|-` block scalars, so no trailing newline).
REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."
FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}"
# [a choice the math reference leaves to the code] text for the `reprompt_success` flag (the math reference names the
# flag but gives no template).
SUCCESS_FEEDBACK_TEMPLATE = "\nThe following is feedback from your successful earlier attempt:\n\n{feedback_raw}"

SDPO_MODES = ("gjs", "pg+jsd")
IS_REFERENCES = ("behaviour", "ema_teacher")
TOPK_SOURCES = ("student", "teacher")
EMA_SCOPES = ("lora", "full")


# --------------------------------------------------------------------------- teacher context


def reprompt(prompt: str, feedback: str, *, success: bool = False) -> str:
    """x' text of the last user turn: REPROMPT_TEMPLATE with no solution and the feedback section (A.3.3).

    The own response is never used as the "solution" (single trajectory, no peers) [CHOICE].
    """
    if feedback is None:
        raise ValueError("reprompt needs feedback text; entries without feedback get sd_mask = 0 instead")
    template = SUCCESS_FEEDBACK_TEMPLATE if success else FEEDBACK_TEMPLATE
    return REPROMPT_TEMPLATE.format(prompt=prompt, solution="", feedback=template.format(feedback_raw=feedback))


def teacher_messages(
    messages: list[dict], feedback: str | None, *, reward: float | None = None, reprompt_success: bool = False
) -> list[dict] | None:
    """Chat messages of the teacher context, or None when this step gets no self-distillation signal.

    Applies :func:`reprompt` to the LAST user turn and keeps every other message (system included).
    Feedback is used only for failed steps (reward < 1) unless ``reprompt_success`` is on [CHOICE, A.3.3].
    """
    if feedback is None:
        return None
    passed = reward is not None and reward >= 1.0
    if passed and not reprompt_success:
        return None
    idx = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if idx is None:
        raise ValueError("teacher_messages: the conversation has no user turn to attach the feedback to")
    out = [dict(m) for m in messages]
    out[idx]["content"] = reprompt(out[idx]["content"], feedback, success=passed)
    return out


def self_distillation_mask(has_feedback: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """m·sd_mask, ``[B, T]`` bool: SDPO's self_distillation_mask (1 iff the entry has a teacher context)."""
    return response_mask.bool() & has_feedback.bool().view(-1, 1)


# --------------------------------------------------------------------------- divergence


def log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x ≤ 0, as log(−expm1(clamp(x, max=−1e-7))) (docs/math.md §A.3.3)."""
    return torch.log(-torch.expm1(x.clamp(max=-1e-7)))


def topk_with_tail(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    k: int = 100,
    *,
    add_tail: bool = True,
    topk_from: str = "student",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather both distributions on the top-K indices and add a tail bucket (docs/math.md §A.3.3).

    Args:
        student_logp, teacher_logp: ``[..., V]`` full-vocabulary log-softmax (teacher detached).
        k: K (default 100); clamped to V.
        add_tail: True (default): append log(1 − Σ_K p) so both are distributions over K+1 outcomes.
            False: renormalise over the K entries (the CLaaS product-repo variant, flag only).
        topk_from: ``"student"`` (default, SDPO) or ``"teacher"`` (CLaaS product repo, flag only).

    Returns:
        ``(s, t)`` log-probabilities of shape ``[..., K+1]`` (or ``[..., K]`` without tail).
    """
    if topk_from not in TOPK_SOURCES:
        raise ValueError(f"topk_from={topk_from!r} is not supported; choose one of {TOPK_SOURCES}")
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(f"student_logp {tuple(student_logp.shape)} and teacher_logp "
                         f"{tuple(teacher_logp.shape)} must have the same [..., V] shape")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    k = min(k, student_logp.shape[-1])
    src = student_logp if topk_from == "student" else teacher_logp
    idx = src.detach().topk(k, dim=-1).indices
    s = student_logp.float().gather(-1, idx)
    t = teacher_logp.detach().float().gather(-1, idx)
    if add_tail:
        s = torch.cat([s, log1m_exp(torch.logsumexp(s, dim=-1, keepdim=True))], dim=-1)
        t = torch.cat([t, log1m_exp(torch.logsumexp(t, dim=-1, keepdim=True))], dim=-1)
    else:
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    return s, t


def generalized_jsd(s: torch.Tensor, t: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """GJS_α between student log-probs ``s`` and teacher log-probs ``t`` over the last dim (docs/math.md §A.3.3).

    0 < α < 1: mix = logsumexp([s + log(1−α), t + log α]); GJS = (1−α)·Σ e^s (s − mix) + α·Σ e^t (t − mix).
    α = 0: forward KL(T‖S) = Σ e^t (t − s);  α = 1: reverse KL(S‖T) = Σ e^s (s − t)  (the mixture is 0 there).

    Shapes: ``[..., K']`` in, ``[...]`` out (fp32).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL)")
    s = s.float()
    t = t.float()
    if alpha == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if alpha == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    mix = torch.logsumexp(torch.stack([s + math.log(1.0 - alpha), t + math.log(alpha)]), dim=0)
    return (1.0 - alpha) * (s.exp() * (s - mix)).sum(-1) + alpha * (t.exp() * (t - mix)).sum(-1)


# --------------------------------------------------------------------------- IS weight and loss


def sdpo_is_weight(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ratio_mode: str = "geo_mean",
    is_clip: float = 2.0,
) -> torch.Tensor:
    """w_e = min(ρ[e], is_clip), detached, ``[B]`` (docs/math.md §A.3.3 [CHOICE]: sequence ratio, not per token).

    ``ref_log_prob`` is the IS reference (``sdpo_is_reference``): the behaviour log-probs (default; per
    token ``[B, T]``, or ℓb on one position, or ``[B]``) or the EMA teacher's log-probs of the sampled
    tokens on the STUDENT context (``"ema_teacher"``). ρ uses the same ``ratio_mode`` as A.2.2.
    """
    if not is_clip > 0:
        raise ValueError(f"is_clip={is_clip} must be > 0")
    with torch.no_grad():
        lr = sequence_log_ratio(log_prob.detach(), ref_log_prob, response_mask, ratio_mode)
        return torch.exp(lr.clamp(max=20.0)).clamp(max=is_clip)


def sdpo_loss(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    log_prob: torch.Tensor,
    is_ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    sd_mask: torch.Tensor,
    *,
    mode: str = "gjs",
    alpha: float = 0.5,
    topk: int = 100,
    add_tail: bool = True,
    topk_from: str = "student",
    is_clip: float = 2.0,
    ratio_mode: str = "geo_mean",
    jsd_coef: float = 1.0,
    response_ids: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | torch.Tensor | None = None,
    global_sd_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    global_sd_seqs: float | torch.Tensor | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SDPO loss on replayed entries (docs/math.md §A.3.3).

    ``gjs`` (default): agg over m·sd_mask of w_e·GJS_α(s_j, t_j) (token-mean: divided by the GLOBAL
    Σ m·sd_mask, pass it as ``global_sd_tokens`` when sharded).
    ``pg+jsd``: A.2 clipped surrogate over m with token advantage A_j = sg(ℓT(y_j) − ℓS(y_j)) and ratio
    against ``old_log_prob`` (behaviour), plus ``jsd_coef``·(the ``gjs`` term) [CHOICE: the same w_e weights
    the JSD term; ``alpha`` defaults to the math reference's 0.5].

    Args:
        student_logp: ``[B, T, V]`` full-vocabulary student log-softmax on the student context (with grad).
        teacher_logp: ``[B, T, V]`` EMA-teacher log-softmax on the teacher context x', same positions (no grad).
        log_prob: ``[B, T]`` student log-prob of the sampled tokens (= student_logp gathered at y, with grad).
        is_ref_log_prob: IS reference for w_e (behaviour or EMA teacher on student context); see :func:`sdpo_is_weight`.
        response_mask: ``[B, T]``.
        sd_mask: ``[B]`` (has feedback) or ``[B, T]``; multiplies m for the divergence term.
        response_ids: ``[B, T]`` sampled token ids, needed in ``pg+jsd`` to read ℓT(y_j).
        old_log_prob: behaviour log-probs for the ``pg+jsd`` surrogate (defaults to ``is_ref_log_prob``).

    Returns:
        ``(loss, metrics)`` with metrics under ``actor/sdpo_*`` (plus the A.2 ones in ``pg+jsd``), 0-dim detached
        tensors that the caller reduces once per step.

    Raises:
        ValueError: bad mode, shape mismatch, missing ``response_ids`` in ``pg+jsd``; NaN/inf on valid positions
        only with the debug flag on (``CLAAS_VERL_DEBUG_CHECKS=1``). No host sync per call.
    """
    if mode not in SDPO_MODES:
        raise ValueError(f"sdpo mode={mode!r} is not supported; choose one of {SDPO_MODES}")
    check_same_shape(log_prob=log_prob, response_mask=response_mask)
    if student_logp.shape[:2] != log_prob.shape or teacher_logp.shape != student_logp.shape:
        raise ValueError(f"student_logp/teacher_logp must be [B, T, V] with [B, T] = {tuple(log_prob.shape)}; got "
                         f"{tuple(student_logp.shape)} and {tuple(teacher_logp.shape)}")
    mask = response_mask.bool()
    sdm = sd_mask.bool()
    if sdm.dim() == 1:
        sdm = self_distillation_mask(sdm, mask)
    else:
        check_same_shape(sd_mask=sd_mask, response_mask=response_mask)
        sdm = sdm & mask
    check_finite("student_logp", student_logp, sdm.unsqueeze(-1).expand_as(student_logp))
    check_finite("teacher_logp", teacher_logp, sdm.unsqueeze(-1).expand_as(teacher_logp))
    check_finite("log_prob", log_prob, mask)

    w = sdpo_is_weight(log_prob, is_ref_log_prob, mask, ratio_mode=ratio_mode, is_clip=is_clip)
    # Replace positions outside m·sd_mask by a harmless uniform distribution so NaN/-inf there never leaks.
    safe = sdm.unsqueeze(-1)
    uniform = torch.full_like(student_logp, -math.log(student_logp.shape[-1]), dtype=torch.float32)
    s_full = torch.where(safe, student_logp.float(), uniform)
    t_full = torch.where(safe, teacher_logp.detach().float(), uniform)
    s, t = topk_with_tail(s_full, t_full, topk, add_tail=add_tail, topk_from=topk_from)
    gjs = generalized_jsd(s, t, alpha)
    div_loss = agg_loss(
        gjs * w.unsqueeze(-1), sdm, loss_agg_mode,
        global_tokens=global_sd_tokens, global_seqs=global_sd_seqs, dp_size=dp_size,
    )
    with torch.no_grad():
        metrics = {
            "actor/sdpo_gjs": masked_mean(gjs, sdm),
            "actor/sdpo_is_weight_mean": masked_mean(w, mask.any(-1)),
            "actor/sdpo_is_weight_clipfrac": masked_mean((w >= is_clip).float(), mask.any(-1)),
            "actor/sdpo_sd_token_frac": masked_mean(sdm.float(), mask),
        }
    if mode == "gjs":
        return div_loss, metrics

    if response_ids is None:
        raise ValueError("sdpo mode 'pg+jsd' needs response_ids [B, T] to read the teacher log-prob of y_j")
    check_same_shape(response_ids=response_ids, response_mask=response_mask)
    ids = torch.where(mask, response_ids, torch.zeros_like(response_ids)).long().unsqueeze(-1)
    t_gathered = teacher_logp.detach().float().gather(-1, ids).squeeze(-1)
    t_tok = torch.where(mask, t_gathered, torch.zeros_like(t_gathered))
    check_finite("teacher log-prob of the sampled tokens", t_tok, mask)
    adv = (t_tok - log_prob.detach().float()) * mask.float()  # SDPO's reverse-KL token advantage
    pg_loss, pg_metrics = seq_is_clipped_loss(
        log_prob, is_ref_log_prob if old_log_prob is None else old_log_prob, adv, mask,
        ratio_mode=ratio_mode, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode, global_tokens=global_tokens,
        global_seqs=global_seqs, dp_size=dp_size,
    )
    metrics.update(pg_metrics)
    metrics["actor/sdpo_pg_loss"] = pg_loss.detach()
    return pg_loss + jsd_coef * div_loss, metrics


# --------------------------------------------------------------------------- EMA teacher


def _select(named: Iterator[tuple[str, torch.Tensor]], scope: str) -> dict[str, torch.Tensor]:
    if scope not in EMA_SCOPES:
        raise ValueError(f"scope={scope!r} is not supported; choose one of {EMA_SCOPES}")
    out = {n: p for n, p in named if scope == "full" or "lora_" in n}
    if not out:
        raise ValueError(f"no parameters selected for the EMA teacher with scope={scope!r} "
                         "(scope='lora' needs parameter names containing 'lora_', as PEFT names them)")
    return out


class EmaTeacher:
    """EMA copy of the student's trainable tensors (docs/math.md §A.3.3): θ_T ← (1−τ)·θ_T + τ·θ.

    In CLaaS only the LoRA tensors train, so the teacher is "base + EMA LoRA": it holds fp32 copies of the
    selected tensors and :meth:`swapped_into` temporarily loads them into the student module for the
    teacher forward. τ = 0 is the frozen teacher of the CLaaS product repo (flag only).

    Args:
        module: the student (a ``torch.nn.Module``); θ_T is initialised to its current θ⁰.
        tau: update rate τ ∈ [0, 1] (default 0.05; SDPO rich-feedback runs use 0.01).
        scope: ``"lora"`` (default; names containing ``lora_``) or ``"full"`` (every parameter).
    """

    def __init__(self, module: torch.nn.Module, tau: float = 0.05, scope: str = "lora"):
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau={tau} must be in [0, 1] (teacher_update_rate)")
        self.tau = float(tau)
        self.scope = scope
        params = _select(module.named_parameters(), scope)
        self.params = {n: p.detach().float().clone() for n, p in params.items()}
        self.num_updates = 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """One EMA step; call only after an APPLIED optimizer step with a finite gradient (docs/math.md §A.2.4)."""
        current = _select(module.named_parameters(), self.scope)
        if set(current) != set(self.params):
            raise ValueError("EmaTeacher.update: the module's selected parameter names differ from the teacher's")
        for name, p in current.items():
            if not bool(torch.isfinite(p).all()):
                raise ValueError(f"EmaTeacher.update: student parameter {name} holds NaN/inf; skip the EMA step")
        for name, p in current.items():
            self.params[name].lerp_(p.detach().float(), self.tau)  # θ_T + τ(θ − θ_T) = (1−τ)θ_T + τθ
        self.num_updates += 1

    @contextlib.contextmanager
    def swapped_into(self, module: torch.nn.Module):
        """Load θ_T into ``module`` for a teacher forward; restore the student's θ on exit."""
        current = _select(module.named_parameters(), self.scope)
        saved = {n: p.detach().clone() for n, p in current.items()}
        try:
            with torch.no_grad():
                for n, p in current.items():
                    p.copy_(self.params[n].to(p.dtype))
            yield module
        finally:
            with torch.no_grad():
                for n, p in current.items():
                    p.copy_(saved[n])

    def state_dict(self) -> dict:
        """τ, scope, the number of EMA steps and the teacher tensors (a sharded tensor's LOCAL shard: each training
        rank saves and restores its own part)."""
        return {"tau": self.tau, "scope": self.scope, "num_updates": self.num_updates,
                "params": {n: _local(t).detach().clone() for n, t in self.params.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` in place (names and local shapes must match; nothing changes on error)."""
        names, mine = set(state["params"]), set(self.params)
        if names != mine:
            diff = sorted(names ^ mine)[:3]
            raise ValueError(f"EmaTeacher.load_state_dict: parameter names differ from this teacher's (e.g. {diff})")
        for n, t in state["params"].items():
            if tuple(t.shape) != tuple(_local(self.params[n]).shape):
                raise ValueError(f"EmaTeacher.load_state_dict: params[{n!r}] has shape {tuple(t.shape)}, this "
                                 f"teacher's (local) shape is {tuple(_local(self.params[n]).shape)}")
        if state["scope"] != self.scope:
            raise ValueError(f"EmaTeacher.load_state_dict: scope={state['scope']!r}, this teacher's is {self.scope!r}")
        with torch.no_grad():
            for n, t in state["params"].items():
                _local(self.params[n]).copy_(t.to(torch.float32))
        self.tau = float(state["tau"])
        self.num_updates = int(state["num_updates"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a sharded (DTensor) tensor, the tensor itself otherwise (a view: writes go through)."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def ema_update_(teacher: list[torch.Tensor], student: list[torch.Tensor], tau: float) -> None:
    """Functional form: in place θ_T ← (1−τ)·θ_T + τ·θ for matching tensor lists."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau={tau} must be in [0, 1]")
    if len(teacher) != len(student):
        raise ValueError(f"teacher has {len(teacher)} tensors, student {len(student)}")
    for t, s in zip(teacher, student):
        t.lerp_(s.detach().to(t.dtype), tau)
