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


def read_report(path: str | Path) -> list[StepReport]:
    """The steps of a ``--straggler-report`` file; a line that does not read is refused with its number.

    Args:
        path: the JSON-lines file the trainer wrote.
    """
    path = checks.check_not_binary("REPORT", path, "a straggler report")
    steps = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            steps.append(StepReport(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as error:
            raise UserError(f"{path}, line {number}: not a straggler report's line ({error})") from None
    if not steps:
        raise UserError(f"{path} holds no step: was it written by --straggler-report, and did a step run?")
    return steps


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
        steps = read_report(args.report)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary(steps), indent=1) if args.json else describe(steps))
    if args.plot:
        plot_stragglers([step.as_dict() for step in steps], path=args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    checks.exit_with(main)
