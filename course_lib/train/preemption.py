"""Stopping cleanly when the cluster asks: finish the step, write a checkpoint, exit "requeue me".

A cluster ends jobs on its own schedule: at the time limit Slurm sends SIGTERM (then SIGKILL a
little later); a job submitted with ``#SBATCH --signal=B:USR1@120`` gets SIGUSR1 two minutes
before the limit; a preemptible partition sends SIGTERM to make room. Killing training in the
middle of a step loses everything since the last checkpoint. Instead:

1. the signal handler only *records* the request (a handler may run at any instruction; doing
   real work there would be unsafe);
2. at each step every rank asks "did anyone get a signal?" in the one tiny all-reduce the
   trainer makes per step anyway (``Trainer._agree_on_step``, which also asks "did anyone's
   loss become NaN?"): the signal may reach the ranks a few milliseconds apart, so they must
   agree on the step;
3. all ranks write a checkpoint of that step and exit with ``EXIT_REQUEUE``; the job script sees
   that status and requeues the job, which resumes from the checkpoint (``--resume latest``).

Cost: one number in an all-reduce of four per step, negligible next to the gradients.
"""

from __future__ import annotations

import signal
import threading

from ..errors import STOP_SIGNALS


class Preempted(Exception):
    """Training stopped at a step boundary because of a signal; a checkpoint of that step was written."""


class StopRequests:
    """Catches SIGUSR1 and SIGTERM while training runs; ``received`` is the signal, or None."""

    def __init__(self, signals=STOP_SIGNALS):
        self.received: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            for number in signals:
                self._previous[number] = signal.signal(number, self._record)

    def _record(self, number, _frame) -> None:
        self.received = number

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
