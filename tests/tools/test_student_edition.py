"""The students' edition (``tools/student_edition.py``): the course without the labs' solutions.

In the instructors' repository: the edition is built, holds no solution and no key, its grader
fails an untouched exercise at its first TODO and passes the solution once it is copied back. In
the edition itself (no solutions there): every lab's untouched exercise is graded and fails, which
is what a student's first check shows; the tests that grade solutions are not collected
(``tests/conftest.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.errors import UserError
from course_lib.tools import grading_room, labs, student_edition

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow  # gradings run the labs' suites in sandboxed processes

HAS_SOLUTIONS = (labs.LABS_DIR / "lab1_ddp" / "solution.py").exists()


def _check(root: Path, lab: str, *extra: str) -> subprocess.CompletedProcess:
    """``labs check`` run in ``root`` (its own ``course_lib`` first on the path, as ``-m`` puts it)."""
    return subprocess.run(
        [sys.executable, "-m", "course_lib.tools.labs", "check", lab, *extra],
        cwd=root, env=clean_env(PYTHONPATH=str(root)), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


if HAS_SOLUTIONS:

    def test_the_edition_leaves_out_every_solution_and_key_and_its_grader_still_grades(tmp_path):
        edition = tmp_path / "students"
        copied, left_out = student_edition.write_edition(edition)
        assert sorted(left_out) == sorted(
            f"labs/{name}/{hidden}" for name in labs.lab_names() for hidden in grading_room.SECRETS
        )
        assert not list(edition.glob("labs/*/solution*"))
        assert copied == len(student_edition.tracked_files()) - len(left_out)
        for name in labs.lab_names():  # exercises, suites, questions and READMEs are all there
            for kept in ("exercise.py", "grading.py", "answers.toml", "README.md"):
                assert (edition / "labs" / name / kept).exists(), (name, kept)
        lab = "lab8_activations"
        untouched = _check(edition, lab)
        assert untouched.returncode == 1, untouched.stdout + untouched.stderr
        assert "TODO" in untouched.stdout + untouched.stderr
        shutil.copy(labs.LABS_DIR / lab / "solution.py", edition / "labs" / lab / "exercise.py")
        shutil.copy(labs.LABS_DIR / lab / "solution_answers.toml", edition / "labs" / lab / "answers.toml")
        solved = _check(edition, lab)
        assert solved.returncode == 0, solved.stdout + solved.stderr
        assert "6 of 6 properties and answers hold" in solved.stdout

    def test_an_edition_is_written_only_into_a_new_folder_outside_the_course(tmp_path, capsys):
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "notes.txt").write_text("mine")
        with pytest.raises(UserError, match="is not empty: name a new folder"):
            student_edition.write_edition(tmp_path / "full")
        with pytest.raises(UserError, match="inside the course repository"):
            student_edition.write_edition(REPO / "labs" / "edition")
        assert student_edition.main([str(tmp_path / "full")]) == 2
        assert "is not empty" in capsys.readouterr().err

else:

    @pytest.mark.parametrize("lab", labs.lab_names())
    def test_every_untouched_exercise_fails_its_grader_at_a_todo(lab):
        """The edition's own check: a student's first ``labs check`` fails, naming the first TODO."""
        untouched = _check(REPO, lab)
        assert untouched.returncode == 1, untouched.stdout + untouched.stderr
        assert "TODO" in untouched.stdout + untouched.stderr
