"""The per-step console line of a MOPD run (claas_verl.mopd.trainer.stage_progress): pure python, hand-checked cases."""

from __future__ import annotations

from claas_verl.mopd.trainer.plan_steps import stage_bounds
from claas_verl.mopd.trainer.stage_progress import StageProgress


def test_the_step_line_gives_the_stage_position_and_an_eta_from_this_process_steps(small_plan):
    # stages of 4 steps (shared budget above); a clock that advances 10 s per step
    _, steps = small_plan("shared")
    now = [0.0]
    progress = StageProgress(steps, stage_bounds(steps), clock_fn=lambda: now[0])
    progress.begin(2)
    lines = []
    for gs in (5, 6, 7, 8):
        now[0] += 10
        lines.append(progress.line(gs, {"mopd/kl_topk": 0.25, "mopd/adv_sigma": 1.5}))
    s = steps[4]
    assert lines[0] == (f"[mopd] step 5/12 stage 2/3: 1/4 steps (25%), 0:10 elapsed, ETA 0:30 | {s['kind']} "
                        f"{s['domain']} block {s['block']} teacher {s['teacher']}, kl_topk 0.2500, sigma 1.5")
    assert ", 0:20 elapsed, ETA 0:20 |" in lines[1] and "4/4 steps (100%), 0:40 elapsed |" in lines[3]
    # the benchmark times steps by the line's opening "[mopd] step N/L"
    assert [int(x.split("[mopd] step ", 1)[1].split("/", 1)[0]) for x in lines] == [5, 6, 7, 8]
    # resumed mid-stage at global step 7: the rate is this process's (1 step in 30 s), the position the plan's
    resumed = StageProgress(steps, stage_bounds(steps), clock_fn=lambda: now[0])
    resumed.begin(2)
    now[0] += 30
    assert "stage 2/3: 3/4 steps (75%), 0:30 elapsed, ETA 0:30 |" in resumed.line(7, {})
