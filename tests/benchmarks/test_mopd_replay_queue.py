"""benchmarks/mopd_replay_queue.sh: the replay plan's runs as the plan spells them, committed runs skipped.

Only the queue's dry run (``I56_DRY=1``) runs here: it lists the stage-proxy runs a part would start."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "mopd_replay_queue.sh"


def _dry(part: str, work: Path, committed: Path | None = None) -> subprocess.CompletedProcess:
    """The queue's dry run of ``part``; ``committed`` stands in for benchmarks/results/ (default: the real one)."""
    env = {"PATH": "/usr/bin:/bin", "I56_DRY": "1", "I56_DIR": str(work)}
    if committed is not None:
        env["I56_RESULTS"] = str(committed)
    return subprocess.run(["bash", str(SCRIPT), part], capture_output=True, text=True, env=env, timeout=60)


def _queue(part: str, work: Path, committed: Path | None = None) -> list[str]:
    done = _dry(part, work, committed)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if not line.startswith("== ")]


def test_committed_parts_queue_nothing(tmp_path):
    """Every committed proxy record is found under the name the queue gives it, so a rerun starts none of them."""
    assert _queue("proxy-e1-1e-3", tmp_path) == []
    assert _queue("proxy-e2", tmp_path) == []
    assert _queue("proxy-e1-3e-4", tmp_path) == []
    assert _queue("proxy-mech", tmp_path) == []


def test_mechanism_arms_follow_the_plan(tmp_path):
    lines = _queue("proxy-mech", tmp_path / "work", committed=tmp_path / "none")
    assert len(lines) == 6 * 2 * 9  # six arms, two orders, seeds 10-18
    for arm, flags in {"seq_b0": "--beta1 0", "paper_b0": "--beta1 0 --replay-every 3",
                       "e3b": "--replay-every 3 --replay-optimizer separate",
                       "e4c0.196": "--replay-every 3 --replay-weight 0.196",
                       "e4c0.3": "--replay-every 3 --replay-weight 0.3",
                       "e5": "--replay-every 3 --replay-cycle reversed"}.items():
        runs = [line for line in lines if f"/mech/{arm}_lr1e-3_n12_" in line]
        assert len(runs) == 18, arm
        assert all(line.split(" --steps 12", 1)[1].split() == ([] if "_o1_" in line else
                                                               ["--order", "palin,reverse,spell"]) + flags.split()
                   for line in runs), arm
        assert sorted(int(line.split("--seed ")[1].split()[0]) for line in runs) == sorted(list(range(10, 19)) * 2)


def test_every_queue_line_is_one_run_for_xargs(tmp_path):
    """``xargs -L 1`` joins a line that ends in a blank to the next one: Seq's lines (no flags after the order) did,
    and three runs went to one proxy process, which refused them."""
    lines = _queue("proxy-e1-1e-4", tmp_path / "work", committed=tmp_path / "none")
    assert len(lines) == 54 and all(line == line.rstrip() for line in lines)
    seq = [line for line in lines if "/e1/seq_" in line]
    assert seq[0].endswith("--steps 120") and seq[-1].endswith("--steps 120 --order palin,reverse,spell")


def test_a_finished_run_in_the_work_folder_is_skipped(tmp_path):
    (tmp_path / "proxy" / "mech").mkdir(parents=True)
    (tmp_path / "proxy" / "mech" / "e5_lr1e-3_n12_o2_s13.json").write_text("{}")
    committed = tmp_path / "committed" / "i56_proxy" / "mech"
    committed.mkdir(parents=True)
    (committed / "e3b_lr1e-3_n12_o1_s10.json").write_text("{}")
    lines = _queue("proxy-mech", tmp_path, committed=tmp_path / "committed")
    assert len(lines) == 106
    assert not any("/e5_lr1e-3_n12_o2_s13 " in line or "/e3b_lr1e-3_n12_o1_s10 " in line for line in lines)


def test_an_unknown_part_is_refused(tmp_path):
    done = _dry("proxy-e9", tmp_path)
    assert done.returncode == 2
    assert "unknown part 'proxy-e9'" in done.stderr
