"""``python -m course_lib.train``: the training command (``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
