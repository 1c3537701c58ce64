"""``python -m claas_verl.mopd.data mopd --out DIR --tokenizer STUDENT [sources...]`` (see docs/reproducing-mopd.md)."""

from claas_verl.mopd.data.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
