"""``python -m claas_verl.mopd.merges ...``: see :mod:`claas_verl.mopd.merges.cli`."""

import sys

from claas_verl.mopd.merges.cli import main

if __name__ == "__main__":
    sys.exit(main())
