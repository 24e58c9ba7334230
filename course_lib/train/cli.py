"""The training command: ``python -m course_lib.train`` (also installed as ``course-train``).

One process::

    python -m course_lib.train --epochs 5

Two processes with DDP, then with FSDP, on this machine::

    torchrun --standalone --nproc-per-node 2 -m course_lib.train --strategy ddp
    torchrun --standalone --nproc-per-node 2 -m course_lib.train --strategy fsdp

On a Slurm cluster, one task per GPU (see ``slurm/``)::

    srun python -m course_lib.train --strategy ddp --dataset cifar10 --model resnet18

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

from .. import checks
from ..data import DATASETS
from ..distributed import environment, runtime
from ..errors import (
    EXIT_CRASH,
    EXIT_DIVERGED,
    EXIT_REQUEUE,
    EXIT_USER_ERROR,
    Diverged,
    RendezvousFailed,
    UserError,
    report_exit_status,
)
from ..models import MODELS
from ..observe import flight_recorder
from ..parallel.fsdp_units import OFFLOAD_MODES, SHARDING_STRATEGIES
from ..parallel.recompute import POLICIES
from .config import OPTIMIZERS, PRECISIONS, TrainConfig, validate_config
from .loop import train
from .preemption import Preempted
from .strategies import IMPLEMENTATIONS, STRATEGIES


class _DefaultsWhereTheyHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, but not for on/off switches ("--no-progress (default: True)" misleads),
    for options that are unset by default, or where the help already states the default."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = checks.CommandParser(
        prog="python -m course_lib.train",
        description="Train a CNN on one process, or on many with DDP or FSDP.",
        formatter_class=_DefaultsWhereTheyHelp,
    )
    what = parser.add_argument_group("what to train")
    what.add_argument("--strategy", choices=STRATEGIES, default=defaults.strategy)
    what.add_argument(
        "--impl",
        choices=IMPLEMENTATIONS,
        default=defaults.impl,
        help="torch: PyTorch's DDP/FSDP2; course: the readable versions in course_lib.parallel",
    )
    what.add_argument("--dataset", choices=DATASETS, default=defaults.dataset)
    what.add_argument(
        "--data-dir",
        default=os.environ.get("COURSE_DATA_DIR", defaults.data_dir),
        help="where cifar10 lives (default: $COURSE_DATA_DIR or ./data)",
    )
    what.add_argument("--model", choices=MODELS, default=defaults.model)
    shard = parser.add_argument_group("sharding (--strategy fsdp --impl course)")
    shard.add_argument(
        "--zero-stage",
        type=int,
        choices=(1, 2, 3),
        default=defaults.zero_stage,
        help="shard optimizer state (1), + gradients (2), + parameters (3: FSDP)",
    )
    shard.add_argument(
        "--sharding",
        choices=SHARDING_STRATEGIES,
        default=defaults.sharding,
        help="FSDP sharding strategy (stage 3)",
    )
    shard.add_argument(
        "--hybrid-shard-size",
        type=int,
        default=None,
        help="ranks per shard group with HYBRID_SHARD (default: ranks per node)",
    )
    shard.add_argument(
        "--cpu-offload",
        choices=OFFLOAD_MODES,
        default=defaults.cpu_offload,
        help="keep shards (params) and also activations (full) in CPU memory",
    )
    how = parser.add_argument_group("how to train")
    how.add_argument("--epochs", type=int, default=defaults.epochs)
    how.add_argument(
        "--global-batch-size",
        type=int,
        default=defaults.global_batch_size,
        help="samples per optimizer step, summed over all ranks",
    )
    how.add_argument("--lr", type=float, default=defaults.lr)
    how.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    how.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    how.add_argument("--clip-grad-norm", type=float, default=None, help="clip the gradient's 2-norm to this")
    how.add_argument("--seed", type=int, default=defaults.seed)
    how.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=defaults.precision,
        help="bf16: autocast matrix products to bfloat16, weights stay fp32",
    )
    how.add_argument(
        "--recompute",
        choices=POLICIES,
        default=defaults.recompute,
        help="what each unit keeps for backward: none (everything), full (its input) or selective",
    )
    how.add_argument(
        "--grad-accum",
        type=int,
        default=defaults.grad_accum,
        help="micro-batches per optimizer step on each rank",
    )
    how.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    how.add_argument(
        "--workers", type=int, default=defaults.workers, help="data-loader worker processes per rank"
    )
    out = parser.add_argument_group("checkpoints and metrics")
    out.add_argument("--checkpoint-dir", default=None, help="save a checkpoint here after every epoch")
    out.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps")
    out.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="resume from the newest checkpoint in --checkpoint-dir, or from the given directory",
    )
    out.add_argument("--metrics", default=None, help="append one JSON line per epoch to this file")
    out.add_argument(
        "--profile",
        default=None,
        help="record the anatomy of a few warm steps: each rank's trace and anatomy.json go into this folder",
    )
    out.add_argument("--profile-steps", type=int, default=3, help="steps --profile records")
    out.add_argument(
        "--check-replicas",
        metavar="N",
        type=int,
        default=0,
        help="every N steps, check that every rank holds the same weights (--strategy ddp; 0: never)",
    )
    out.add_argument(
        "--straggler-report",
        metavar="FILE",
        default=None,
        help="one JSON line per step: each rank's lateness at the collectives and the slowest rank "
        "(needs --impl course); plot it with python -m course_lib.tools.stragglers FILE --plot OUT.png",
    )
    out.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (one is shown by default)",
    )
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="check the configuration for this many processes (WORLD_SIZE) and exit",
    )
    system = parser.add_argument_group("processes")
    system.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl with GPUs, gloo without",
    )
    system.add_argument(
        "--timeout",
        type=float,
        default=runtime.DEFAULT_TIMEOUT_S,
        help="seconds a rank waits for the others before giving up",
    )
    system.add_argument(
        "--flight-recorder",
        metavar="DIR",
        default=None,
        help="every rank keeps its last collectives and writes them to DIR when one fails, on SIGUSR2 or "
        "at the end: read them with python -m course_lib.tools.diagnose DIR",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{name: value for name, value in vars(args).items() if name in fields})


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
        checks.check_number("--timeout", timeout_s, above=0, maximum=runtime.MAX_TIMEOUT_S)
        environment.choose_backend(backend, _cuda_available())
        validate_config(config, env.world_size, env.local_world_size)
        if flight_recorder_dir:
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
        if runtime.is_peer_failure(error):
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
        else:
            traceback.print_exc()
        status = EXIT_CRASH
    if status not in (0, EXIT_REQUEUE):  # the flight record, if one is kept, says why this rank stopped
        flight_recorder.dump(f"stopped by an error: {why or f'exit status {status}'}")
    # Outside the except blocks: the exception and its traceback (which keeps the model alive) are gone.
    runtime.shutdown()
    return status


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
        config_from_args(args),
        backend=args.backend,
        timeout_s=args.timeout,
        dry_run=args.dry_run,
        flight_recorder_dir=args.flight_recorder,
    )
    report_exit_status(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
