"""Tenants of the chat service: a tenant is a named set of API keys with its own replay sizes and quotas.

A tenant owns one adapter lineage (versions 0, 1, 2, ...), one partition of the replay actor
(:mod:`claas_verl.claas.replay.partitions`) with its own ``B_min``, ``B_max``, ``A_max`` and age clock, and the
quotas below. The YAML section is a mapping from tenant name to :class:`TenantConfig` keys::

    claas:
      service:
        tenants:
          alice: {api_keys: [sk-alice-1, sk-alice-2], b_min: 4, b_max: 64, a_max: 2}
          bob:   {api_keys: [sk-bob], max_pending: 128, rate_limit_per_s: 2.0}

A key belongs to exactly one tenant; a key named twice (in two tenants, or twice in one) is refused at load. No
section (null or ``{}``) is the single-tenant service: one implicit tenant, :data:`DEFAULT_TENANT`, holds every key.
:class:`TenantDirectory` answers "which tenant is this key" in one dictionary look-up.

No Ray, verl or torch import: the service and the trainer both read it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from claas_verl.utils.schema import MISSING, knob

#: the implicit tenant of a service without a ``tenants`` section (and of a replay actor built without partitions)
DEFAULT_TENANT = "default"
#: tenant names: they appear in metric labels, log lines, file names of checkpoints and the ``claas`` reply object
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class TenantConfig:
    """One tenant; each field's help text is in its ``metadata`` (docs/config.md lists them under
    ``claas.service.tenants.<t>``)."""

    api_keys: tuple[str, ...] = knob(help="the tenant's 'Authorization: Bearer' keys (at least one; a key belongs to "
                                     "one tenant only)")
    b_min: int = knob(8, "B_min of the tenant's replay partition: entries it needs before its next update")
    b_max: int = knob(256, "B_max of the tenant's replay partition: FIFO capacity, counted in the tenant's entries")
    a_max: int = knob(4, "A_max of the tenant's partition: an entry lives a_max + 1 of the TENANT's updates")
    max_pending: int = knob(1024, "turns of this tenant awaiting feedback (its oldest goes beyond); other tenants' "
                            "turns never count")
    rate_limit_per_s: float | None = knob(None, "token bucket over the tenant's chat and feedback requests, all its "
                                          "keys together, requests/s (429 beyond); null: no tenant limit")
    rate_limit_burst: int = knob(20, "burst size of the tenant's token bucket")
    max_buffer_share: float = knob(1.0, "fraction of the tenant's partition (of its b_max) one of its keys may hold "
                                   "when its entry would push another key's out; 1.0: no limit")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tenant(name: str, cfg: TenantConfig, where: str) -> TenantConfig:
    """``cfg`` with its keys as a tuple, or ``ValueError`` naming ``<where><name>.<field>`` and the fix."""
    def field(f: str) -> str:
        return f"{where}{name}.{f}"

    keys = cfg.api_keys
    if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
        raise ValueError(f"{field('api_keys')} must be a list of keys, got {keys!r}")
    keys = tuple(keys)
    if not keys:
        raise ValueError(f"{field('api_keys')} is empty: give the tenant at least one API key")
    if any(not isinstance(k, str) or not k or k != k.strip() for k in keys):
        raise ValueError(f"{field('api_keys')} must be non-empty strings without surrounding spaces")
    for f in ("b_min", "b_max", "max_pending", "rate_limit_burst"):
        value = getattr(cfg, f)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{field(f)} must be an int >= 1, got {value!r}")
    if cfg.b_max < cfg.b_min:
        raise ValueError(f"{field('b_max')}={cfg.b_max} is below {field('b_min')}={cfg.b_min}: the partition could "
                         "never hold the B_min entries an update waits for")
    if not _is_int(cfg.a_max) or cfg.a_max < 0:
        raise ValueError(f"{field('a_max')} must be an int >= 0, got {cfg.a_max!r}")
    rate = cfg.rate_limit_per_s
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
        raise ValueError(f"{field('rate_limit_per_s')} must be null or a number > 0, got {rate!r}")
    share = cfg.max_buffer_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"{field('max_buffer_share')} must be a number in (0, 1], got {share!r}")
    return dataclasses.replace(cfg, api_keys=keys)


_FIELDS = tuple(f.name for f in dataclasses.fields(TenantConfig))


def tenant_from_mapping(name: str, node: Mapping[str, Any], where: str = "claas.service.tenants.") -> TenantConfig:
    """Build one tenant from its YAML mapping; unknown keys and a missing ``api_keys`` are refused by name."""
    if not isinstance(node, Mapping):
        raise ValueError(f"{where}{name} must be a mapping of {list(_FIELDS)}, got {type(node).__name__}")
    unknown = sorted(set(node) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}{name}: unknown key(s) {unknown}; a tenant takes {list(_FIELDS)}")
    required = [f.name for f in dataclasses.fields(TenantConfig)
                if f.default is MISSING and f.default_factory is MISSING and f.name not in node]
    if required:
        raise ValueError(f"{where}{name}: missing {required}")
    return _check_tenant(name, TenantConfig(**dict(node)), where)


class TenantDirectory:
    """Tenants by name and by API key (immutable after construction).

    ``tenants``: name -> :class:`TenantConfig` (or its YAML mapping). Empty: the single-tenant service, where
    :meth:`tenant_of` answers :data:`DEFAULT_TENANT` for every key the service accepted (``implicit``).
    """

    def __init__(self, tenants: Mapping[str, TenantConfig | Mapping[str, Any]] | None = None,
                 where: str = "claas.service.tenants."):
        if tenants is not None and not isinstance(tenants, Mapping):
            raise ValueError(f"{where.rstrip('.')} must be a mapping from tenant name to its keys, "
                             f"got {type(tenants).__name__}")
        self._tenants: dict[str, TenantConfig] = {}
        self._by_key: dict[str, str] = {}
        for name, node in (tenants or {}).items():
            if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"{where}{name!r}: a tenant name is 1-64 characters of letters, digits, '_', '.', "
                                 "'-', starting with a letter or digit")
            cfg = (_check_tenant(name, node, where) if isinstance(node, TenantConfig)
                   else tenant_from_mapping(name, node, where))
            for key in cfg.api_keys:
                owner = self._by_key.get(key)
                if owner is not None:
                    same = "twice in" if owner == name else f"in both {owner!r} and"
                    raise ValueError(f"{where}{name}.api_keys: a key is listed {same} {name!r}; a key belongs to "
                                     "exactly one tenant (the key itself is not shown)")
                self._by_key[key] = name
            self._tenants[name] = cfg

    @property
    def implicit(self) -> bool:
        """True for the single-tenant service (no tenants configured)."""
        return not self._tenants

    @property
    def names(self) -> tuple[str, ...]:
        """The tenant names in configuration order (``(DEFAULT_TENANT,)`` when implicit)."""
        return tuple(self._tenants) or (DEFAULT_TENANT,)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> TenantConfig:
        try:
            return self._tenants[name]
        except KeyError:
            raise KeyError(f"no tenant {name!r}; configured: {list(self._tenants)}") from None

    def api_keys(self) -> tuple[str, ...]:
        """Every tenant key (what the service accepts besides its own ``api_keys`` and the admin key)."""
        return tuple(self._by_key)

    def tenant_of(self, key: str) -> str | None:
        """The tenant of API key ``key``; None for a key no tenant holds (a multi-tenant service refuses it: 401).
        Implicit directory: :data:`DEFAULT_TENANT` for any key (the service checked the key already)."""
        if self.implicit:
            return DEFAULT_TENANT
        return self._by_key.get(key)

    def replay_partitions(self, default: Mapping[str, int] | None = None) -> dict[str, dict[str, int]]:
        """``{tenant: {"b_min", "b_max", "a_max"}}`` for the replay actor's ``partitions`` argument; an implicit
        directory gives ``default`` (the job's ``claas.b_min``/``b_max``/``a_max``) under :data:`DEFAULT_TENANT`."""
        if self.implicit:
            if default is None:
                raise ValueError("a single-tenant directory needs the job's b_min/b_max/a_max as `default`")
            return {DEFAULT_TENANT: {k: int(default[k]) for k in ("b_min", "b_max", "a_max")}}
        return {n: {"b_min": c.b_min, "b_max": c.b_max, "a_max": c.a_max} for n, c in self._tenants.items()}


def check_tenant_names(names: Iterable[str], where: str) -> tuple[str, ...]:
    """The names as a tuple, or ``ValueError`` naming ``where`` for an empty list, a bad or a repeated name."""
    out = tuple(names)
    if not out:
        raise ValueError(f"{where}: no tenants")
    for n in out:
        if not isinstance(n, str) or not NAME_PATTERN.fullmatch(n):
            raise ValueError(f"{where}: {n!r} is not a tenant name (1-64 letters, digits, '_', '.', '-')")
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: a tenant is named twice in {list(out)}")
    return out
