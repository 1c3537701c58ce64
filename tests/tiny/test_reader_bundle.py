"""The reader bundle (claas_verl/tiny/reader.py): the shipped student that reads a rule in its context.

ensure_reader unpacks the repository's archive and checks its fingerprint (a wrong one is refused); the manifest's
instruction-reading table meets the plan's gates (benchmarks/plans/claas_feedback.md), recomputed here from its
numbers; and the shipped student, sampled here, follows a rule in its system prompt more often than without it.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from claas_verl.tiny import reader
from claas_verl.tiny.fingerprint import bundle_fingerprint
from claas_verl.tiny.reader_measure import (
    CONDITIONS,
    STREAM_FAMILIES,
    diff_interval,
    gates_pass,
    reading_gates,
)
from claas_verl.tiny.shipped import BUNDLES_DIR_ENV, bundles_dir, shipped, shipped_name


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return reader.ensure_reader(tmp_path_factory.mktemp("reader") / "bundle")


def test_ensure_reader_unpacks_the_shipped_bundle_with_its_recorded_fingerprint(bundle, monkeypatch):
    found = shipped("reader", reader.READER_VERSION, 0)
    assert found is not None, f"no shipped reader bundle v{reader.READER_VERSION} seed 0 in {bundles_dir()}"
    assert bundle_fingerprint(bundle.root) == found[1]["fingerprint"]
    manifest = json.loads(bundle.manifest.read_text())
    assert manifest["version"] == reader.READER_VERSION and manifest["seed"] == 0
    # the layout the CLaaS tiny recipes read ($CLAAS_TINY_DIR/student): an HF model and its tokenizer
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (bundle.student / name).is_file(), name
    # current: returned as it is, not unpacked again (a marker file in it survives)
    (bundle.root / "kept").write_text("x")
    assert reader.ensure_reader(bundle.root) == bundle and (bundle.root / "kept").exists()


def test_a_shipped_archive_with_a_wrong_fingerprint_is_refused(tmp_path, monkeypatch):
    name = shipped_name("reader", reader.READER_VERSION, 0)
    ships = tmp_path / "bundles"
    ships.mkdir()
    shutil.copy(bundles_dir() / f"{name}.tar.gz", ships)
    record = json.loads((bundles_dir() / f"{name}.json").read_text())
    (ships / f"{name}.json").write_text(json.dumps({**record, "fingerprint": "0123456789abcdef"}))
    monkeypatch.setenv(BUNDLES_DIR_ENV, str(ships))
    with pytest.raises(ValueError, match="fingerprint is .* record says 0123456789abcdef.*damaged or was replaced"):
        reader.ensure_reader(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-unpacked is left where a run would read it


def test_ensure_reader_refuses_a_directory_that_is_not_a_reader_bundle(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a reader bundle.*CLAAS_TINY_READER_DIR"):
        reader.ensure_reader(tmp_path / "data")
    assert (tmp_path / "data" / "notes.txt").read_text() == "mine"


def test_the_manifests_instruction_reading_meets_the_plans_gates(bundle):
    m = json.loads(bundle.manifest.read_text())
    table = m["instruction_reading"]
    z = 1.959963984540054
    for family in STREAM_FAMILIES:
        row = table[family]
        assert set(row) == {*CONDITIONS, *(f"pre_sft_{c}" for c in CONDITIONS)}
        (b, nb), (s, ns), (f, nf), (b0, _) = row["base"], row["student"], row["teacher"], row["pre_sft_base"]
        assert nb == ns == 512 and nf > 0  # 32 scenarios x 4 turns x 4 conversations; teacher: steps with feedback
        assert abs(b - b0) <= 0.05, f"{family}: base rate moved {b0} -> {b}"
        assert s - b >= 0.15 and s - b - z * math.sqrt(s * (1 - s) / ns + b * (1 - b) / nb) > 0, family
        assert s <= 0.70, f"{family}: student already passes {s}: no room to learn"
        assert f - s >= 0.15 and f - s - z * math.sqrt(f * (1 - f) / nf + s * (1 - s) / ns) > 0, family
    # the module's gate arithmetic agrees with the manifest's record of it
    assert gates_pass(reading_gates(table)) and m["gates"] == reading_gates(table)
    assert m["sft"]["steps"] in reader.STEPS_GRID and m["sft"]["steps"] == reader.READER_SFT_STEPS


def test_diff_interval_and_gates_by_hand():
    # 0.6 vs 0.4 on 100 each: half-width 1.96 * sqrt(0.24/100 + 0.24/100) = 1.96 * 0.06928 = 0.1358
    d, lo, hi = diff_interval(0.6, 100, 0.4, 100)
    assert d == pytest.approx(0.2) and lo == pytest.approx(0.2 - 0.13579, abs=1e-4) and hi == pytest.approx(0.33579,
                                                                                                           abs=1e-4)
    row = {"base": [0.30, 512], "student": [0.55, 512], "teacher": [0.80, 500], "icl": [0.50, 500],
           "pre_sft_base": [0.33, 512], "pre_sft_student": [0.3, 512], "pre_sft_teacher": [0.2, 500],
           "pre_sft_icl": [0.2, 500]}
    table = {f: dict(row) for f in STREAM_FAMILIES}
    assert gates_pass(reading_gates(table))
    for key, value, gate in (("student", [0.75, 512], "room to learn"),  # s > 0.70
                             ("pre_sft_base", [0.40, 512], "base rate kept"),  # |0.30 - 0.40| > 0.05
                             ("teacher", [0.65, 500], "teacher knows more")):  # 0.65 - 0.55 < 0.15
        bad = {f: dict(row) for f in STREAM_FAMILIES}
        bad["end_punctuation"][key] = value
        gates = reading_gates(bad)
        assert not gates_pass(gates) and not gates["end_punctuation"][gate]["passed"]
    # 0.20 above the base, but on 20 replies the interval reaches below 0: "reads" is not shown
    few = {f: {**row, "base": [0.30, 20], "student": [0.50, 20]} for f in STREAM_FAMILIES}
    assert not reading_gates(few)["capital_start"]["reads the system prompt"]["passed"]


def test_the_shipped_student_follows_a_rule_in_its_system_prompt_more_often_than_without(bundle):
    """A small held-out sample (16 scenarios of the stream's seed 0, first turn, 8 replies each), about 10 s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from claas_verl.tiny.reader_measure import Sampler, held_out_scenarios, without_rule

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(bundle.student)
    model = AutoModelForCausalLM.from_pretrained(bundle.student).eval()
    sampler = Sampler(model, tok)
    scenarios = held_out_scenarios("capital_start", n=16)
    rates = {}
    for name, system in (("rule", lambda sc: sc.system_prompt), ("no rule", without_rule)):
        replies = sampler.sample([sc.messages(0, [], system_prompt=system(sc)) for sc in scenarios], ("test", name),
                                 k=8)
        graded = [sc.grade(text, 0).reward == 1.0 for sc, rs in zip(scenarios, replies) for text, _ in rs]
        rates[name] = sum(graded) / len(graded)
    assert rates["rule"] - rates["no rule"] >= 0.15, rates
