"""``python -m claas_verl.tiny reader``: unpack, build, ship or measure the reader bundle (``reader.py``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def add_reader_parser(sub) -> None:
    reader = sub.add_parser("reader", help="the tiny student fine-tuned to read a rule in its context")
    reader.add_argument("out_dir", nargs="?", default=None,
                        help="default: $CLAAS_TINY_READER_DIR or /tmp/claas_verl_tiny_reader")
    reader.add_argument("--seed", type=int, default=0, help="build seed (sampling, fine-tune); default 0")
    reader.add_argument("--version", default=None,
                        help="the bundle's design (claas_verl/tiny/reader.py DESIGNS): 1 (plan step 1, the shipped "
                             "bundle; default) or 2 (plan step 1c: the stream's rules, partial rule-only targets)")
    reader.add_argument("--sft-steps", type=int, default=None,
                        help="fine-tune steps N (with --build; default: the shipped bundle's N)")
    reader.add_argument("--build", action="store_true",
                        help="build from scratch even where the repository ships this bundle (benchmarks/bundles/); "
                             "a bundle rebuilt on another machine may differ in its bits")
    reader.add_argument("--ship", action="store_true",
                        help="after making the bundle, pack it into benchmarks/bundles/ (archive + fingerprint record)")
    reader.add_argument("--complete", action="store_true",
                        help="measure, on the bundle at OUT_DIR and on its pre-SFT student, the rule families its "
                             "manifest lacks (a grid bundle has the gated ones only) and rewrite the manifest")
    reader.add_argument("--grid", metavar="GRID_DIR", default=None,
                        help="instead of one bundle: fine-tune once to the largest N of the plan's grid, write the "
                             "bundle of every N into GRID_DIR/N<n> (measured on the gated families), complete the "
                             "chosen one's manifest, and the tables, gates and chosen N into GRID_DIR/grid.json")
    reader.add_argument("--grid-steps", default=None, metavar="N1,N2,...",
                        help="with --grid: the N to measure instead of the plan's step-1 grid (the same seeded "
                             "fine-tune, so a longer grid continues the shorter one; plan step 1b: 1600,3200)")


def run_reader(args, cpu_model: str) -> int:
    from claas_verl.tiny.reader import (
        DESIGNS,
        READER_VERSION,
        STEPS_GRID,
        ReaderPaths,
        complete_manifest,
        ensure_reader,
        measure_grid,
    )

    t0 = time.time()
    version = args.version or READER_VERSION
    if version not in DESIGNS:
        print(f"error: --version must be one of {sorted(DESIGNS)}, got {args.version!r}", file=sys.stderr)
        return 2
    if args.complete:
        m = complete_manifest(ReaderPaths(Path(args.out_dir)))
        print(f"measured every family of {args.out_dir} in {time.time() - t0:.1f}s: {sorted(m['instruction_reading'])}")
        return 0
    if args.grid:
        try:
            grid = tuple(int(n) for n in args.grid_steps.split(",")) if args.grid_steps else STEPS_GRID
        except ValueError:
            print(f"error: --grid-steps takes comma-separated integers (e.g. 1600,3200), got {args.grid_steps!r}",
                  file=sys.stderr)
            return 2
        if min(grid) < 1:
            print(f"error: --grid-steps must all be >= 1, got {args.grid_steps!r}", file=sys.stderr)
            return 2
        result = measure_grid(Path(args.grid), seed=args.seed, grid=grid, version=version)
        if result["chosen"] is None:
            print(f"grid measured in {time.time() - t0:.1f}s into {args.grid}: no N meets every gate (grid.json "
                  f"says which failed); the longest fine-tune is {args.grid}/N{result['shipped']}")
        else:
            print(f"grid measured in {time.time() - t0:.1f}s into {args.grid}; chosen N: {result['chosen']} (ship it "
                  f"with `python -m claas_verl.tiny reader {args.grid}/N{result['chosen']} --version {version} "
                  "--ship`)")
        return 0
    if args.grid_steps and not args.grid:
        print("error: --grid-steps sets the N of a --grid measurement; add --grid GRID_DIR", file=sys.stderr)
        return 2
    if args.sft_steps is not None and not args.build:
        print("error: --sft-steps sets the fine-tune of a build; add --build (without it the shipped bundle is "
              "unpacked)", file=sys.stderr)
        return 2
    try:
        paths = ensure_reader(args.out_dir, seed=args.seed, build=args.build, sft_steps=args.sft_steps,
                              version=version)
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    m = json.loads(paths.manifest.read_text())
    if args.ship:
        import platform

        from claas_verl.tiny.shipped import pack_bundle

        archive, record = pack_bundle(paths.root, "reader", version, args.seed,
                                      f"python -m claas_verl.tiny reader DIR --build --version {version} "
                                      f"--seed {args.seed} "
                                      f"--sft-steps {m['sft']['steps']} on {platform.machine()} ({cpu_model}), "
                                      f"{time.strftime('%Y-%m-%d')}")
        print(f"packed {archive} and {record}")
    print(f"reader bundle v{m['version']} (seed {m['seed']}, {m['sft']['steps']} SFT steps) ready at {paths.root} "
          f"in {time.time() - t0:.1f}s")
    for family, row in (m.get("instruction_reading") or {}).items():
        print(f"  {family:>16}: " + "  ".join(f"{c} {v[0]}" for c, v in row.items() if v[0] is not None))
    return 0
