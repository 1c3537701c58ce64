"""Worker side of the per-step log of a MOPD run (``mopd.probe``, ``mopd.train.replay_optimizer``): the fixed probe's
KL to M_{k−1}, the update's size, and which AdamW state a step uses.

:class:`MOPDStepLogWorker` is :class:`claas_verl.mopd.trainer.workers.MOPDWorker` with these registered methods
(the trainer swaps it in for verl's actor worker); the driver side is :mod:`claas_verl.mopd.trainer.step_probe`.

* The probe (``mopd_probe_begin`` / ``mopd_probe_kl``): at a stage start, ``replies`` continuations of each probe
  prompt are sampled from the reference teacher (M_{k−1}, ``student:<k−1>``) at τ = 1 with a generator seeded by
  ``seed`` (one no-cache forward per token, every rank the same), and kept for the stage. After a step, per
  sequence, the student's and the reference's full-vocabulary log-probs at the reply positions give
  ``Σ_t KL(p_s(·|y_<t) ‖ p_ref(·|y_<t))`` over the reply tokens (the stop token included, nothing after it);
  the driver divides by the tokens (token mean per domain).
* The update size (``mopd_params_snapshot`` / ``mopd_update_norm``): ‖θ_after − θ_before‖₂ over this rank's
  parameter shards, summed over the ranks.
* ``mopd_optimizer_state``: :func:`claas_verl.mopd.trainer.verl_couplings.use_optimizer_state`.
"""

from __future__ import annotations

import math

import torch
from verl.single_controller.base.decorator import Dispatch, register

from claas_verl.mopd.trainer import verl_couplings as vc
from claas_verl.mopd.trainer.workers import MOPDWorker
from claas_verl.verl_ext.engine_device import compute_device, engine_autocast


def full_kl_sum(student_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """``Σ_t Σ_v p_s(v) (log p_s(v) − log p_ref(v))`` over the rows of two ``[T, V]`` logit tensors (τ = 1, fp32);
    0 exactly when the logits are equal, > 0 otherwise."""
    ls = torch.log_softmax(student_logits.float(), dim=-1)
    lr = torch.log_softmax(ref_logits.float(), dim=-1)
    return (ls.exp() * (ls - lr)).sum()


def sample_continuations(logits_of, prompt_ids: list[int], replies: int, max_tokens: int, eos_ids: list[int],
                         generator: torch.Generator) -> list[list[int]]:
    """``replies`` continuations of ``prompt_ids`` sampled at τ = 1 from ``logits_of(ids [B, L]) -> [B, L, V]``, one
    full forward per token (no cache: forward-only FSDP engines run one ``module(...)`` call at a time); each reply
    ends at its first stop token (kept) or after ``max_tokens``."""
    x = torch.tensor([prompt_ids] * replies)
    out: list[list[int]] = [[] for _ in range(replies)]
    done = [False] * replies
    for _ in range(max_tokens):
        probs = torch.softmax(logits_of(x)[:, -1].float().cpu(), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in eos_ids
        if all(done):
            break
        x = torch.cat([x, nxt[:, None]], dim=1)
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (FSDP2 parameters are DTensors)."""
    p = p.detach()
    return p.to_local() if hasattr(p, "to_local") else p


class MOPDStepLogWorker(MOPDWorker):
    """The MOPD worker plus the registered methods of the per-step log (see the module doc); they read its ``actor``
    (the student engine) and ``teachers`` (plan name -> forward-only ``TrainingWorker``)."""

    @staticmethod
    def _logits_fn(engine):
        device = compute_device()

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            with engine.eval_mode(), torch.no_grad(), engine_autocast(engine, device):
                return engine.module(input_ids=ids.to(device), use_cache=False).logits.float().cpu()

        return logits_of

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_probe_begin(self, reference: str, prompts: dict[str, list[list[int]]], replies: int, seed: int,
                         max_tokens: int, eos_ids: list[int]) -> dict[str, int]:
        """Sample and keep the stage's probe from teacher ``reference``; returns the reply tokens per domain."""
        if reference not in self.teachers:
            raise ValueError(f"the probe's reference {reference!r} is not loaded (held: {sorted(self.teachers)})")
        logits_of = self._logits_fn(self.teachers[reference].engine)
        module = self.teachers[reference].engine.module
        from claas_verl.utils.generation import eos_token_ids

        stops = sorted(set(eos_ids) | set(eos_token_ids(module)))
        generator = torch.Generator().manual_seed(seed)
        probe: dict[str, list[tuple[list[int], list[int]]]] = {}
        for domain, rows in prompts.items():
            probe[domain] = [(p, r) for p in rows
                             for r in sample_continuations(logits_of, p, replies, max_tokens, stops, generator) if r]
        self.mopd_probe = {"reference": reference, "sequences": probe}
        return {d: sum(len(r) for _, r in seqs) for d, seqs in probe.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_probe_kl(self) -> dict[str, tuple[float, int]]:
        """{domain: (Σ over the probe's reply tokens of KL(student ‖ reference), reply tokens)}."""
        held = getattr(self, "mopd_probe", None)
        if held is None:
            raise ValueError("mopd_probe_kl before mopd_probe_begin: the stage's probe was never sampled")
        student = self._logits_fn(self.actor.engine)
        reference = self._logits_fn(self.teachers[held["reference"]].engine)
        out = {}
        for domain, seqs in held["sequences"].items():
            total, tokens = 0.0, 0
            for prompt_ids, reply in seqs:
                ids = torch.tensor([prompt_ids + reply])
                P, n = len(prompt_ids), len(reply)
                # the logits at position P-1+j predict reply token j
                total += float(full_kl_sum(student(ids)[0, P - 1: P - 1 + n], reference(ids)[0, P - 1: P - 1 + n]))
                tokens += n
            out[domain] = (total, tokens)
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_params_snapshot(self) -> int:
        """Keep this rank's parameter shards (host copies) as θ_before of the next update."""
        params = [p for p in self.actor.engine.module.parameters() if p.requires_grad]
        self.mopd_params_before = [_local(p).float().cpu().clone() for p in params]
        return len(params)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_update_norm(self) -> float:
        """‖θ_after − θ_before‖₂ over every rank's shards (all-reduced where torch.distributed runs)."""
        before = getattr(self, "mopd_params_before", None)
        if before is None:
            raise ValueError("mopd_update_norm before mopd_params_snapshot")
        params = [p for p in self.actor.engine.module.parameters() if p.requires_grad]
        sq = math.fsum(float(((_local(p).float().cpu() - b) ** 2).sum()) for p, b in zip(params, before, strict=True))
        self.mopd_params_before = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            t = torch.tensor([sq], dtype=torch.float64, device=compute_device())
            torch.distributed.all_reduce(t)
            sq = float(t.item())
        return math.sqrt(sq)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mopd_optimizer_state(self, which: str) -> int:
        return vc.use_optimizer_state(self.actor.engine, which)
