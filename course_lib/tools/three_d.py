"""3-D and 4-D parallelism from the command line: a data x pipeline x context x tensor run beside one process.

``python -m course_lib.tools.three_d --data 2 --pipeline 2 --tensor 2`` (add ``--context 2`` for
ring attention over a 4-D grid of 16) trains the transformer of
``course_lib.train.three_d`` on 8 local processes and on one, prints both loss curves as JSON
(they must agree), and with ``--plot`` draws them.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import checks
from ..distributed.launch import check_process_count, launch
from ..errors import UserError
from ..parallel.mesh import describe_grid
from ..parallel.recompute import POLICIES
from ..plan.layout import CONTEXT_ATTENTION
from ..train.three_d import ONE_STAGE_SCHEDULES, check_run, train_3d
from .plots import image_to_write, plot_loss_curves


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.tools.three_d``: a 3-D run beside the one-process run, step by step."""
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.three_d",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    positive = checks.int_at_least(1)
    parser.add_argument("--data", type=positive, default=2, help="data-parallel degree")
    parser.add_argument("--pipeline", type=positive, default=2, help="pipeline stages")
    parser.add_argument("--tensor", type=positive, default=2, help="tensor-parallel degree")
    parser.add_argument(
        "--context", type=positive, default=1, help="context-parallel degree (ring attention)"
    )
    parser.add_argument("--steps", type=positive, default=20)
    parser.add_argument("--global-batch", type=positive, default=16)
    parser.add_argument("--microbatches", type=positive, default=2)
    parser.add_argument("--schedule", choices=ONE_STAGE_SCHEDULES, default="1f1b")
    parser.add_argument(
        "--recomputation",
        choices=POLICIES,
        default="none",
        help="what each block of the grid run keeps for backward (the one-process run keeps everything)",
    )
    parser.add_argument(
        "--context-attention",
        choices=CONTEXT_ATTENTION,
        default="ring",
        help="with --context above 1: ring attention (zig-zag chunks) or Ulysses' all-to-alls (contiguous "
        "chunks)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tensor above 1, Megatron-LM's sequence parallelism: the norms on 1/T of the tokens, "
        "and 1/T of the activations sent between stages",
    )
    parser.add_argument(
        "--plot", type=image_to_write, default=None, help="save the two loss curves to this PNG"
    )
    parser.add_argument(
        "--profile",
        type=checks.folder_to_write,
        default=None,
        help="record the grid run's anatomy: each rank's trace and anatomy.json go into this folder",
    )
    args = parser.parse_args(argv)
    world = args.data * args.pipeline * args.context * args.tensor
    try:
        check_run(
            world, args.data, args.pipeline, args.tensor, args.global_batch, args.microbatches, 4, 64, 4,
            context=args.context, sequence_parallel=args.sequence_parallel,
            context_attention=args.context_attention,
        )  # fmt: skip
        check_process_count(world)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    degrees = dict(data=args.data, pipeline=args.pipeline, context=args.context, tensor=args.tensor)
    print(describe_grid(world, **degrees), file=sys.stderr)
    print(f"training on 1 process, then on {world}...", file=sys.stderr, flush=True)
    options = {
        "steps": args.steps,
        "global_batch": args.global_batch,
        "microbatches": args.microbatches,
        "schedule": args.schedule,
    }
    single = launch(train_3d, 1, data=1, pipeline=1, tensor=1, **options)[0]
    grid = launch(
        train_3d,
        world,
        data=args.data,
        pipeline=args.pipeline,
        context=args.context,
        tensor=args.tensor,
        timeout_s=1800,
        profile=str(args.profile) if args.profile else None,
        recomputation=args.recomputation,
        sequence_parallel=args.sequence_parallel,
        context_attention=args.context_attention,
        **options,
    )[0]
    if args.profile:
        print(
            f"the grid run's anatomy is in {args.profile}/anatomy.json, each rank's trace beside it",
            file=sys.stderr,
        )
    if args.plot:
        plot_loss_curves(
            {
                "1 process": single,
                " x ".join(f"{axis} {degree}" for axis, degree in degrees.items() if degree > 1): grid,
            },
            path=args.plot,
        )
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
