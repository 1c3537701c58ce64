"""CLI: ``python -m claas_verl.tiny make OUT_DIR [--seed N] [--force] [--arch qwen2|qwen3]``, ``... info [OUT_DIR]`` and
``... gym [OUT_DIR] [--seed N]`` (the continual benchmark's reasoning-gym bundle, ``claas_verl/tiny/gym.py``) and
``... reader [OUT_DIR] [--seed N] [--sft-steps N] [--build] [--ship] [--grid OUT_JSON]`` (the tiny student that reads
rules in context, ``claas_verl/tiny/reader.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from claas_verl.tiny.build import default_dir, make_tiny, read_manifest
from claas_verl.tiny.model import ARCHS, DEFAULT_ARCH


def _cpu_model() -> str:
    """The CPU's model name (a build's bits may depend on it), as Linux reports it."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m claas_verl.tiny", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="build the tiny student, experts, tokenizer and data (no network)")
    mk.add_argument("out_dir", help="output directory (created; replaced only with --force)")
    mk.add_argument("--seed", type=int, default=0, help="build seed (weights, task vectors, data); default 0")
    mk.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR already holds a bundle")
    mk.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH,
                    help="model family of the student and experts (qwen3: per-head q/k norms); default qwen2")
    info = sub.add_parser("info", help="print the manifest of a built bundle")
    info.add_argument("out_dir", nargs="?", default=None, help="default: $CLAAS_TINY_DIR or /tmp/claas_verl_tiny")
    gym = sub.add_parser("gym", help="build the continual benchmark's reasoning-gym bundle (about 45 min on 2 cores)")
    gym.add_argument("out_dir", nargs="?", default=None, help="default: $CLAAS_GYM_DIR or /tmp/claas_verl_gym")
    gym.add_argument("--seed", type=int, default=0, help="build seed (data draw, weights); default 0")
    gym.add_argument("--build", action="store_true",
                     help="build from scratch even where the repository ships this bundle (benchmarks/bundles/); a "
                          "bundle rebuilt on another machine may differ in its bits, and results on it are a new "
                          "measurement")
    gym.add_argument("--ship", action="store_true",
                     help="after making the bundle, pack it into benchmarks/bundles/ (archive + fingerprint record)")
    from claas_verl.tiny.reader_cli import add_reader_parser, run_reader

    add_reader_parser(sub)
    args = parser.parse_args(argv)

    if args.cmd == "reader":
        return run_reader(args, _cpu_model())
    if args.cmd == "gym":
        from claas_verl.tiny.gym import ensure_gym

        t0 = time.time()
        try:
            paths = ensure_gym(args.out_dir, seed=args.seed, build=args.build)
        except FileExistsError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        m = json.loads(paths.manifest.read_text())
        if args.ship:
            import platform

            from claas_verl.tiny.gym import GYM_VERSION
            from claas_verl.tiny.shipped import pack_bundle

            archive, record = pack_bundle(paths.root, "gym", GYM_VERSION, args.seed,
                                          f"python -m claas_verl.tiny gym DIR --build --seed {args.seed} on "
                                          f"{platform.machine()} ({_cpu_model()}), {time.strftime('%Y-%m-%d')}")
            print(f"packed {archive} and {record}")
        print(f"gym bundle v{m['version']} (seed {m['seed']}) ready at {paths.root} in {time.time() - t0:.1f}s")
        for model, acc in m["accuracy"].items():
            print(f"  {model:>16}: " + "  ".join(f"{d} {v:.3f}" for d, v in acc.items()))
        return 0

    if args.cmd == "make":
        t0 = time.time()
        try:
            paths = make_tiny(args.out_dir, seed=args.seed, force=args.force, arch=args.arch)
        except FileExistsError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        m = read_manifest(paths.root)
        print(f"tiny bundle v{m['version']} (seed {m['seed']}, {args.arch}) ready at {paths.root} "
              f"in {time.time() - t0:.1f}s")
        print(f"  student: {paths.student}  ({m['sizes']['num_parameters']} params, vocab {m['sizes']['vocab_size']})")
        print(f"  experts: {', '.join(m['domains'])}  under {paths.root / 'experts'}")
        print(f"  data:    {', '.join(m['data_domains'])}  under {paths.root / 'data'}")
        return 0
    m = read_manifest(args.out_dir or default_dir())
    if m is None:
        print(f"error: no manifest.json in {args.out_dir or default_dir()}; run `make` first", file=sys.stderr)
        return 1
    print(json.dumps(m, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
