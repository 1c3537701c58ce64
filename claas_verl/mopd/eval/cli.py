"""Command line of the evaluation (see docs/reproducing-mopd.md)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from claas_verl.mopd.eval import benchmarks
from claas_verl.utils.cli import name_values


def _checkpoints(model: str, name: str | None) -> list[tuple[str, str]]:
    """(name, path) pairs: a Hugging Face model folder, or a MOPD run folder with ``snapshots/student_<j>``."""
    p = Path(model)
    if (p / "config.json").exists():
        return [(name or p.name, str(p))]
    snaps = sorted(((int(m.group(1)), d) for d in (p / "snapshots").glob("student_*")
                    if (m := re.fullmatch(r"student_(\d+)", d.name)) and (d / "config.json").exists()),
                   key=lambda t: t[0]) if (p / "snapshots").is_dir() else []
    if not snaps:
        raise ValueError(f"--model {model}: neither a Hugging Face model folder (config.json) nor a MOPD run "
                         "folder with snapshots/student_<j>/config.json")
    return [(f"{name or p.name}/student_{j}", str(d)) for j, d in snaps]


REPORT_HELP = "the MOPD paper's table (markdown + PNG) from evaluation outputs"


def eval_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m claas_verl.mopd.eval", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluate checkpoints with the MOPD paper's benchmark settings.",
        epilog=f"subcommands:\n  report      {REPORT_HELP} (python -m claas_verl.mopd.eval report --help)")
    ap.add_argument("--model", required=True, help="Hugging Face model folder, or a MOPD run folder (every stage "
                                                   "snapshot is evaluated)")
    ap.add_argument("--name", help="checkpoint name in the output (default: the folder name)")
    ap.add_argument("--benchmarks", default=",".join(benchmarks.SETTINGS),
                    help=f"comma-separated, from {list(benchmarks.SETTINGS)} (MBPP yields MBPP and MBPP+, XSTest "
                         "yields XSTest-safe and XSTest-unsafe)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-dir", help="folder holding the benchmark files under their default names "
                                       f"{benchmarks.DEFAULT_FILES}")
    ap.add_argument("--data", action="append", default=[], help="BENCH=PATH, overrides --data-dir for one benchmark")
    ap.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto",
                    help="auto: vLLM when a GPU is visible, else Hugging Face generate on CPU")
    ap.add_argument("--judge-config",
                    help="YAML/JSON naming the OpenAI-compatible safety judge (see docs/reproducing-mopd.md)")
    ap.add_argument("--ifbench-repo", help="checkout of the IFBench repository (its verifiers score IFBench)")
    ap.add_argument("--gym-tasks", help="comma-separated reasoning-gym tasks (default: the 38 of GYM_TASKS)")
    ap.add_argument("--limit", type=int, help="first N items per benchmark (smoke runs; not the MOPD paper's numbers)")
    ap.add_argument("--max-new-tokens-cap", type=int, help="cap the MOPD paper's max new tokens (smoke runs only)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8, help="HF backend batch size")
    ap.add_argument("--code-timeout", type=float, default=20.0, help="seconds per sandboxed test program")
    a = ap.parse_args(argv)

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    benches = [b.strip() for b in a.benchmarks.split(",") if b.strip()]
    unknown = [b for b in benches if b not in benchmarks.SETTINGS]
    if unknown:
        raise SystemExit(f"--benchmarks: unknown {unknown}; choose from {list(benchmarks.SETTINGS)}")
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    data = benchmarks.resolve_data(a.data_dir, name_values(a.data, "--data"))
    gym = tuple(t.strip() for t in a.gym_tasks.split(",")) if a.gym_tasks else benchmarks.GYM_TASKS
    judge = None
    if any(b in benchmarks.JUDGED for b in benches):
        if not a.judge_config:
            judged = [b for b in benches if b in benchmarks.JUDGED]
            raise SystemExit(f"{judged} need a safety judge: pass --judge-config")
        from claas_verl.mopd.eval.judge import Judge, JudgeConfig

        judge = Judge(JudgeConfig.load(a.judge_config))
    backend = a.backend
    if backend == "auto":
        import torch

        backend = "vllm" if torch.cuda.is_available() else "hf"
    from claas_verl.mopd.eval.generate import HFGenerator, VLLMGenerator
    from claas_verl.mopd.eval.runner import evaluate_model

    for name, path in _checkpoints(a.model, a.name):
        if backend == "vllm":
            gen = VLLMGenerator(path, a.max_model_len, a.tensor_parallel_size, max_new_tokens_cap=a.max_new_tokens_cap)
        else:
            gen = HFGenerator(path, a.batch_size, a.max_new_tokens_cap)
        evaluate_model(gen, path, Path(a.out) / name, benches, seeds, data, judge, a.ifbench_repo, a.limit, gym,
                       a.code_timeout)
        if hasattr(gen, "close"):
            gen.close()
    return 0


def report_main(argv: list[str]) -> int:
    from claas_verl.mopd.eval import report

    ap = argparse.ArgumentParser(prog="python -m claas_verl.mopd.eval report",
                                 description=REPORT_HELP[0].upper() + REPORT_HELP[1:] + ".")
    ap.add_argument("--runs", required=True, help="the --out folder of the evaluations")
    ap.add_argument("--k", type=int, default=5, help="number of learned domains (3: the three-stage prefix)")
    ap.add_argument("--base", help="checkpoint name of the base student (for Norm, Norm_dom)")
    ap.add_argument("--experts", help="domain=checkpoint,... (for Norm, Norm_dom)")
    ap.add_argument("--stages", help="checkpoint names M_1,...,M_K of one run, in order (for BWT)")
    ap.add_argument("--out", help="output prefix (default RUNS/table): writes .md and .png")
    a = ap.parse_args(argv)
    runs = report.load_runs(a.runs)
    experts = name_values(a.experts.split(","), "--experts") if a.experts else None
    stages = a.stages.split(",") if a.stages else None
    prefix = Path(a.out) if a.out else Path(a.runs) / "table"
    md = report.markdown(runs, a.k, a.base, experts, stages)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.md").write_text(md)
    report.plot(runs, a.k, f"{prefix}.png")
    print(md)
    print(f"wrote {prefix}.md and {prefix}.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    return eval_main(argv)
