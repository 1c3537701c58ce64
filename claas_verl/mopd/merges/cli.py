"""Command line of the training-free merges (docs/math.md §B.10) on Hugging Face model directories (safetensors).

    python -m claas_verl.mopd.merges ties --base DIR --models DIR1 DIR2 ... --out DIR [--density 0.2] [--lam 1.0]
                                     [--stagewise] [--dtype auto|float32|bfloat16|float16]
                                     [--threshold-method streaming|flat]
    python -m claas_verl.mopd.merges average --models DIR1 DIR2 ... --out DIR [--base DIR] [--dtype ...]

``ties`` without ``--stagewise``: one TIES over the given models (the experts, or the Seq snapshots
M_1..M_K). With ``--stagewise``: m_1 = first model, m_k = TIES({m_{k−1} − θ_0, E_k − θ_0}), each m_k
stored in bf16 (``--dtype`` overrides) before the next stage reads it. ``average``: the uniform
mean of the models. The output has the base's shard layout, config and tokenizer files
(``average`` uses ``--base`` or the first model as the template).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from claas_verl.mopd.merges.io import SafetensorsDir, save_like
from claas_verl.mopd.merges.ties import THRESHOLD_METHODS, iter_ties_merge, iter_ties_stagewise, uniform_average

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m claas_verl.mopd.merges", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("ties", help="TIES merge of models around a base (docs/math.md §B.10)")
    t.add_argument("--base", required=True, help="base student θ_0 (HF directory); its config/tokenizer are copied")
    t.add_argument("--models", required=True, nargs="+", help="experts or snapshots, in stage order")
    t.add_argument("--out", required=True, help="new output directory")
    t.add_argument("--density", type=float, default=0.2, help="share of entries kept per task vector (0.2)")
    t.add_argument("--lam", type=float, default=1.0, help="scale λ of the merged task vector (1.0)")
    t.add_argument("--stagewise", action="store_true", help="stage-by-stage TIES, each stage stored in bf16")
    t.add_argument("--dtype", choices=sorted(_DTYPES), default="auto",
                   help="stored dtype: auto = the base's (plain TIES) or bfloat16 (--stagewise)")
    t.add_argument("--threshold-method", choices=THRESHOLD_METHODS, default="streaming",
                   help="trim threshold: exact two-pass radix select (streaming) or one concatenation (flat)")
    a = sub.add_parser("average", help="uniform elementwise average of models")
    a.add_argument("--models", required=True, nargs="+")
    a.add_argument("--out", required=True)
    a.add_argument("--base", default=None, help="template for layout/config/tokenizer (default: the first model)")
    a.add_argument("--dtype", choices=sorted(_DTYPES), default="auto")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    models = [SafetensorsDir(d) for d in args.models]
    dtype = _DTYPES[args.dtype]
    if args.cmd == "average":
        template = args.base or args.models[0]
        merged = uniform_average(models, out_dtype=dtype)
        save_like(template, merged.items(), args.out)
        print(f"uniform average of {len(models)} models → {args.out} ({time.perf_counter() - t0:.1f}s)")
        return 0
    base = SafetensorsDir(args.base)
    if args.stagewise:
        if len(models) < 2:
            raise SystemExit("--stagewise needs at least two --models (m_1 = the first model)")
        store = dtype or torch.bfloat16
        # All stages but the last are kept in memory in the stored dtype; the last streams to disk.
        last = None
        for k, m in iter_ties_stagewise(base, models[:-1], args.density, args.lam, store, args.threshold_method):
            last = m
            print(f"stage {k}: m_{k} ready", file=sys.stderr)
        stats: dict = {}
        tensors = iter_ties_merge(base, [last, models[-1]], args.density, args.lam, store, args.threshold_method,
                                  stats)
        save_like(args.base, tensors, args.out)
        print(f"stage {len(models)}: {json.dumps(stats)}", file=sys.stderr)
    else:
        stats = {}
        save_like(args.base, iter_ties_merge(base, models, args.density, args.lam, dtype, args.threshold_method,
                                             stats), args.out)
        print(f"TIES: {json.dumps(stats)}", file=sys.stderr)
    kind = "stage-by-stage TIES" if args.stagewise else "TIES"
    print(f"{kind} of {len(models)} models (density {args.density}, λ {args.lam}) → {args.out} "
          f"({time.perf_counter() - t0:.1f}s)")
    return 0
