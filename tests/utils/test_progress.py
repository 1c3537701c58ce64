"""Long work reports progress on stderr: a line per report with the count, the elapsed time and an ETA, throttled,
the same in a terminal and in a CI log (no carriage returns). Bundle builds (the SFT/pretraining loops), the
evaluation and the data preparation use it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from claas_verl.utils.progress import Progress, clock, track

FIX = Path(__file__).parent.parent / "fixtures" / "eval"


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lines_are_throttled_and_carry_the_eta(monkeypatch):
    monkeypatch.delenv("CLAAS_PROGRESS_S", raising=False)
    out, now = io.StringIO(), FakeClock()
    p = Progress("[x] sft", 10, "steps", every_s=5.0, stream=out, clock_fn=now)
    for _ in range(10):
        now.t += 1.0  # one second per step
        p.update(loss=0.5)
    lines = out.getvalue().splitlines()
    # the first step, then one line per 5 s, and the last step
    assert lines == ["[x] sft: 1/10 steps (10%), 0:01 elapsed, ETA 0:09 | loss 0.5",
                     "[x] sft: 6/10 steps (60%), 0:06 elapsed, ETA 0:04 | loss 0.5",
                     "[x] sft: 10/10 steps (100%), 0:10 elapsed | loss 0.5"]
    assert "\r" not in out.getvalue()
    assert clock(3725) == "1:02:05" and clock(59.6) == "1:00"


def test_environment_sets_the_interval_or_silences(monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv("CLAAS_PROGRESS_S", "off")
    list(track(range(3), "[x] quiet", stream=out))
    assert out.getvalue() == ""
    monkeypatch.setenv("CLAAS_PROGRESS_S", "0")
    list(track(iter(range(3)), "[x] every", stream=out))
    assert [ln.split(",")[0] for ln in out.getvalue().splitlines()] == [
        "[x] every: 1/3 items (33%)", "[x] every: 2/3 items (67%)", "[x] every: 3/3 items (100%)"]
    monkeypatch.setenv("CLAAS_PROGRESS_S", "often")
    with pytest.raises(ValueError, match=r"\$CLAAS_PROGRESS_S='often': expected seconds"):
        Progress("[x]", 1)


def test_tiny_training_loop_reports_steps(monkeypatch, capsys):
    from claas_verl.tiny.model import build_student, train_lm

    monkeypatch.setenv("CLAAS_PROGRESS_S", "0")
    model = build_student(32, [1], 0, seed=0)
    train_lm(model, [([2, 3], [4, 5])], steps=3, lr=1e-3, batch_size=1, seed=0, prompt_loss=True, pad_token_id=0,
             label="[tiny] pretrain")
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == [f"[tiny] pretrain: {k}/3 steps" for k in (1, 2, 3)]
    assert "ETA" in lines[0] and "| loss " in lines[-1]


def test_evaluation_reports_generation_and_benchmark_runs(tiny, tmp_path, monkeypatch, capsys):
    from claas_verl.mopd.eval import benchmarks
    from claas_verl.mopd.eval.generate import HFGenerator
    from claas_verl.mopd.eval.runner import evaluate_model

    monkeypatch.setenv("CLAAS_PROGRESS_S", "0")
    gen = HFGenerator(str(tiny.student), batch_size=2, max_new_tokens_cap=2)
    data = benchmarks.resolve_data(str(FIX), {})
    evaluate_model(gen, str(tiny.student), tmp_path / "student", ["BBH"], [0, 1], data, limit=3)
    err = capsys.readouterr().err.splitlines()
    assert [ln.split(" (")[0] for ln in err if ln.startswith("[eval] student")] == [
        "[eval] student: 1/2 benchmark runs", "[eval] student: 2/2 benchmark runs"]
    assert [ln.split(" (")[0] for ln in err if ln.startswith("[eval] generate")] == [
        "[eval] generate: 2/3 prompts", "[eval] generate: 3/3 prompts"] * 2
    # a resumed evaluation counts only what is left
    evaluate_model(gen, str(tiny.student), tmp_path / "student", ["BBH"], [0, 1, 2], data, limit=3)
    assert [ln.split(" (")[0] for ln in capsys.readouterr().err.splitlines() if ln.startswith("[eval] student")] \
        == ["[eval] student: 1/1 benchmark runs"]
    assert sorted(json.loads((tmp_path / "student" / "scores.json").read_text())["seeds"]) == ["0", "1", "2"]


def test_data_preparation_reports_accepted_prompts(monkeypatch, capsys):
    from claas_verl.mopd.data.mopd import Candidate, take

    monkeypatch.setenv("CLAAS_PROGRESS_S", "0")
    cands = (Candidate(f"q{i}", f"q{i}", "1", "math_dapo", "test", str(i)) for i in range(10))
    got = take(cands, lambda c: int(c.source_id) % 2 == 0, 3, "math", "test")
    assert [c.source_id for c in got] == ["0", "2", "4"]
    assert [ln.split(" (")[0] for ln in capsys.readouterr().err.splitlines()] == [
        "[data] math: 1/3 prompts", "[data] math: 2/3 prompts", "[data] math: 3/3 prompts"]


def test_an_open_ended_count_has_no_total_and_no_eta(monkeypatch):
    """A stream-driven CLaaS run does not know its number of updates: the line counts them, without a made-up
    total (verl's bar showed ``6/1000000000`` with an ETA of 25 years)."""
    monkeypatch.delenv("CLAAS_PROGRESS_S", raising=False)
    out, now = io.StringIO(), FakeClock()
    p = Progress("[claas] training", None, "updates", every_s=0.0, stream=out, clock_fn=now)
    for _ in range(2):
        now.t += 3.0
        p.update(split="1/2", buffer=5)
    assert out.getvalue().splitlines() == ["[claas] training: 1 updates, 0:03 elapsed | split 1/2, buffer 5",
                                           "[claas] training: 2 updates, 0:06 elapsed | split 1/2, buffer 5"]
