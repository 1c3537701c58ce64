"""Shared by the tests that hold a recipe's YAML equal to the config schema that owns its defaults."""

from __future__ import annotations


def schema_yaml_diff(schema: dict, yaml: dict, prefix: str) -> list[str]:
    """Every key present in one mapping and not the other, and every value that differs (by value or type), nested,
    by dotted key; ``[]`` when the two agree."""
    out = []
    for key in sorted(set(schema) | set(yaml)):
        where = f"{prefix}.{key}"
        if key not in yaml:
            out.append(f"{where}: in the schema, not in the YAML")
        elif key not in schema:
            out.append(f"{where}: in the YAML, not in the schema")
        elif isinstance(schema[key], dict) and isinstance(yaml[key], dict) and schema[key] and yaml[key]:
            out.extend(schema_yaml_diff(schema[key], yaml[key], where))
        elif schema[key] != yaml[key] or type(schema[key]) is not type(yaml[key]):
            out.append(f"{where}: schema {schema[key]!r}, YAML {yaml[key]!r}")
    return out
