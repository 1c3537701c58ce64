"""Token channel of continual MOPD: student top-k rewards, per-domain advantages, loss (docs/math.md §B.2, MOPD paper
eqs. 4-5).

Shapes used throughout: ``B`` responses, ``T`` response positions, ``V`` vocabulary, ``K`` = κ candidates
(κ = 16 in the MOPD paper). ``mask`` is the ``[B, T]`` response mask of docs/math.md §0 (1 on generated tokens incl.
EOS).

Memory contract: logits arrive as one ``[B, T, V]`` tensor (the model output, any float dtype). Every function
here works on row chunks of ``chunk_size`` positions, so at most one ``[chunk_size, V]`` compute-dtype temporary
(plus its exponent in the backward) exists at a time. The differentiable path (:func:`topk_logprobs`) is one
autograd node over all chunks: the forward keeps only the ``[N, K]`` result and the ``[N]`` log-normalisers, and
the backward allocates the ``[N, V]`` logits gradient ONCE and writes each chunk's rows in place, so time and
memory are linear in the number of positions (checkpointing slices of a flat tensor would allocate a zero
``[N, V]`` gradient per chunk, quadratic in N; ``benchmarks/bench_topk_chunked.py`` measures it).
Flattening ``[B, T, V]`` to ``[B·T, V]`` is a view for contiguous logits; a non-contiguous slice (e.g.
``logits[:, P-1:-1]`` of a prompt+response forward) is copied once in its own dtype, so slice before upcasting.

Precision (docs/math.md §0, fp32 math): every function computes in ``promote_types(input dtype, float32)`` and returns
that dtype: bf16/fp16/fp32 inputs give fp32, float64 inputs stay float64 (nothing is downcast). Gradients reach
the logits in the logits' own dtype. Log-probabilities are full-vocabulary values of ``log_softmax(logits / τ)``.
Host syncs: the per-micro-batch path (:func:`topk_logprobs`, the loss) reads none but the backward's overwrite check.
"""

from __future__ import annotations

import torch

from claas_verl.utils.host_sync import debug_checks_enabled
from claas_verl.utils.masked import agg_loss, masked_mean

DEFAULT_CHUNK_SIZE = 1024
# docs/math.md §B.2.2 [CHOICE]: a domain with fewer than 2 values or σ_d below this uses σ := 1 (A = r).
MIN_DOMAIN_STD = 1e-8


# ----------------------------------------------------------------------------------------------------------------
# validation helpers


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            f"{name} must be a float tensor [B, T, V]; got dtype {logits.dtype}, shape {tuple(logits.shape)}"
        )


def _check_chunk(chunk_size: int | None) -> int | None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None (no chunking); got {chunk_size!r}")
    return chunk_size


def _check_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the rollout temperature τ of docs/math.md §0); got {temperature!r}")
    return float(temperature)


def _check_topk_pair(ids: torch.Tensor, logits: torch.Tensor, ids_name: str, logits_name: str, values=True) -> None:
    """Shapes and dtype always; the id range (a host read of min/max) only if ``values``."""
    if ids.dim() != 3 or ids.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"{ids_name} must be [B, T, K] with the same B, T as {logits_name} {tuple(logits.shape)}; "
            f"got {tuple(ids.shape)}"
        )
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{ids_name} must hold integer token ids (int64/int32); got {ids.dtype}")
    if values and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= logits.shape[-1]):
        raise ValueError(
            f"{ids_name} holds ids outside [0, {logits.shape[-1]}) of {logits_name}'s vocabulary; student and "
            "teacher must share the tokenizer (pad the smaller vocabulary's logits to the larger one's size)"
        )


def _check_mask(mask: torch.Tensor, like: torch.Tensor, name: str = "mask") -> None:
    if mask.shape != like.shape[:2]:
        raise ValueError(f"{name} must be [B, T] = {tuple(like.shape[:2])}; got {tuple(mask.shape)}")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """``promote_types`` of the inputs' dtypes and float32: the dtype every function of this module computes in."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _scaled_chunk(rows: torch.Tensor, dtype: torch.dtype, tau: float) -> torch.Tensor:
    """A fresh ``rows.to(dtype) / τ`` (one ``[c, V]`` allocation: the division is in place)."""
    z = rows.to(dtype, copy=True)
    return z if tau == 1.0 else z.div_(tau)


def _row_chunks(n: int, chunk_size: int | None):
    step = n if chunk_size is None else chunk_size
    for start in range(0, n, max(step, 1)):
        yield start, min(start + step, n)


# ----------------------------------------------------------------------------------------------------------------
# B.2.1 pre-update quantities (no gradient: they are constants of the update)


@torch.no_grad()
def student_topk(
    logits: torch.Tensor, k: int = 16, *, temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student candidates ``V_t`` and their full-vocabulary log-probs ``S`` (docs/math.md §B.2.1).

    Args:
        logits: ``[B, T, V]`` student logits from the training model *before* the update, aligned with the
            response positions (logits[:, t] predicts response token t).
        k: κ, the number of candidates (16 in the MOPD paper).
        temperature: τ; log-probs are ``log_softmax(logits / τ)``.
        chunk_size: positions per chunk (``None``: all at once).

    Returns:
        ``ids [B, T, k]`` (int64) and ``logp [B, T, k]`` (``promote_types(logits.dtype, float32)``), sorted by
        decreasing log-prob. Padding positions get values too; every consumer masks them.
    """
    _check_logits(logits, "logits")
    tau = _check_temperature(temperature)
    _check_chunk(chunk_size)
    B, T, V = logits.shape
    if not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"k must be an int in [1, V={V}]; got {k!r}")
    dtype = compute_dtype(logits)
    flat = logits.reshape(B * T, V)
    ids = torch.empty(B * T, k, dtype=torch.long, device=logits.device)
    logp = torch.empty(B * T, k, dtype=dtype, device=logits.device)
    for s, e in _row_chunks(B * T, chunk_size):
        z = _scaled_chunk(flat[s:e], dtype, tau)  # the one [chunk, V] temporary
        # top-k of z/τ = top-k of log_softmax; computing z[ids] − logsumexp exactly as _gathered_logp does makes
        # S bit-identical to teacher_logprobs_at/topk_logprobs on the same logits (so q = p gives r = 0 exactly).
        top_z, ids[s:e] = torch.topk(z, k, dim=-1)
        logp[s:e] = top_z - torch.logsumexp(z, dim=-1, keepdim=True)
        del z
    return ids.view(B, T, k), logp.view(B, T, k)


@torch.no_grad()
def teacher_logprobs_at(
    logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Teacher full-vocabulary log-probs ``Q`` at the student's candidates (docs/math.md §B.2.1).

    ``Q[b,t,j] = log_softmax(teacher_logits[b,t] / τ)[ids[b,t,j]]``; the values are **not** renormalised over
    the k candidates, so ``Σ_j exp Q[b,t,j] ≤ 1``.

    Args:
        logits: ``[B, T, V]`` teacher logits on the same ``(x, y)`` and positions as the student.
        ids: ``[B, T, K]`` student candidate ids from :func:`student_topk`.

    Returns:
        ``[B, T, K]`` in ``promote_types(logits.dtype, float32)``.
    """
    _check_logits(logits, "teacher logits")
    tau = _check_temperature(temperature)
    _check_chunk(chunk_size)
    _check_topk_pair(ids, logits, "ids", "teacher logits")
    B, T, V = logits.shape
    K = ids.shape[-1]
    out, _ = _gather_logp_rows(logits.reshape(B * T, V), ids.long().reshape(B * T, K), tau, chunk_size)
    return out.view(B, T, K)


def _gather_logp_rows(flat: torch.Tensor, flat_ids: torch.Tensor, tau: float, chunk_size: int | None):
    """``(log_softmax(z/τ)[ids] [N, K], logsumexp(z/τ) [N])`` of flat ``[N, V]`` logits, chunk by chunk.

    ``z[ids]/τ − logsumexp(z/τ)`` with one ``[chunk, V]`` temporary in ``compute_dtype(flat)``; no autograd.
    """
    dtype = compute_dtype(flat)
    n = flat.shape[0]
    out = torch.empty(n, flat_ids.shape[-1], dtype=dtype, device=flat.device)
    lse = torch.empty(n, dtype=dtype, device=flat.device)
    with torch.no_grad():
        for s, e in _row_chunks(n, chunk_size):
            z = _scaled_chunk(flat[s:e], dtype, tau)  # the one [c, V] temporary of this chunk
            lse_c = torch.logsumexp(z, dim=-1, keepdim=True)
            out[s:e] = torch.gather(z, -1, flat_ids[s:e]) - lse_c
            lse[s:e] = lse_c.squeeze(-1)
            del z
    return out, lse


class _ChunkedTopkLogprobs(torch.autograd.Function):
    """``log_softmax(z/τ)[ids]`` over flat ``[N, V]`` logits, linear in N in time and memory.

    Forward: :func:`_gather_logp_rows` (keeps ``[N, K]`` and the ``[N]`` logsumexp; the logits are saved by
    reference, no copy). Backward: with ``g [N, K]`` the upstream gradient and ``p = softmax(z/τ)``,
    ``∂/∂z = (scatter(g at ids) − p·Σ_k g) / τ``, computed chunk by chunk from the saved logsumexp and written
    into ONE preallocated ``[N, V]`` gradient in the logits' dtype.

    The backward reads the logits again, so they must still be the forward's. A kernel that overwrites them
    in its own backward without autograd noticing (flash-attn's cross-entropy with ``inplace_backward=True``,
    which verl's FSDP engine runs on the same logits for the sampled-token log-probs unless the batch says
    ``distillation_only``) would make this gradient silently wrong; the backward recomputes the forward's
    ``[N, K]`` values from the logits it reads and raises if a single one differs.
    """

    @staticmethod
    def forward(ctx, flat, flat_ids, tau, chunk_size):
        out, lse = _gather_logp_rows(flat, flat_ids, tau, chunk_size)
        ctx.save_for_backward(flat, flat_ids, lse, out.clone())  # [N, K]: the overwrite check of the backward
        ctx.tau, ctx.chunk_size = tau, chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        flat, flat_ids, lse, out = ctx.saved_tensors
        tau, dtype = ctx.tau, lse.dtype
        grad = torch.empty_like(flat, memory_format=torch.contiguous_format)
        g_all = grad_out.to(dtype)
        changed = torch.zeros((), dtype=torch.bool, device=flat.device)
        for s, e in _row_chunks(flat.shape[0], ctx.chunk_size):
            g = g_all[s:e]
            z = _scaled_chunk(flat[s:e], dtype, tau)
            # the same ops as the forward on unchanged logits give bit-identical values (NaN counts as equal)
            again, before = torch.gather(z, -1, flat_ids[s:e]) - lse[s:e, None], out[s:e]
            changed |= ((again != before) & ~(again.isnan() & before.isnan())).any()
            # in place: z -> p = exp(z − lse) -> −p·Σg -> + scatter(g) -> /τ (one [c, V] temporary per chunk)
            z.sub_(lse[s:e, None]).exp_().mul_(-g.sum(-1, keepdim=True))
            z.scatter_add_(-1, flat_ids[s:e], g).div_(tau)
            grad[s:e] = z
            del z
        if bool(changed):
            raise RuntimeError(
                "topk_logprobs: the logits changed between the forward and the backward of this node, so its "
                "gradient would be wrong. Another consumer of the same logits overwrote them in place in its "
                "backward, e.g. flash-attn's cross-entropy with inplace_backward=True, which verl's FSDP engine "
                "runs for the sampled-token log-probs. Set the batch's non-tensor key distillation_only=True (verl "
                "then computes none; return the sampled token's log-prob from the logits processor, as "
                "claas_verl's SDPO loss does) or VERL_DISABLE_FLASH_ATTN_CE=1 in the workers' environment."
            )
        return grad, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# eq. (4): rewards


def topk_rewards(student_logp_topk: torch.Tensor, teacher_logp_topk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``r[t,v] = w[t,v]·(Q[t,v] − S[t,v])`` with ``w = softmax_κ(S)`` (docs/math.md §B.2.1, MOPD paper eq. 4).

    ``w = p_v / P_t`` is the student's distribution renormalised over its own top-k; Q and S stay full-vocabulary
    values. ``Σ_v −r`` is the student-weighted log-ratio (see :func:`topk_weighted_kl`).

    Args:
        student_logp_topk: ``S [B, T, K]`` from :func:`student_topk` (θ_old, no gradient).
        teacher_logp_topk: ``Q [B, T, K]`` from :func:`teacher_logprobs_at`.
        mask: ``[B, T]`` response mask.

    Returns:
        ``r [B, T, K]`` in ``promote_types(S.dtype, Q.dtype, float32)``, exactly 0 on padding.
    """
    S, Q, valid = _checked_topk_pair(student_logp_topk, teacher_logp_topk, mask)
    w = torch.softmax(S, dim=-1)
    r = w * (Q - S)
    return torch.where(valid, r, torch.zeros_like(r))


def _checked_topk_pair(
    student_logp_topk: torch.Tensor, teacher_logp_topk: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate S and Q ``[B, T, K]`` against ``mask``; return them detached in ``compute_dtype(S, Q)`` and the
    ``[B, T, K]`` valid mask. Raises on shape mismatch or on a non-finite value at a valid position."""
    S, Q = student_logp_topk, teacher_logp_topk
    if S.dim() != 3 or S.shape != Q.shape:
        raise ValueError(
            f"student_logp_topk and teacher_logp_topk must both be [B, T, K] of equal shape; got {tuple(S.shape)} "
            f"and {tuple(Q.shape)}"
        )
    _check_mask(mask, S)
    dtype = compute_dtype(S, Q)
    S, Q = S.detach().to(dtype), Q.detach().to(dtype)
    valid = mask.bool().unsqueeze(-1).expand_as(S)
    if not (torch.isfinite(S[valid]).all() and torch.isfinite(Q[valid]).all()):
        raise ValueError(
            "non-finite log-probs at valid positions of student_logp_topk/teacher_logp_topk: a teacher logit of -inf "
            "at a student candidate (e.g. a vocabulary mask) makes r infinite; mask such logits with a large finite "
            "negative value instead"
        )
    return S, Q, valid


def topk_weighted_kl(
    student_logp_topk: torch.Tensor, teacher_logp_topk: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Logging: token-mean of ``Σ_v w[t,v]·(S[t,v] − Q[t,v])`` over valid positions (= mean of ``−Σ_v r``).

    The student-weighted KL to the teacher restricted to the student's top-k (docs/math.md §B.2.1, last line). Returns a
    0-d fp32 tensor (0 for an empty mask).
    """
    r = topk_rewards(student_logp_topk, teacher_logp_topk, mask)
    return masked_mean(-r.sum(dim=-1), mask)


def topk_binned_kl(
    student_logp_topk: torch.Tensor, teacher_logp_topk: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Logging: KL from student to teacher over ``K + 1`` outcomes (the student's top-k ids, and "any other token").

    Per valid position, with ``p = exp(S)``, ``q = exp(Q)`` (full-vocabulary probabilities at the top-k ids) and the
    tail masses ``p̄ = 1 − Σ_v p``, ``q̄ = 1 − Σ_v q``::

        KL_bin[t] = Σ_v p[t,v]·(S[t,v] − Q[t,v]) + p̄·log(p̄ / q̄)

    Merging outcomes never increases a KL (data-processing inequality), so ``0 <= KL_bin <= KL(π_s || π_t)`` over
    the full vocabulary, with equality when the top-k hold all of the student's mass. It needs nothing beyond what
    the token channel already has (S and Q, ``[B, T, K]``), and, unlike :func:`topk_weighted_kl` (renormalised
    weights, no tail), it is never negative, which is what a forgetting table wants. This is a claas_verl addition,
    not a quantity of the MOPD paper. Returns the 0-d token-mean over ``mask`` in ``compute_dtype(S, Q)`` (0 for an
    empty mask).
    """
    S, Q, _ = _checked_topk_pair(student_logp_topk, teacher_logp_topk, mask)
    head = (S.exp() * (S - Q)).sum(dim=-1)
    # tail masses from log Σ p, via expm1 for accuracy when the top-k hold nearly everything; rounding can push
    # Σ p a hair above 1, hence the clamps (the teacher's tail is floored so that p̄ > 0 never divides by zero)
    p_tail = (-torch.expm1(torch.logsumexp(S, dim=-1))).clamp(min=0.0)
    q_tail = (-torch.expm1(torch.logsumexp(Q, dim=-1))).clamp(min=torch.finfo(Q.dtype).tiny)
    kl = head + torch.xlogy(p_tail, p_tail) - torch.xlogy(p_tail, q_tail)
    return masked_mean(torch.where(mask.bool(), kl, torch.zeros_like(kl)), mask)


# ----------------------------------------------------------------------------------------------------------------
# B.2.2 per-domain normalised advantages


def _dist_ready(sync: bool | None) -> bool:
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    if sync and not available:
        raise ValueError("sync=True needs an initialised torch.distributed process group; use sync=None or False")
    return available if sync is None else bool(sync)


def _domain_index(domain_ids, B: int, device) -> torch.Tensor:
    if domain_ids is None:
        return torch.zeros(B, dtype=torch.long, device=device)
    d = torch.as_tensor(domain_ids, device=device)
    if d.shape != (B,) or d.is_floating_point() or d.dtype == torch.bool:
        raise ValueError(
            f"domain_ids must be an integer tensor [B={B}] (one domain per response); got {tuple(d.shape)}"
        )
    if B and int(d.min()) < 0:
        raise ValueError("domain_ids must be non-negative integers (e.g. 0..4 for logic, math, code, safety, IF)")
    return d.long()


def domain_moments(
    r: torch.Tensor, mask: torch.Tensor, domain_ids=None, *, num_domains: int | None = None
) -> torch.Tensor:
    """Local sufficient statistics per domain: ``[num_domains, 3]`` fp64 rows ``(count, Σr, Σr²)``.

    Counted over every candidate of every valid position (docs/math.md §B.2.2). Summing these rows across ranks (or
    micro-batches) and then calling :func:`stds_from_moments` gives the global σ_d.
    """
    if r.dim() != 3:
        raise ValueError(f"r must be [B, T, K]; got {tuple(r.shape)}")
    _check_mask(mask, r)
    B, _, K = r.shape
    d = _domain_index(domain_ids, B, r.device)
    n_dom = (int(d.max()) + 1 if B else 1) if num_domains is None else int(num_domains)
    if B and int(d.max()) >= n_dom:
        raise ValueError(f"domain_ids hold {int(d.max())} but num_domains={n_dom}")
    m = mask.to(torch.float64)
    x = torch.where(mask.bool().unsqueeze(-1), r.detach().to(torch.float64), torch.zeros((), dtype=torch.float64))
    per_resp = torch.stack([m.sum(-1) * K, x.sum((1, 2)), (x * x).sum((1, 2))], dim=-1)  # [B, 3]
    out = torch.zeros(n_dom, 3, dtype=torch.float64, device=r.device)
    return out.index_add_(0, d, per_resp)


def stds_from_moments(moments: torch.Tensor) -> torch.Tensor:
    """σ_d (sample std, ddof=1) from ``(count, Σr, Σr²)`` rows; NaN where count < 2. ``[num_domains]`` fp64."""
    n, s, ss = moments.unbind(-1)
    var = (ss - s * s / n.clamp(min=1)) / (n - 1).clamp(min=1)
    return torch.where(n >= 2, var.clamp(min=0).sqrt(), torch.full_like(n, float("nan")))


def domain_stds(r: torch.Tensor, mask: torch.Tensor, domain_ids=None, *, sync: bool | None = None, group=None,
                std_floor: float = 0.0) -> dict[int, dict[str, float]]:
    """Logging: per present domain, ``{"count", "std", "scale"}`` where ``scale`` is the σ actually divided by.

    ``std`` is NaN for fewer than 2 values; ``scale`` applies the docs/math.md §B.2.2 fallbacks (σ := 1) and
    ``std_floor`` as :func:`domain_normalized_advantages` does. A step that needs both uses
    :func:`domain_advantages_and_stds` (one σ_d computation, one all-reduce).
    """
    std_floor = check_std_floor(std_floor)
    d = _domain_index(domain_ids, r.shape[0] if r.dim() == 3 else 0, r.device)
    return _stds_dict(*_global_sigma(r, mask, d, sync, group, std_floor))


def _stds_dict(moments: torch.Tensor, sigma: torch.Tensor) -> dict[int, dict[str, float]]:
    # three host reads for the whole table (not three per domain)
    counts, stds, scales = moments[:, 0].tolist(), stds_from_moments(moments).tolist(), sigma.tolist()
    return {dom: {"count": counts[dom], "std": stds[dom], "scale": scales[dom]}
            for dom in range(len(counts)) if counts[dom] > 0}


def check_std_floor(std_floor: float) -> float:
    """``std_floor`` as a float, or ValueError unless it is a finite number >= 0 (Python only: no host sync)."""
    if isinstance(std_floor, bool) or not (isinstance(std_floor, (int, float)) and 0 <= std_floor < float("inf")):
        raise ValueError(f"std_floor must be a finite float >= 0 (0: the paper's σ_d, no floor); got {std_floor!r}")
    return float(std_floor)


def _global_sigma(r, mask, d, sync, group, std_floor):
    """``(moments [D, 3], σ [D])`` over the step batch (all ranks when syncing) for the domain index ``d`` ``[B]``;
    ``std_floor`` already checked by the public caller."""
    do_sync = _dist_ready(sync)
    B = r.shape[0] if r.dim() == 3 else 0
    n_dom = int(d.max()) + 1 if B else 1
    if do_sync:
        # ranks may hold different domain sets: agree on the table size first, then sum the moments
        size = torch.tensor([n_dom], dtype=torch.long, device=r.device)
        torch.distributed.all_reduce(size, op=torch.distributed.ReduceOp.MAX, group=group)
        n_dom = int(size)
    moments = domain_moments(r, mask, d, num_domains=n_dom)
    if do_sync:
        torch.distributed.all_reduce(moments, op=torch.distributed.ReduceOp.SUM, group=group)
    sigma = stds_from_moments(moments)
    # docs/math.md §B.2.2 [CHOICE]: count < 2 (σ is NaN) or σ_d < 1e-8 -> σ := 1, i.e. A = r; otherwise no epsilon.
    use_one = torch.isnan(sigma) | (sigma < MIN_DOMAIN_STD)
    # the floor (a deviation, off by default) bounds the amplification 1/σ_d of a step whose rewards are all small
    return moments, torch.where(use_one, torch.ones_like(sigma), sigma.clamp(min=std_floor))


def _scaled_by_domain(r: torch.Tensor, mask: torch.Tensor, d: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``A = r / σ_{d(b)}``, exactly 0 on padding, in ``compute_dtype(r)``."""
    dtype = compute_dtype(r)
    scale = sigma[d].to(dtype).view(-1, 1, 1)
    A = r.detach().to(dtype) / scale
    return torch.where(mask.bool().unsqueeze(-1), A, torch.zeros_like(A))


def domain_normalized_advantages(
    r: torch.Tensor,
    mask: torch.Tensor,
    domain_ids=None,
    *,
    sync: bool | None = None,
    group=None,
    std_floor: float = 0.0,
) -> torch.Tensor:
    """``A[b,t,v] = r[b,t,v] / σ_{d(b)}`` with no mean subtracted (docs/math.md §B.2.2).

    σ_d is the sample standard deviation (ddof = 1) of r over all K candidates of all valid positions of the
    responses of domain d; the mean enters only inside the std. Fallback ``[CHOICE]``: fewer than 2 values or
    σ_d < 1e-8 gives σ := 1. Subtracting a mean would break the gradient identity of B.2.4.

    ``std_floor`` (default 0, the paper) divides by ``max(σ_d, std_floor)`` instead, a deviation from docs/math.md
    §B.2.2: by B.2.4 the step's gradient is ``∇D/(σ_d P)``, so a step whose student already sits near its teacher
    (small D, small σ_d) takes a full-size step along a direction its few samples barely determine; with the floor
    such a step shrinks with D, as an unnormalised KL gradient does. The fallbacks above still apply first.

    Args:
        r: ``[B, T, K]`` rewards of :func:`topk_rewards`.
        mask: ``[B, T]`` response mask.
        domain_ids: ``[B]`` non-negative ints, one domain per response; ``None`` = one domain.
        sync: all-reduce the per-domain (count, Σr, Σr²) over ``group`` so σ_d covers the whole step batch
            (all ranks). ``None``: iff ``torch.distributed`` is initialised. Every rank of ``group`` must call this.
        group: process group for the reduction (default: world).
        std_floor: lower bound on the σ divided by (0: none, the paper).

    Returns:
        ``A [B, T, K]`` in ``promote_types(r.dtype, float32)``, exactly 0 on padding.
    """
    return domain_advantages_and_stds(r, mask, domain_ids, sync=sync, group=group, std_floor=std_floor, stats=False)[0]


def domain_advantages_and_stds(
    r: torch.Tensor, mask: torch.Tensor, domain_ids=None, *, sync: bool | None = None, group=None,
    std_floor: float = 0.0, stats: bool = True,
) -> tuple[torch.Tensor, dict[int, dict[str, float]] | None]:
    """:func:`domain_normalized_advantages` and :func:`domain_stds` of the same arguments from ONE σ_d computation.

    A MOPD step needs both (the advantages, and σ_d for its log): this computes the per-domain moments, their
    all-reduce (with ``sync``) and σ once, and checks ``std_floor`` once. Arguments as in
    :func:`domain_normalized_advantages`; ``stats=False`` skips the stats (and their host reads) and returns None.

    Returns:
        ``(A [B, T, K], {domain: {"count", "std", "scale"}})``, equal to the two functions' results.
    """
    if r.dim() != 3:
        raise ValueError(f"r must be [B, T, K]; got {tuple(r.shape)}")
    _check_mask(mask, r)
    std_floor = check_std_floor(std_floor)
    d = _domain_index(domain_ids, r.shape[0], r.device)
    moments, sigma = _global_sigma(r, mask, d, sync, group, std_floor)
    return _scaled_by_domain(r, mask, d, sigma), (_stds_dict(moments, sigma) if stats else None)


# ----------------------------------------------------------------------------------------------------------------
# eq. (5): the loss


def topk_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Differentiable ``log π_θ(v | ·)`` at the stored ids, ``[B, T, K]`` (full-vocabulary log_softmax).

    Returns ``promote_types(logits.dtype, float32)``. With a gradient, one :class:`_ChunkedTopkLogprobs` node:
    the forward keeps the ``[N, K]`` result and ``[N]`` logsumexp only; the backward writes each chunk's rows of
    the single ``[N, V]`` logits gradient in place (linear in N). This is what a verl actor produces as the 3-D
    ``log_prob`` for :mod:`claas_verl.mopd.verl_losses`.
    Host syncs: none in the forward (id range checked only with ``CLAAS_VERL_DEBUG_CHECKS=1``; ``gather`` still
    rejects an id outside V); ONE in the backward, its check that the logits were not overwritten.
    """
    _check_logits(logits, "logits")
    tau = _check_temperature(temperature)
    _check_chunk(chunk_size)
    _check_topk_pair(ids, logits, "ids", "logits", values=debug_checks_enabled())
    B, T, V = logits.shape
    K = ids.shape[-1]
    flat, flat_ids = logits.reshape(B * T, V), ids.long().reshape(B * T, K)
    if logits.requires_grad and torch.is_grad_enabled():
        out = _ChunkedTopkLogprobs.apply(flat, flat_ids, tau, chunk_size)
    else:
        out, _ = _gather_logp_rows(flat, flat_ids, tau, chunk_size)
    return out.view(B, T, K)


def topk_distill_loss_from_logprobs(
    logp_topk: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_tokens=None,
    global_seqs=None,
    dp_size: int = 1,
    horizon: int | None = None,
) -> torch.Tensor:
    """eq. (5) given ``log π_θ`` at the ids: per position ``−Σ_k A·logp``, then :func:`agg_loss` (docs/math.md §B.2.3).

    Args:
        logp_topk: ``[B, T, K]`` differentiable log-probs at the stored ids.
        advantages: ``[B, T, K]`` fixed advantages (detached here).
        mask: ``[B, T]`` response mask.
        loss_agg_mode, global_tokens, global_seqs, dp_size, horizon: passed to
            :func:`claas_verl.utils.masked.agg_loss`; MOPD paper uses ``token-mean`` (N_mb = valid positions).
    """
    if logp_topk.dim() != 3 or advantages.shape != logp_topk.shape:
        raise ValueError(
            f"log-probs and advantages must both be [B, T, K] of equal shape; got {tuple(logp_topk.shape)} and "
            f"{tuple(advantages.shape)}"
        )
    _check_mask(mask, logp_topk)
    dtype = compute_dtype(logp_topk, advantages)
    A = advantages.detach().to(dtype)
    valid = mask.bool().unsqueeze(-1)
    # NaN·0 would leak through a plain product: zero both factors outside the mask first.
    A = torch.where(valid, A, torch.zeros_like(A))
    logp = torch.where(valid, logp_topk.to(dtype), torch.zeros_like(logp_topk, dtype=dtype))
    loss_mat = -(A * logp).sum(dim=-1)  # [B, T]:  −Σ_{v∈V_t} A[t,v]·log π_θ(v | x, y_<t)
    return agg_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        dp_size=dp_size,
        horizon=horizon,
    )


def topk_distill_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    loss_agg_mode: str = "token-mean",
    global_tokens=None,
    dp_size: int = 1,
) -> torch.Tensor:
    """``ℓ_tok = −(1/N) Σ_{t: m=1} Σ_{v∈V_t} A[t,v]·log π_θ(v | x, y_<t)`` (docs/math.md §B.2.3, MOPD paper eq. 5).

    Args:
        logits: ``[B, T, V]`` current (differentiable) student logits at the response positions.
        ids: ``[B, T, K]`` candidate ids stored at θ_old (:func:`student_topk`).
        advantages: ``[B, T, K]`` from :func:`domain_normalized_advantages` (held fixed).
        mask: ``[B, T]`` response mask.
        temperature: τ of the rollout.
        chunk_size: positions per chunk of the log-prob forward and backward (``None``: one chunk).
        global_tokens, dp_size: token-mean normaliser over the whole global batch and the data-parallel size
            (see :func:`claas_verl.utils.masked.agg_loss`); default: this micro-batch's Σm, 1.

    Returns:
        0-d loss in ``promote_types(logits.dtype, advantages.dtype, float32)``. Its gradient at θ_old is
        ``(1/N) Σ_t ∇D_t / (σ_d P_t)`` (B.2.4).
    """
    logp = topk_logprobs(logits, ids, temperature=temperature, chunk_size=chunk_size)
    return topk_distill_loss_from_logprobs(
        logp, advantages, mask, loss_agg_mode=loss_agg_mode, global_tokens=global_tokens, dp_size=dp_size
    )
