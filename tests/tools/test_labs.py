"""The labs: solutions reach their accuracy, exercises are in sync, and the check command helps."""

from __future__ import annotations

import subprocess
import sys

import pytest

from course_lib.tools import labs

from conftest import REPO, clean_env

EXPECTED_ACCURACY = {"lab1_ddp": 0.8, "lab2_fsdp": 0.8}


def test_every_committed_exercise_is_what_the_generator_writes():
    for name in labs.lab_names():
        folder = labs.LABS_DIR / name
        generated = labs.exercise_text((folder / "solution.py").read_text())
        assert (folder / "exercise.py").read_text() == generated, (
            f"labs/{name}/exercise.py is stale: run python -m course_lib.tools.labs generate"
        )


def test_the_generator_refuses_unbalanced_markers():
    with pytest.raises(ValueError, match="not closed"):
        labs.exercise_text("x = 1\n    # BEGIN SOLUTION: hint\n    y = 2\n")
    with pytest.raises(ValueError, match="END SOLUTION without BEGIN"):
        labs.exercise_text("x = 1\n# END SOLUTION\n")


@pytest.mark.parametrize("name", ["lab1_ddp", "lab2_fsdp", "lab3_scaling"])
def test_the_check_passes_on_the_solution_and_explains_the_untouched_exercise(name):
    def check(*args):
        return subprocess.run(
            [sys.executable, "-m", "course_lib.tools.labs", "check", name, *args],
            cwd=REPO,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    solved = check("--file", f"labs/{name}/solution.py")
    assert solved.returncode == 0 and solved.stdout.startswith("PASS"), solved.stdout + solved.stderr
    if name in EXPECTED_ACCURACY:
        accuracy = float(solved.stdout.split("validation accuracy ")[1].split("%")[0]) / 100
        assert accuracy >= EXPECTED_ACCURACY[name]
    untouched = check()
    assert untouched.returncode == 1
    assert untouched.stdout.startswith("NOT YET not finished yet: TODO: ")
    assert "(exercise.py, line " in untouched.stdout and "fill it in, then check again" in untouched.stdout


def test_a_wrong_answer_is_reported_with_the_first_difference(tmp_path):
    wrong = (
        (labs.LABS_DIR / "lab1_ddp" / "solution.py")
        .read_text()
        .replace("param.grad /= world_size", "param.grad /= 2 * world_size")
    )
    path = tmp_path / "attempt.py"
    path.write_text(wrong)
    passed, message = labs.check("lab1_ddp", path)
    assert not passed
    assert message.startswith("different from the solution: the loss of step 2 is ")
