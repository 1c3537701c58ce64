"""Small command-line helpers shared by the ``python -m claas_verl.*`` commands."""

from __future__ import annotations


def name_values(items: list[str], flag: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; a malformed item exits with a message naming ``flag``."""
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k or not v:
            raise SystemExit(f"{flag} {it!r}: expected NAME=VALUE")
        out[k] = v
    return out
