"""benchmarks/mopd_stage_proxy.py: the MOPD stage outside the trainer (used to choose the gym bundle's design)
must be the trainer's math: no update toward a copy of itself, and a falling KL toward another teacher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from proxy_fixtures import ROWS, tiny_model  # noqa: E402

from benchmarks.host import host_signature  # noqa: E402
from benchmarks.mopd_stage_proxy import majority_answer_score, stage  # noqa: E402
from claas_verl.mopd.eval.gym_snapshots import response_logits, right_padded  # noqa: E402
from claas_verl.tiny import gym  # noqa: E402


def test_right_padding_keeps_positions_and_marks_reply_tokens():
    ids, attn, resp = right_padded([5, 6, 7], [[1, 2], [3]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 2], [5, 6, 7, 3, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert resp.tolist() == [[1, 1], [1, 0]]


def test_response_logits_predict_the_reply_tokens(tok):
    model = tiny_model(tok, 0)
    ids, attn, _ = right_padded([5, 6, 7], [[1, 2]], pad_id=0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits
        got = response_logits(model, ids, attn, prompt_len=3)
    assert got.shape == (1, 2, len(tok))
    torch.testing.assert_close(got, full[:, 2:4].float())  # logits at 2 predict reply token 0 (position 3)


def test_a_student_distilled_toward_itself_only_decays(tok):
    # q = p gives r = 0 exactly (docs/math.md §B.2.1), so every gradient is 0 and AdamW's update is its decoupled decay;
    # the teacher is the student itself, so q = p at every step
    student = tiny_model(tok, 0)
    before = [p.detach().clone() for p in student.parameters()]
    lr, steps = 1e-3, 2
    kls = stage(student, student, tok, ROWS, steps=steps, prompts=2, replies=2, topk=16, lr=lr, seed=0)
    assert [abs(k) for k in kls] == [0.0] * steps
    for b, p in zip(before, student.parameters()):
        torch.testing.assert_close(p.detach(), b * (1 - lr * 0.01) ** steps, rtol=1e-6, atol=0)


def test_warm_up_scales_each_update_linearly(tok):
    # with q = p the update is AdamW's decoupled decay alone, θ·(1 − lr_i·0.01): warm-up over 2 updates gives
    # lr_0 = lr/2 and lr_1 = lr
    student = tiny_model(tok, 0)
    before = [p.detach().clone() for p in student.parameters()]
    lr = 1e-1
    stage(student, student, tok, ROWS, steps=2, prompts=2, replies=2, topk=16, lr=lr, seed=0, warmup=2)
    for b, p in zip(before, student.parameters()):
        torch.testing.assert_close(p.detach(), b * (1 - lr / 2 * 0.01) * (1 - lr * 0.01), rtol=1e-6, atol=0)


def test_the_stage_moves_the_student_toward_a_sharp_teacher(tok):
    # κ = V: the per-step weighted KL is the exact reverse KL on that step's own samples, which eq. (5) lowers
    student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
    with torch.no_grad():
        expert.lm_head.weight.mul_(8.0)  # a sharp teacher, far (27 nats/token) from the near-uniform student
    kls = stage(student, expert, tok, ROWS, steps=8, prompts=3, replies=2, topk=len(tok), lr=1e-2, seed=0)
    assert kls[0] > 20 and kls[-1] < 0.5 * kls[0]


def test_a_stage_on_given_blocks_times_its_phases(tok):
    # bench_mopd_step.py runs the proxy on the trainer's plan blocks and reads one timing dict per step
    student = tiny_model(tok, 0)
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
        student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
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


class _CountingTeacher(torch.nn.Module):
    """A teacher that counts its forwards (one per prompt of every step it teaches)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


def test_replay_steps_leave_the_new_domain_steps_their_prompts_and_seeds(tok):
    # --replay-every M adds one replay step after every M new-domain steps; the new-domain steps must draw the
    # prompts and samples they draw without replay, so the first update and its KL are those of Seq exactly
    def run(replay):
        student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
        after = []
        kls = stage(student, expert, tok, ROWS, steps=2, prompts=2, replies=2, topk=16, lr=1e-2, seed=0,
                    after_step=lambda i: after.append([p.detach().clone() for p in student.parameters()]),
                    replay=replay(student) if replay else None, replay_every=1)
        return kls, after

    seq_kls, seq_after = run(None)
    kls, after = run(lambda student: [(tiny_model(tok, 2), ROWS)])
    assert len(kls) == len(after) == 2  # replay steps are neither KLs nor after_step calls
    assert kls[0] == seq_kls[0]
    for a, b in zip(after[0], seq_after[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # update 1 is Seq's; the replay step comes after it
    assert kls[1] != seq_kls[1]  # ... and moved the student before update 2


def test_replay_cycles_over_the_earlier_domains_every_m_steps(tok):
    # the shared budget (recipes/mopd/budget/shared.yaml): after new steps 2, 4, 6 the replay steps go to the
    # earlier domains in turn, A, B, A; each replay step forwards its teacher once per prompt
    student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
    a, b = _CountingTeacher(tiny_model(tok, 2)), _CountingTeacher(tiny_model(tok, 3))
    replay_kls = []
    kls = stage(student, expert, tok, ROWS, steps=6, prompts=2, replies=1, topk=16, lr=1e-3, seed=0,
                replay=[(a, ROWS[:3]), (b, ROWS[3:])], replay_every=2, replay_kls=replay_kls)
    assert (a.calls, b.calls) == (2 * 2, 1 * 2)
    assert len(kls) == 6 and len(replay_kls) == 3


def test_the_one_answer_baseline_is_the_share_of_held_out_prompts_with_the_most_common_train_answer(tmp_path):
    # syllogism answers Yes or No: a student that always says the commoner train answer scores exactly the
    # share of held-out prompts with that answer (what the design notes read a syll "gain" against)
    from claas_verl.utils.prompt_rows import write_parquet

    train, test = gym.gym_rows(gym.GymDomain("syll", "syllogism", {}), seed=0)
    paths = gym.GymPaths(tmp_path)
    write_parquet(train, paths.data("syll", "train"))
    write_parquet(test, paths.data("syll", "test"))
    answers = [r["extra_info"]["reference"] for r in train]
    common = max(set(answers), key=answers.count)
    share = sum(r["extra_info"]["reference"] == common for r in test) / len(test)
    assert majority_answer_score(tmp_path, "syll") == (common, round(share, 3))
    assert 0 < share < 1


def test_the_script_runs_the_stages_of_a_bundle_in_the_order_asked(tmp_path, monkeypatch, capsys):
    # the command line end to end at a few steps, on a tiny bundle built by the bundle's own recipe
    from benchmarks import mopd_stage_proxy

    for name in ("BASE_SFT", "GENERALIST_SFT", "SPECIALISE_SFT", "COVER_SFT"):
        monkeypatch.setattr(gym, name, dict(getattr(gym, name), steps=1))
    monkeypatch.setattr(gym, "ACC_PROMPTS", 2)
    monkeypatch.setattr(gym, "N_TEST", 4)  # held-out prompts: the proxy scores every model on all of them
    root = tmp_path / "bundle"
    gym.build_bundle(root, 0)
    argv = ["proxy", "--gym-dir", str(root), "--order", "palin,spell", "--steps", "1", "--prompts", "2",
            "--replies", "1", "--eval-replies", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    mopd_stage_proxy.main()
    out = capsys.readouterr().out
    assert "one answer to every prompt" in out
    assert out.index("stage 1 (palin") < out.index("stage 2 (spell") and "(reverse" not in out
    assert "| 2:spell |" in out and "stage 3" not in out
    monkeypatch.setattr(sys, "argv", [*argv, "--replay-every", "1"])
    mopd_stage_proxy.main()
    out = capsys.readouterr().out
    assert "stage 1 (palin, 1 steps + 0 replay" in out and "stage 2 (spell, 1 steps + 1 replay" in out
    # --json: the stage-end table, the benchmark's run metrics and one record per step, new and replay
    out_json = tmp_path / "run.json"
    monkeypatch.setattr(sys, "argv", [*argv, "--replay-every", "1", "--replay-cycle", "reversed", "--json",
                                      str(out_json), "--probe-prompts", "2"])
    mopd_stage_proxy.main()
    import json

    doc = json.loads(out_json.read_text())
    assert doc["order"] == ["palin", "spell"] and [r["after"] for r in doc["table"]] == ["start", "1:palin", "2:spell"]
    assert doc["host"] == host_signature()
    assert set(doc["metrics"]) >= {"forgetting", "final_avg", "bwt", "stage_gain", "min_stage_gain"}
    assert doc["stage_scores"] == {"1": {"palin": doc["table"][1]["palin"][0]},
                                   "2": {"palin": doc["table"][2]["palin"][0], "spell": doc["table"][2]["spell"][0]}}
    assert [(s["stage"], s["kind"], s["domain"], s["global_step"]) for s in doc["steps"]] == [
        (1, "new", "palin", 1), (2, "new", "spell", 2), (2, "replay", "palin", 3)]
    assert set(doc["steps"][2]["metrics"]) >= {"mopd/probe_kl/palin", "mopd/probe_kl/spell", "mopd/update_norm",
                                                "actor/grad_norm", "mopd/adv_std", "mopd/adv_sigma", "mopd/kl_topk"}
    assert "mopd/probe_kl/spell" not in doc["steps"][0]["metrics"]  # stage 1 has learned palin only
    monkeypatch.setattr(sys, "argv", [*argv, "--replay-every", "-1"])
    with pytest.raises(SystemExit, match="--replay-every must be 0"):
        mopd_stage_proxy.main()
    monkeypatch.setattr(sys, "argv", [*argv[:4], "arith"])
    with pytest.raises(SystemExit, match="unknown domain"):
        mopd_stage_proxy.main()
