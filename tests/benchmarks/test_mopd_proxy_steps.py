"""The stage proxy's replay arms and per-step log (benchmarks/mopd_proxy_steps.py, ``mopd_stage_proxy.py --json``;
benchmarks/plans/mopd_replay.md): the fixed probe's exact KL, the update norm, and each arm flag doing what it says
while the paper's defaults change no bit."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from proxy_fixtures import ROWS, tiny_model  # noqa: E402

from benchmarks import mopd_stage_proxy  # noqa: E402
from benchmarks.mopd_proxy_steps import (  # noqa: E402
    FixedProbe,
    Optimisers,
    ReplayArm,
    full_kl_token_mean,
    parameters_copy,
    update_norm,
)
from benchmarks.mopd_stage_proxy import stage  # noqa: E402
from claas_verl.tiny import gym  # noqa: E402


def _probe(model, tok, prompts=("ab", "cd")):
    eos, pad = gym.stop_and_pad_ids(tok)
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    return FixedProbe(model, {"x": ids, "y": ids[:1]}, replies=2, seed=0, max_new_tokens=6, eos_ids=[eos], pad_id=pad)


def test_the_full_kl_is_the_hand_computed_value():
    # p = [0.5, 0.5], q = [0.9, 0.1]: KL(p || q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5·(−0.58779) + 0.5·1.60944
    # = 0.51083; the second token is masked out, so the sum is one token's
    p = torch.tensor([[[0.5, 0.5], [0.2, 0.8]]]).log()
    q = torch.tensor([[[0.9, 0.1], [0.9, 0.1]]]).log()
    total, tokens = full_kl_token_mean(p, q, torch.tensor([[1.0, 0.0]]))
    assert tokens == 1 and total == pytest.approx(0.51083, abs=1e-5)
    assert full_kl_token_mean(p, p, torch.ones(1, 2)) == (0.0, 2)


def test_the_probe_kl_of_a_model_to_itself_is_zero_and_to_a_perturbed_copy_positive(tok):
    model = tiny_model(tok, 0)
    probe = _probe(model, tok)
    assert probe.domains == ["x", "y"]
    assert probe.kl(model) == {"mopd/probe_kl/x": 0.0, "mopd/probe_kl/y": 0.0}
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.add_(0.5 * torch.randn_like(moved.lm_head.weight))
    kl = probe.kl(moved)
    assert kl["mopd/probe_kl/x"] > 1e-3 and kl["mopd/probe_kl/y"] > 1e-3


def test_the_probe_sequences_are_fixed_when_the_student_trains(tok):
    # the reference's log-probs and sequences are taken at the stage start: training the very model they came from
    # changes neither, and the probe then measures the drift (> 0); the same model and seed sample the same probe
    student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
    probe = _probe(student, tok)
    before = [s.clone() for s in probe.sequences("x")]
    records = []
    stage(student, expert, tok, ROWS, steps=2, prompts=2, replies=2, topk=16, lr=1e-2, seed=0, records=records,
          probe=probe, domain="x")
    assert all(torch.equal(a, b) for a, b in zip(before, probe.sequences("x")))
    drift = [r["metrics"]["mopd/probe_kl/x"] for r in records]
    assert drift[0] > 0 and drift[1] > drift[0]  # two steps toward another teacher move further from M_{k-1}
    again = _probe(tiny_model(tok, 0), tok)
    assert all(torch.equal(a, b) for a, b in zip(before, again.sequences("x")))


def test_the_update_norm_is_the_parameter_distance():
    # θ moves by +0.3 in 4 entries and −0.4 in 3 others: ‖Δθ‖ = sqrt(4·0.09 + 3·0.16) = sqrt(0.84)
    model = torch.nn.Linear(2, 2, bias=True)
    before = parameters_copy(model)
    with torch.no_grad():
        model.weight.add_(0.3)
        model.bias.add_(torch.tensor([-0.4, 0.0]))
        model.bias[1].sub_(0.4 * math.sqrt(2))
    assert update_norm(before, model) == pytest.approx(math.sqrt(0.84), rel=1e-6)


def test_each_step_is_logged_with_the_trainers_fields_and_logging_changes_nothing(tok):
    def run(log):
        student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
        records = [] if log else None
        kls = stage(student, expert, tok, ROWS, steps=2, prompts=2, replies=2, topk=16, lr=1e-2, seed=0,
                    replay=[(tiny_model(tok, 2), ROWS)], replay_every=1, records=records,
                    probe=_probe(student, tok) if log else None, stage_no=2, domain="new_d", replay_domains=["old"])
        return kls, [p.detach().clone() for p in student.parameters()], records

    kls, weights, records = run(True)
    plain_kls, plain_weights, _ = run(False)
    assert kls == plain_kls and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert [(r["kind"], r["domain"], r["block"], r["teacher"], r["global_step"]) for r in records] == [
        ("new", "new_d", 0, "expert:new_d", 1), ("replay", "old", 0, "student:1", 2),
        ("new", "new_d", 1, "expert:new_d", 3), ("replay", "old", 1, "student:1", 4)]
    for r in records:
        m = r["metrics"]
        assert r["stage"] == 2 and m["actor/grad_norm"] > 0 and m["mopd/update_norm"] > 0
        assert m["mopd/adv_sigma"] == m["mopd/adv_std"] > 0 and math.isfinite(m["mopd/kl_topk"])
        assert {"mopd/probe_kl/x", "mopd/probe_kl/y"} <= set(m)
        # the paper's arm logs no arm field (the plan: logged when the arm's key is set)
        assert not {"mopd/replay_weight", "mopd/optimizer_state", "mopd/responses_per_prompt"} & set(m)


def _replay_run(tok, arm, steps=1, replay_every=1, replay=None, records=None):
    student, expert = tiny_model(tok, 0), tiny_model(tok, 1)
    records = [] if records is None else records
    stage(student, expert, tok, ROWS, steps=steps, prompts=2, replies=2, topk=16, lr=1e-2, seed=0,
          replay=replay or [(tiny_model(tok, 2), ROWS)], replay_every=replay_every, records=records, arm=arm,
          stage_no=3, domain="c", replay_domains=["a", "b"][: len(replay or [1])])
    return records, [p.detach().clone() for p in student.parameters()]


def test_the_replay_weight_scales_the_replay_gradient(tok):
    # the new step is the same in both runs, and the replay step sees the same weights and samples, so its gradient
    # (linear in the advantages) is c times the paper's: grad-norm ratio 0.25
    paper, w_paper = _replay_run(tok, ReplayArm())
    weighted, _ = _replay_run(tok, ReplayArm(weight=0.25))
    assert weighted[0]["metrics"]["actor/grad_norm"] == paper[0]["metrics"]["actor/grad_norm"]
    ratio = weighted[1]["metrics"]["actor/grad_norm"] / paper[1]["metrics"]["actor/grad_norm"]
    assert ratio == pytest.approx(0.25, rel=1e-5)
    assert weighted[1]["metrics"]["mopd/replay_weight"] == 0.25 and weighted[0]["metrics"]["mopd/replay_weight"] == 1
    _, w_default = _replay_run(tok, ReplayArm(weight=1.0))
    assert all(torch.equal(a, b) for a, b in zip(w_paper, w_default))


def test_replay_replies_change_only_the_replay_steps_sample_count(tok, monkeypatch):
    asked = []
    real = mopd_stage_proxy.sample_replies

    def counting(model, prompt_ids, n, *args):
        asked.append(n)
        return real(model, prompt_ids, n, *args)

    monkeypatch.setattr(mopd_stage_proxy, "sample_replies", counting)
    records, _ = _replay_run(tok, ReplayArm(replies=8), steps=2)
    assert asked == [2, 2, 8, 8, 2, 2, 8, 8]  # 2 prompts per step: new, replay, new, replay
    assert [r["metrics"]["mopd/responses_per_prompt"] for r in records] == [2, 8, 2, 8]


def test_the_reversed_cycle_replays_the_first_domain_last(tok):
    replay = [(tiny_model(tok, 2), ROWS[:3]), (tiny_model(tok, 3), ROWS[3:])]
    fwd, _ = _replay_run(tok, ReplayArm(), steps=4, replay=replay)
    rev, _ = _replay_run(tok, ReplayArm(cycle="reversed"), steps=4, replay=replay)
    assert [r["domain"] for r in fwd if r["kind"] == "replay"] == ["a", "b", "a", "b"]
    assert [r["domain"] for r in rev if r["kind"] == "replay"] == ["b", "a", "b", "a"]
    assert fwd[0] == rev[0]  # the first new step precedes every replay


def test_a_separate_replay_optimizer_keeps_its_own_adamw_state(tok):
    model = tiny_model(tok, 0)
    opts = Optimisers(model, 1e-3, ReplayArm(optimizer="separate", beta1=0.0))
    main, replay = opts.for_step(replay=False), opts.for_step(replay=True)
    assert main[0] is not replay[0] and opts.for_step(replay=True)[0] is replay[0]
    assert main[0].param_groups[0]["betas"] == (0.0, 0.999) == replay[0].param_groups[0]["betas"]
    shared = Optimisers(model, 1e-3, ReplayArm())
    assert shared.for_step(replay=True)[0] is shared.for_step(replay=False)[0]
    # in a stage: the new step before any replay is the shared run's exactly; the replay step then starts a fresh
    # state (its first AdamW update moves every weight by about lr), not the new step's, so it moves differently
    records, _ = _replay_run(tok, ReplayArm(optimizer="separate"), steps=2)
    assert [r["metrics"]["mopd/optimizer_state"] for r in records] == [0, 1, 0, 1]
    shared_records, _ = _replay_run(tok, ReplayArm(), steps=2)
    assert records[0] == {**shared_records[0], "metrics": {**shared_records[0]["metrics"], "mopd/optimizer_state": 0}}
    assert records[1]["metrics"]["mopd/update_norm"] != shared_records[1]["metrics"]["mopd/update_norm"]


@pytest.mark.parametrize("flags, message", [
    (["--replay-weight", "0.5"], "give --replay-every M too"),
    (["--replay-every", "3", "--replay-weight", "0"], "--replay-weight must be a finite number > 0"),
    (["--replay-every", "3", "--replay-replies", "0"], "--replay-replies must be at least 1"),
    (["--beta1", "1.0"], r"--beta1 must be in \[0, 1\)"),
    (["--probe-prompts", "0"], "--probe-prompts must be at least 1"),
])
def test_bad_arm_flags_are_refused_before_anything_loads(flags, message):
    with pytest.raises(SystemExit, match=message):
        mopd_stage_proxy.main(["--gym-dir", "/nonexistent", *flags])
