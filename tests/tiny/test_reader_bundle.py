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


def test_the_manifests_gates_are_those_of_its_numbers_and_its_n_follows_the_plans_rule(bundle):
    """Each gate statistic recomputed by hand from the manifest's pass rates equals the one it records; the shipped
    N is the plan's: the smallest N meeting every gate when they pass, else the grid's largest (amendment of
    2026-12-06)."""
    m = json.loads(bundle.manifest.read_text())
    table, gates = m["instruction_reading"], m["gates"]
    z = 1.959963984540054
    for family in STREAM_FAMILIES:
        row = table[family]
        assert set(row) == {*CONDITIONS, *(f"pre_sft_{c}" for c in CONDITIONS)}
        (b, nb), (s, ns), (f, nf), (b0, nb0) = row["base"], row["student"], row["teacher"], row["pre_sft_base"]
        assert nb == ns == nb0 == 512 and 0 < nf <= 512  # 32 scenarios x 4 turns x 4; teacher: steps with feedback
        g = gates[family]
        assert g["base rate kept"]["value"] == pytest.approx(b - b0, abs=1e-4)
        assert g["base rate kept"]["passed"] == (abs(b - b0) <= 0.05)
        reads_low = s - b - z * math.sqrt(s * (1 - s) / ns + b * (1 - b) / nb)
        assert g["reads the system prompt"]["low"] == pytest.approx(reads_low, abs=1e-4)
        assert g["reads the system prompt"]["passed"] == (s - b >= 0.15 and reads_low > 0)
        assert g["room to learn"]["passed"] == (s <= 0.70)
        teacher_low = f - s - z * math.sqrt(f * (1 - f) / nf + s * (1 - s) / ns)
        assert g["teacher knows more"]["low"] == pytest.approx(teacher_low, abs=1e-4)
        assert g["teacher knows more"]["passed"] == (f - s >= 0.15 and teacher_low > 0)
    assert gates == reading_gates(table)
    assert set(table) >= set(STREAM_FAMILIES) and len(table) == 9  # every family is reported
    expected = reader.READER_SFT_STEPS if gates_pass(gates) else max(reader.STEPS_GRID)
    assert m["sft"]["steps"] == expected == reader.SHIPPED_SFT_STEPS


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


def test_the_shipped_student_gives_its_manifests_pass_rates(bundle):
    """The measurement's own base and student conversations of ``capital_start`` (512 replies each, about 20 s) on
    the unpacked student land within 0.1 of the manifest's rates (3.5 standard errors at n = 512: another CPU may
    sample other replies; a wrong student, tokenizer or protocol moves them further)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from claas_verl.tiny.reader_measure import ROLLOUTS, Sampler, held_out_scenarios, rollouts, without_rule

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = AutoTokenizer.from_pretrained(bundle.student)
        model = AutoModelForCausalLM.from_pretrained(bundle.student).eval()
        sampler = Sampler(model, tok)
        scenarios = held_out_scenarios("capital_start")
        table = json.loads(bundle.manifest.read_text())["instruction_reading"]["capital_start"]
        for name, system in (("base", without_rule), ("student", lambda sc: sc.system_prompt)):
            convs = rollouts(sampler, scenarios, [system(sc) for sc in scenarios], ROLLOUTS,
                             ("measure", 0, "capital_start", name))
            steps = [s for conv in convs for s in conv]
            assert len(steps) == table[name][1]
            assert abs(sum(s.passed for s in steps) / len(steps) - table[name][0]) < 0.1, name
    finally:
        torch.set_num_threads(threads)


def test_the_cli_refuses_sft_steps_without_build(capsys):
    from claas_verl.tiny.__main__ import main

    assert main(["reader", "/tmp/claas_reader_never_made", "--sft-steps", "50"]) == 2
    assert "--sft-steps sets the fine-tune of a build; add --build" in capsys.readouterr().err


def test_the_cli_checks_grid_steps(capsys):
    from claas_verl.tiny.__main__ import main

    assert main(["reader", "--grid-steps", "1600"]) == 2
    assert "--grid-steps sets the N of a --grid measurement; add --grid GRID_DIR" in capsys.readouterr().err
    assert main(["reader", "--grid", "/tmp/claas_reader_never_made", "--grid-steps", "16x0"]) == 2
    assert "--grid-steps takes comma-separated integers" in capsys.readouterr().err
    assert main(["reader", "--grid", "/tmp/claas_reader_never_made", "--grid-steps", "0,1600"]) == 2
    assert "--grid-steps must all be >= 1" in capsys.readouterr().err


def test_design_2_builds_from_the_streams_two_rules_alternating_and_design_1_from_every_family():
    from claas_verl.claas.envs.rule_following import ALL_FAMILIES

    v2 = reader.build_scenarios(0, version="2")
    fams = lambda scs: [tuple(sc.meta["families"]) for sc in scs]  # noqa: E731
    assert len(v2) == 2 * 144 and set(fams(v2)) == {("capital_start",), ("end_punctuation",)}
    assert fams(v2[:4]) == [("capital_start",), ("end_punctuation",)] * 2
    v1 = reader.build_scenarios(0)
    assert len(v1) == 32 * len(ALL_FAMILIES) and fams(v1[:9]) == [(f,) for f in ALL_FAMILIES]
    with pytest.raises(ValueError, match="reader version '9' is not one of"):
        reader.build_scenarios(0, version="9")


def test_a_rule_only_example_targets_the_passing_reply_with_the_designs_share(bundle):
    """Scripted replies (the first of every turn fails both stream rules, the second passes both) through the real
    tokenizer and chat template: at share 1.0 every rule-only target is the passing reply; at 0.4 the failing one
    exactly where the build's seeded draw is ≥ 0.4; the feedback third does not depend on the share, and its form
    (SDPO's re-prompt or ICL's block) follows the design's stride."""
    import random

    from transformers import AutoTokenizer

    from claas_verl.tiny.reader_measure import Sampler, feedback_contexts, grade
    from claas_verl.utils.prompt_rows import stable_seed

    class ScriptedSampler(Sampler):
        def sample(self, prompts, key, k=1):
            texts = ["no", "Done, here it is."] * k
            return [[(t, self.tok.encode(t, add_special_tokens=False)) for t in texts[:k]] for _ in prompts]

    tok = AutoTokenizer.from_pretrained(bundle.student)
    sampler = ScriptedSampler(None, tok)
    fail, ok = (tok.encode(t, add_special_tokens=False) for t in ("no", "Done, here it is."))
    scenarios = reader.build_scenarios(0, per_family=3, version="2")
    full = reader.sft_thirds(sampler, scenarios, seed=5, rule_pass_share=1.0)
    part = reader.sft_thirds(sampler, scenarios, seed=5, rule_pass_share=0.4)
    n = len(scenarios) * 4  # turns
    assert [t for _, t in full["rule"]] == [ok] * n
    rng = random.Random(stable_seed("claas_reader.rule_target", 5))
    expected = [fail if rng.random() >= 0.4 else ok for _ in range(n)]
    assert [t for _, t in part["rule"]] == expected and 0 < expected.count(fail) < n
    assert [p for p, _ in part["rule"]] == [p for p, _ in full["rule"]]
    assert part["feedback"] == full["feedback"] and len(full["feedback"]) == n
    assert part["no_rule"] == full["no_rule"]
    # the feedback form of each scenario's first turn: stride 1 alternates scenario by scenario (so with two rules
    # alternating, each rule would get one form only), stride 2 by pairs: each rule gets both
    strided = reader.sft_thirds(sampler, scenarios, seed=5, rule_pass_share=0.4, form_stride=2)
    count = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731

    def forms(thirds):
        out = []
        for i, sc in enumerate(scenarios):
            msgs = sc.messages(0, [])
            bad = grade(sc, 0, msgs, ("no", fail))
            teacher, icl = feedback_contexts(bad, ("no", bad.feedback), count)
            prompt = thirds["feedback"][i][0]  # turn 0's examples come first, in scenario order
            by_prompt = {tuple(sampler.prompt_ids(teacher)): "sdpo", tuple(sampler.prompt_ids(icl)): "icl"}
            out.append(by_prompt[tuple(prompt)])
        return out

    assert forms(full) == ["sdpo", "icl"] * 3 and forms(strided) == ["sdpo", "sdpo", "icl", "icl", "sdpo", "sdpo"]


def test_the_cli_refuses_an_unknown_version(capsys):
    from claas_verl.tiny.__main__ import main

    assert main(["reader", "--grid", "/tmp/claas_reader_never_made", "--version", "7"]) == 2
    assert "--version must be one of ['1', '2']" in capsys.readouterr().err


@pytest.mark.parametrize("chosen,says", [(None, "no N meets every gate (grid.json says which failed); the longest "
                                                "fine-tune is GRID/N3200"),
                                         (800, "chosen N: 800 (ship it with `python -m claas_verl.tiny reader "
                                               "GRID/N800 --version 2 --ship`)")])
def test_the_grid_cli_names_the_bundle_to_ship_or_says_none_met_the_gates(chosen, says, monkeypatch, capsys):
    from claas_verl.tiny.__main__ import main

    seen = {}

    def grid(out_dir, seed, grid, version):
        seen.update(seed=seed, grid=grid, version=version)
        return {"chosen": chosen, "shipped": chosen or 3200}

    monkeypatch.setattr(reader, "measure_grid", grid)  # what is measured is tested above; here only what is said
    assert main(["reader", "--grid", "GRID", "--grid-steps", "800,3200", "--version", "2"]) == 0
    assert seen == {"seed": 0, "grid": (800, 3200), "version": "2"}
    assert says in capsys.readouterr().out


def test_a_version_that_is_not_shipped_is_refused_with_its_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(BUNDLES_DIR_ENV, str(tmp_path / "no_bundles"))
    monkeypatch.setenv(reader.ENV_READER_DIR, str(tmp_path / "reader"))
    assert reader.default_reader_dir("2") == tmp_path / "reader_v2"  # versions never share a directory
    with pytest.raises(FileNotFoundError, match=r"reader_v2_seed0 .*reader DIR --build --version 2 --sft-steps N"):
        reader.ensure_reader(version="2")
    assert not (tmp_path / "reader_v2").exists()
