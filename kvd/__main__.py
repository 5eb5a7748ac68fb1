"""``python -m kvd``: the same as the ``kvd`` command (kvd.cli)."""

import sys

from kvd.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
