"""The tenant schema and the key -> tenant directory: every bad configuration is refused with the field named."""

from __future__ import annotations

import pytest

from claas_verl.claas.tenants.config import DEFAULT_TENANT, TenantConfig, TenantDirectory, check_tenant_names
from claas_verl.utils.schema import schema_rows


def test_keys_map_to_their_tenant_and_sizes_reach_the_replay_partitions():
    d = TenantDirectory({"alice": {"api_keys": ["a1", "a2"], "b_min": 2, "b_max": 5, "a_max": 1},
                         "bob": {"api_keys": ("b1",)}})
    assert d.names == ("alice", "bob") and not d.implicit and len(d) == 2
    assert d.tenant_of("a1") == d.tenant_of("a2") == "alice" and d.tenant_of("b1") == "bob"
    assert d.tenant_of("nobody") is None and d.tenant_of("") is None
    assert d["alice"].api_keys == ("a1", "a2") and d["bob"].api_keys == ("b1",)  # lists normalised to tuples
    assert d.replay_partitions() == {"alice": {"b_min": 2, "b_max": 5, "a_max": 1},
                                     "bob": {"b_min": 8, "b_max": 256, "a_max": 4}}
    assert set(d.api_keys()) == {"a1", "a2", "b1"}
    with pytest.raises(KeyError, match="no tenant 'carol'"):
        d["carol"]


def test_no_section_is_one_implicit_tenant():
    for empty in (None, {}):
        d = TenantDirectory(empty)
        assert d.implicit and d.names == (DEFAULT_TENANT,) and d.tenant_of("any-key") == DEFAULT_TENANT
    assert TenantDirectory().replay_partitions({"b_min": 3, "b_max": 9, "a_max": 2, "m": 1}) == \
        {DEFAULT_TENANT: {"b_min": 3, "b_max": 9, "a_max": 2}}
    with pytest.raises(ValueError, match="needs the job's b_min"):
        TenantDirectory().replay_partitions()


@pytest.mark.parametrize("tenants, message", [
    ({"a": {"api_keys": ["k"]}, "b": {"api_keys": ["x", "k"]}},
     r"claas.service.tenants.b.api_keys: a key is listed in both 'a' and 'b'"),
    ({"a": {"api_keys": ["k", "k"]}}, r"tenants.a.api_keys: a key is listed twice in 'a'"),
    ({"a": {"api_keys": ["k"], "bmax": 3}}, r"tenants.a: unknown key\(s\) \['bmax'\]"),
    ({"a": {"b_min": 3}}, r"tenants.a: missing \['api_keys'\]"),
    ({"a": {"api_keys": []}}, r"tenants.a.api_keys is empty"),
    ({"a": {"api_keys": "k"}}, r"tenants.a.api_keys must be a list"),
    ({"a": {"api_keys": [" k"]}}, r"surrounding spaces"),
    ({"a": {"api_keys": ["k"], "b_min": 9, "b_max": 4}}, r"tenants.a.b_max=4 is below claas.service.tenants.a.b_min=9"),
    ({"a": {"api_keys": ["k"], "b_min": 0}}, r"tenants.a.b_min must be an int >= 1"),
    ({"a": {"api_keys": ["k"], "b_max": True}}, r"tenants.a.b_max must be an int >= 1"),
    ({"a": {"api_keys": ["k"], "a_max": -1}}, r"tenants.a.a_max must be an int >= 0"),
    ({"a": {"api_keys": ["k"], "max_pending": 0}}, r"tenants.a.max_pending must be an int >= 1"),
    ({"a": {"api_keys": ["k"], "rate_limit_per_s": 0}}, r"tenants.a.rate_limit_per_s must be null or a number > 0"),
    ({"a": {"api_keys": ["k"], "max_buffer_share": 1.5}}, r"tenants.a.max_buffer_share must be a number in \(0, 1\]"),
    ({"a b": {"api_keys": ["k"]}}, r"'a b': a tenant name is 1-64 characters"),
    ({"a": ["k"]}, r"tenants.a must be a mapping"),
    (["a"], r"claas.service.tenants must be a mapping"),
])
def test_bad_configurations_name_the_field(tenants, message):
    with pytest.raises(ValueError, match=message):
        TenantDirectory(tenants)


def test_a_duplicate_key_error_never_shows_the_key():
    with pytest.raises(ValueError) as info:
        TenantDirectory({"a": {"api_keys": ["sk-secret-123"]}, "b": {"api_keys": ["sk-secret-123"]}})
    assert "sk-secret-123" not in str(info.value)


def test_dataclass_instances_are_checked_too_and_every_field_has_help():
    with pytest.raises(ValueError, match="tenants.t.b_min must be an int >= 1"):
        TenantDirectory({"t": TenantConfig(api_keys=("k",), b_min=0)})
    rows = list(schema_rows(TenantConfig, "claas.service.tenants.<t>"))
    assert [r[0] for r in rows][:2] == ["claas.service.tenants.<t>.api_keys", "claas.service.tenants.<t>.b_min"]
    assert all(r[3] for r in rows)


def test_tenant_name_lists_are_checked():
    assert check_tenant_names(["a", "b"], "w") == ("a", "b")
    for bad, msg in (([], "no tenants"), (["a", "a"], "named twice"), (["a/b"], "not a tenant name")):
        with pytest.raises(ValueError, match=msg):
            check_tenant_names(bad, "w")


def test_the_operator_guides_example_is_a_valid_configuration():
    import re
    from pathlib import Path

    import yaml

    page = (Path(__file__).resolve().parents[3] / "docs/service.md").read_text()
    section = page[page.index("## Tenants"):]
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    d = TenantDirectory(example["claas"]["service"]["tenants"])
    assert d.names == ("alice", "bob") and d.tenant_of("sk-alice-2") == "alice"
    assert d["bob"].rate_limit_per_s == 2.0 and d["alice"].b_max == 64
    from claas_verl.claas.service import ServiceConfig

    service = example["claas"]["service"]  # the example is a service configuration the key rule accepts
    assert ServiceConfig(**service).directory.names == ("alice", "bob")
    c = TenantConfig(api_keys=("k",))  # the guide's table of defaults is the schema's
    for row in (f"| `b_min`, `b_max`, `a_max` | {c.b_min}, {c.b_max}, {c.a_max} |",
                f"| `max_pending` | {c.max_pending} |",
                f"| `rate_limit_per_s`, `rate_limit_burst` | null, {c.rate_limit_burst} |",
                f"| `max_buffer_share` | {c.max_buffer_share} |"):
        assert row in section, row
    assert c.rate_limit_per_s is None
