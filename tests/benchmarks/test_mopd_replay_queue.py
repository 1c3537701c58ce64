"""benchmarks/mopd_replay_queue.sh: the replay plan's runs as the plan spells them, committed runs skipped.

Only the queue's dry run (``I56_DRY=1``) runs here: it lists the stage-proxy runs a part would start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

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


def test_the_trainer_parts_spell_the_plans_commands(tmp_path):
    """Trainer parts in the dry run: one continual.py line per directory, the arm's key and the second order's."""
    o2 = "mopd.order=[palin,reverse,spell]"
    head = "continual.py --recipes {} --seeds 31,32,33,34,35,36,37,38,39 --jobs 2 --keep-step-logs --out {} " \
           "mopd.probe.enabled=true"
    arms = {"trainer-e3a": ("e3a", "mopd/gym_seq,mopd/gym_replay_kl", "mopd.train.betas=[0.0,0.999]"),
            "trainer-e3b": ("e3b", "mopd/gym_replay_kl", "mopd.train.replay_optimizer=separate"),
            "trainer-e5": ("e5", "mopd/gym_replay_kl", "mopd.replay.cycle=reversed"),
            "trainer-machine": ("e1rerun", "mopd/gym_seq,mopd/gym_replay_kl", "")}
    for part, (name, recipes, key) in arms.items():
        lines = _queue(part, tmp_path)
        expected = [" ".join(filter(None, [head.format(recipes, tmp_path / f"{name}_o{o}"), key, extra]))
                    for o, extra in ((1, ""), (2, o2))]
        assert lines == expected, part


def test_the_trainer_check_is_one_seq_run_at_the_plans_first_rate(tmp_path):
    assert _queue("trainer-check", tmp_path) == [
        f"continual.py --recipes mopd/gym_seq --seeds 31 --jobs 1 --keep-step-logs --out {tmp_path / 'check_trainer'}"
        " mopd.probe.enabled=true"]


def test_every_key_a_trainer_part_sets_is_one_the_recipes_accept(tmp_path):
    """Each part's overrides compose with its recipes, pass the trainer's config checks and build a plan (a misspelt
    or refused key would otherwise cost hours of queue before the run fails)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from continual_methods import config_name, method_overrides  # noqa: PLC0415 - the benchmark's own spelling

    from claas_verl.mopd.config import MopdConfig
    from claas_verl.mopd.recipe_schedule import plan_from_config
    from claas_verl.paths import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        for part in ("trainer-e3a", "trainer-e3b", "trainer-e5", "trainer-e1-3e-4", "trainer-machine"):
            for line in _queue(part, tmp_path):
                recipes = line.split("--recipes ")[1].split()[0].split(",")
                overrides = line.split("mopd.probe.enabled=true")[1].split()
                for recipe in recipes:
                    cfg = compose(config_name=config_name(recipe),
                                  overrides=[*method_overrides(recipe), "mopd.probe.enabled=true", *overrides])
                    MopdConfig.from_config(cfg)
                    assert plan_from_config(cfg).steps, (part, recipe)
