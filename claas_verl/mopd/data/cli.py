"""Command line of the data preparation."""

from __future__ import annotations

import argparse
import os

from claas_verl.mopd.data import mopd as mopd_data
from claas_verl.utils.cli import name_values

MOPD_HELP = "per-domain MOPD prompt files (MOPD paper §5.1) from local raw datasets"


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m claas_verl.mopd.data", description="Training data preparation.")
    sub = top.add_subparsers(dest="cmd", required=True, metavar="{mopd}")
    ap = sub.add_parser("mopd", help=MOPD_HELP, description=MOPD_HELP[0].upper() + MOPD_HELP[1:] + ".")
    ap.add_argument("--out", required=True, help="output folder (point CLAAS_DATA_DIR at it for the recipes)")
    ap.add_argument("--tokenizer", required=True, help="the student's model folder (its chat template measures "
                                                       "prompt lengths)")
    ap.add_argument("--domains", default="logic,math,code,safety,if")
    ap.add_argument("--math", help="DAPO-Math-17k parquet/jsonl")
    ap.add_argument("--code", help="OpenCodeReasoning parquet/jsonl (id, input)")
    ap.add_argument("--safety-harmful", help="STAR-1 file (question)")
    ap.add_argument("--safety-benign", help="STAR-benign-915 file (question)")
    ap.add_argument("--if", dest="if_", help="UltraData-SFT instruction-following subset (messages or prompt)")
    ap.add_argument("--logic-seed", type=int, default=mopd_data.LOGIC_SEED,
                    help="reasoning-gym seed of the training prompts")
    ap.add_argument("--logic-tasks", help="comma-separated reasoning-gym tasks (default: the 38 GYM tasks)")
    ap.add_argument("--seed", type=int, default=0, help="draw order of the file-based domains (MOPD paper: seed 0)")
    ap.add_argument("--blocks", default=",".join(f"{d}={n}" for d, n in mopd_data.PAPER_BLOCKS.items()))
    ap.add_argument("--block-size", type=int, default=mopd_data.BLOCK_SIZE)
    ap.add_argument("--max-prompt-tokens", type=int, default=mopd_data.MAX_PROMPT_TOKENS)
    ap.add_argument("--eval-data-dir", help="the benchmark folder of python -m claas_verl.mopd.eval (--data-dir): its "
                                            "prompts are removed from training")
    ap.add_argument("--eval-data", action="append", default=[], help="BENCH=PATH, as for the eval command")
    ap.add_argument("--extra-eval-prompts", action="append", default=[],
                    help="more files of evaluation prompts (a column prompt, question or input)")
    ap.add_argument("--no-gym-overlap", action="store_true",
                    help="do not check against the generated GYM items (seed 4242)")
    return top


def mopd_main(a: argparse.Namespace) -> int:

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    domains = [d.strip() for d in a.domains.split(",") if d.strip()]
    blocks = {**mopd_data.PAPER_BLOCKS, **{d: int(n) for d, n in name_values(a.blocks.split(","), "--blocks").items()}}
    given = {"math": a.math, "code": a.code, "if": a.if_}
    sources: dict[str, dict] = {}
    for d in domains:
        if d == "logic":
            tasks = tuple(t.strip() for t in a.logic_tasks.split(",")) if a.logic_tasks else None
            sources[d] = {"seed": a.logic_seed, "tasks": tasks}
        elif d == "safety":
            if not (a.safety_harmful and a.safety_benign):
                raise SystemExit("domain safety needs --safety-harmful (STAR-1) and --safety-benign (STAR-benign-915)")
            sources[d] = {"harmful": a.safety_harmful, "benign": a.safety_benign}
        elif d in given:
            if not given[d]:
                raise SystemExit(f"domain {d} needs --{d} FILE (or leave it out of --domains)")
            sources[d] = {"path": given[d]}
        else:
            raise SystemExit(f"--domains: unknown domain {d!r}; choose from {list(mopd_data.ABILITY)}")

    from claas_verl.mopd.data.io import read_records
    from claas_verl.mopd.eval import benchmarks

    questions: list[str] = []
    data = benchmarks.resolve_data(a.eval_data_dir, name_values(a.eval_data, "--eval-data"))
    checked = []
    for bench in [b for b in benchmarks.SETTINGS if b in data or (b == "GYM" and not a.no_gym_overlap)]:
        qs = benchmarks.benchmark_questions(bench, data)
        questions += qs
        checked.append(f"{bench} ({len(qs)})")
    for path in a.extra_eval_prompts:
        rows = read_records(path)
        col = next((c for c in ("prompt", "question", "input") if rows and c in rows[0]), None)
        if col is None:
            raise SystemExit(f"{path}: --extra-eval-prompts file needs a column prompt, question or input")
        questions += [str(r[col]) for r in rows]
        checked.append(f"{path} ({len(rows)})")
    print(f"[data] evaluation prompts checked for overlap: {', '.join(checked) or 'none'}")
    reports = mopd_data.build(a.out, sources, mopd_data.token_counter(a.tokenizer), mopd_data.OverlapIndex(questions),
                              blocks, a.block_size, a.max_prompt_tokens, a.seed)
    print(f"{'domain':8} {'rows':>6} {'blocks':>6} {'seen':>7} {'dup':>6} {'>tokens':>8} {'overlap':>8}  source")
    for d, r in reports.items():
        print(f"{d:8} {r.rows:6d} {r.blocks:6d} {r.seen:7d} {r.duplicate:6d} {r.too_long:8d} {r.overlap:8d}  "
              f"{r.source}")
    print(f"[data] wrote {a.out}/<domain>/train.parquet and manifest.json; "
          f"export CLAAS_DATA_DIR={os.path.abspath(a.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    return mopd_main(a)
