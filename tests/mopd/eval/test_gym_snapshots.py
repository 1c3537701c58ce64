"""The continual benchmark's snapshot scorer: exact full-vocabulary KL on right-padded replies, seeded sampling that
stops at the stop token, and reasoning-gym scoring of the decoded replies (tiny random models, no bundle build)."""

from __future__ import annotations

import pytest
import torch

from claas_verl.mopd.eval import gym_snapshots
from claas_verl.tiny import gym
from claas_verl.tiny.model import build_student, save_model
from claas_verl.tiny.tokenizer import EOT_TOKEN, IM_END, special_token_ids


@pytest.fixture(scope="module")
def tok():
    return gym.byte_tokenizer()


def _model(tok, seed: int):
    ids = special_token_ids(tok)
    return build_student(len(tok), [ids[IM_END], ids[EOT_TOKEN]], ids[EOT_TOKEN], seed)


@pytest.fixture(scope="module")
def reverse_rows():
    _, test = gym.gym_rows(next(d for d in gym.GYM_DOMAINS if d.name == "reverse"), seed=0)
    return test[:3]


def _direct_kl(student, expert, prompt, reply) -> tuple[float, int]:
    """Σ over reply tokens of Σ_v p_s (log p_s − log p_E), one unpadded sequence at a time."""
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        ls = torch.log_softmax(student(input_ids=ids).logits[0], -1)
        le = torch.log_softmax(expert(input_ids=ids).logits[0], -1)
    total = 0.0
    for j in range(len(reply)):
        t = len(prompt) + j - 1  # the position whose logits predict reply token j
        total += float((ls[t].exp() * (ls[t] - le[t])).sum())
    return total, len(reply)


def test_reply_kl_on_padded_batch_equals_per_sequence_kl(tok):
    student, expert = _model(tok, 1), _model(tok, 2)
    prompt = [5, 17, 99, 3]
    replies = [[40, 41, 42, 2], [7], [], [8, 9]]  # ragged, one empty (no token, nothing to average)
    kl, n = gym_snapshots.reply_kl_sum(student, expert, prompt, replies)
    want = [_direct_kl(student, expert, prompt, r) for r in replies if r]
    assert n == sum(w[1] for w in want) == 7
    assert kl == pytest.approx(sum(w[0] for w in want), rel=1e-5)
    assert kl > 0
    same, _ = gym_snapshots.reply_kl_sum(student, student, prompt, replies)
    assert same == pytest.approx(0.0, abs=1e-5)  # KL(p || p) = 0


def test_sampling_is_seeded_and_stops_at_the_stop_token(tok):
    model = _model(tok, 3)
    eos = [special_token_ids(tok)[IM_END]]
    prompt = tok.encode("hello", add_special_tokens=False)
    torch.manual_seed(0)
    a = gym_snapshots.sample_replies(model, prompt, 6, 12, 1.0, eos, 0)
    torch.manual_seed(0)
    b = gym_snapshots.sample_replies(model, prompt, 6, 12, 1.0, eos, 0)
    assert a == b and len(a) == 6
    for r in a:
        assert 1 <= len(r) <= 12
        assert all(t not in eos for t in r[:-1])  # nothing after a stop token is kept
    assert gym_snapshots.sampling_seed(1, "student_1/spell") != gym_snapshots.sampling_seed(2, "student_1/spell")
    assert gym_snapshots.sampling_seed(1, "student_1/spell") == gym_snapshots.sampling_seed(1, "student_1/spell")


def test_score_snapshot_decodes_and_scores_with_reasoning_gym(tok, reverse_rows, tmp_path, monkeypatch):
    path = tmp_path / "m"
    save_model(_model(tok, 4), tok, path)
    end = special_token_ids(tok)[IM_END]
    answers = iter([r["reward_model"]["ground_truth"] for r in reverse_rows])

    def right_then_wrong(model, prompt_ids, n, *args):
        truth = next(answers)
        right = tok.encode(truth, add_special_tokens=False) + [end]
        return [right] + [tok.encode("no", add_special_tokens=False) + [end]] * (n - 1)

    monkeypatch.setattr(gym_snapshots, "sample_replies", right_then_wrong)
    s = gym_snapshots.score_snapshot(str(path), reverse_rows, expert_path=None, n=4, max_new_tokens=8, temperature=1.0,
                                     seed=0, tag="t")
    assert (s.replies, s.kl, s.tokens) == (12, None, 0)
    assert s.score == pytest.approx(1 / 4)  # one exact answer of four per prompt, "no" scores 0


def test_score_snapshot_is_reproducible_and_kl_is_zero_to_itself(tok, reverse_rows, tmp_path):
    path = tmp_path / "m"
    save_model(_model(tok, 5), tok, path)
    kw = dict(n=2, max_new_tokens=6, temperature=1.0, seed=3, tag="student_1/reverse")
    a = gym_snapshots.score_snapshot(str(path), reverse_rows, expert_path=str(path), **kw)
    b = gym_snapshots.score_snapshot(str(path), reverse_rows, expert_path=str(path), **kw)
    assert a == b and a.replies == 6 and a.tokens > 0
    assert a.kl == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        gym_snapshots.score_snapshot(str(path), reverse_rows, expert_path=None, **{**kw, "temperature": 0.0})
