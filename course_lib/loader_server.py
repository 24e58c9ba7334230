"""The server the data loaders' processes are forked from (``data.LOADER_START``): what it imports.

The loaders start their processes in multiprocessing's *forkserver*: one small process, started
once per training process, forks every loader process, so that none is forked from a training
process with threads running (the deadlock ``data.LOADER_START`` describes). The server imports
this module before it forks anything. Two things follow for every loader process:

- it ignores SIGTERM and SIGUSR1 while it unpickles what it was sent: ``scancel``, a preemption
  and the time limit signal every process of a job, and the training process must be the one
  that stops (at a step boundary, with a checkpoint). Then torch's ``_worker_loop`` sets a SIGTERM
  handler of its own, and ``data.leave_stop_signals_to_the_trainer`` (the loaders'
  ``worker_init_fn``) ignores both again: between the two, a few milliseconds, a SIGTERM still
  ends a loader process (as it did when loader processes were forked from the trainer);
- torch is already imported, so a loader process starts in milliseconds, not seconds.

Importing this module anywhere else would make that process deaf to stop signals: only the
server imports it.
"""

import signal

import torch.utils.data  # noqa: F401 (imported once in the server, inherited by every loader process)

from .errors import STOP_SIGNALS

for _number in STOP_SIGNALS:
    signal.signal(_number, signal.SIG_IGN)
