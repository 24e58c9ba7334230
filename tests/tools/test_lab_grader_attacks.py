"""The labs' graders under attack: an untouched exercise that attacks its grader fails every lab, and
each attack, written as a student would, fails with its reason (apart from ``test_labs.py``, so that
``make test``'s two workers share the labs' gradings)."""

from __future__ import annotations

import pytest

from course_lib.tools import labs

from test_labs import LAB7, SUITE_LABS, _check_command

pytestmark = pytest.mark.slow  # every grading runs the lab's suite in sandboxed processes: seconds each

# What a submission that attacks its grader adds to an unfinished exercise, each attack guarded so
# that the file still loads: it writes the verdict, patches the grading code, and becomes the
# lab's solution. Where any of them worked, the exercise would pass.
ATTACKING_TAIL = """
import importlib.util as _util
import json as _json
import os as _os
import sys as _sys

for _arg in _sys.argv:
    if _arg.endswith("verdict.json"):
        for _target in (_arg, _arg[: -len(".json")] + ".partial"):
            try:
                with open(_target, "w") as _file:
                    _json.dump({{"passed": True, "summary": "every property holds"}}, _file)
                if _target != _arg:
                    _os.replace(_target, _arg)
            except OSError:
                pass

import course_lib.tools.labs as _graders

_graders.run_suite = lambda *args, **kwargs: (True, ["every property holds"])
_graders._property_outcome = lambda *args, **kwargs: None
for _module in list(_sys.modules.values()):
    if getattr(_module, "PROPERTIES", None):
        _module.PROPERTIES = []

try:
    _spec = _util.spec_from_file_location("_answer", _graders.LABS_DIR / {name!r} / "solution.py")
    _answer = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_answer)
    globals().update({{key: value for key, value in vars(_answer).items() if not key.startswith("__")}})
except PermissionError:
    pass
"""


@pytest.mark.parametrize("name", SUITE_LABS)
def test_the_untouched_exercise_fails_helpfully_even_when_it_attacks_the_grader(name, tmp_path):
    grading = labs.load(labs.LABS_DIR / name / "grading.py")
    total = len(grading.PROPERTIES) + len(grading.QUESTIONS)
    attempt = tmp_path / "exercise.py"  # answers.toml: the lab's, which holds no answer
    attempt.write_text((labs.LABS_DIR / name / "exercise.py").read_text() + ATTACKING_TAIL.format(name=name))
    untouched = _check_command(name, "--file", str(attempt))
    assert untouched.returncode == 1
    lines = untouched.stdout.splitlines()
    first = grading.PROPERTIES[0]
    assert lines[0].startswith(f"FAIL  {first.name} (") and "not finished yet: TODO: " in lines[0], lines[0]
    assert "(exercise.py, line " in lines[0]
    assert lines[-1] == f"{name}: 0 of {total} properties and answers hold; hint: {first.hint}"
    assert "not answered yet" in untouched.stdout  # the committed answers.toml holds no answer


# every lab meets the three attacks together, guarded (ATTACKING_TAIL, above); here each is shown unguarded,
# as a student would write it, with the line the grading then prints

ATTACKS = {
    "writes its own verdict": (
        """
import json, sys
for arg in sys.argv:
    if arg.endswith("verdict.json"):
        with open(arg, "w") as file:
            json.dump({"passed": True, "summary": "lab7_scaling: 10 of 10 hold"}, file)
""",
        "does not load: PermissionError: a graded submission may not touch the grader's verdict",
    ),
    "imports the solution": (
        """
import importlib.util
import course_lib.tools.labs as graders
_spec = importlib.util.spec_from_file_location("answer", graders.LABS_DIR / "lab7_scaling" / "solution.py")
_answer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_answer)
speedup_and_efficiency, karp_flatt_metric = _answer.speedup_and_efficiency, _answer.karp_flatt_metric
""",
        "does not load: PermissionError: a graded submission may not read the lab's solution (solution.py)",
    ),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_exercise_that_attacks_the_grader_fails_with_the_reason(attack, tmp_path):
    """The submission runs only in processes apart from the judge: what it writes or imports there
    is refused, and the grading says so."""
    tail, reason = ATTACKS[attack]
    path = tmp_path / "attempt.py"
    path.write_text((LAB7 / "exercise.py").read_text() + tail)
    (tmp_path / "answers.toml").write_text((LAB7 / "solution_answers.toml").read_text())
    graded = _check_command("lab7_scaling", "--file", str(path))
    assert graded.returncode == 1, graded.stdout
    assert reason in graded.stdout, graded.stdout
