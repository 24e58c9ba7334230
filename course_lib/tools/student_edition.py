"""The repository a student receives: the course without the labs' solutions and answer keys.

The instructors' repository holds each lab's ``solution.py`` (from which its exercise is
generated) and ``solution_answers.toml`` (the key to its questions). A student who has them has
the lab done. This command copies every file git tracks into a new folder, leaving those out; the
exercises, the grading suites, the notebooks (whose prediction cells hold no answer) and the
predictions files stay.

``make test`` in the edition stays green, and does not pretend: the tests that grade a lab's
solution are not collected there (``tests/conftest.py``: there is no solution to grade), and
``tests/tools/test_student_edition.py`` instead grades every untouched exercise and expects each to
fail at its first TODO, as a student's first check does. Copy a solution back as the exercise and
the same grader passes it (the instructors' repository tests exactly that).

Usage::

    python -m course_lib.tools.student_edition ../course-student
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import UserError
from .grading_room import SECRETS

ROOT = Path(__file__).resolve().parents[2]


def is_hidden(path: str) -> bool:
    """Whether a tracked file stays in the instructors' repository: a lab's solution or its key.

    Args:
        path: the file's path relative to the repository's root (``labs/lab1_ddp/solution.py``).
    """
    parts = Path(path).parts
    return len(parts) == 3 and parts[0] == "labs" and parts[2] in SECRETS


def tracked_files(root: Path = ROOT) -> list[str]:
    """Every file git tracks under ``root``, relative to it.

    Args:
        root: the course repository (a git work tree).
    """
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True, text=True
        )
    except (OSError, subprocess.CalledProcessError) as error:
        raise UserError(
            f"{root} is not a git work tree ({error}): build the edition from a clone of the course"
        ) from None
    return [name for name in listed.stdout.split("\0") if name]


def write_edition(target: Path, *, root: Path = ROOT) -> tuple[int, list[str]]:
    """Copy ``root``'s tracked files into ``target`` without the solutions; return (copied, left out).

    Args:
        target: a new or empty folder for the students' repository.
        root: the instructors' repository.
    """
    target = target.resolve()
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{target} is not empty: name a new folder for the students' edition")
    if target == root or root in target.parents:
        raise UserError(f"{target} is inside the course repository: name a folder outside it")
    copied, left_out = 0, []
    for name in tracked_files(root):
        if is_hidden(name):
            left_out.append(name)
            continue
        source = root / name
        if not source.exists() and not source.is_symlink():  # deleted, not yet committed
            continue
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination, follow_symlinks=False)  # a link stays a link
        copied += 1
    return copied, left_out


def main(argv: list[str] | None = None) -> int:
    """Write the students' edition of the course into a new folder."""
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.tools.student_edition", description=main.__doc__
    )
    parser.add_argument("target", type=Path, help="a new (or empty) folder outside this repository")
    args = parser.parse_args(argv)
    try:
        copied, left_out = write_edition(args.target)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    hidden = " and ".join(SECRETS)
    print(f"wrote {copied} files to {args.target}; left out {len(left_out)}: every lab's {hidden}")
    print("there, `make test` grades each untouched exercise and expects it to fail at its first TODO")
    return 0


if __name__ == "__main__":
    sys.exit(main())
