"""benchmarks/mopd_stage_proxy.py: the MOPD stage outside the trainer (used to choose the gym bundle's design)
must be the trainer's math: no update toward a copy of itself, and a falling KL toward another teacher."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.mopd_stage_proxy import (  # noqa: E402
    VARIANT_DONE,
    bundle_domains,
    ensure_variant,
    majority_answer_score,
    neighbour_answer,
    parse_arch,
    parse_domains,
    stage,
    variant_marker,
)
from claas_verl.mopd.eval.gym_snapshots import response_logits, right_padded  # noqa: E402
from claas_verl.tiny import gym  # noqa: E402
from claas_verl.tiny.model import TINY_ARCH, build_student, student_config  # noqa: E402

ROWS = [{"prompt": [{"role": "user", "content": w}]} for w in ("cat", "dog", "bird", "fish", "ant", "owl")]


@pytest.fixture(scope="module")
def tok():
    return gym.byte_tokenizer()


def _model(tok, seed):
    eos, pad = gym.stop_and_pad_ids(tok)
    return build_student(len(tok), eos, pad, seed)


def test_right_padding_keeps_positions_and_marks_reply_tokens():
    ids, attn, resp = right_padded([5, 6, 7], [[1, 2], [3]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 2], [5, 6, 7, 3, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert resp.tolist() == [[1, 1], [1, 0]]


def test_response_logits_predict_the_reply_tokens(tok):
    model = _model(tok, 0)
    ids, attn, _ = right_padded([5, 6, 7], [[1, 2]], pad_id=0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits
        got = response_logits(model, ids, attn, prompt_len=3)
    assert got.shape == (1, 2, len(tok))
    torch.testing.assert_close(got, full[:, 2:4].float())  # logits at 2 predict reply token 0 (position 3)


def test_a_student_distilled_toward_itself_only_decays(tok):
    # q = p gives r = 0 exactly (docs/math.md §B.2.1), so every gradient is 0 and AdamW's update is its decoupled decay;
    # the teacher is the student itself, so q = p at every step
    student = _model(tok, 0)
    before = [p.detach().clone() for p in student.parameters()]
    lr, steps = 1e-3, 2
    kls = stage(student, student, tok, ROWS, steps=steps, prompts=2, replies=2, topk=16, lr=lr, seed=0)
    assert [abs(k) for k in kls] == [0.0] * steps
    for b, p in zip(before, student.parameters()):
        torch.testing.assert_close(p.detach(), b * (1 - lr * 0.01) ** steps, rtol=1e-6, atol=0)


def test_warm_up_scales_each_update_linearly(tok):
    # with q = p the update is AdamW's decoupled decay alone, θ·(1 − lr_i·0.01): warm-up over 2 updates gives
    # lr_0 = lr/2 and lr_1 = lr
    student = _model(tok, 0)
    before = [p.detach().clone() for p in student.parameters()]
    lr = 1e-1
    stage(student, student, tok, ROWS, steps=2, prompts=2, replies=2, topk=16, lr=lr, seed=0, warmup=2)
    for b, p in zip(before, student.parameters()):
        torch.testing.assert_close(p.detach(), b * (1 - lr / 2 * 0.01) * (1 - lr * 0.01), rtol=1e-6, atol=0)


def test_the_stage_moves_the_student_toward_a_sharp_teacher(tok):
    # κ = V: the per-step weighted KL is the exact reverse KL on that step's own samples, which eq. (5) lowers
    student, expert = _model(tok, 0), _model(tok, 1)
    with torch.no_grad():
        expert.lm_head.weight.mul_(8.0)  # a sharp teacher, far (27 nats/token) from the near-uniform student
    kls = stage(student, expert, tok, ROWS, steps=8, prompts=3, replies=2, topk=len(tok), lr=1e-2, seed=0)
    assert kls[0] > 20 and kls[-1] < 0.5 * kls[0]


def test_a_stage_on_given_blocks_times_its_phases(tok):
    # bench_mopd_step.py runs the proxy on the trainer's plan blocks and reads one timing dict per step
    student = _model(tok, 0)
    blocks = [ROWS[:2], ROWS[2:4]]
    timings = []
    stage(student, student, tok, ROWS, steps=2, prompts=6, replies=2, topk=16, lr=1e-3, seed=0, blocks=blocks,
          timings=timings)
    assert len(timings) == 2
    for t in timings:
        phases = [t[p] for p in ("gen", "old_log_prob", "teacher", "update_actor")]
        assert min(phases) >= 0 and abs(sum(phases) - t["step"]) < 1e-6
        assert 1 <= t["response_tokens"] <= 2 * 2 * 40  # 2 prompts x 2 replies of at most 40 tokens
    with pytest.raises(ValueError, match="only 2 blocks"):
        stage(student, student, tok, ROWS, steps=3, prompts=2, replies=2, topk=16, lr=1e-3, seed=0, blocks=blocks)


def test_scoring_mid_stage_changes_nothing_in_the_stage(tok):
    # --eval-every scores the student between updates (sampling consumes torch's generator); the stage's own
    # samples, KLs and weights must be those of a stage scored only at its end
    def run(after_step):
        student, expert = _model(tok, 0), _model(tok, 1)
        kls = stage(student, expert, tok, ROWS, steps=3, prompts=2, replies=2, topk=16, lr=1e-2, seed=0,
                    after_step=after_step)
        return kls, [p.detach().clone() for p in student.parameters()]

    calls = []

    def score(i):
        calls.append(i)
        torch.rand(1000)  # what sampling held-out replies would draw

    plain_kls, plain_w = run(None)
    kls, w = run(score)
    assert calls == [1, 2, 3]
    assert kls == plain_kls
    for a, b in zip(w, plain_w):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_build_arch_gives_the_requested_wider_student(tok):
    shape = parse_arch("hidden=128, heads=4,kv_heads=2,intermediate=256")
    assert shape == {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "intermediate_size": 256}
    eos, pad = gym.stop_and_pad_ids(tok)
    wide, tiny = build_student(len(tok), eos, pad, 0, shape=shape), _model(tok, 0)
    cfg = wide.config
    got = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    assert got == (128, 4, 2, 256)
    assert cfg.num_hidden_layers == TINY_ARCH["num_hidden_layers"] and cfg.initializer_range == 0.1  # the rest kept
    assert wide.model.layers[0].self_attn.k_proj.out_features == 2 * 32  # head size 32, 2 KV heads
    assert sum(p.numel() for p in wide.parameters()) > 3 * sum(p.numel() for p in tiny.parameters())
    assert wide(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, len(tok))


@pytest.mark.parametrize("spec", ["", "width=128", "hidden=0", "hidden=128,heads=8", "heads=3",
                                  "hidden=192,heads=6,kv_heads=4", "layers"])
def test_build_arch_refuses_a_shape_it_cannot_build(spec):
    # head size below 32 (vLLM's CPU kernels), heads not dividing hidden or not a multiple of kv_heads, unknown keys
    with pytest.raises(ValueError, match="--build-arch"):
        parse_arch(spec)


def test_student_config_refuses_an_unknown_shape_entry():
    with pytest.raises(ValueError, match="hidden_sise"):
        student_config(32, [1], 0, shape={"hidden_sise": 128})


def test_the_variant_marker_records_a_reshaped_student_only():
    # a generalist variant built before --build-arch existed keeps its marker, so it is not rebuilt
    assert variant_marker(1200, 0, None) == {"base_steps": 1200, "seed": 0}
    assert variant_marker(250, 1, {"hidden_size": 128}) == {"base_steps": 250, "seed": 1,
                                                            "arch": {"hidden_size": 128}}


def test_build_domains_names_distinct_known_domains_in_stage_order():
    assert [d.name for d in parse_domains("syll, gcd,spell")] == ["syll", "gcd", "spell"]
    assert parse_domains("spell")[0] == gym.GYM_DOMAINS[0]  # the benchmark's own, unchanged
    for spec in ("", "syll,syll", "syll,sudoku"):
        with pytest.raises(ValueError, match="--build-domains"):
            parse_domains(spec)


def test_a_bundle_build_refuses_a_domain_without_expert_steps_before_writing(tmp_path):
    with pytest.raises(ValueError, match="expert_steps.*syll"):
        gym.build_bundle(tmp_path / "b", 0, parse_domains("syll"), {"spell": 2})
    assert not (tmp_path / "b").exists()


def test_the_one_answer_baseline_is_the_share_of_held_out_prompts_with_the_most_common_train_answer(tmp_path):
    # syllogism answers Yes or No: a student that always says the commoner train answer scores exactly the
    # share of held-out prompts with that answer (what the design notes read a syll "gain" against)
    from claas_verl.tiny.data import write_parquet

    train, test = gym.gym_rows(parse_domains("syll")[0], seed=0)
    paths = gym.GymPaths(tmp_path)
    write_parquet(train, paths.data("syll", "train"))
    write_parquet(test, paths.data("syll", "test"))
    answers = [r["extra_info"]["reference"] for r in train]
    common = max(set(answers), key=answers.count)
    share = sum(r["extra_info"]["reference"] == common for r in test) / len(test)
    assert majority_answer_score(tmp_path, "syll") == (common, round(share, 3))
    assert 0 < share < 1


def test_a_variant_folder_is_built_once_replaced_when_stale_and_a_bundle_is_never_deleted(tmp_path):
    built = []

    def build(folder, marker):
        def run():
            (folder / "student").mkdir(parents=True)
            (folder / VARIANT_DONE).write_text(json.dumps(marker))
            built.append(marker)
        return run

    v = tmp_path / "v"
    assert ensure_variant(v, {"a": 1}, build(v, {"a": 1})) and built == [{"a": 1}]
    assert not ensure_variant(v, {"a": 1}, build(v, {"a": 1}))  # there already: reused
    assert ensure_variant(v, {"a": 2}, build(v, {"a": 2})) and built[-1] == {"a": 2}  # another variant: replaced
    (v / VARIANT_DONE).unlink()  # killed while building: rebuilt
    assert ensure_variant(v, {"a": 2}, build(v, {"a": 2})) and len(built) == 3
    for name, files in (("bundle", ["manifest.json", "student/config.json"]), ("mine", ["notes.txt"])):
        folder = tmp_path / name
        for f in files:
            (folder / f).parent.mkdir(parents=True, exist_ok=True)
            (folder / f).write_text("keep")
        with pytest.raises(SystemExit, match="not a variant"):
            ensure_variant(folder, {"a": 1}, build(folder, {"a": 1}))
        assert all((folder / f).read_text() == "keep" for f in files)


def test_the_script_builds_a_bundle_of_other_domains_and_runs_its_stages_in_its_order(tmp_path, monkeypatch, capsys):
    # the command line end to end at a few steps: build, then every stage of the bundle's own order by default
    from benchmarks import mopd_stage_proxy

    monkeypatch.setattr(gym, "BASE_SFT", dict(gym.BASE_SFT, steps=2))
    monkeypatch.setattr(gym, "ACC_PROMPTS", 2)
    monkeypatch.setattr(sys, "argv", ["proxy", "--build-domains", "syll,count", "--variant-dir", str(tmp_path / "v"),
                                      "--expert-steps", "1", "--steps", "1", "--prompts", "2", "--replies", "1",
                                      "--eval-replies", "1"])
    mopd_stage_proxy.main()
    out = capsys.readouterr().out
    assert "built the bundle of ['syll', 'count']" in out
    assert "one answer to every prompt" in out and "syll 'Yes'" in out
    assert out.index("stage 1 (syll") < out.index("stage 2 (count")
    assert "| 2:count |" in out
    # the bundle: its own data, π0, one expert per domain, a manifest naming the domains (keys sorted: the stage
    # order comes from the marker), reused as it is through --gym-dir (never rebuilt as the benchmark's bundle)
    v = tmp_path / "v"
    paths = gym.GymPaths(v)
    manifest = json.loads(paths.manifest.read_text())
    assert sorted(manifest["domains"]) == ["count", "syll"] and manifest["seed"] == 0
    assert manifest["domains"]["syll"]["task"] == "syllogism"
    assert manifest["expert_sft"]["steps"] == {"syll": 1, "count": 1}
    assert set(manifest["accuracy"]) == {"student", "expert:syll", "expert:count"}
    for d in ("syll", "count"):
        assert paths.data(d, "test").is_file() and (paths.expert(d) / "config.json").is_file()
    assert bundle_domains(v) == ["syll", "count"] and gym.is_current(v)
    assert bundle_domains(tmp_path) == list(gym.DOMAIN_NAMES)  # no marker: the benchmark's bundle
    monkeypatch.setattr(sys, "argv", ["proxy", "--build-domains", "syll", "--gym-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="no --gym-dir"):
        mopd_stage_proxy.main()


def test_the_neighbouring_rule_answers_with_the_text_the_task_gives():
    # the bundle's own question formats (reasoning-gym spell_backward and word_sequence_reversal)
    assert neighbour_answer("spell", "Spell this word backward (example: sun -> nus): tara") == "tara"
    question = ("Solve the following problem.\n\nProvide you answer as a comma-separated list of words with a space "
                "after the comma.\n\nReverse this list of words: it, or, my\n")
    assert neighbour_answer("reverse", question) == "it, or, my"
    for domain, q in (("reverse", "Spell this word backward: tara"), ("spell", "Spell this word backward: ")):
        with pytest.raises(ValueError, match=f"no neighbouring rule for this {domain} question"):
            neighbour_answer(domain, q)


def test_the_script_builds_a_neighbouring_rule_variant_of_the_bundle(tmp_path, monkeypatch, capsys):
    # the command line end to end at a few steps: a tiny benchmark bundle, then the variant built from it
    from benchmarks import mopd_stage_proxy

    monkeypatch.setattr(gym, "BASE_SFT", dict(gym.BASE_SFT, steps=2))
    monkeypatch.setattr(gym, "ACC_PROMPTS", 2)
    monkeypatch.setattr(gym, "N_TEST", 4)  # held-out prompts: the proxy scores every model on all of them
    monkeypatch.setattr(mopd_stage_proxy, "COVER_STEPS", 2)
    monkeypatch.setattr(mopd_stage_proxy, "SPECIALISE_STEPS", 1)
    root, v = tmp_path / "bundle", tmp_path / "v"
    gym.build_bundle(root, 0, gym.GYM_DOMAINS, {d: 1 for d in gym.DOMAIN_NAMES})
    argv = ["proxy", "--gym-dir", str(root), "--build-neighbour", "3", "--variant-dir", str(v), "--order", "reverse",
            "--steps", "1", "--prompts", "2", "--replies", "1", "--eval-replies", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    mopd_stage_proxy.main()
    out = capsys.readouterr().out
    assert "built the neighbouring-rule variant (generalist: 3 joint steps)" in out
    assert "stage 1 (reverse" in out and "| 1:reverse |" in out
    marker = json.loads((v / VARIANT_DONE).read_text())
    assert marker == {"neighbour": {"generalist_steps": 3, "cover_steps": 2, "specialise_steps": 1}, "seed": 0}
    accuracy = json.loads((v / "accuracy.json").read_text())
    assert set(accuracy) == {"generalist", "student", "expert:spell", "expert:reverse", "expert:arith"}
    assert all(set(a) == set(gym.DOMAIN_NAMES) for a in accuracy.values())
    # π0 and every expert are new models of the bundle's shape; the bundle is untouched
    base = gym.GymPaths(root)
    before = (base.student / "model.safetensors").read_bytes()
    for model in (gym.GymPaths(v).student, *(gym.GymPaths(v).expert(d) for d in gym.DOMAIN_NAMES)):
        assert (model / "model.safetensors").read_bytes() != before
    assert mopd_stage_proxy.ensure_variant(v, mopd_stage_proxy.neighbour_marker(3, 0), None) is False  # reused
    monkeypatch.setattr(sys, "argv", [*argv, "--build-arch", "hidden=128"])
    with pytest.raises(SystemExit, match="drop the other --build-"):
        mopd_stage_proxy.main()
