"""``python -m claas_verl.mopd.eval --model DIR --benchmarks ... --seeds 0,1,2 --out OUT`` and
``python -m claas_verl.mopd.eval report --runs OUT --k 5 [--base NAME --experts d=NAME,...] [--stages ...]``."""

from claas_verl.mopd.eval.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
