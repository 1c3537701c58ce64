"""A tiny CLaaS stream on CPU: rollout producers, the replay-buffer actor and the LoRA trainer, then M[j, k].

    python examples/run_claas_demo.py [--recipe claas/reinforce_pp] [--scale tiny] [--out DIR] [key=value ...]

Builds the offline tiny model if needed, runs ``python -m claas_verl.main_claas`` (verl + Ray on CPU; the
built-in rule-following environment, 2 splits), then prints the continual metrics of docs/math.md §A.4 — the matrix
M[j, k] (checkpoint after split j evaluated on split k), forward transfer, forgetting, final performance —
and the replay buffer's statistics, and says where the heatmap PNG is; then the benchmark's committed comparison of
the five methods (REINFORCE++, PPO, SDPO, ICL, no update) on the compatible rule stream, paired with no update, and
where its heatmaps are. Other recipes: ``claas/ppo``,
``claas/sdpo``, ``claas/icl`` (``--scale tiny``, the default, runs them on the tiny CPU model). Extra ``key=value``
arguments are Hydra overrides. The demo starts afresh
every time (``trainer.resume_mode=disable``; the recipes themselves resume a killed run: pass
``trainer.resume_mode=auto`` to continue an interrupted demo).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The committed five-method run of the continual benchmark (docs/benchmark.md, "A stream of compatible rules")
COMMITTED = REPO / "benchmarks" / "results" / "continual_claas_compatible"


def _pm(pair, signed: bool = False) -> str:
    mean, hw = pair
    return "n/a" if mean is None else f"{mean:{'+' if signed else ''}.3f}" + ("" if hw is None else f" ± {hw:.3f}")


def committed_comparison(directory: Path = COMMITTED) -> list[str]:
    """The committed comparison as printable lines: per method final and forgetting (mean ± 95% half-width over its
    seeds) and final paired with the no-update baseline seed by seed, as the benchmark computed them."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.continual_claas import label  # the benchmark's method names

    results = json.loads((directory / "results.json").read_text())
    summary, paired = results["summary"], results["claas_paired"]
    base = paired["baseline"]
    seeds = summary[base]["seeds"]
    lines = [f"committed comparison, compatible rule stream, seeds {seeds[0]}-{seeds[-1]} ({directory}):",
             f"  {'method':<12} {'final':>15} {'forgetting':>15} {'final − ' + label(base):>22}"]
    for recipe, row in summary.items():
        diff = "baseline" if recipe == base else _pm(paired["differences"][recipe]["final_avg"], signed=True)
        lines.append(f"  {label(recipe):<12} {_pm(row['final_avg']):>15} {_pm(row['forgetting']):>15} "
                     f"{diff:>22}")
    lines.append(f"  M[j, k] heatmaps: {directory}/claas_M_*.png. The tiny model does not read feedback, so the CLaaS "
                 "paper's comparisons that need one are not testable at this scale (docs/benchmark.md).")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="claas/reinforce_pp")
    ap.add_argument("--scale", default="tiny", help="paper | tiny (recipes/claas/scale/)")
    ap.add_argument("--out", default="/tmp/claas_verl_claas_demo")
    args, overrides = ap.parse_known_args(argv)

    tiny_dir = os.environ.setdefault("CLAAS_TINY_DIR", "/tmp/claas_verl_tiny")
    subprocess.run([sys.executable, "-m", "claas_verl.tiny", "make", tiny_dir], check=True, cwd=REPO)

    env = dict(os.environ, CLAAS_OUT_DIR=args.out, PYTHONUNBUFFERED="1")
    if not any(o.lstrip("+~").startswith("trainer.resume_mode=") for o in overrides):
        overrides.append("trainer.resume_mode=disable")  # a demo run starts afresh in its fixed folder
    cmd = [sys.executable, "-m", "claas_verl.main_claas", f"--config-name={args.recipe}",
           f"scale={args.scale}", *overrides]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env)
    if proc.returncode != 0:
        return proc.returncode

    found = sorted(Path(args.out).glob("*/continual_metrics.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        print(f"no continual_metrics.json under {args.out}", file=sys.stderr)
        return 1
    metrics_path = found[-1]
    metrics = json.loads(metrics_path.read_text())
    print("\nM[j, k] (rows: checkpoint after split j; columns: split k; defender pass rate)")
    for j, row in enumerate(metrics["M"], start=1):
        print(f"  j={j}: " + "  ".join(f"{v:.3f}" for v in row))
    for key in ("forward_transfer", "forgetting", "final"):
        print(f"{key:>17}: {metrics.get(key)}")
    stats = metrics.get("buffer_stats") or {}
    keep = ("inserted", "dropped_none", "evicted_fifo", "evicted_age", "sampled", "update_count", "max_uses")
    print("     replay buffer: " + ", ".join(f"{k}={stats[k]}" for k in keep if k in stats))
    print(f"\nwritten: {metrics_path}, {metrics_path.with_name('continual_matrix.csv')}, "
          f"{metrics_path.with_name('continual_matrix.png')} (heatmap)\n")
    print("\n".join(committed_comparison()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
