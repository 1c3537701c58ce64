"""Checks at the chat service's door: who is calling (key ids), how often (per-key rate), what the body may hold
(depth, text, integer range), where a keyless request comes from (Host/Origin), which template arguments pass, what
a reward and a scenario id may be.

Everything here answers with a ``ValueError`` naming the field (HTTP 400) or a value the HTTP layer turns into its
status; nothing here touches the event loop or the backend.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
import zlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

INT63 = 1 << 63  # every integer a request carries must fit an int64 (entries pack scenario/step/version as int64)
MAX_DEPTH = 32  # nesting of the JSON body; chat requests need 5 levels (messages -> content parts -> text)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")

#: chat_template_kwargs a request may set by default: the switches model families document for their templates.
#: Anything else (a ``chat_template`` of the request's own, ``tools``, ``tokenize``, ...) is refused.
DEFAULT_TEMPLATE_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")


def key_id(key: str) -> str:
    """The id under which a key is counted, logged and rate-limited: ``key-`` + 12 hex digits of its SHA-256. The key
    itself never leaves the process."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class RateLimiter:
    """A token bucket per key id: ``rate_per_s`` requests per second on average, bursts of ``burst``.

    ``acquire(key)`` takes one token and returns 0.0, or returns the seconds until one is available (the request is
    then refused: HTTP 429 with ``Retry-After``).
    """

    def __init__(self, rate_per_s: float, burst: int, clock=time.monotonic):
        if not rate_per_s > 0 or burst < 1:
            raise ValueError(f"rate limit needs rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate, self.burst, self._clock = float(rate_per_s), float(burst), clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def acquire(self, key: str) -> float:
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


def check_json_tree(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse (``ValueError`` naming the field) what a JSON body may carry but the service cannot use: nesting deeper
    than ``max_depth``, integers outside int64, strings with lone surrogates (not encodable as UTF-8). Iterative:
    the check itself cannot overflow the stack."""
    stack: list[tuple[Any, str, int]] = [(body, "body", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"{path} nests deeper than {max_depth} levels; send a flatter JSON body")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, f"{path} key {k[:40]!r}")
                stack.append((v, f"{path}.{k}" if path != "body" else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and not -INT63 <= value < INT63:
            raise ValueError(f"'{path}' = {str(value)[:20]}... is outside the 64-bit integer range; send a number "
                             "in [-2**63, 2**63)")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"'{path}' is not a finite number (JSON numbers beyond float range are refused)")


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"'{path}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send valid "
                         "Unicode text") from None


def bounded_int(value: Any, name: str, low: int = 0) -> int:
    """``value`` as an int in ``[low, 2**63)`` (decimal strings accepted, for headers); ``ValueError`` naming
    ``name`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text.isdigit() or len(text) > 19:
            raise ValueError(f"{name} must be an int in [{low}, 2**63), got {value[:40]!r}")
        value = int(text)
    if not isinstance(value, int) or not low <= value < INT63:
        raise ValueError(f"{name} must be an int in [{low}, 2**63), got {str(value)[:40]}")
    return value


def template_kwargs(value: Any, allowed: tuple[str, ...]) -> dict | None:
    """Validate ``chat_template_kwargs``: an object whose keys are in ``allowed`` and whose values are booleans,
    numbers or short strings (a template never gets code, a template or a tool list from a request)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    for k, v in value.items():
        if k not in allowed:
            raise ValueError(f"'chat_template_kwargs.{k}' is not accepted by this service; allowed keys: "
                             f"{sorted(allowed) or 'none'} (a request never sets the chat template itself)")
        if isinstance(v, str) and len(v) > 64 or not isinstance(v, (bool, int, float, str)) or v is None:
            raise ValueError(f"'chat_template_kwargs.{k}' must be a boolean, a number or a string of at most 64 "
                             f"characters, got {type(v).__name__}")
    return dict(value)


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def keyless_origin_error(headers: Mapping[str, str]) -> str | None:
    """Why a request to a keyless (loopback-only) service must be refused, or None. Its ``Host`` must name a loopback
    host (a page that rebinds its own DNS name to 127.0.0.1 sends its name) and an ``Origin``, if sent, must be a
    loopback origin (a cross-site page sends its own)."""
    h = {k.lower(): v for k, v in headers.items()}
    host = _hostname(h.get("host", ""))
    if host not in LOOPBACK_HOSTS:
        return (f"Host {h.get('host', '')[:80]!r} is not a loopback name; this keyless service answers only "
                "requests to 127.0.0.1/localhost (configure API keys to serve other hosts)")
    origin = h.get("origin")
    if origin is not None and origin != "null" and (urlsplit(origin).hostname or "") not in LOOPBACK_HOSTS + ("::1",):
        return f"cross-site request from Origin {origin[:80]!r} refused by this keyless service"
    if origin == "null":
        return "cross-site request from an opaque Origin refused by this keyless service"
    return None


def validate_reward(value: Any, mode: str) -> float | None:
    """The ``reward`` field of ``POST /v1/feedback`` (docs/math.md §A.1.4): ``None`` (grader error: dropped), else a
    number in {0, 1} (``mode="binary"``) or [0, 1] (``mode="unit"``); ``ValueError`` naming the field otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'reward' must be a finite number (or null for a grader error), got {value!r}")
    if isinstance(value, int) and not 0 <= value <= 1:  # compared as an int: a 400-digit integer has no float
        raise ValueError(f"'reward' must be in [0, 1] (docs/math.md §A.1.4), got {str(value)[:20]}")
    if not math.isfinite(value):
        raise ValueError(f"'reward' must be a finite number (or null for a grader error), got {value!r}")
    if mode == "binary" and value not in (0, 1):
        raise ValueError(f"'reward' must be 0 or 1 (this run uses binary rewards, docs/math.md §A.1.4), got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"'reward' must be in [0, 1] (docs/math.md §A.1.4), got {value!r}")
    return float(value)


def scenario_key_to_id(key: Any) -> tuple[int, str | None]:
    """``(scenario_id, original_key)``: an int >= 0 (or its decimal string) is used as is; any other string maps to
    a stable 31-bit id (crc32) and is returned so the entry keeps it in ``metadata["scenario"]``."""
    if isinstance(key, bool):
        raise ValueError(f"scenario_id must be an int >= 0 or a string, got {key!r}")
    if isinstance(key, int):
        return bounded_int(key, "scenario_id"), None
    if isinstance(key, str) and key:
        if key.isdigit():
            return bounded_int(key, "scenario_id"), None
        return zlib.crc32(key.encode()) & 0x7FFFFFFF, key
    raise ValueError(f"scenario_id must be an int >= 0 or a non-empty string, got {key!r}")

