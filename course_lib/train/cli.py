"""The training command: ``python -m course_lib.train`` (also installed as ``course-train``).

One process::

    python -m course_lib.train --epochs 5

Two processes with DDP, then with FSDP, on this machine::

    torchrun --standalone --nproc-per-node 2 -m course_lib.train --sharding ddp
    torchrun --standalone --nproc-per-node 2 -m course_lib.train --sharding fsdp

On a Slurm cluster, one task per GPU (see ``slurm/``)::

    srun python -m course_lib.train --sharding ddp --dataset cifar10 --model resnet18

Exit status: 0 done, 2 a mistake in the input (one line says how to fix it), 1 a crash (on this
rank, or on another rank that this one was waiting for), 3 stopped by SIGUSR1 or SIGTERM at a
step boundary after writing a checkpoint (a job script requeues itself on 3; see
``course_lib.train.preemption``), 4 the loss or a gradient became NaN or infinite: every rank stopped
at that step, before updating, and the newest checkpoint is the last good one (one line says
what to try).

``--dry-run`` checks everything that can be checked without the other processes (flags, data,
batch sizes, the checkpoint to resume) and exits: a job script runs it before spending GPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from .. import checks, flags
from ..distributed import (
    collective_check,  # noqa: F401 (installed: every call checked)
    environment,
    runtime,
)
from ..errors import (
    EXIT_CRASH,
    EXIT_DIVERGED,
    EXIT_REQUEUE,
    EXIT_USER_ERROR,
    STATUS_FOLDER,
    Diverged,
    RendezvousFailed,
    UserError,
    report_exit_status,
)
from ..observe import flight_recorder  # noqa: F401
from .config import CHOICES, TrainConfig, validate_config
from .loop import train
from .preemption import Preempted

FLAG_GROUPS = {
    "what to train": "sharding",
    "the course's FSDP (--sharding fsdp --impl course)": "sharding_strategy",
    "how to train": "epochs",
    "checkpoints and metrics": "checkpoint_dir",
}
"""The sections of ``--help``, each with the first of ``TrainConfig``'s fields it shows."""


def _steps_or_auto(text: str) -> int | str:
    """argparse type of ``--checkpoint-every``: a whole number of steps, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of steps or auto, got {text!r}") from None


def _options() -> dict[str, dict]:
    """What argparse needs beyond ``TrainConfig``'s fields: an environment's default (read when the
    parser is built), an optional value, the placeholders of ``--help``."""
    data_dir = flags.field_docs(TrainConfig)["data_dir"]
    return {
        "data_dir": {  # the cluster's data folder, set once for every job
            "default": os.environ.get("COURSE_DATA_DIR", "data"),
            "help": f"{data_dir} (default: $COURSE_DATA_DIR or ./data)",
        },
        "resume": {"nargs": "?", "const": "latest"},  # --resume alone: the newest checkpoint
        "checkpoint_every": {"type": _steps_or_auto, "metavar": "N|auto"},
        "check_replicas": {"metavar": "N"},
        "mtbf_hours": {"metavar": "HOURS"},
        "straggler_report": {"metavar": "FILE"},
        "metrics": {"metavar": "FILE"},
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``TrainConfig`` (``flags.add_fields``), and this command's own flags."""
    parser = checks.CommandParser(
        prog="python -m course_lib.train",
        description="Train a CNN on one process, or on many with DDP or FSDP.",
        formatter_class=flags.DefaultsWhereTheyHelp,
    )
    flags.add_fields(parser, TrainConfig, groups=FLAG_GROUPS, choices=CHOICES, options=_options())
    command = parser.add_argument_group("this command")
    command.add_argument(
        "--dry-run",
        action="store_true",
        help="check the configuration for this many processes (WORLD_SIZE) and exit",
    )
    command.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl with GPUs, gloo without",
    )
    command.add_argument(
        "--timeout",
        type=float,
        default=runtime.DEFAULT_TIMEOUT_S,
        help="seconds a rank waits for the others before giving up",
    )
    command.add_argument(
        "--flight-recorder",
        metavar="DIR",
        default=None,
        help="every rank keeps its last collectives and writes them to DIR when one fails, on SIGUSR2 or "
        "at the end: read them with python -m course_lib.tools.diagnose DIR",
    )
    return parser


class RendezvousRefused(UserError):
    """A mistake in how this process was told to meet the others (an address, a port in use)."""


RANK_0_SPEAKS_S = 3.0
"""How long the other ranks wait before they exit, when rank 0 alone says why every rank stops."""


def _report_user_error(error: UserError) -> None:
    if checks.launched_rank() == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        _let_rank_0_speak()


def _let_rank_0_speak() -> None:
    """Every rank stops for the same reason and rank 0 prints it; the others wait a moment first,
    since torchrun ends every rank as soon as one has exited, rank 0 too, maybe before its line."""
    time.sleep(RANK_0_SPEAKS_S)


def run(
    config: TrainConfig,
    backend: str = "auto",
    timeout_s: float = runtime.DEFAULT_TIMEOUT_S,
    dry_run: bool = False,
    flight_recorder_dir: str | None = None,
) -> int:
    """Validate, join the process group, train, leave. Returns the exit status."""
    why = ""  # what stopped this rank, for its flight record

    try:
        env = environment.resolve_environment()
    except UserError as error:  # which process is rank 0 is what is in doubt: every one says it
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    try:
        if os.environ.get(STATUS_FOLDER):  # where a wrapper reads the exit status: checked before the work
            checks.check_existing_folder(STATUS_FOLDER, os.environ[STATUS_FOLDER])
        checks.check_number("--timeout", timeout_s, above=0, maximum=runtime.MAX_TIMEOUT_S)
        environment.choose_backend(backend, _cuda_available())
        validate_config(config, env.world_size, env.local_world_size)
        if flight_recorder_dir is not None:
            checks.check_folder_to_write("--flight-recorder", flight_recorder_dir)
        if dry_run:
            if checks.launched_rank() == "0":
                print(f"configuration OK for {env.world_size} process(es)", flush=True)
            return 0
        if flight_recorder_dir:  # runtime.init starts it, before the process group (PyTorch's reads it then)
            os.environ[flight_recorder.FOLDER_VARIABLE] = str(flight_recorder_dir)
        try:
            runtime.init(backend=backend, timeout_s=timeout_s)
        except UserError as error:  # about this process's own view of the launch: every rank says it
            raise RendezvousRefused(str(error)) from None
        train(config, stop_on_signals=True)
        status = 0
    except Preempted as stopped:
        if checks.launched_rank() == "0":
            print(f"rank 0: {stopped}", file=sys.stderr, flush=True)
        status = EXIT_REQUEUE
    except Diverged as diverged:
        why = str(diverged)
        if checks.launched_rank() == "0":
            print(f"error: {diverged}", file=sys.stderr, flush=True)
        else:
            _let_rank_0_speak()
        status = EXIT_DIVERGED
    except RendezvousRefused as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        status = EXIT_USER_ERROR
    except UserError as error:
        why = str(error)
        _report_user_error(error)
        status = EXIT_USER_ERROR
    except RendezvousFailed as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        status = EXIT_CRASH
    except KeyboardInterrupt:
        print(f"rank {checks.launched_rank()}: interrupted", file=sys.stderr, flush=True)
        status = EXIT_CRASH
    except Exception as error:  # noqa: BLE001
        _report_crash(error, flight_recorder_dir)
        status = EXIT_CRASH
    if status not in (0, EXIT_REQUEUE):  # the flight record, if one is kept, says why this rank stopped
        flight_recorder.dump(f"stopped by an error: {why or f'exit status {status}'}")
    # Outside the except blocks: the exception and its traceback (which keeps the model alive) are gone.
    # After an error the peers may be gone already: the group is left to the process's end.
    runtime.shutdown(leave_group=status in (0, EXIT_REQUEUE))
    return status


def _report_crash(error: Exception, flight_recorder_dir: str | None) -> None:
    """A crash in one line where it is a peer's (the peer says why), else with its traceback."""
    if not runtime.is_peer_failure(error):
        traceback.print_exc()
        return
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(
        f"rank {checks.launched_rank()}: stopped because another rank failed or stopped answering "
        f"({first_line[:160]}); see that rank's error",
        file=sys.stderr,
        flush=True,
    )
    if flight_recorder_dir and checks.launched_rank() == "0":
        print(
            f"flight records: python -m course_lib.tools.diagnose {flight_recorder_dir}",
            file=sys.stderr,
            flush=True,
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # a flag argparse refused (2), or --help (0)
        report_exit_status(stop.code or 0)
        raise
    status = run(
        flags.from_args(TrainConfig, args),
        backend=args.backend,
        timeout_s=args.timeout,
        dry_run=args.dry_run,
        flight_recorder_dir=args.flight_recorder,
    )
    report_exit_status(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
