"""The hands-on labs: exercises generated from their solutions, and a check that says what is wrong.

Each lab in ``labs/<name>/`` has a ``solution.py`` whose teaching parts are marked::

    # BEGIN SOLUTION: average the gradients over all ranks (comm.all_reduce, then divide)
    ...the code...
    # END SOLUTION

``python -m course_lib.tools.labs generate`` writes ``exercise.py`` beside it, with every marked region
replaced by a TODO carrying the hint and a ``raise NotImplementedError`` (so an untouched exercise
fails loudly, at the right line). A test fails if a committed exercise differs from what the
command generates, so the two can never drift apart.

``python -m course_lib.tools.labs check lab1_ddp`` runs the lab's grading suite (``grading.py``) on the
student's ``exercise.py`` (or ``--file``): each ``Property`` runs the student's code on real
processes (gloo) at several world sizes, against one process and PyTorch's own, and prints PASS
or FAIL with what differs; the first failure comes with a hint that teaches the idea, never the
line. A rank waiting for a collective another never made is stopped (``LAB_TIMEOUT_S``) with a
message. Then each ``Question`` of the lab's README is checked from the student's
``answers.toml``, against the value the course's own models compute. ``--submissions DIR`` grades
every ``name.py`` in a folder (with ``name.toml``), for instructors.

Each submission is graded by the process that runs ``check`` (the *judge*), which never imports
the student's file: the properties run in a grading process of their own, in a room without the
labs' solutions and keys (``grading_room``), whose outcomes reach the judge signed; the student's
code runs only in processes forked from it (``sandbox``: the ranks a property launches, and a
sandbox for each value asked of it), whose answers come back as data, compared with what the
suite computes itself on inputs drawn afresh for every grading (``GRADING_SEED``). The judge
checks the answers against the keys, ends every process of the grading, and prints the verdict
last. A file that exits while it is imported (``sys.exit``, ``os._exit``), never finishes
importing, forges the verdict, patches the grader, reads the solution or replays recorded outputs
fails with the reason.
"""

from __future__ import annotations

import importlib.util
import math
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import checks
from ..distributed import collective_check  # noqa: F401  (installed: a student's one-sided call gets one line)
from ..distributed.launch import launch
from ..distributed.runtime import PEER_GONE
from ..errors import PeerLeft, UserError
from . import grading_room, sandbox

LINE_LENGTH = 110  # pyproject.toml's [tool.ruff] line-length: exercises are formatted like the code
LABS_DIR = grading_room.LABS
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION: (?P<hint>.+)$")
END = re.compile(r"^\s*# END SOLUTION\s*$")


def lab_names() -> list[str]:
    """Every lab (a folder with a grading suite), in the course's order (lab 10 after lab 9, not
    after lab 1). The students' edition has them all, without their solutions."""
    names = [path.parent.name for path in LABS_DIR.glob("*/grading.py")]

    def number(name: str) -> int:
        found = re.search(r"\d+", name)
        return int(found.group()) if found else 0

    return sorted(names, key=lambda name: (number(name), name))


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
    """Write each lab's ``exercise.py`` from its ``solution.py`` (every lab that has one)."""
    written = []
    for name in names or lab_names():
        solution = LABS_DIR / name / "solution.py"
        if not solution.exists():  # the students' edition: its exercises are already written
            continue
        target = solution.with_name("exercise.py")
        target.write_text(exercise_text(solution.read_text()))
        written.append(target)
    return written


# -- grading suites ---------------------------------------------------------------------------------

GRADING_SEED = 0
"""Drawn afresh by every grading (``run_suite``): suites mix it into their inputs, so that outputs
recorded from another run (a solution's, a classmate's) answer other questions."""


def case_seed(base: int) -> int:
    """A seed for one of a suite's inputs: ``base`` mixed with this grading's ``GRADING_SEED``.

    Args:
        base: the input's own number in the suite (any whole number; each input its own).
    """
    return (base * 1_000_003 + GRADING_SEED) % 2**31


LAB_TIMEOUT_S = 60
"""How long the ranks of one property may take (COURSE_LAB_TIMEOUT_S overrides it): a student's
collective that some rank never calls would otherwise wait forever."""


MIN_LAB_TIMEOUT_S = 2.0
"""The shortest ``COURSE_LAB_TIMEOUT_S``: less, and a property's processes cannot even start (its
ranks would be reported as waiting in a collective)."""


def lab_timeout_s() -> float:
    """``COURSE_LAB_TIMEOUT_S`` (seconds, above 0, at most a day), or ``LAB_TIMEOUT_S``; one line where
    the variable is not such a number."""
    text = os.environ.get("COURSE_LAB_TIMEOUT_S", "")
    if not text:
        return LAB_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_LAB_TIMEOUT_S <= value <= 86_400:  # NaN too
        raise UserError(
            f"COURSE_LAB_TIMEOUT_S={text!r}: give seconds, from {MIN_LAB_TIMEOUT_S:g} (what starting a "
            "property's processes takes) to 86400"
        )
    return value


def grading_seed() -> int:
    """``COURSE_GRADING_SEED`` (a whole number from 1 to 2^31 - 1: the inputs of a grading to
    reproduce), or one drawn afresh; one line where the variable is not such a number."""
    text = os.environ.get("COURSE_GRADING_SEED", "")
    if not text:
        return random.SystemRandom().randrange(1, 2**31)
    if not text.strip().isdigit() or not 1 <= int(text) < 2**31:
        raise UserError(
            f"COURSE_GRADING_SEED={text!r}: give the whole number a grading printed (from 1 to {2**31 - 1}), "
            "or unset it to draw new inputs"
        )
    return int(text)


@dataclass(frozen=True)
class Property:
    """One thing a lab's grading suite checks.

    Args:
        name: what holds when the student's code is right, as the check prints it.
        check: ``check(lab_module)``; raises AssertionError with what differs.
        hint: shown for the first property that fails: the idea, the API to look up, the pitfall.
        optional: part of a lab's optional part: while its code is still a TODO it is reported as
            not attempted (SKIP) and the lab can pass without it; once written, it is graded like
            the rest.
    """

    name: str
    check: Callable[[ModuleType], None]
    hint: str
    _: KW_ONLY
    optional: bool = False


class Refused(Exception):
    """A question's right value cannot be taken from these measurements as they are: the message says
    why (too few runs, a term that cannot be negative) and what to measure instead."""


@dataclass(frozen=True)
class Question:
    """A numeric question of a lab's README, answered in the lab's ``answers.toml``.

    Args:
        key: the answer's name in ``answers.toml``.
        answer: computes the right value with the course's own models (never stored as a literal);
            with ``from_answers``, from the student's own measurements: ``answer(answers)`` gets
            the whole ``answers.toml`` as a dictionary.
        how: shown when the answer is wrong: which model or measurement gives it, not the number.
        rel_tol: how close an answer must be (relative), for questions with rounded answers.
        from_answers: the right value depends on what the student measured (a lab graded on the
            student's own data), which ``answers.toml`` holds beside the answers.
    """

    key: str
    answer: Callable[..., float]
    how: str
    _: KW_ONLY
    rel_tol: float = 1e-3
    from_answers: bool = False


def check_answers(questions: list[Question], path: Path) -> list[str]:
    """One PASS or FAIL line per question, from the answers in the TOML file at ``path``."""
    import math
    import tomllib

    if not path.is_file():
        return [f"FAIL  answers: {path} does not exist (copy the lab's answers.toml and fill it in)"]
    try:
        given = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        return [
            f"FAIL  answers: {path.name} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
            f"position {error.start}): save it as UTF-8 (TOML files must be)"
        ]
    except tomllib.TOMLDecodeError as error:
        return [f"FAIL  answers: {path.name} is not valid TOML: {error}"]
    lines = []
    for question in questions:
        value = given.get(question.key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            lines.append(f"FAIL  question {question.key}: not answered yet (a number in {path.name})")
            continue
        try:
            right = question.answer(given) if question.from_answers else question.answer()
        except Refused as refusal:
            lines.append(f"FAIL  question {question.key}: {refusal}")
            continue
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            lines.append(
                f"FAIL  question {question.key}: your measurements in {path.name} cannot give it "
                f"({type(error).__name__}: {error}); paste the [measured] block the lab's script prints"
            )
            continue
        if math.isclose(value, right, rel_tol=question.rel_tol):
            lines.append(f"PASS  question {question.key}")
        else:
            lines.append(f"FAIL  question {question.key}: {value:g} is not it; {question.how}")
    return lines


class CollectiveHung(Exception):
    """The ranks of a property did not finish: some rank waits for a collective another never made."""


def on_ranks(world_size: int, fn: Callable, *args: Any) -> list:
    """``fn(*args)`` on ``world_size`` fresh processes (gloo): every rank's result, in rank order.

    Args:
        world_size: how many processes.
        fn: the function every rank runs (a module-level function of the grading suite).
        args: its arguments (the student's module among them: forked processes inherit it).
    """
    try:  # what the ranks send back is read as data only (sandbox.safe_loads)
        return launch(fn, world_size, *args, timeout_s=lab_timeout_s(), read_result=sandbox.safe_loads)
    except TimeoutError:
        raise CollectiveHung(
            f"on {world_size} ranks nothing finished within {lab_timeout_s():g} s: some rank is waiting in a "
            "collective that another rank never made (every rank must make the same collectives, in the "
            "same order, and wait on every handle it started)"
        ) from None


def in_sandbox(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in a process forked for it, where the submission (``lab``, among ``args``) may
    run; what it returns comes back as data (``sandbox``). For what the judge cannot ask of a
    function's result from afar: identity, autograd through the student's code.

    Args:
        fn: a module-level function of the grading suite.
        args: its arguments.
    """
    return sandbox.in_sandbox(fn, *args, timeout_s=lab_timeout_s())


def _property_outcome(prop: Property, student: sandbox.Submission, path: Path) -> str | None:
    """None when the property holds, else the one line that says what is wrong."""
    try:
        prop.check(student)
    except (SystemExit, sandbox.CalledExit) as stop:
        how = stop if isinstance(stop, sandbox.CalledExit) else f"sys.exit({stop.code!r})"
        return f"your code called {how} while it was checked: return or raise instead"
    except NotImplementedError as error:
        return f"not finished yet: {_first_todo(error, path)}"
    except AssertionError as error:
        return str(error).splitlines()[0] if str(error) else "an assertion failed"
    except CollectiveHung as error:
        return str(error)
    except (UserError, PeerLeft) as error:  # the course's own line (collectives that differ across ranks...)
        return str(error)
    except Exception as error:  # noqa: BLE001 (the student's mistake is reported, never raised)
        if any(sign in str(error) for sign in PEER_GONE):
            return (
                "a rank waited in a collective that another rank never made (that rank had already "
                "finished): every rank must make the same collectives, in the same order"
            )
        if isinstance(error.__cause__, NotImplementedError) or "NotImplementedError" in str(error):
            return f"not finished yet: {_first_todo(error, path)}"
        first_line = str(error).splitlines()[0] if str(error) else ""
        return f"your code raised {type(error).__name__}: {first_line}"
    return None


def _loads(lab: sandbox.Submission) -> None:
    lab.module()  # in a sandbox: what the file does when it is imported happens there


def _load_problem(student: sandbox.Submission, seconds: float) -> str | None:
    """None when the student's file imports cleanly in a sandbox, else the one line that says why not
    (code at a file's top level runs when it is imported)."""
    name = student.path.name
    try:
        sandbox.in_sandbox(_loads, student, timeout_s=seconds)
    except sandbox.SandboxTimeout:
        return (
            f"importing {name} did not finish within {seconds:g} s: code at the top level of a file "
            'runs when it is imported; put it in a function, or under if __name__ == "__main__":'
        )
    except sandbox.CalledExit as stop:
        return (
            f"{name} called {stop} while it was imported: a lab file only defines things; put code "
            'that runs in a function, or under if __name__ == "__main__":'
        )
    except sandbox.SandboxDied as error:
        return f"{name} ended its process while it was imported ({error}): a lab file only defines things"
    except Exception as error:  # noqa: BLE001 (the student's mistake is reported, never raised)
        first = str(error).splitlines()[0] if str(error) else ""
        return f"{name} does not load: {type(error).__name__}: {first}"
    return None


def run_properties(name: str, path: Path, *, emit=None) -> list[dict]:
    """Every property of lab ``name`` on the student's file: one record each (``status`` PASS, FAIL
    or SKIP, the property's ``index``, the ``line`` to print), or one FAIL record where the file
    does not load.

    This process never imports the student's file, which runs only in the processes it forks
    (``sandbox``), and it compares what they send back with what it computes itself.

    Args:
        name: the lab.
        path: the student's Python file.
        emit: called with each record as soon as it is known (for progress).
    """
    global GRADING_SEED
    # inputs a recording cannot have seen (COURSE_GRADING_SEED: the same inputs again, to reproduce one)
    GRADING_SEED = grading_seed()
    grading = load(LABS_DIR / name / "grading.py")
    records: list[dict] = []

    def report(status: str, index: int | None, line: str) -> None:
        records.append({"status": status, "index": index, "line": line})
        if emit is not None:
            emit(records[-1])

    student = sandbox.Submission(path, load=load, timeout_s=lab_timeout_s())
    problem = _load_problem(student, lab_timeout_s())
    if problem:
        report("FAIL", None, f"FAIL  {problem}")
        return records
    for index, prop in enumerate(grading.PROPERTIES):
        started = time.perf_counter()
        problem = _property_outcome(prop, student, path)
        took = f"({time.perf_counter() - started:.1f} s)"
        if problem is None:
            report("PASS", index, f"PASS  {prop.name} {took}")
        elif prop.optional and problem.startswith("not finished yet"):
            report("SKIP", index, f"SKIP  {prop.name} {took}: optional, not attempted ({problem})")
        else:
            report("FAIL", index, f"FAIL  {prop.name} {took}: {problem}")
    return records


def finish_report(name: str, records: list[dict], path: Path, answers: Path | None) -> tuple[bool, list[str]]:
    """The judge's part after the properties: the answers checked against the keys, then the
    verdict line, last. Returns (all passed, every line of the report).

    Args:
        name: the lab.
        records: ``run_properties``'s, as they came back.
        path: the student's file (where ``answers.toml`` is looked for beside it).
        answers: the student's answers (None: ``answers.toml`` beside the file, or the lab's).
    """
    grading = load(LABS_DIR / name / "grading.py")
    lines = [record["line"] for record in records]
    questions = getattr(grading, "QUESTIONS", [])
    if questions and not (records and records[0]["index"] is None):  # a file that does not load: no more
        if answers is None:
            beside = path.with_name("answers.toml") if path.parent != LABS_DIR / name else None
            answers = beside if beside is not None and beside.is_file() else LABS_DIR / name / "answers.toml"
        lines += check_answers(questions, answers)
    failed = [record["index"] for record in records if record["status"] == "FAIL"]
    first_hint = grading.PROPERTIES[failed[0]].hint if failed and failed[0] is not None else None
    passed = len(records) == len(grading.PROPERTIES) and not any(line.startswith("FAIL") for line in lines)
    total = len(grading.PROPERTIES) + len(questions)
    held = sum(line.startswith("PASS") for line in lines)
    summary = f"{name}: {held} of {total} properties and answers hold"
    if passed and any(line.startswith("SKIP") for line in lines):
        summary += " (the optional part not attempted)"
    lines.append(summary + (f"; hint: {first_hint}" if first_hint else ""))
    return passed, lines


def run_suite(name: str, path: Path, answers: Path | None = None) -> tuple[bool, list[str]]:
    """Every property of lab ``name`` on the student's file, then its questions, in this process:
    (all passed, the report). ``grade_submission`` is the same, with the properties in a grading
    room of their own.

    Args:
        name: the lab.
        path: the student's Python file.
        answers: the student's answers (None: ``answers.toml`` beside the file, or the lab's).
    """
    return finish_report(name, run_properties(name, path), path, answers)


# -- each submission in a room of its own -----------------------------------------------------------

SILENCE_LIMIT_PER_TIMEOUT = 4
"""A property runs the student's code on a few world sizes, each bounded by ``lab_timeout_s``; a
grader silent for this many of those (plus ``GRADER_START_S``) is stuck, and is stopped."""

GRADER_START_S = 15
"""What a grading process needs before its first line: start Python, import torch and the suite."""


def grading_silence_limit_s() -> float:
    return SILENCE_LIMIT_PER_TIMEOUT * lab_timeout_s() + GRADER_START_S


def _grade_in_child(name: str, path: Path, channel: int) -> int:
    """The grading process's side (in the room): read the channel's key from the judge, then run
    the properties, each outcome signed and sent as soon as it is known, and a last message that
    says the suite reached its end."""
    key = sys.stdin.buffer.read(grading_room.KEY_BYTES)
    sys.stdin.close()
    sender = grading_room.Sender(channel, key)
    del key
    run_properties(name, path, emit=sender.send)
    sender.send({"status": "END"})
    return 0


def _relay(stream, shown: Callable[[str], None]) -> threading.Thread:
    """Show what the grading's processes print, marked as theirs, until the judge closes the pipe."""

    def relay() -> None:
        for line in stream:
            shown(f"  | {line.rstrip()}")

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return thread


def grade_submission(name: str, path: Path, answers: Path | None = None, *, echo=print) -> bool:
    """Grade ``path`` in a grading room (``grading_room``); True if every property and answer holds.

    Each property's line comes signed from the grading process and is shown at once (``echo``);
    what the submission printed goes to stderr, marked. The grading passes only if the signed
    record of its end arrives: exiting early, being killed, a message that does not verify, or
    falling silent for longer than ``grading_silence_limit_s()`` (an endless loop) fails it, with
    the reason. Then every process of the grading is ended, the answers are checked here, and the
    verdict is the last line.

    Args:
        name: the lab.
        path: the student's Python file.
        answers: the student's answers (None: the default rule of ``finish_report``).
        echo: where each line of the report goes.
    """
    key, records, why = grading_room.new_key(), [], None
    with tempfile.TemporaryDirectory(prefix="course-grade-") as scratch:
        graded = grading_room.build_room(Path(scratch), path)
        receive, send = os.pipe()
        argv = [sys.executable, "-m", "course_lib.tools.labs", "_grade", name, str(graded), str(send)]
        child = subprocess.Popen(
            grading_room.command(argv),
            cwd=scratch,  # the room's course_lib is imported, not the repository's
            env={**os.environ, "PYTHONPATH": scratch, "PYTHONSAFEPATH": ""},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(send,),
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: ending it ends the processes it started
        )
        os.close(send)
        child.stdin.buffer.write(key)  # the channel's key: only the grading process reads it
        child.stdin.close()
        relay = _relay(child.stdout, lambda line: print(line, file=sys.stderr, flush=True))
        messages: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            with os.fdopen(receive, "r", errors="replace") as channel:
                for line in channel:
                    messages.put(line)
            messages.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            try:
                line = messages.get(timeout=grading_silence_limit_s())
            except queue.Empty:
                why = (
                    f"nothing happened for {grading_silence_limit_s():g} s (an endless loop?), so it was "
                    "stopped"
                )
                break
            if line is None:
                break
            record = grading_room.verify(key, len(records), line)
            if record is None:
                why = "a message on the grading's channel did not verify (written by something else)"
                break
            records.append(record)
            if record["status"] == "END":
                break
            echo(record["line"])
        _end(child)
        relay.join(5)
        child.stdout.close()  # a process that escaped the group prints into a closed pipe: never shown
    finished = bool(records) and records[-1]["status"] == "END"
    if not finished:
        last = next((r["line"] for r in reversed(records) if r["status"] in ("PASS", "FAIL", "SKIP")), "")
        where = f" after: {last}" if last else " while it was imported"
        why = (
            why
            or f"the process ended with status {child.returncode}{where} (a sys.exit or os._exit in the "
            "file?)"
        )
        echo(f"FAIL  {path.name}: the grading did not reach its end, so nothing is passed: {why}")
        echo(f"{name}: not graded to the end")
        return False
    passed, lines = finish_report(name, records[:-1], path, answers)
    for line in lines[len(records) - 1 :]:
        echo(line)
    return passed


def _end(child: subprocess.Popen) -> None:
    """End every process of a grading: its process group (and, in a PID namespace, everything in it)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def load(path: Path) -> ModuleType:
    """Import the Python file at ``path`` as a module of its own (a lab's grading suite, a submission).

    Args:
        path: the file.
    """
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


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.labs", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help="write every exercise.py from its solution.py")
    checker = sub.add_parser(
        "check", help="run the lab's grading suite on your exercise, and check your answers"
    )
    checker.add_argument("lab", help=f"one of: {', '.join(lab_names())}")
    checker.add_argument(
        "--file",
        type=checks.named_file((".py",), "Python code", to_write=False),
        default=None,
        help="the file to check (default: the lab's exercise.py)",
    )
    checker.add_argument(
        "--answers",
        type=checks.named_file((".toml",), "answers", to_write=False),
        default=None,
        help="your answers to the README's questions (default: answers.toml beside the file, or the lab's)",
    )
    checker.add_argument(
        "--submissions",
        type=checks.existing_folder,
        default=None,
        help="instructors: check every .py file in this folder, one report each",
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["_grade"]:  # the child of grade_submission (not for people: no help entry)
        name, path, channel = argv[1:]
        return _grade_in_child(name, Path(path), int(channel))
    args = parser.parse_args(argv)
    lab_timeout_s()  # a bad COURSE_LAB_TIMEOUT_S or COURSE_GRADING_SEED is refused before any grading starts
    grading_seed()
    if args.command == "generate":
        for path in generate():
            print(f"wrote {path.relative_to(LABS_DIR.parent)}")
        return 0
    if args.lab not in lab_names():
        print(f"error: no lab named {args.lab!r}: choose one of {', '.join(lab_names())}", file=sys.stderr)
        return 2
    files = (
        sorted(args.submissions.glob("*.py"))
        if args.submissions
        else [args.file or LABS_DIR / args.lab / "exercise.py"]
    )
    if not files:
        print(f"error: {args.submissions} holds no .py file to check", file=sys.stderr)
        return 2
    everyone_passed = True
    for path in files:
        if len(files) > 1:
            print(f"== {path.name}")
        own_answers = path.with_suffix(".toml") if args.submissions else args.answers
        passed = grade_submission(
            args.lab, path.resolve(), own_answers, echo=lambda line: print(line, flush=True)
        )
        everyone_passed &= passed
    return 0 if everyone_passed else 1


if __name__ == "__main__":
    # The grading suites import this module by its name: run that module's main, not this copy
    # (run as __main__), so that both see the same classes (CollectiveHung, Property).
    from course_lib.tools import labs

    checks.exit_with(labs.main)
