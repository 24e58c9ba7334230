"""The labs: solutions reach their accuracy, exercises are in sync, and the check command helps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.observe import flight_recorder
from course_lib.tools import labs

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow  # every grading runs the lab's suite in sandboxed processes: seconds each

SUITE_LABS = labs.lab_names()  # every lab has a grading suite (grading.py) and questions (answers.toml)


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


def _check_command(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "course_lib.tools.labs", "check", name, *args],
        cwd=REPO,
        env=clean_env(**env) if env else clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


class Recorder:
    """What the processes that ran a submission answered the judge, property by property: recorded
    from one grading, or played back to another, as a submission replaying its outputs would (the
    processes the grader starts for its own references, which never load the file, run as ever;
    played back to a grading with the recorded inputs, they are replayed too, to save their time)."""

    def __init__(self, monkeypatch):
        self.answers: dict[str, list] = {}  # property -> [(the submission's?, result, files)], in call order
        self.playing, self.everything = False, False
        self._property, self._positions = "loading", {}
        launch, in_sandbox, outcome = labs.launch, labs.sandbox.in_sandbox, labs._property_outcome

        def property_outcome(prop, *args):
            self._property, self._positions = prop.name, {True: 0, False: 0}
            if not self.playing:
                self.answers[prop.name] = []
            problem = outcome(prop, *args)
            if problem is not None and self.playing and not self.everything:
                raise Refused(f"{prop.name}: {problem}")  # one property fooled no one: the grading fails
            return problem

        monkeypatch.setattr(labs, "_property_outcome", property_outcome)
        monkeypatch.setattr(labs, "launch", self._wrap(launch))
        monkeypatch.setattr(labs.sandbox, "in_sandbox", self._wrap(in_sandbox))

    def _wrap(self, call):
        def answered(*args, **kwargs):
            if self._property == "loading":  # importing the file: nothing to replay
                return call(*args, **kwargs)
            submission = any(
                isinstance(arg, (labs.sandbox.Submission, labs.sandbox.RemoteFunction))
                for arg in (*args, *kwargs.values())
            )
            # what the ranks leave in the folder the grader names (lab 6's flight records) is replayed too
            folder = os.environ.get(flight_recorder.FOLDER_VARIABLE)
            if self.playing and (submission or self.everything):
                recorded = [entry for entry in self.answers.get(self._property, []) if entry[0] == submission]
                position = self._positions[submission]
                if position >= len(recorded):
                    raise RuntimeError("asked what was never recorded")
                self._positions[submission] += 1
                _, result, files = recorded[position]
                for file_name, content in files.items():
                    (Path(folder) / file_name).write_bytes(content)
                return result
            result = call(*args, **kwargs)
            if not self.playing:
                files = {path.name: path.read_bytes() for path in Path(folder).iterdir()} if folder else {}
                self.answers[self._property].append((submission, result, files))
            return result

        return answered

    def grade(
        self, name: str, seed: int, *, playing: bool, everything: bool = False
    ) -> tuple[bool, list[str]]:
        """A grading of the solution; played back to another grading (not ``everything``), it stops
        at the first property that fails, which is enough to fail the grading."""
        self.playing, self.everything, self._property = playing, everything, "loading"
        os.environ["COURSE_GRADING_SEED"] = str(seed)
        try:
            return labs.run_suite(
                name,
                labs.LABS_DIR / name / "solution.py",
                labs.LABS_DIR / name / "solution_answers.toml",
            )
        except Refused as failed:
            return False, [f"FAIL  {failed}"]
        finally:
            del os.environ["COURSE_GRADING_SEED"]


class Refused(Exception):
    """A property that failed on answers played back: the grading cannot pass."""


@pytest.mark.parametrize("name", SUITE_LABS)
def test_the_suite_passes_on_the_solution_and_its_recorded_answers_pass_no_other_grading(name, monkeypatch):
    """Every property compares, in the judge, what the ranks and sandboxes sent with what it computes
    itself on inputs drawn for this grading: the solution's answers, recorded and played back,
    pass the grading they came from and fail any other."""
    grading = labs.load(labs.LABS_DIR / name / "grading.py")
    total = len(grading.PROPERTIES) + len(grading.QUESTIONS)
    recorder = Recorder(monkeypatch)
    passed, lines = recorder.grade(name, 1234, playing=False)
    assert passed, "\n".join(lines)
    assert lines[-1] == f"{name}: {total} of {total} properties and answers hold"
    assert sum(line.startswith("PASS  ") for line in lines) == total

    replayed, lines = recorder.grade(name, 1234, playing=True, everything=True)
    assert replayed, "\n".join(lines)  # the replay is faithful: the same inputs, the same verdict
    replayed, lines = recorder.grade(name, 4321, playing=True)
    assert not replayed, f"{name}'s grading passes on answers recorded from another:\n" + "\n".join(lines)


def _regions(solution: str) -> tuple[list[str], set[str]]:
    """The code lines inside a solution's BEGIN/END SOLUTION regions, and those outside them."""
    inside, hidden, given = False, [], set()
    for line in solution.splitlines():
        if labs.BEGIN.match(line):
            inside = True
        elif labs.END.match(line):
            inside = False
        elif inside:
            hidden.append(line.strip())
        else:
            given.add(line.strip())
    return hidden, given


def test_no_exercise_contains_a_line_of_its_solution():
    for name in labs.lab_names():
        folder = labs.LABS_DIR / name
        solution = (folder / "solution.py").read_text()
        exercise = {line.strip() for line in (folder / "exercise.py").read_text().splitlines()}
        # the given code may repeat a generic line (a loop header) that a region also has
        hidden, given = _regions(solution)
        # non-trivial: real code, not a closing bracket, a bare return or a blank
        given_away = [
            line
            for line in hidden
            if len(line) > 12 and not line.startswith("#") and line in exercise and line not in given
        ]
        assert given_away == [], f"labs/{name}/exercise.py contains its solution's lines: {given_away}"


def _mutant(name: str, old: str, new: str, tmp_path) -> Path:
    source = (labs.LABS_DIR / name / "solution.py").read_text()
    assert old in source
    path = tmp_path / "attempt.py"
    path.write_text(source.replace(old, new))
    return path


def test_lab1_a_wrong_average_a_blocking_call_and_a_one_sided_collective_are_each_named(tmp_path):
    grading = labs.load(labs.LABS_DIR / "lab1_ddp" / "grading.py")
    by_name = {prop.check.__name__: prop for prop in grading.PROPERTIES}

    def outcome(check: str, path: Path) -> str | None:
        return labs._property_outcome(by_name[check], labs.load(path), path)

    halved = _mutant(
        "lab1_ddp", "param.grad /= self.world_size", "param.grad /= 2 * self.world_size", tmp_path
    )
    assert "rank 0's gradient of first.weight differs from the whole batch's" in outcome(
        "check_per_parameter_gradients", halved
    )
    blocking = _mutant(
        "lab1_ddp",
        'handle = comm.all_reduce(param.grad, op="sum", async_op=True)',
        'comm.all_reduce(param.grad, op="sum")\n            handle = comm.barrier(async_op=True)',
        tmp_path,
    )
    assert "still in flight when it returned" in outcome("check_per_parameter_overlap", blocking)
    one_sided = _mutant(
        "lab1_ddp",
        "comm.broadcast(tensor, src=0)",
        "comm.broadcast(tensor, src=0) if runtime.rank() == 0 else None",
        tmp_path,
    )
    os.environ["COURSE_LAB_TIMEOUT_S"] = "5"
    try:
        message = outcome("check_per_parameter_gradients", one_sided)
    finally:
        del os.environ["COURSE_LAB_TIMEOUT_S"]
    # every rank reached a collective, but not the same one: the ranks' calls are named
    assert message.startswith(
        "comm: the ranks made different calls (rank 0: broadcast of float32 (23, 7); rank 1: "
    )


def test_a_wrong_formula_is_named_and_a_missing_lab_refused(tmp_path, capsys):
    grading = labs.load(labs.LABS_DIR / "lab7_scaling" / "grading.py")
    path = _mutant(
        "lab7_scaling", "(seconds[1] / t, seconds[1] / t / n)", "(seconds[1] / t, seconds[1] / t)", tmp_path
    )
    message = labs._property_outcome(grading.PROPERTIES[0], labs.load(path), path)
    assert message.startswith("a cluster-shaped DDP table, N = 2: you give speedup and efficiency")
    assert labs.main(["check", "lab99_nothing"]) == 2
    assert "no lab named 'lab99_nothing': choose one of lab1_ddp" in capsys.readouterr().err


def test_instructors_grade_a_folder_of_submissions(tmp_path):
    folder = labs.LABS_DIR / "lab7_scaling"
    (tmp_path / "ada.py").write_text((folder / "solution.py").read_text())
    (tmp_path / "ada.toml").write_text((folder / "solution_answers.toml").read_text())
    (tmp_path / "bob.py").write_text((folder / "exercise.py").read_text())  # no answers file at all
    graded = _check_command("lab7_scaling", "--submissions", str(tmp_path))
    assert graded.returncode == 1  # not everyone passed
    ada, bob = graded.stdout.split("== bob.py")
    assert ada.startswith("== ada.py") and "lab7_scaling: 10 of 10 properties and answers hold" in ada
    assert "not finished yet: TODO: " in bob and "bob.toml does not exist" in bob


def _with_tail(tail: str, tmp_path: Path, answers: bytes | None = None) -> Path:
    """Lab 7's solution, then ``tail``, run as it is imported (and its answers beside it)."""
    folder = labs.LABS_DIR / "lab7_scaling"
    path = tmp_path / "attempt.py"
    path.write_text((folder / "solution.py").read_text() + "\n" + tail + "\n")
    path.with_name("answers.toml").write_bytes(
        answers if answers is not None else (folder / "solution_answers.toml").read_bytes()
    )
    return path


# (what the file does when imported, what the one FAIL line must say)
SUBMISSIONS_THAT_NEVER_FINISH = {
    "sys.exit": ("import sys\nsys.exit(0)", "attempt.py called sys.exit(0) while it was imported"),
    "os._exit": (
        "import os\nos._exit(0)",
        "attempt.py ended its process while it was imported (the process ended with status 0 without "
        "answering)",
    ),
    "endless import": ("while True:\n    pass", "importing attempt.py did not finish within 2 s"),
    "endless, deaf to the alarm": (  # the sandbox is killed, whatever signals it blocks
        "import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\nwhile True:\n    pass",
        "importing attempt.py did not finish within 2 s",
    ),
}


@pytest.mark.parametrize("case", SUBMISSIONS_THAT_NEVER_FINISH)
def test_a_submission_that_never_finishes_its_checks_fails_with_the_reason(case, tmp_path):
    tail, reason = SUBMISSIONS_THAT_NEVER_FINISH[case]
    path = _with_tail(tail, tmp_path)
    started = time.monotonic()
    graded = _check_command("lab7_scaling", "--file", str(path), COURSE_LAB_TIMEOUT_S="2")
    assert graded.returncode == 1, graded.stdout + graded.stderr
    assert reason in graded.stdout, graded.stdout
    assert "PASS" not in graded.stdout and "Traceback" not in graded.stdout + graded.stderr
    assert time.monotonic() - started < 60


def test_the_same_file_without_the_tail_passes(tmp_path):
    graded = _check_command("lab7_scaling", "--file", str(_with_tail("", tmp_path)))
    assert graded.returncode == 0, graded.stdout


def _lab7_answers_with_seconds(seconds: str) -> bytes:
    """The instructors' key with another ``seconds_per_epoch`` line in its [measured] block."""
    text = (labs.LABS_DIR / "lab7_scaling" / "solution_answers.toml").read_text()
    return re.sub(r"(?m)^seconds_per_epoch = .*$", f"seconds_per_epoch = {seconds}", text).encode()


def test_lab7_refuses_too_few_sizes_and_a_negative_term_saying_what_to_measure(tmp_path):
    """Three runs fit three terms exactly and say nothing of the model; runs whose time grows faster
    than any communication scale explains give a negative compute time even with it: both are
    refused, naming what to do."""
    three = _with_tail(
        "", tmp_path, answers=_lab7_answers_with_seconds('{"1" = 0.09, "2" = 0.14, "3" = 0.2}')
    )
    graded = _check_command("lab7_scaling", "--file", str(three))
    assert graded.returncode == 1 and "Traceback" not in graded.stdout + graded.stderr
    assert (
        "FAIL  question fitted_compute_s: your [measured] block has runs at N = [1, 2, 3]: three terms "
        "fitted through three runs go through them exactly"
    ) in graded.stdout, graded.stdout
    assert "--gpus 1 2 3 4" in graded.stdout
    # the times of 2 to 4 processes far above what one process takes, and hardly apart
    steep = _with_tail(
        "", tmp_path, answers=_lab7_answers_with_seconds('{"1" = 0.05, "2" = 0.5, "3" = 0.52, "4" = 0.53}')
    )
    graded = _check_command("lab7_scaling", "--file", str(steep))
    assert graded.returncode == 1
    assert re.search(
        r"FAIL  question fitted_compute_s: your runs give T_compute = -[\d.]+ even with the "
        r"communication's scale: no time is negative, so this model still lacks a term",
        graded.stdout,
    ), graded.stdout
    assert "PASS  question plain_fit_compute_s" not in graded.stdout  # the key's answer, not these runs'


def test_answers_that_are_not_utf8_fail_in_one_line(tmp_path):
    text = (labs.LABS_DIR / "lab7_scaling" / "solution_answers.toml").read_text()
    path = _with_tail("# café", tmp_path, answers=("# café\n" + text).encode("latin-1"))
    graded = _check_command("lab7_scaling", "--file", str(path))
    assert graded.returncode == 1
    assert "FAIL  answers: answers.toml is not UTF-8 text (byte 0xe9 at position 5): save it as UTF-8" in (
        graded.stdout
    )
    assert "Traceback" not in graded.stdout + graded.stderr


def test_lab7s_script_names_a_missing_results_file_in_one_line(tmp_path):
    script = labs.LABS_DIR / "lab7_scaling" / "solution.py"
    missing = tmp_path / "scaling.csv"
    done = subprocess.run(
        [sys.executable, str(script), str(missing), str(tmp_path / "allreduce.json")],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=REPO,
    )
    assert done.returncode != 0
    assert done.stderr.strip() == (
        f"error: {missing} does not exist: make it with `python -m course_lib.tools.study collect`"
    )


def test_an_optional_part_not_attempted_is_skipped_and_once_written_is_graded(tmp_path):
    """Lab 5's optional part (ZB-H1): a TODO there still lets the lab pass; a wrong one fails it."""
    solution = (labs.LABS_DIR / "lab5_pipeline" / "solution.py").read_text()
    body = solution[solution.index("def compute_order_zb_h1") :]
    body = body[: body.index("def schedule_zb_h1")]
    header = body[: body.index("    # BEGIN SOLUTION")]
    answers = ["--answers", "labs/lab5_pipeline/solution_answers.toml"]
    untouched = tmp_path / "required_only.py"
    untouched.write_text(
        solution.replace(body, header + '    raise NotImplementedError("TODO: ZB-H1")\n\n\n')
    )
    skipped = _check_command("lab5_pipeline", "--file", str(untouched), *answers)
    assert skipped.returncode == 0, skipped.stdout
    assert skipped.stdout.count("SKIP  optional: ") == 2 and "FAIL" not in skipped.stdout
    assert skipped.stdout.splitlines()[-1] == (
        "lab5_pipeline: 9 of 11 properties and answers hold (the optional part not attempted)"
    )
    wrong = tmp_path / "wrong_optional.py"  # every W right after its B: not ZB-H1's order
    wrong.write_text(
        solution.replace(
            body, header + "    return compute_order_1f1b(rank, pipeline_size, microbatches)\n\n\n"
        )
    )
    failed = _check_command("lab5_pipeline", "--file", str(wrong), *answers)
    assert failed.returncode == 1
    assert "FAIL  optional: ZB-H1's order is valid" in failed.stdout


def _outcome(name: str, check: str, path: Path) -> str | None:
    grading = labs.load(labs.LABS_DIR / name / "grading.py")
    prop = {prop.check.__name__: prop for prop in grading.PROPERTIES}[check]
    return labs._property_outcome(prop, labs.load(path), path)


def test_lab1s_timed_property_fails_a_step_far_slower_than_pytorchs(tmp_path):
    """A synchronization that stalls every step (here a sleep where a blocking wait would be) makes
    the step several times PyTorch's: the timed property names the ratio."""
    waiting = "        for handle, packed in self.pending:\n            handle.wait()"
    slow = _mutant("lab1_ddp", waiting, "        __import__('time').sleep(0.1)\n" + waiting, tmp_path)
    outcome = _outcome("lab1_ddp", "check_timed_beside_the_course_and_torch", slow)
    assert outcome is not None and "times PyTorch's DDP's" in outcome, outcome


def test_lab9_a_merge_that_leaves_log_space_and_a_ring_one_rank_never_feeds_are_each_named(tmp_path):
    overflowing = _mutant(
        "lab9_ring_attention",
        "merged = torch.logaddexp(lse, block_lse)",
        "merged = torch.log(torch.exp(lse) + torch.exp(block_lse))",
        tmp_path,
    )
    assert "stay in log space" in _outcome("lab9_ring_attention", "check_merge", overflowing)
    starving = _mutant(  # rank 0 only receives: its right-hand neighbour waits for a chunk that never comes
        "lab9_ring_attention",
        "handle = comm.send_recv(held, following, buffer, preceding)",
        "handle = (\n                comm.irecv(buffer, preceding) if rank == 0 "
        "else comm.send_recv(held, following, buffer, preceding)\n            )",
        tmp_path,
    )
    os.environ["COURSE_LAB_TIMEOUT_S"] = "10"
    try:
        message = _outcome("lab9_ring_attention", "check_ring_not_causal", starving)
    finally:
        del os.environ["COURSE_LAB_TIMEOUT_S"]
    assert message.startswith("on 2 ranks nothing finished within 10 s") or message.startswith(
        "ranks waited in a collective that other ranks never made"
    ), message


def test_lab10_a_combine_that_forgets_the_gates_and_counts_sent_twice_are_each_named(tmp_path):
    ungated = _mutant(
        "lab10_moe", "weighted = back * routing.gate[order].unsqueeze(-1)", "weighted = back", tmp_path
    )
    assert "output differs from one process's" in _outcome("lab10_moe", "check_layer", ungated)
    chatty = _mutant(
        "lab10_moe",
        "comm.all_to_all_single(incoming, per_expert)",
        "comm.all_to_all_single(incoming, per_expert)\n        comm.all_to_all_single(incoming, per_expert)",
        tmp_path,
    )
    assert "the routing says" in _outcome("lab10_moe", "check_traffic", chatty)


def test_lab10_part_2_a_bias_in_the_gates_an_update_on_one_ranks_load_and_counts_gathered_twice_are_named(
    tmp_path,
):
    for name in ("weighed", "alone", "twice"):
        (tmp_path / name).mkdir()
    weighed = _mutant("lab10_moe", "    chosen = scores.gather(1, experts)\n",
                      "    chosen = (scores + (bias if bias is not None else 0)).gather(1, experts)\n",
                      tmp_path / "weighed")  # fmt: skip
    assert "the scores alone weigh" in _outcome("lab10_moe", "check_route_dropless", weighed)
    alone = _mutant("lab10_moe", '    comm.all_reduce(total, op="sum")\n', "", tmp_path / "alone")
    assert "summed over the ranks gives" in _outcome("lab10_moe", "check_bias_update", alone)
    gather = "        comm.all_gather_into_tensor(everyone, routing.load)\n"
    twice = _mutant("lab10_moe", gather, gather + gather, tmp_path / "twice")
    assert "one all-gather of the counts" in _outcome("lab10_moe", "check_dropless_messages", twice)


def test_lab11_a_ring_that_waits_before_it_multiplies_and_a_wrong_slot_are_each_named(tmp_path):
    """A loop that waits for each exchange before its matmul computes the right numbers and sends the
    right bytes, but hides nothing: only the overlap property fails. Chunks filed as if they went the
    wrong way round the ring give a sequence out of order."""
    overlapped = (
        "            exchange = comm.send_recv(here, right, arriving, left, group=group)\n"
        "        chunks[owner], products[owner] = here, here @ matrix\n"
        "        if step < size - 1:\n"
        "            exchange.wait()\n"
    )
    waits_first = (
        "            exchange = comm.send_recv(here, right, arriving, left, group=group)\n"
        "            exchange.wait()\n"
        "        chunks[owner], products[owner] = here, here @ matrix\n"
        "        if step < size - 1:\n"
    )
    serial = _mutant("lab11_collective_matmul", overlapped, waits_first, tmp_path)
    for check in ("check_all_gather_matmul", "check_matmul_reduce_scatter", "check_messages"):
        assert _outcome("lab11_collective_matmul", check, serial) is None, check
    hidden = _outcome("lab11_collective_matmul", "check_overlap", serial)
    assert hidden.startswith(
        "all_gather_matmul on 2 ranks: while an exchange was in flight rank 0 multiplied 0 multiply-"
    ), hidden
    misplaced = _mutant(
        "lab11_collective_matmul", "owner = (rank - step) % size", "owner = (rank + step) % size", tmp_path
    )
    outcome = _outcome("lab11_collective_matmul", "check_all_gather_matmul", misplaced)
    assert outcome is not None and "differs from one process's" in outcome, outcome


# -- a grader that cannot be fooled: attacks on lab 7, each failing with its reason -------------------------

LAB7 = labs.LABS_DIR / "lab7_scaling"
LAB7_FUNCTIONS = (
    "speedup_and_efficiency",
    "karp_flatt_metric",
    "communication_seconds",
    "fit_compute_and_fixed",
)

RECORDING = """
import functools

def _recorded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        with open(RECORD_TO, "a") as file:
            file.write(repr([fn.__name__, repr((args, sorted(kwargs.items()))), result]) + "\\n")
        return result
    return wrapper

for _name in {functions}:
    globals()[_name] = _recorded(globals()[_name])
"""

REPLAY = """
import ast
_PLAYED = {{}}
for _line in open({record!r}).read().splitlines():
    _name, _args, _result = ast.literal_eval(_line)
    _PLAYED[(_name, _args)] = _result

def _replay(name):
    def function(*args, **kwargs):
        return _PLAYED[(name, repr((args, sorted(kwargs.items()))))]
    return function

for _name in {functions}:
    globals()[_name] = _replay(_name)
"""


def test_outputs_recorded_from_another_grading_answer_nothing(tmp_path):
    """A submission that replays the solution's outputs passes only a grading with the very inputs it
    recorded; every grading draws its own (``labs.GRADING_SEED``)."""
    record = tmp_path / "recorded.txt"
    recorder = tmp_path / "recorder.py"
    recorder.write_text(
        (LAB7 / "solution.py").read_text() + f"\nRECORD_TO = {str(record)!r}\n"
        + RECORDING.format(functions=LAB7_FUNCTIONS)
    )  # fmt: skip
    (tmp_path / "answers.toml").write_text((LAB7 / "solution_answers.toml").read_text())
    assert (
        _check_command("lab7_scaling", "--file", str(recorder), COURSE_GRADING_SEED="12345").returncode == 0
    )
    replay = tmp_path / "replay.py"
    replay.write_text(REPLAY.format(record=str(record), functions=LAB7_FUNCTIONS))
    graded = _check_command("lab7_scaling", "--file", str(replay))
    assert graded.returncode == 1, graded.stdout
    assert "KeyError" in graded.stdout  # asked what it never recorded


def test_the_judge_never_imports_the_submission(tmp_path):
    from course_lib.tools import sandbox

    marker = tmp_path / "imported-in.txt"
    path = tmp_path / "attempt.py"
    path.write_text(f"import os\nopen({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\nVALUE = 7\n")
    submission = sandbox.Submission(path, load=labs.load, timeout_s=30)
    assert submission.VALUE == 7  # fetched from a sandbox
    assert str(os.getpid()) not in marker.read_text().split()
    with pytest.raises(RuntimeError, match="the judge never loads the submission"):
        submission.module()


@pytest.mark.parametrize(
    "variable, value, message",
    [
        *[
            ("COURSE_LAB_TIMEOUT_S", value, "give seconds, from 2")
            for value in ("abc", "-3", "nan", "0", "0.01")
        ],
        *[
            ("COURSE_GRADING_SEED", value, "give the whole number a grading printed")
            for value in ("abc", "0", "-5")
        ],
    ],
)
def test_a_bad_grading_variable_is_refused_in_one_line(variable, value, message, monkeypatch, capsys):
    """Each was blamed on the student's file, or (a timeout too short to start a process) reported
    as a rank waiting in a collective."""
    from conftest import call_main

    monkeypatch.setenv(variable, value)
    shown = call_main(labs.main, ["check", "lab7_scaling"], capsys)
    assert shown.returncode == 2 and shown.stderr.count("\n") == 1
    assert f"{variable}={value!r}: {message}" in shown.stderr
