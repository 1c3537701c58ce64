"""``python -m claas_verl.merges ...``: see :mod:`claas_verl.merges.cli`."""

import sys

from claas_verl.merges.cli import main

if __name__ == "__main__":
    sys.exit(main())
