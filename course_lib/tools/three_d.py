"""3-D and 4-D parallelism from the command line: a data x pipeline x context x tensor run beside one process.

``python -m course_lib.tools.three_d --layout d2.p2.t2`` (``d2.p2.c2.t2`` for ring attention over
a 4-D grid of 16; any ``Layout.from_name`` words: ``gpipe``, ``sac``, ``ulysses``, ``sp``) trains
the transformer of ``course_lib.train.three_d`` on 8 local processes and on one, prints both loss
curves as JSON (they must agree), and with ``--plot`` draws them. The run's shape
(``RunShape``: steps, batch, micro-batches, model) has one flag per field.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import checks, flags
from ..distributed.launch import check_process_count, launch
from ..errors import UserError
from ..parallel.mesh import describe_grid
from ..train.three_d import COUNTS, RunShape, check_run, run_layout, train_3d
from .plots import image_to_write, plot_loss_curves

BOUNDS = {
    **dict.fromkeys(COUNTS, {"type": checks.int_at_least(1)}),
    "seed": {"type": checks.int_at_least(0, checks.MAX_SEED)},
    "lr": {"type": checks.learning_rate},
}
"""``RunShape``'s limits as argparse types, so that a flag out of them is refused in argparse's words."""


def _layout(text: str):
    """argparse type of ``--layout``: a 3-D run's layout (``run_layout``), or argparse's one-line refusal."""
    try:
        return run_layout(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.three_d",
        description=__doc__.split("\n\n")[0],
        formatter_class=flags.DefaultsWhereTheyHelp,
    )
    parser.add_argument(
        "--layout",
        type=_layout,
        default="d2.p2.t2",
        help="the grid and its techniques, as Layout.from_name reads them (what it leaves out: ddp, fp32, "
        "1f1b, no sequence parallelism): d2.p2.t2, p2.t2 gpipe sac, d2.c2.t2 ulysses sp",
    )
    flags.add_fields(parser, RunShape, groups={"the run's shape": "steps"}, options=BOUNDS)
    parser.add_argument(
        "--plot", type=image_to_write, default=None, help="save the two loss curves to this PNG"
    )
    parser.add_argument(
        "--profile",
        type=checks.folder_to_write,
        default=None,
        help="record the grid run's anatomy: each rank's trace and anatomy.json go into this folder",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.tools.three_d``: a 3-D run beside the one-process run, step by step."""
    args = _parser().parse_args(argv)
    try:
        layout, shape = args.layout, flags.from_args(RunShape, args)
        check_run(layout, shape, world_size=layout.gpus)
        check_process_count(layout.gpus)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    world = layout.gpus
    degrees = {axis: layout.degree(axis) for axis in ("data", "pipeline", "context", "tensor")}
    print(describe_grid(world, **degrees), file=sys.stderr)
    print(f"training {layout.name()} on 1 process, then on {world}...", file=sys.stderr, flush=True)
    single = launch(train_3d, 1, run_layout("single"), shape=shape)[0]
    profile = str(args.profile) if args.profile else None
    grid = launch(train_3d, world, layout, shape=shape, profile=profile, timeout_s=1800)[0]
    if args.profile:
        print(
            f"the grid run's anatomy is in {args.profile}/anatomy.json, each rank's trace beside it",
            file=sys.stderr,
        )
    if args.plot:
        label = " x ".join(f"{axis} {degree}" for axis, degree in degrees.items() if degree > 1)
        plot_loss_curves({"1 process": single, label or "1 process": grid}, path=args.plot)
    print(
        json.dumps(
            {
                "world_size": world,
                "single_process_loss": single,
                "grid_loss": grid,
                "max_difference": max(abs(a - b) for a, b in zip(single, grid)),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
