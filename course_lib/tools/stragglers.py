"""Read a ``--straggler-report`` file: name the slowest rank, what it cost, and draw every step.

python -m course_lib.tools.stragglers REPORT.jsonl [--plot stragglers.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import checks
from ..errors import UserError
from ..observe.stragglers import StepReport, describe, summary
from .plots import image_to_write, plot_stragglers


def read_runs(path: str | Path) -> list[list[tuple[int, StepReport]]]:
    """The runs of a ``--straggler-report`` file, each its (line number, step) pairs. The trainer
    appends: a second run (or a resumed one, which redoes the steps after its checkpoint) starts
    where a step number stops growing or the ranks change in number.

    Args:
        path: the JSON-lines file the trainer wrote.
    """
    path = checks.check_not_binary("REPORT", path, "a straggler report")
    runs: list[list[tuple[int, StepReport]]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            step = StepReport(**json.loads(line))
            ranks = len(step.lateness_s)
            if not ranks or len(step.waited_s) != ranks or len(step.last_arrivals) != ranks:
                raise TypeError("its lists must hold one number for each rank")
            if not 0 <= step.slowest_rank < ranks:
                raise TypeError(f"slowest_rank {step.slowest_rank} is not one of its {ranks} ranks")
        except (json.JSONDecodeError, TypeError) as error:
            raise UserError(f"{path}, line {number}: not a straggler report's line ({error})") from None
        previous = runs[-1][-1][1] if runs else None
        if previous is None or step.step <= previous.step or ranks != len(previous.lateness_s):
            runs.append([])
        runs[-1].append((number, step))
    if not runs:
        raise UserError(f"{path} holds no step: was it written by --straggler-report, and did a step run?")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.stragglers",
        description="Name the slowest rank of a run from its --straggler-report, and draw every step.",
    )
    parser.add_argument("report", help="the JSON-lines file --straggler-report wrote")
    parser.add_argument(
        "--plot",
        type=image_to_write,
        default=None,
        help="draw each rank's lateness and wait per step (.png)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.report)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    steps = [step for _, step in runs[-1]]
    if len(runs) > 1:
        first_line = runs[-1][0][0]
        print(
            f"note: {args.report} holds {len(runs)} runs (the trainer appends; a resumed run starts again "
            f"after its checkpoint): reading the last, from line {first_line} (step {steps[0].step}, "
            f"{len(steps[0].lateness_s)} ranks); give each run its own file to keep them apart",
            file=sys.stderr,
        )
    print(json.dumps(summary(steps), indent=1) if args.json else describe(steps))
    if args.plot:
        plot_stragglers([step.as_dict() for step in steps], path=args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    checks.exit_with(main)
