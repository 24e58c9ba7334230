"""The hands-on labs: exercises generated from their solutions, and a check that says what is wrong.

Each lab in ``labs/<name>/`` has a ``solution.py`` whose teaching parts are marked::

    # BEGIN SOLUTION: average the gradients over all ranks (comm.all_reduce, then divide)
    ...the code...
    # END SOLUTION

``python -m course_lib.tools.labs generate`` writes ``exercise.py`` beside it, with every marked region
replaced by a TODO carrying the hint and a ``raise NotImplementedError`` (so an untouched exercise
fails loudly, at the right line). A test fails if a committed exercise differs from what the
command generates, so the two can never drift apart.

``python -m course_lib.tools.labs check lab1_ddp`` runs the student's ``exercise.py`` (or ``--file``) the
way the lab's ``check(run)`` says, usually on 2 CPU processes, runs the solution the same way, and
compares the numbers, naming the first difference or the first TODO still to fill in.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType

from .. import checks

LINE_LENGTH = 110  # pyproject.toml's [tool.ruff] line-length: exercises are formatted like the code
LABS_DIR = Path(__file__).resolve().parent.parent.parent / "labs"
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION: (?P<hint>.+)$")
END = re.compile(r"^\s*# END SOLUTION\s*$")


def lab_names() -> list[str]:
    return sorted(path.parent.name for path in LABS_DIR.glob("*/solution.py"))


def _raise_todo(indent: str, hint: str) -> list[str]:
    """``raise NotImplementedError("TODO: hint")`` laid out as the project's formatter lays it out."""
    message = f"TODO: {hint}"
    literal = repr(message) if '"' in message else '"' + message.replace("\\", "\\\\") + '"'
    one_line = f"{indent}raise NotImplementedError({literal})"
    if len(one_line) <= LINE_LENGTH:
        return [one_line]
    return [f"{indent}raise NotImplementedError(", f"{indent}    {literal}", f"{indent})"]


def exercise_text(solution: str) -> str:
    """The exercise for a solution's text: each marked region becomes a TODO with its hint."""
    lines, inside, out = solution.splitlines(), False, []
    for number, line in enumerate(lines, 1):
        begin = BEGIN.match(line)
        if begin:
            if inside:
                raise ValueError(f"line {number}: BEGIN SOLUTION inside another solution region")
            inside = True
            indent, hint = begin["indent"], begin["hint"].strip()
            out += [f"{indent}# TODO: {hint}", *_raise_todo(indent, hint)]
        elif END.match(line):
            if not inside:
                raise ValueError(f"line {number}: END SOLUTION without BEGIN")
            inside = False
        elif not inside:
            out.append(line.replace("Solution of ", "Exercise: ", 1) if number <= 3 else line)
    if inside:
        raise ValueError("a solution region is not closed with # END SOLUTION")
    return "\n".join(out) + "\n"


def generate(names: list[str] | None = None) -> list[Path]:
    written = []
    for name in names or lab_names():
        solution = LABS_DIR / name / "solution.py"
        target = solution.with_name("exercise.py")
        target.write_text(exercise_text(solution.read_text()))
        written.append(target)
    return written


def compare_training(got: dict, expected: dict, *, tolerance: float = 1e-4) -> list[str]:
    """Differences between two training runs' ``losses`` (step by step) and final ``weights``.

    Args:
        got: the student's run: ``{"losses": [...], "weights": flat tensor}``.
        expected: the solution's run, in the same form.
        tolerance: the largest difference taken as rounding.
    """
    problems = []
    for step, (ours, theirs) in enumerate(zip(got["losses"], expected["losses"])):
        if abs(ours - theirs) > tolerance:
            problems.append(f"the loss of step {step + 1} is {ours:.4f}, the solution's {theirs:.4f}")
            break
    difference = (got["weights"] - expected["weights"]).abs().max().item()
    if difference > tolerance:
        problems.append(f"the final weights differ by up to {difference:.2e}")
    return problems


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"lab_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_todo(error: BaseException, path: Path) -> str:
    """The TODO's text and where it is: from this process's traceback, or the one a rank sent back."""
    lines = [
        frame.lineno for frame in traceback.extract_tb(error.__traceback__) if Path(frame.filename) == path
    ]
    for note in getattr(error, "__notes__", []):  # launch() attaches the failing rank's traceback
        lines += [int(n) for n in re.findall(rf'File "{re.escape(str(path))}", line (\d+)', note)]
    where = f" ({path.name}, line {lines[-1]})" if lines else ""
    return f"{str(error).splitlines()[0]}{where}"


def check(name: str, file: Path | None = None) -> tuple[bool, str]:
    """Run the student's file and the solution the lab's way; (passed, message)."""
    folder = LABS_DIR / name
    if not (folder / "solution.py").is_file():
        raise SystemExit(f"error: no lab named {name!r}: choose one of {', '.join(lab_names())}")
    student_path = (file or folder / "exercise.py").resolve()
    solution = load(folder / "solution.py")
    expected = solution.check_run(solution)
    try:
        student = load(student_path)
        got = solution.check_run(student)
    except NotImplementedError as error:
        return False, f"not finished yet: {_first_todo(error, student_path)}: fill it in, then check again"
    except Exception as error:  # noqa: BLE001 (any mistake in the student's code is reported, not raised)
        first_line = str(error).splitlines()[0] if str(error) else ""
        return False, f"your code raised {type(error).__name__}: {first_line}"
    problems = solution.compare(got, expected)
    if problems:
        return False, "different from the solution: " + "; ".join(problems)
    return True, f"{name}: your {student_path.name} gives the solution's numbers ({solution.summary(got)})"


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.labs", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help="write every exercise.py from its solution.py")
    checker = sub.add_parser("check", help="run your exercise and compare it with the solution")
    checker.add_argument("lab", help=f"one of: {', '.join(lab_names())}")
    checker.add_argument(
        "--file",
        type=checks.file_to_read,
        default=None,
        help="the file to check (default: the lab's exercise.py)",
    )
    args = parser.parse_args(argv)
    if args.command == "generate":
        for path in generate():
            print(f"wrote {path.relative_to(LABS_DIR.parent)}")
        return 0
    passed, message = check(args.lab, args.file)
    print(("PASS " if passed else "NOT YET ") + message)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
