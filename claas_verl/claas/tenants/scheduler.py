"""Which tenant the trainer updates next: oldest-ready first, with a proven bound on a ready tenant's wait.

One trainer job serves every tenant, one update at a time; an update belongs to one tenant (its mini-batch, adapter
and optimizer state). Before each update the trainer asks :meth:`TenantScheduler.pick` with the tenants whose
replay partition is ready (``|B_t| >= B_min,t``: the actor's ``ready_tenants``).

The rule. Let ``n`` count the updates granted so far. A tenant's *ready mark* is the ``n`` at which a pick first saw
it ready since its last update. ``pick`` grants the update to the ready tenant with the smallest key

    (ready mark, -staleness, configuration order),    staleness = n - (n at its last update; -1 if never),

so tenants are served in the order they became ready (first come, first served over readiness), and among tenants
that became ready at the same ``n`` the one whose adapter is most out of date goes first. A picked tenant loses its
mark; it gets a new one, ``>= n + 1``, at the first pick that sees it ready again.

The bound. If tenant ``T`` is in ``ready`` at every pick from the pick where it got mark ``c`` on, it is picked
within ``N`` picks of that one (``N`` tenants): at most ``N - 1`` other tenants are picked before it.
Proof: a pick before ``T``'s goes to a tenant ``U`` whose key is below ``T``'s, so ``U``'s mark is ``<= c``. Once
``U`` is picked its next mark is ``>= n + 1 > c``, above ``T``'s, so ``U`` cannot pass ``T`` twice; only the
``N - 1`` other tenants can pass ``T``, each at most once. Its wait counted in updates is thus ``<= N - 1``, whatever
the others' arrival pattern (``tests/claas/tenants/test_scheduler.py`` checks it against adversarial sequences).
The premise holds for the replay partitions: a partition's readiness drops only at its own tenant's ``on_update``
(FIFO never shrinks it below ``B_max >= B_min``, and age eviction runs on its own clock), so a ready tenant stays
ready until it is updated. A caller that reports a marked tenant as not ready clears its mark (the bound restarts).

Continuously ready tenants are served round robin, one update each per ``N`` updates: the fairness rule is equal
updates, not equal tokens. :meth:`state_dict` holds the whole state (marks, counts, last updates, worst waits), so a
resumed trainer picks exactly what the interrupted one would have.

Pure Python: no Ray, no verl, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from claas_verl.claas.tenants.config import check_tenant_names

_FORMAT = 1


class TenantScheduler:
    """The rule of the module docstring over ``tenants`` (their order breaks the last ties)."""

    def __init__(self, tenants: Sequence[str]):
        self.tenants = check_tenant_names(tenants, "TenantScheduler tenants")
        self._order = {t: i for i, t in enumerate(self.tenants)}
        self.updates = 0  # n: updates granted
        self._mark: dict[str, int] = {}  # tenant -> n when first seen ready since its last update
        self._last: dict[str, int] = {}  # tenant -> n of its last update
        self.granted = dict.fromkeys(self.tenants, 0)  # updates per tenant
        self.worst_wait = dict.fromkeys(self.tenants, 0)  # most updates of others between mark and own update

    @property
    def bound(self) -> int:
        """Most updates of other tenants a continuously ready tenant waits for: ``N - 1``."""
        return len(self.tenants) - 1

    def staleness(self, tenant: str) -> int:
        """Updates granted since ``tenant``'s last one (``n + 1`` if it never had one)."""
        return self.updates - self._last.get(tenant, -1)

    def _observe(self, ready: Iterable[str]) -> set[str]:
        now = set(ready)
        unknown = now - set(self.tenants)
        if unknown:
            raise ValueError(f"ready names tenants {sorted(unknown)} that the scheduler does not know; "
                             f"tenants: {list(self.tenants)}")
        for t in list(self._mark):
            if t not in now:  # no longer ready: the mark (and the bound) restarts when it is ready again
                del self._mark[t]
        for t in now:
            self._mark.setdefault(t, self.updates)
        return now

    def waiting(self, tenant: str) -> int | None:
        """Updates of others since ``tenant`` was marked ready (None: not marked)."""
        mark = self._mark.get(tenant)
        return None if mark is None else self.updates - mark

    def pick(self, ready: Iterable[str]) -> str | None:
        """Grant the next update among the ``ready`` tenants (None when none is ready: nothing is granted)."""
        now = self._observe(ready)
        if not now:
            return None
        chosen = min(now, key=lambda t: (self._mark[t], -self.staleness(t), self._order[t]))
        self.worst_wait[chosen] = max(self.worst_wait[chosen], self.updates - self._mark.pop(chosen))
        self._last[chosen] = self.updates
        self.granted[chosen] += 1
        self.updates += 1
        return chosen

    def stats(self) -> dict:
        """Per tenant: ``granted`` updates, ``staleness``, ``waiting`` (None if not ready) and ``worst_wait``; and
        the ``bound`` every ``worst_wait`` stays within."""
        return {"updates": self.updates, "bound": self.bound,
                "tenants": {t: {"granted": self.granted[t], "staleness": self.staleness(t),
                                "waiting": self.waiting(t), "worst_wait": self.worst_wait[t]}
                            for t in self.tenants}}

    def state_dict(self) -> dict:
        return {"format": _FORMAT, "tenants": list(self.tenants), "updates": self.updates,
                "mark": dict(self._mark), "last": dict(self._last), "granted": dict(self.granted),
                "worst_wait": dict(self.worst_wait)}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; the tenants must be the same, in the same order (their order breaks
        ties). On error nothing changes."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"scheduler state must come from TenantScheduler.state_dict (format {_FORMAT})")
        if list(state["tenants"]) != list(self.tenants):
            raise ValueError(f"the scheduler state was saved for tenants {state['tenants']}, this job has "
                             f"{list(self.tenants)}: adding or removing a tenant needs a fresh scheduler state")
        updates = int(state["updates"])
        for name in ("mark", "last"):
            bad = {t: v for t, v in state[name].items() if t not in self._order or not 0 <= int(v) <= updates}
            if bad:
                raise ValueError(f"scheduler state {name!r} holds {bad}: outside the tenants or after update {updates}")
        self.updates = updates
        self._mark = {t: int(v) for t, v in state["mark"].items()}
        self._last = {t: int(v) for t, v in state["last"].items()}
        self.granted = {t: int(state["granted"][t]) for t in self.tenants}
        self.worst_wait = {t: int(state["worst_wait"][t]) for t in self.tenants}
