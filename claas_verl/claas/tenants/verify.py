"""Verified serving: a tenant's new adapter version is served only once the serving engine scores a fixed probe as
the trainer's forward of that version does.

The flow of one reload of tenant ``t`` to version ``v`` (digest ``d``):

1. the trainer scores the probe with its forward of ``t``'s new adapter: ``trained_j = log p_v(s_j | s_<j)``,
   teacher-forced on the probe tokens ``s`` (:func:`probe_token_logprobs`);
2. the serving engine loads ``v`` NEXT TO the served version and scores the same tokens with it (``served_j``);
3. :meth:`VerifiedServing.offer` compares them (:mod:`claas_verl.metrics.served_check`: max and mean absolute
   difference against :class:`ProbeTolerance`). Match: ``v`` is served from now on, and the tenant's stats name
   ``(v, d)``. Mismatch: the engine drops ``v`` and the tenant keeps its previous version; the tenant's alarm counter
   goes up and a log line names the tenant, the version and both differences. At the ``max_failures``-th mismatch
   (over all tenants) :class:`~claas_verl.metrics.served_check.ServedWeightsMismatch` stops the run.

Teacher forcing (not greedy decoding) makes the probe's tokens the same on both sides, so the comparison needs
nothing from the sampler. The HF backend implements step 2 in ``HFBackend.load_adapter(..., probe=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from claas_verl.claas.tenants.config import check_tenant_names
from claas_verl.metrics.served_check import ProbeTolerance, ProbeVerdict, ServedCheckAlarm

#: the fixed probe text (its first ``tokens + 1`` token ids under the policy's tokenizer)
PROBE_TEXT = "A reply that follows the rules it was taught: first a capital, then a list, then the answer."
#: default tolerance: 0.5 nat on any probe token, 0.1 nat on average; bf16 serving of fp32 weights moved log-probs by
#: 0.06-0.13 nat per token in the measurements of docs/limits.md, fp32 on CPU by about 1e-6
DEFAULT_TOLERANCE = ProbeTolerance(max_abs=0.5, mean_abs=0.1)


def probe_ids(tokenizer, tokens: int) -> list[int]:
    """The fixed probe: the first ``tokens + 1`` token ids of :data:`PROBE_TEXT` (``tokens`` scored positions)."""
    ids = [int(t) for t in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]][: tokens + 1]
    if tokens < 1 or len(ids) < 2:
        raise ValueError(f"the serving probe needs at least 1 scored token (2 ids), got tokens={tokens}, "
                         f"{len(ids)} ids")
    return ids


def probe_token_logprobs(model, ids: list[int]) -> list[float]:
    """``log p(ids[j] | ids[:j])`` for ``j = 1 .. len(ids) - 1`` under ``model`` (an HF causal LM, no grad, fp32
    log-softmax of the full vocabulary)."""
    import torch

    with torch.no_grad():
        param = next(model.parameters())
        logits = model(input_ids=torch.tensor([ids], dtype=torch.long, device=param.device)).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(ids[1:], dtype=torch.long, device=logp.device)
        return [float(x) for x in logp.gather(-1, target[:, None])[:, 0].cpu()]


@dataclass(frozen=True)
class ReloadProbe:
    """What a backend needs to verify a reload: the probe ``ids`` and ``accept(served_logprobs) -> bool`` (True:
    serve the new adapter; False or an exception: keep the previous one)."""

    ids: list[int]
    accept: Callable[[list[float]], bool]


class VerifiedServing:
    """Each tenant's served ``(version, digest)``, advanced only by an offer whose probe matches.

    Args:
        tenants: the tenant names.
        initial: ``(version, digest)`` every tenant is served at first (the initial adapter), or one per tenant.
        tolerance: the accepted difference; ``max_failures``: mismatches (all tenants together) before the run
            stops.
    """

    def __init__(self, tenants, initial: tuple[int, str] | Mapping[str, tuple[int, str]],
                 tolerance: ProbeTolerance = DEFAULT_TOLERANCE, max_failures: int = 3):
        self.tenants = check_tenant_names(tenants, "VerifiedServing tenants")
        start = initial if isinstance(initial, Mapping) else dict.fromkeys(self.tenants, initial)
        if set(start) != set(self.tenants):
            raise ValueError(f"initial versions are given for {sorted(start)}, the tenants are {list(self.tenants)}")
        self._served = {t: (int(start[t][0]), str(start[t][1])) for t in self.tenants}
        self.alarm = ServedCheckAlarm(tolerance, max_failures, "verified serving")
        self.last: dict[str, ProbeVerdict] = {}
        self._failures: dict[str, int] = {}  # tenant -> mismatches (its alarm counter)

    def served(self, tenant: str) -> tuple[int, str]:
        """``(version, digest)`` of the adapter ``tenant``'s requests get."""
        try:
            return self._served[tenant]
        except KeyError:
            raise KeyError(f"no tenant {tenant!r}; tenants: {list(self.tenants)}") from None

    def offer(self, tenant: str, version: int, digest: str, served: list[float], trained: list[float]) -> bool:
        """Accept ``tenant``'s ``version`` when the engine's probe log-probs match the trainer's; else keep the
        previous version, count and log the mismatch (raising at the limit, see the module doc)."""
        current = self.served(tenant)[0]
        if version <= current:
            raise ValueError(f"tenant {tenant!r} serves v{current}; a reload must offer a later version, "
                             f"got v{version}")
        try:
            verdict = self.alarm.check(f"tenant {tenant!r} v{version}", [served], [trained])
        except Exception:
            self._failures[tenant] = self._failures.get(tenant, 0) + 1  # the limit's mismatch counts too
            raise
        self.last[tenant] = verdict
        if not verdict.ok:
            self._failures[tenant] = self._failures.get(tenant, 0) + 1
        if verdict.ok:
            self._served[tenant] = (int(version), str(digest))
        return verdict.ok

    def failures(self, tenant: str) -> int:
        """Mismatches of ``tenant``'s reloads so far (its alarm counter)."""
        self.served(tenant)  # an unknown tenant raises
        return self._failures.get(tenant, 0)

    def stats(self) -> dict:
        """Per tenant: the served ``version`` and ``digest``, its ``probe_failures`` and the last check's
        ``probe_max_abs``/``probe_mean_abs``; and ``probe_failures_total``."""
        out = {}
        for t in self.tenants:
            v, d = self._served[t]
            last = self.last.get(t)
            out[t] = {"version": v, "digest": d, "probe_failures": self._failures.get(t, 0),
                      "probe_max_abs": None if last is None else last.max_abs,
                      "probe_mean_abs": None if last is None else last.mean_abs}
        return {"tenants": out, "probe_failures_total": self.alarm.total_failures}

    def state_dict(self) -> dict:
        return {"served": {t: list(v) for t, v in self._served.items()}, "failures": dict(self._failures),
                "alarm": dict(self.alarm.failures)}

    def load_state_dict(self, state: dict) -> None:
        if sorted(state["served"]) != sorted(self.tenants):
            raise ValueError(f"the state holds tenants {sorted(state['served'])}, this job has {list(self.tenants)}")
        self._served = {t: (int(v), str(d)) for t, (v, d) in state["served"].items()}
        self._failures = {str(t): int(n) for t, n in state["failures"].items()}
        self.alarm.failures = {str(k): int(n) for k, n in state["alarm"].items()}
