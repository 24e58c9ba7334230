"""The labs' graders under attack: an untouched exercise that attacks its grader fails every lab, and
each attack, written as a student would, fails with its reason (apart from ``test_labs.py``, so that
``make test``'s two workers share the labs' gradings)."""

from __future__ import annotations

from pathlib import Path

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


# every lab meets the three attacks together, guarded (ATTACKING_TAIL, above); here each escape route is
# written as a student would, with the line the grading then prints. The solution is reached by the
# repository's absolute path, which the file finds from the interpreter it runs in (the repository's
# .venv): a route that reads it would pass the lab.

FIND_THE_SOLUTION = """
import os, pathlib, sys
REPOSITORY = pathlib.Path({repository!r})
SOLUTION = REPOSITORY / "labs" / "lab7_scaling" / "solution.py"
"""

BECOME_THE_SOLUTION = """
try:
    _found = read_solution()
    exec(compile(_found, "solution", "exec") if isinstance(_found, str) else _found, globals())
except Exception:
    pass
"""

ESCAPES = {
    "a directory-relative os.open": """
def read_solution():
    folder = os.open(SOLUTION.parent, os.O_RDONLY)
    return os.read(os.open("solution.py", os.O_RDONLY, dir_fd=folder), 10**6).decode()
""",
    "libc's open through ctypes": """
import ctypes
def read_solution():
    libc = ctypes.CDLL(None)
    libc.open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    fd = libc.open(bytes(SOLUTION), os.O_RDONLY)
    return os.read(fd, 10**6).decode()
""",
    "a program started where no audit event sees it": """
import ctypes, tempfile
def read_solution():
    copy = pathlib.Path(tempfile.mkdtemp()) / "copy.py"
    ctypes.CDLL(None).system(f"cat {SOLUTION} > {copy}".encode())
    return copy.read_text()
""",
    "its cached bytecode": """
import marshal
def read_solution():
    cached = SOLUTION.parent / "__pycache__" / f"solution.{sys.implementation.cache_tag}.pyc"
    return marshal.loads(cached.read_bytes()[16:])
""",
}


def test_no_route_reaches_a_solution_where_the_submission_runs(tmp_path):
    """The grading runs in a room without the solutions, and (where Linux allows namespaces, as on
    every machine the course is tested on) with the repository's labs and git objects empty: one
    submission tries every route, each in turn, and the untouched exercise fails as it is."""
    import py_compile

    from course_lib.tools import grading_room

    from conftest import REPO

    py_compile.compile(str(LAB7 / "solution.py"), doraise=True)  # the cached bytecode is there to find
    path = tmp_path / "attempt.py"
    attempts = [FIND_THE_SOLUTION.format(repository=str(REPO))]
    for route in ESCAPES.values():  # each defines read_solution; each is tried before the next
        attempts += [route, BECOME_THE_SOLUTION]
    path.write_text((LAB7 / "exercise.py").read_text() + "".join(attempts))
    (tmp_path / "answers.toml").write_text((LAB7 / "solution_answers.toml").read_text())
    graded = _check_command("lab7_scaling", "--file", str(path))
    assert graded.returncode == 1, graded.stdout
    assert "PASS  speedup" not in graded.stdout, graded.stdout
    assert graded.stdout.splitlines()[-1].startswith("lab7_scaling: 5 of 10 properties and answers hold")
    assert grading_room.namespace_prefix(), "this machine allows no namespace: the routes are only narrowed"


FORGED_LINES = """
import os, pathlib, time
print("lab7_scaling: 10 of 10 properties and answers hold", flush=True)
_marker = pathlib.Path.cwd() / ".forked"  # the grading's room: one grandchild for the whole grading
try:
    _marker.touch(exist_ok=False)
    if os.fork() == 0:
        os.setsid()
        time.sleep(3)
        print("lab7_scaling: 10 of 10 properties and answers hold", flush=True)
        os._exit(0)
except FileExistsError:
    pass
"""
FORGED_MESSAGES = """
import json, os
for _fd in __import__("glob").glob("/proc/*/fd/*"):
    try:
        if os.readlink(_fd).startswith("pipe:"):
            _body = json.dumps({"n": 0, "record": {"status": "END"}})
            with open(_fd, "w") as _pipe:
                _pipe.write(json.dumps({"body": _body, "mac": "0" * 64}) + chr(10))
    except OSError:
        pass
"""


@pytest.mark.parametrize("forgery", ["lines", "messages"])
def test_the_judges_verdict_is_its_own_and_comes_last(forgery, tmp_path):
    """What a submission prints (itself, or a grandchild it left behind) is shown apart, on stderr,
    marked, and never after the verdict; a message on the grading's channel not signed with its key
    ends the grading as not graded. The judge's verdict is the last line."""
    import time

    path = tmp_path / "attempt.py"
    path.write_text(
        (LAB7 / "exercise.py").read_text() + (FORGED_LINES if forgery == "lines" else FORGED_MESSAGES)
    )
    (tmp_path / "answers.toml").write_text((LAB7 / "solution_answers.toml").read_text())
    graded = _check_command("lab7_scaling", "--file", str(path))
    time.sleep(4)  # a grandchild that outlived the judge would print now
    assert graded.returncode == 1, graded.stdout
    last = graded.stdout.splitlines()[-1]
    if forgery == "messages":
        assert last == "lab7_scaling: not graded to the end", graded.stdout
        assert "did not verify" in graded.stdout
    else:
        assert last.startswith("lab7_scaling: 5 of 10 properties and answers hold"), graded.stdout
    assert "10 of 10" not in graded.stdout
    for line in graded.stderr.splitlines():  # what the submission printed, marked as its own
        if "10 of 10" in line:
            assert line.startswith("  | "), line


def _lab11_attempt(tmp_path, old: str, new: str, tail: str = "") -> Path:
    source = (labs.LABS_DIR / "lab11_collective_matmul" / "solution.py").read_text()
    assert old in source
    path = tmp_path / "attempt.py"
    path.write_text(source.replace(old, new) + tail)
    (tmp_path / "answers.toml").write_text(
        (labs.LABS_DIR / "lab11_collective_matmul" / "solution_answers.toml").read_text()
    )
    return path


WAIT_FIRST = (
    "        chunks[owner], products[owner] = here, here @ matrix\n        if step < size - 1:\n"
    "            exchange.wait()\n",
    "        tiny = torch.ones(1, 1) @ torch.ones(1, 1)\n        if step < size - 1:\n"
    "            exchange.wait()\n        chunks[owner], products[owner] = here, here @ matrix\n"
    "        if step < size - 1:\n",
)
REPLACE_THE_ORDER_CHECK = """
import sys as _sys
for _module in list(_sys.modules.values()):
    if getattr(_module, "__name__", "").startswith("lab_lab11") and hasattr(_module, "_order"):
        _module._order = lambda call, *args: ([["post", 0], ["matmul", 10**9], ["wait", 0]] * 3)[:1]
"""


def test_lab11s_overlap_is_measured_not_the_order_of_calls(tmp_path):
    """A loop that waits before its real matmul does not overlap, whatever small product it places
    between post and wait, and whatever the rank's file does to the suite's recorder."""
    path = _lab11_attempt(tmp_path, *WAIT_FIRST, tail=REPLACE_THE_ORDER_CHECK)
    graded = _check_command("lab11_collective_matmul", "--file", str(path))
    assert graded.returncode == 1, graded.stdout
    overlap = next(line for line in graded.stdout.splitlines() if "in flight while" in line)
    assert overlap.startswith("FAIL") and "less than one chunk's product" in overlap, graded.stdout
