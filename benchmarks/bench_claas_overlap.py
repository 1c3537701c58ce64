"""How much training slows rollouts down in the CLaaS trainer (CLaaS paper Fig. 7: training hidden behind inference).

Runs the tiny CLaaS stream twice through ``python -m claas_verl.main_claas`` (as a user would):

1. rollout alone: ``claas.algorithm=icl`` with the ICL memory effectively off (no parameter updates);
2. rollout with training: ``claas/reinforce_pp scale=tiny`` (producers and the trainer run concurrently);

and prints

- rollout throughput (generated tokens per second of rollout wall time) of both, and their ratio
  (target >= 0.9 where rollout and training have their own devices; on a shared 2-core CPU both
  compete for the same cores, so expect less);
- the staleness distribution: policy-version lag ``(k - 1) - P`` of every sampled entry;
- the trainer's idle time waiting for the buffer, as a share of its wall time.

Split evaluation is switched off (``claas.eval.enabled=false``) so only rollout and training run.

    python benchmarks/bench_claas_overlap.py [--scenarios-per-split 4] [--splits 2] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(recipe: str, out: Path, args, extra: list[str]) -> dict:
    n = args.splits * args.scenarios_per_split
    cmd = [
        sys.executable, "-m", "claas_verl.main_claas", "--config-name", f"claas/{recipe}",
        "claas.eval.enabled=false", f"claas.stream.num_splits={args.splits}",
        f"claas.stream.split_size={args.scenarios_per_split}", f"claas.env.kwargs.num_scenarios={n}",
        f"claas.producer.max_new_tokens={args.max_new_tokens}", *extra,
    ]
    env = dict(os.environ, CLAAS_OUT_DIR=str(out), PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write((proc.stdout + proc.stderr)[-4000:])
        raise SystemExit(f"{recipe} failed with exit code {proc.returncode}")
    run_dir = out / f"claas_{recipe}"
    metrics = json.loads((run_dir / "continual_metrics.json").read_text())
    trace = [json.loads(line) for line in (run_dir / "claas_trace.jsonl").read_text().splitlines()]
    return {"metrics": metrics, "trace": trace, "process_s": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splits", type=int, default=2)
    p.add_argument("--scenarios-per-split", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="claas_bench_") as tmp:
        # The ICL memory budget of 1 token rejects every item: the baseline generates with plain prompts.
        alone = run("tiny_icl", Path(tmp) / "alone", args, ["claas.icl.token_budget=1"])
        train = run("tiny_reinforce_pp", Path(tmp) / "train", args, [])
    pa, pt = alone["metrics"]["producer"], train["metrics"]["producer"]
    ratio = pt["tokens_per_s"] / pa["tokens_per_s"]
    print(f"rollout alone       : {pa['generated_tokens']} tokens in {pa['rollout_wall_s']:.1f} s "
          f"-> {pa['tokens_per_s']:.1f} tok/s")
    print(f"rollout + training  : {pt['generated_tokens']} tokens in {pt['rollout_wall_s']:.1f} s "
          f"-> {pt['tokens_per_s']:.1f} tok/s  ({train['metrics']['updates']} updates)")
    print(f"throughput ratio (with training / alone): {ratio:.2f}  (target >= 0.90 with separate devices)")
    lags = collections.Counter()
    for r in train["trace"]:
        if r["event"] == "update":
            lags.update((r["global_steps"] - 1) - s["P"] for s in r["sampled"])
    total = sum(lags.values())
    print("staleness (policy-version lag of sampled entries):")
    for lag in sorted(lags):
        print(f"  lag {lag:>2}: {lags[lag]:>4}  ({lags[lag] / total:.0%})")
    wait, wall = train["metrics"]["trainer_wait_buffer_s"], train["metrics"]["wall_s"]
    print(f"trainer idle waiting for the buffer: {wait:.1f} s of {wall:.1f} s ({wait / wall:.0%})")


if __name__ == "__main__":
    main()
