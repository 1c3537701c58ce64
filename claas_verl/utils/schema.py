"""Config dataclasses that carry their own help text, and the walk that lists them (docs/config.md).

A schema field is ``knob(default, "help")`` (``field(default=..., metadata={"help": ...})``, as TRL's config
dataclasses write it); a field whose type is itself a dataclass is a nested section (``claas.producer``). The docs
page and the tests that hold a recipe's YAML equal to the schema both read the schema through :func:`schema_rows`
and :func:`schema_defaults`, so the default and its meaning live in one place.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator
from typing import Any

MISSING = dataclasses.MISSING


def knob(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
         key: str | None = None) -> Any:
    """A dataclass field with its help text; ``factory`` for a mutable default, no default for a required key;
    ``key``: the YAML key when it is not the field's name (``segments.size`` for ``segment_size``)."""
    if not help:
        raise ValueError("every config field needs its help text")
    metadata = {"help": help} if key is None else {"help": help, "key": key}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML key of a schema field (dotted when the field sits in a sub-mapping of the YAML)."""
    return f.metadata.get("key", f.name)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _section(cls: type, f: dataclasses.Field) -> type | None:
    """The dataclass type of a nested section field, else None."""
    hint = typing.get_type_hints(cls).get(f.name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _plain(value: Any) -> Any:
    """Tuples as lists (YAML has no tuples), dataclasses as nested dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


Skip = Callable[[type, str], bool] | None  # skip(owner class, field name): leave the key out


def schema_fields(cls: type, skip: Skip = None) -> Iterator[tuple[type, dataclasses.Field]]:
    """``(owner class, field)`` of ``cls``'s keys, in declaration order, less those ``skip(owner, name)`` drops."""
    for f in dataclasses.fields(cls):
        if not (skip and skip(cls, f.name)):
            yield cls, f


def schema_defaults(cls: type, skip: Skip = None) -> dict:
    """The defaults of ``cls`` as the nested mapping its YAML block holds (sections recursed, tuples as lists; a
    required key maps to :data:`MISSING`)."""
    out = {}
    for owner, f in schema_fields(cls, skip):
        sub = _section(owner, f)
        value = schema_defaults(sub, skip) if sub is not None else _plain(_default(f))
        *parents, leaf = yaml_key(f).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def type_name(hint: Any) -> str:
    """A short readable type (``int | None``, ``list[str]``)."""
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    text = str(hint).replace("typing.", "")
    for long, short in (("NoneType", "None"), ("collections.abc.", "")):
        text = text.replace(long, short)
    return text


def schema_rows(cls: type, prefix: str, skip: Skip = None) -> Iterator[tuple[str, str, Any, str]]:
    """``(dotted key, type, default, help)`` of every key of ``cls`` under ``prefix``; a field without help raises."""
    hints = typing.get_type_hints(cls)
    for owner, f in schema_fields(cls, skip):
        key = f"{prefix}.{yaml_key(f)}"
        sub = _section(owner, f)
        if sub is not None:
            yield from schema_rows(sub, key, skip)
            continue
        help_text = f.metadata.get("help")
        if not help_text:
            raise ValueError(f"{owner.__name__}.{f.name} ({key}) has no help text: declare it with knob(default, help)")
        yield key, type_name(hints[f.name]), _plain(_default(f)), help_text
