"""docs/config.md is generated from the config schemas and lists every key of both systems; a stale page fails."""

from __future__ import annotations

from pathlib import Path

from claas_verl import config_docs
from claas_verl.utils.schema import knob, schema_rows

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_page_is_current():
    page = (REPO / config_docs.PAGE).read_text()
    stale = "docs/config.md is out of date: python -m claas_verl.config_docs > docs/config.md"
    assert page == config_docs.render(), stale
    assert config_docs.main(["--check"]) == 0


def test_the_page_lists_every_key_of_both_systems_once():
    rows = config_docs.claas_rows() + config_docs.mopd_rows()
    keys = [key for key, *_ in rows]
    assert len(keys) == len(set(keys))
    page = (REPO / config_docs.PAGE).read_text()
    for key in keys:
        assert f"| `{key}` |" in page
    for key in ("claas.b_min", "claas.producer.max_new_tokens", "claas.service.api_keys", "claas.sdpo.tau",
                "mopd.train.lr", "mopd.train.betas", "mopd.signal.aux_kinds", "mopd.replay.m", "mopd.segments.size",
                "mopd.domains.<d>.expert", "mopd.eval.responses_per_prompt"):
        assert key in keys, key
    # the keys a job sets itself are not recipe keys
    assert "claas.service.record" not in keys and "claas.service.default_max_tokens" not in keys


def test_a_field_without_help_cannot_be_declared_or_listed():
    import dataclasses

    import pytest

    with pytest.raises(ValueError, match="help text"):
        knob(1, "")

    @dataclasses.dataclass
    class Bare:
        x: int = 1

    with pytest.raises(ValueError, match=r"Bare.x \(s.x\) has no help text"):
        list(schema_rows(Bare, "s"))


def test_help_points_to_the_page(capsys):
    config_docs.print_help_pointer(["--config-name", "claas/x"])
    assert capsys.readouterr().out == ""
    config_docs.print_help_pointer(["--help"])
    assert "docs/config.md" in capsys.readouterr().out
