"""``torchrun``, ending with the training command's own exit status and one line, never a traceback.

::

    python -m course_lib.tools.torchrun --standalone --nproc-per-node 2 -m course_lib.train --sharding ddp

takes exactly torchrun's flags and runs torchrun's own launcher (``torch.distributed.run``), with
SIGUSR1 added to the signals it passes on to its workers. What changes is the end. Plain
torchrun answers any worker that did not exit 0, and any stop signal it receives itself, with a
Python traceback and status 1, so a job script cannot tell "stopped cleanly, requeue me" (3)
from "a flag was wrong" (2) or a crash (1). Here every worker reports its status, and the
command exits with the one that describes the run:

======  ======================================================================================
0       every rank finished
2       a rank refused its input (its one line says how to fix it)
3       stopped by a signal, every rank having written its checkpoint: rerun with --resume latest
4       the training diverged (its line says what to try)
1       anything else: a crash, or a rank killed before it could report
======  ======================================================================================

SIGTERM or SIGUSR1 sent to this command, to its workers, or to all of them at once (what
``scancel``, a preemption or the time limit do), ends in the clean stop: each worker finishes its
step and checkpoints, while torchrun waits ``--shutdown-timeout`` seconds (default here: 90) for
them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import uuid
from pathlib import Path

from .. import checks
from ..distributed.runtime import RUN_VARIABLE
from ..errors import EXIT_CRASH, EXIT_DIVERGED, EXIT_REQUEUE, EXIT_USER_ERROR, STATUS_FOLDER, UserError
from ..observe import faults

FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT_S = "90"


def verdict(statuses: dict[int, int], workers: int, *, all_exited_0: bool = False) -> tuple[int, str | None]:
    """The run's status from its ranks' statuses, and one line to print when it is not 0.

    Args:
        statuses: the exit status each rank reported, by global rank.
        workers: how many ranks this launcher started (a rank that did not report was killed).
        all_exited_0: torchrun saw every worker exit with status 0: a script of the user's own,
            which reports nothing, succeeded.
    """
    if all_exited_0 and set(statuses.values()) <= {0}:
        return 0, None
    codes = set(statuses.values())
    # A refused input or a divergence is the run's own verdict, its line printed by rank 0; ranks
    # that did not report were stopped by torchrun, which ends every rank once one has exited.
    for status in (EXIT_USER_ERROR, EXIT_DIVERGED):
        if status in codes:
            return status, None
    if len(statuses) < workers:
        return EXIT_CRASH, (
            f"{workers - len(statuses)} of the {workers} ranks started here ended without reporting their "
            "status (killed, or a crash in native code): see their output above"
        )
    if codes == {0}:
        return 0, None
    if codes == {EXIT_REQUEUE}:
        return EXIT_REQUEUE, (
            "every rank stopped at the same step and wrote its checkpoint: rerun with --resume latest"
        )
    # a rank that stopped cleanly (3) is not the cause when another crashed
    failed = min(rank for rank, code in statuses.items() if code not in (0, EXIT_REQUEUE))
    return EXIT_CRASH, f"rank {failed} exited with status {statuses[failed]}: see its output above"


def _defaults(argv: list[str]) -> list[str]:
    """torchrun's flags, plus the course's defaults for the two that decide a clean stop."""
    given = {arg.split("=")[0].replace("_", "-") for arg in argv}
    extra = []
    if "--signals-to-handle" not in given:
        extra.append(f"--signals-to-handle={FORWARDED_SIGNALS}")
    if "--shutdown-timeout" not in given:
        extra.append(f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}")
    return extra + argv


def _parse(argv: list[str]):
    """torchrun's own flags, a mistake among them in one line (argparse would print its usage)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "torchrun"

    def one_line(message: str):
        raise UserError(f"{message} (see torchrun --help)")

    parser.error = one_line
    return parser.parse_args(argv)


def _check_program(args) -> None:
    """The module or script the workers run exists, before any worker starts to find it missing."""
    if args.no_python:
        return
    if args.module:
        try:
            found = importlib.util.find_spec(args.training_script)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise UserError(
                f"no module named {args.training_script!r}: check its spelling (e.g. -m course_lib.train)"
            )
    else:
        checks.check_file_to_read("the training script", args.training_script)


def _nodes(text: str) -> tuple[int, int]:
    """``--nnodes``: N, or MIN:MAX for an elastic job, as (least, most)."""
    parts = str(text).split(":")
    if len(parts) > 2 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise UserError(f"--nnodes {text!r}: give a number of nodes, 1 or more, or MIN:MAX (e.g. 2:4)")
    least, most = int(parts[0]), int(parts[-1])
    if least > most:
        raise UserError(f"--nnodes {text!r}: the least nodes ({least}) is above the most ({most})")
    return least, most


def _check_flags(args) -> None:
    """torchrun's flags that its parser takes but its launcher would end in a traceback on, or
    hang on, refused in one line before any worker starts."""
    processes = str(args.nproc_per_node)
    if processes not in ("auto", "cpu", "gpu", "xpu") and not (processes.isdigit() and int(processes) >= 1):
        raise UserError(
            f"--nproc-per-node {processes!r}: give a number of processes, 1 or more, or auto, cpu or gpu"
        )
    if processes == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise UserError(
                "--nproc-per-node gpu starts one process per GPU, and this machine has none: give a number "
                "of processes (e.g. --nproc-per-node 2)"
            )
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    nodes = _nodes(args.nnodes)
    if args.standalone and nodes != (1, 1):
        raise UserError(
            f"--standalone runs one node by itself, but --nnodes {args.nnodes} asks for more: the other "
            "nodes would wait for it forever. Give the nodes a meeting point (--rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT, as slurm/torchrun_per_node.sbatch does), or leave out --nnodes"
        )


def _world_size(args, workers: int) -> int:
    """The job's ranks: this node's workers times the most nodes torchrun may join (``--nnodes``)."""
    return workers * _nodes(args.nnodes)[1]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, run

    args = _parse(_defaults(sys.argv[1:] if argv is None else argv))
    _check_flags(args)
    _check_program(args)
    workers = determine_local_world_size(args.nproc_per_node)
    faults.check_environment(_world_size(args, workers))
    if _world_size(args, workers) == workers:  # one node: this run's own id for its flight records
        os.environ.setdefault(RUN_VARIABLE, f"torchrun-{uuid.uuid4().hex[:12]}")
    with tempfile.TemporaryDirectory(prefix="course-torchrun-") as folder:
        os.environ[STATUS_FOLDER] = folder  # the workers inherit it (errors.report_exit_status)
        stopped_by, all_exited_0 = None, False
        try:
            run(args)
            all_exited_0 = True  # torchrun raises for any worker that did not exit 0
        except SignalException as stop:  # torchrun passed it on and waited for the workers to stop
            stopped_by = stop.sigval
        except ChildFailedError:
            pass  # the statuses tell which rank, and how
        statuses = {}
        for report in Path(folder).glob("rank-*"):
            statuses[int(report.name.removeprefix("rank-"))] = int(report.read_text())
    status, line = verdict(statuses, workers, all_exited_0=all_exited_0)
    if line:
        cause = f"stopped by {stopped_by.name}: " if stopped_by is not None else ""
        print(f"torchrun: {cause}{line}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    checks.exit_with(main)
