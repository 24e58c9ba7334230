"""``python -m course_lib.train``: the training command (``cli.py``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
