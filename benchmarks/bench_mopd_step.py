"""How far is a MOPD trainer step from its compute? The real ``mopd/seq scale=gym`` job next to the stage proxy.

    python benchmarks/bench_mopd_step.py                      # 5 trainer steps and 5 proxy steps, each run twice
    python benchmarks/bench_mopd_step.py --steps 4 --repeats 3 --out DIR
    python benchmarks/bench_mopd_step.py --proxy-only         # only the in-process proxy (seconds)

Trainer: ``python -m claas_verl.main_mopd --config-name mopd/seq scale=gym`` through its real entry point (Ray, verl's
v1 sync trainer, FSDP2 on CPU, the ``hf`` rollout, TransferQueue, reward workers) for ``--steps`` steps, with the
benchmark's own overrides (``benchmarks/continual.py``: no periodic checkpoint, no in-run evaluation). Its phases
are verl's ``timing_s/*`` metrics (verl's file logger); its wall step is the time between two consecutive
``[mopd] step N`` lines, which also covers what verl does after its ``step`` timer (metrics, logging, clearing
TransferQueue). Proxy: ``benchmarks/mopd_stage_proxy.py``'s step (Hugging Face ``generate``, the same top-κ math,
one AdamW update, one process, one thread) on the same prompts (the plan's first blocks, checked against the
trainer's ``steps.jsonl``), the same replies per prompt and the same κ, from the same π0 and expert.

The first step of each is left out (the trainer loads the stage's teacher and builds a fresh optimizer there; a
stage costs it once). Each side runs ``--repeats`` times; the table shows the run with the smallest mean step
(the CPU is shared: the minimum is the least disturbed measurement). The trainer's stage-end checkpoint and
snapshot are not in these steps (once per stage; ``--steps 12`` reaches the end of stage 1 and shows it as
``timing_s/save_checkpoint`` of the last step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_jobs import job_env, run_job, stopping_jobs_on_signals  # noqa: E402

RECIPE = "mopd/seq"
SCALE = "scale=gym"  # the continual benchmark's scale (docs/recipes.md)
# As in benchmarks/continual.py (RUN_OVERRIDES): what the benchmark's own runs use
OVERRIDES = ["trainer.save_freq=-1", "trainer.resume_mode=disable", "mopd.eval.enabled=false"]
# verl's phases in the order a step runs them; the proxy has the ones marked in PROXY_PHASES
TRAINER_PHASES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "save_checkpoint", "update_weights")
PROXY_PHASES = {"gen": "gen", "old_log_prob": "old_log_prob", "adv": "teacher", "update_actor": "update_actor"}
STEP_LINE = "[mopd] step "


def recipe_sizes(steps: int) -> dict:
    """Block size, replies per prompt, κ, learning rate and the first ``steps`` plan steps' ``(domain, block)`` of
    ``RECIPE``, composed as its trainer job composes it."""
    from hydra import compose, initialize_config_dir

    from claas_verl.mopd.recipe_schedule import plan_from_config
    from claas_verl.paths import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(config_name=RECIPE, overrides=[SCALE])
    plan = [s.to_dict() for s in plan_from_config(cfg).steps][:steps]
    return {"block_size": int(cfg.mopd.block_size), "replies": int(cfg.mopd.train.responses_per_prompt),
            "topk": int(cfg.mopd.train.topk), "lr": float(cfg.mopd.train.lr),
            "blocks": [(s["domain"], int(s["block"])) for s in plan]}


# ---------------------------------------------------------------------------------------------------- trainer
def trainer_run(out: Path, steps: int, seed: int, sizes: dict, extra: list[str]) -> dict:
    """One ``RECIPE`` job of ``steps`` steps; returns ``{"steps": [per-step dict], "job_s": float}``."""
    name = f"bench_step_{int(time.time() * 1000)}"
    metrics_file = out / f"{name}.metrics.jsonl"
    cmd = [sys.executable, "-m", "claas_verl.main_mopd", f"--config-name={RECIPE}", SCALE,
           f"trainer.experiment_name={name}", f"trainer.total_training_steps={steps}",
           f"actor_rollout_ref.rollout.seed={seed}", f"actor_rollout_ref.actor.data_loader_seed={seed}",
           "trainer.logger=[console,file]", *OVERRIDES, *extra]
    seen: dict[int, float] = {}

    def stamp(line: str) -> None:
        if STEP_LINE in line:  # "[mopd] step N/L stage=..."
            n = int(line.split(STEP_LINE, 1)[1].split("/", 1)[0])
            seen[n] = time.perf_counter()
        return None

    job_s = run_job(cmd, job_env(CLAAS_OUT_DIR=str(out / "runs"), VERL_FILE_LOGGER_PATH=str(metrics_file)),
                    out / f"{name}.log", stamp)
    logged = {int(r["step"]): r["data"] for r in map(json.loads, metrics_file.read_text().splitlines())}
    audit = [json.loads(line) for line in (out / "runs" / name / "steps.jsonl").read_text().splitlines()]
    rows = []
    for rec in audit:
        n = rec["global_step"]
        data = logged[n]
        row = {p: float(data.get(f"timing_s/{p}", 0.0)) for p in TRAINER_PHASES}
        row.update(step=float(data["timing_s/step"]), domain=rec["domain"], block=int(rec["block"]),
                   response_tokens=float(data["response_length/mean"]) * sizes["block_size"]
                   * sizes["replies"])
        row["wall"] = seen[n] - seen[n - 1] if n - 1 in seen else float("nan")
        rows.append(row)
    return {"steps": rows, "job_s": job_s}


# ---------------------------------------------------------------------------------------------------- proxy
def proxy_run(steps: int, seed: int, sizes: dict) -> dict:
    """The proxy's stage on the plan's first ``steps`` blocks (one domain), from π0; per-step phase seconds."""
    import torch

    from benchmarks.mopd_stage_proxy import read_rows, stage
    from claas_verl.mopd.eval.gym_snapshots import load_model
    from claas_verl.tiny import gym

    paths = gym.GymPaths(Path(os.environ["CLAAS_GYM_DIR"]))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths.student)
    domain = sizes["blocks"][0][0]
    student, expert = load_model(str(paths.student)), load_model(str(paths.expert(domain)))
    torch.set_num_threads(1)
    domains = {d for d, _ in sizes["blocks"]}
    if len(domains) != 1:
        raise SystemExit(f"{RECIPE}'s first {steps} steps span the domains {sorted(domains)}: lower --steps")
    (domain,) = domains
    rows = read_rows(paths.root, domain, "train")
    b = sizes["block_size"]
    blocks = [rows[i * b: (i + 1) * b] for _, i in sizes["blocks"]]
    timings: list[dict] = []
    stage(student, expert, tok, rows, steps=steps, prompts=b, replies=sizes["replies"], topk=sizes["topk"],
          lr=sizes["lr"], seed=seed, blocks=blocks, timings=timings)
    out = []
    for t in timings:
        row = {p: t.get(PROXY_PHASES[p], 0.0) if p in PROXY_PHASES else 0.0 for p in TRAINER_PHASES}
        row.update(step=t["step"], wall=t["step"], response_tokens=t["response_tokens"])
        out.append(row)
    return {"steps": out}


# ---------------------------------------------------------------------------------------------------- report
def mean_of(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def best(runs: list[dict]) -> dict:
    """The run (its steps after the first) with the smallest mean wall step; the per-key means of those steps."""
    measured = [r["steps"][1:] for r in runs]
    rows = min(measured, key=lambda s: mean_of(s, "wall"))
    keys = (*TRAINER_PHASES, "step", "wall", "response_tokens")
    return {k: mean_of(rows, k) for k in keys} | {"all_walls": [round(mean_of(s, "wall"), 3) for s in measured]}


def table(trainer: dict | None, proxy: dict) -> str:
    lines = ["| phase | trainer s | proxy s |", "|---|---:|---:|"]
    for p in (*TRAINER_PHASES, "step"):
        t = f"{trainer[p]:.3f}" if trainer else "-"
        lines.append(f"| {p} | {t} | {proxy[p]:.3f} |" if p in PROXY_PHASES or p == "step"
                     else f"| {p} | {t} | - |")
    t = f"{trainer['wall']:.3f}" if trainer else "-"
    lines.append(f"| **wall step** | **{t}** | **{proxy['wall']:.3f}** |")
    tt = f"{trainer['response_tokens']:.0f}" if trainer else "-"
    lines.append(f"| reply tokens per step | {tt} | {proxy['response_tokens']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first is left out; at least 2)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side (the fastest is reported)")
    ap.add_argument("--seed", type=int, default=1, help="rollout seed of both sides")
    ap.add_argument("--out", default=None, help="folder for the trainer jobs' logs and metrics (default: a temp dir)")
    ap.add_argument("--proxy-only", action="store_true", help="skip the trainer jobs")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for the trainer job")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps must be at least 2 (the first step is left out); got {args.steps}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1; got {args.repeats}")
    from claas_verl.tiny.gym import ensure_gym

    os.environ["CLAAS_GYM_DIR"] = str(ensure_gym().root)
    sizes = recipe_sizes(args.steps)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_mopd_step_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{RECIPE} {SCALE}: {sizes['block_size']} prompts x {sizes['replies']} replies per step, "
          f"kappa {sizes['topk']}; {args.steps} steps per run, {args.repeats} runs each; logs in {out}",
          flush=True)
    proxy_runs = []
    for i in range(args.repeats):
        proxy_runs.append(proxy_run(args.steps, args.seed, sizes))
        print(f"proxy run {i + 1}: wall step {mean_of(proxy_runs[-1]['steps'][1:], 'wall'):.3f} s", flush=True)
    trainer_runs = []
    if not args.proxy_only:
        with stopping_jobs_on_signals():
            for i in range(args.repeats):
                run = trainer_run(out, args.steps, args.seed, sizes, args.overrides)
                blocks = [(r["domain"], r["block"]) for r in run["steps"]]
                if blocks != [tuple(b) for b in sizes["blocks"]]:
                    raise SystemExit(f"the trainer ran the blocks {blocks}, the proxy {sizes['blocks']}: the "
                                     "comparison would not be on the same prompts")
                trainer_runs.append(run)
                print(f"trainer run {i + 1}: wall step {mean_of(run['steps'][1:], 'wall'):.3f} s "
                      f"(job {run['job_s']:.0f} s)", flush=True)
    proxy = best(proxy_runs)
    trainer = best(trainer_runs) if trainer_runs else None
    print("\n" + table(trainer, proxy))
    result = {"recipe": f"{RECIPE} {SCALE}", "sizes": sizes, "steps": args.steps, "repeats": args.repeats,
              "proxy": proxy, "trainer": trainer}
    if trainer:
        ratio = trainer["wall"] / proxy["wall"]
        result["ratio"] = ratio
        print(f"\ntrainer / proxy wall step: {ratio:.2f}x  (trainer runs {trainer['all_walls']} s, "
              f"proxy runs {proxy['all_walls']} s; mean of steps 2..{args.steps}, fastest run)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
