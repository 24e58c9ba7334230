"""``python -m course_lib.train``: the training command (``cli.py``)."""

import sys

from ..distributed import runtime
from ..errors import EXIT_REQUEUE
from .cli import main

if __name__ == "__main__":
    status = main()
    if status not in (0, EXIT_REQUEUE):
        # Stopped by an error: end now. Tearing down a process group whose peers may already be
        # gone can abort the interpreter ("terminate called without an active exception", exit
        # -6) after the error was said; every checkpoint is already whole on disk.
        runtime.flush_and_exit(status)
    sys.exit(status)
