"""``python -m course_lib.train``: the training command (``cli.py``)."""

from ..distributed import runtime
from .cli import main

if __name__ == "__main__":
    status = main()
    # End now, without the interpreter's teardown, whatever the status. main() has already left the
    # process group (after a good run) and every checkpoint is whole on disk. The teardown itself is
    # the danger: gloo's threads free objects while the interpreter dies and abort it ("terminate
    # called without an active exception", exit -6), after a finished run as after an error whose
    # peers are gone. ``launch``'s children end the same way.
    runtime.flush_and_exit(status)
