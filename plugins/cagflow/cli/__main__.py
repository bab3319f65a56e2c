"""``python -m cagflow.cli``: the ``cagflow`` command, as the local runners and the fault bench start it."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
