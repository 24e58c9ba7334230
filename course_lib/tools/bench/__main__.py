"""``python -m course_lib.tools.bench``: see ``cli``."""

import sys

from .cli import main

sys.exit(main())
