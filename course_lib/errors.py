"""The exit statuses of the commands, and the exceptions that choose them.

Training code raises ``UserError`` with a message that names the fix ("pass --global-batch-size 66,
a multiple of 3"). The command line prints that message as a single line, once, and exits with
``EXIT_USER_ERROR``. Every other exception is a bug or a crash and keeps its traceback.

Most user errors are found before the processes meet (the world size is known from the
environment alone), so every rank raises the same error at the same moment and none is left
waiting for a partner that already left.
"""

import signal
import sys

EXIT_USER_ERROR = 2
"""Exit status for a mistake in flags, data or checkpoints (the same status argparse uses)."""

EXIT_CRASH = 1
"""Exit status for an unexpected failure on this rank or on another one, or for ranks that never met."""


EXIT_REQUEUE = 3
"""Exit status after a stop signal (SIGUSR1, SIGTERM): a checkpoint was written, requeue the job."""

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
"""The signals that ask a job to stop (Slurm's time limit, ``--signal=B:USR1@120``, a preemption):
the training process finishes its step, checkpoints and exits with ``EXIT_REQUEUE``."""

EXIT_DIVERGED = 4
"""Exit status when the loss or the gradient became NaN or infinite: the run stopped at that step,
every rank together, and the newest checkpoint is still the last good one. Requeueing would only
diverge again: change the run (a lower --lr, --clip-grad-norm, fp32) and resume."""


STATUS_FOLDER = "COURSE_STATUS_FOLDER"
"""If set, the folder where each training process leaves its exit status as it ends (``rank-N``):
a launcher around torchrun (``course_lib.tools.torchrun``) reads them to exit with the run's."""


def report_exit_status(status: int) -> None:
    """Leave this process's exit status where its launcher reads it (nothing if none asked)."""
    import os
    from pathlib import Path

    folder = os.environ.get(STATUS_FOLDER)
    if folder:
        try:
            Path(folder, f"rank-{os.environ.get('RANK', '0')}").write_text(f"{status}\n")
        except OSError as error:  # the run's work is done: say why its launcher will not see its status
            print(
                f"warning: {STATUS_FOLDER}={folder!r}: cannot leave this rank's exit status there "
                f"({error.strerror or error}); set it to a folder that exists, or unset it",
                file=sys.stderr,
                flush=True,
            )


class UserError(Exception):
    """A mistake in the input (flag, environment, data, checkpoint) that the message tells how to fix."""


class PeerLeft(Exception):
    """A rank waited in a collective for a rank that had already ended (the transport only says that
    the connection closed). From this rank's side the cause is unknown: the other rank crashed or
    was killed (the run's failure is that rank's: exit 1), or it finished without making the
    collective (the program's mistake, which ``launch`` names where it sees the other rank return)."""


class Diverged(Exception):
    """Training produced a non-finite loss or gradient; every rank stopped at the same step."""


class RendezvousFailed(Exception):
    """This rank could not meet rank 0 (it never started, or the address names another host): exit 1."""
