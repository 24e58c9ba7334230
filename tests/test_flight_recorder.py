"""Faults on purpose, on real processes: no rank waits past the timeout, and the diagnosis names
the rank and the cause from the flight records the ranks wrote."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from course_lib.distributed import comm, hooks, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.observe import faults, flight_recorder
from course_lib.tools import diagnose

COLLECTIVE_TIMEOUT_S = 4


def _train_a_little(steps: int = 4) -> bool:
    """Three collectives a step: the weight's and the bias's gradients, then a progress count."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    for step in range(steps):
        model(torch.randn(4, 5)).sum().backward()
        for param in model.parameters():
            comm.all_reduce(param.grad, op="mean")  # the gradients' line
        comm.all_reduce(torch.tensor([float(step)]))  # the progress line
    return True


def _run(folder, monkeypatch, fault: str | None, world_size: int = 3):
    """Launch the little training with ``fault``; return (what launch raised or None, seconds)."""
    monkeypatch.setenv(flight_recorder.FOLDER_VARIABLE, str(folder))
    if fault:
        monkeypatch.setenv(faults.VARIABLE, fault)
    else:
        monkeypatch.delenv(faults.VARIABLE, raising=False)
    started = time.monotonic()
    try:
        launch(_train_a_little, world_size, timeout_s=60, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 (each fault fails its own way; the diagnosis is the test)
        return error, time.monotonic() - started
    return None, time.monotonic() - started


def _diagnosis(folder, capsys) -> tuple[int, str]:
    status = diagnose.main([str(folder)])
    return status, capsys.readouterr().out


def test_a_run_without_fault_is_found_without_problem(tmp_path, monkeypatch, capsys):
    error, _ = _run(tmp_path, monkeypatch, None)
    assert error is None
    status, out = _diagnosis(tmp_path, capsys)
    assert status == 0 and out.startswith("no problem found"), out
    assert "completed: #11" in out  # 4 steps of 3 collectives: #0 to #11
    record = json.loads((tmp_path / "rank-2.json").read_text())
    assert record["reason"].startswith("finished") and len(record["entries"]) == 12
    assert record["entries"][0]["caller"].startswith("tests/test_flight_recorder.py:")


def test_a_skipped_collective_is_named_with_both_lines(tmp_path, monkeypatch, capsys):
    error, _ = _run(tmp_path, monkeypatch, "skip-collective:1:4")  # rank 1 skips step 1's bias gradient
    assert isinstance(error, UserError) and "different calls" in str(error)
    status, out = _diagnosis(tmp_path, capsys)
    first = out.splitlines()[0]
    assert status == 1
    assert "collective #4" in first and "different sizes" in first and "rank 1 is the odd one" in first, out
    assert "rank 1: all_reduce of float32 [1]" in out and "rank 0: all_reduce of float32 [3]" in out


def test_a_different_size_is_named(tmp_path, monkeypatch, capsys):
    error, _ = _run(tmp_path, monkeypatch, "wrong-size:2:3")  # rank 2 sends half of step 1's weight gradient
    assert isinstance(error, UserError)
    status, out = _diagnosis(tmp_path, capsys)
    first = out.splitlines()[0]
    assert status == 1 and "collective #3" in first and "rank 2 is the odd one" in first, out
    assert "rank 2: all_reduce of float32 [7]" in out and "rank 0: all_reduce of float32 [3x5]" in out


def test_a_hung_rank_is_named_with_where_it_was(tmp_path, monkeypatch, capsys):
    error, seconds = _run(tmp_path, monkeypatch, "hang:1:4")
    assert error is not None and seconds < COLLECTIVE_TIMEOUT_S + 20  # nobody waits for the launch's 60 s
    status, out = _diagnosis(tmp_path, capsys)
    first = out.splitlines()[0]
    assert status == 1
    assert first.startswith("rank 1 never reached collective #4 of group (0, 1, 2) (all_reduce)"), out
    assert "ranks 0, 2 waited in" in first
    assert "rank 1 was instead at tests/test_flight_recorder.py:" in out and "_train_a_little" in out


def test_a_killed_rank_is_named(tmp_path, monkeypatch, capsys):
    error, seconds = _run(tmp_path, monkeypatch, "kill:2:5")
    assert error is not None and seconds < COLLECTIVE_TIMEOUT_S + 20
    status, out = _diagnosis(tmp_path, capsys)
    assert status == 1 and out.startswith("rank 2 left no record: it died"), out
    assert not (tmp_path / "rank-2.json").exists() and (tmp_path / "rank-0.json").exists()


def test_a_rank_that_ended_early_is_named(tmp_path, monkeypatch, capsys):
    """Rank 0 makes one step fewer: the others wait in the last step's first collective."""
    monkeypatch.setenv(flight_recorder.FOLDER_VARIABLE, str(tmp_path))
    monkeypatch.delenv(faults.VARIABLE, raising=False)
    with pytest.raises(Exception):  # noqa: B017 (a timeout on the waiting ranks; its kind is gloo's)
        launch(_fewer_steps_on_rank_0, 3, timeout_s=60, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    status, out = _diagnosis(tmp_path, capsys)
    assert status == 1 and out.startswith("rank 0 never reached collective #9"), out
    assert "rank 0 was instead finished: its program ended without making it" in out


def _fewer_steps_on_rank_0() -> bool:
    import torch.distributed as dist

    return _train_a_little(steps=3 if dist.get_rank() == 0 else 4)


# -- bad input: one line each ------------------------------------------------------------------


def test_a_folder_without_records_says_how_to_make_them(tmp_path, capsys):
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no flight records" in err and "--flight-recorder" in err


def _record(rank: int, run_id: str = "run-a", **changes) -> dict:
    return {
        "format": flight_recorder.FORMAT,
        "run_id": run_id,
        "rank": rank,
        "world_size": 2,
        "host": "h",
        "pid": 1,
        "reason": hooks.FINISHED,
        "started_s": 0.0,
        "written_s": 10.0,
        "where": [],
        "entries": [],
    } | changes


def test_records_of_different_runs_are_refused(tmp_path, capsys):
    (tmp_path / "rank-0.json").write_text(json.dumps(_record(0, "run-a")))
    (tmp_path / "rank-1.json").write_text(json.dumps(_record(1, "run-b")))
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "different runs (run-a, run-b)" in err


def test_a_truncated_record_is_refused(tmp_path, capsys):
    text = json.dumps(_record(0))
    (tmp_path / "rank-0.json").write_text(text[: len(text) // 2])
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "rank-0.json is not a complete flight record" in err


def test_two_runs_under_one_id_are_told_apart_by_their_times(tmp_path, capsys):
    """torchrun's default run id is "none" for every run: a later run's rank started after the
    earlier run's record was written."""
    (tmp_path / "rank-0.json").write_text(json.dumps(_record(0, "none", started_s=0.0, written_s=10.0)))
    (tmp_path / "rank-1.json").write_text(json.dumps(_record(1, "none", started_s=500.0, written_s=600.0)))
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds records of two runs: rank-1.json was started at" in err
    assert "after rank-0.json was written at" in err


def test_a_record_missing_a_field_names_it(tmp_path, capsys):
    record = _record(0)
    del record["started_s"]
    (tmp_path / "rank-0.json").write_text(json.dumps(record))
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "rank-0.json is not a complete flight record: it has no field 'started_s'" in err


def test_a_failed_run_is_never_no_problem_found(tmp_path, capsys):
    """Every rank completed the same collectives, but one stopped with an error: that is the cause."""
    (tmp_path / "rank-0.json").write_text(json.dumps(_record(0)))
    failed = _record(1, reason="stopped by an error: ValueError: the loss is nan")
    (tmp_path / "rank-1.json").write_text(json.dumps(failed))
    assert diagnose.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no problem found" not in out
    assert out.startswith("no collective went wrong; rank 1 stopped by an error: ValueError: the loss is nan")
    # any reason but a program that returned, or a dump asked of a live run, is a failure
    (tmp_path / "rank-1.json").write_text(json.dumps(_record(1, reason="rank 0: the ranks hang")))
    assert diagnose.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.startswith(
        "no collective went wrong, but rank 1's run did not finish (rank 0: the ranks hang)"
    )
    (tmp_path / "rank-1.json").write_text(json.dumps(_record(1)))
    assert diagnose.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("no problem found")


def _run_id() -> str:
    import os

    return os.environ[runtime.RUN_VARIABLE]


def test_every_launch_is_a_run_of_its_own():
    first, second = launch(_run_id, 2), launch(_run_id, 2)
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]


@pytest.mark.parametrize(
    "text, message",
    [
        ("skip:1", "write KIND:RANK:AT with KIND one of skip-collective"),
        ("nan:0:nan", "(RANK and AT are at least 0, and AT is finite)"),
        ("slow:1:inf", "(RANK and AT are at least 0, and AT is finite)"),
        ("slow:1:1e9", "a slowdown of 1e+09 s a collective never lets the run end: give at most 60 s"),
        ("seed:1:99999999999999999999", "a seed is at most 4294967295"),
        ("kill:1:2.5", "AT of kill counts the collective it strikes, from 0: give a whole number"),
        ("nan:all:1.5", "AT of nan counts the step whose loss it makes NaN: give a whole number"),
    ],
)
def test_a_fault_that_cannot_work_is_refused_before_the_run(text, message):
    """Each was accepted and failed mid-run with a traceback (a step at nan, a seed too large for the
    generator, a slowdown that never ends)."""
    with pytest.raises(UserError) as raised:
        faults.parse(text)
    assert message in str(raised.value)


def test_pytorchs_own_dump_is_read_as_the_same_entries(tmp_path):
    """A dump in the layout PyTorch's ProcessGroupNCCL writes (``torch.distributed.flight_recorder``)."""
    import pickle

    def entry(sequence, state):
        return {
            "collective_seq_id": sequence,
            "profiling_name": "nccl:all_reduce",
            "process_group": ("0", "default_pg"),
            "input_sizes": [[3, 5]],
            "input_dtypes": ["Float"],
            "state": state,
            "time_created_ns": 1,
            "frames": [{"filename": "train.py", "line": 7, "name": "step"}],
        }

    for rank, last in ((0, "started"), (1, None)):
        entries = [entry(1, "completed")] + ([entry(2, last)] if last else [])
        dump = {
            "version": "2.10",
            "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1]"}},
            "entries": entries,
        }
        (tmp_path / f"{flight_recorder.PYTORCH_PREFIX}{rank}").write_bytes(pickle.dumps(dump))
    found = diagnose.diagnose(diagnose.load(tmp_path))
    assert found.cause.startswith("rank 1 never reached collective #1 of group (0, 1) (all_reduce)"), (
        found.text()
    )
    assert "train.py:7 in step" in found.text()


@pytest.mark.slow
def test_the_training_command_records_and_the_diagnosis_names_the_hung_rank(tmp_path):
    """The real command on 2 ranks, the course's DDP: rank 1 hangs at its 6th collective; nobody waits
    past --timeout, and ``diagnose`` on what they wrote names rank 1 and the line it was stuck at."""
    from conftest import run_tool, start_ranks

    records = tmp_path / "records"
    argv = ["--epochs", "1", "--max-steps", "4", "--no-progress", "--sharding", "ddp", "--impl", "course"]
    argv += ["--timeout", "6", "--flight-recorder", str(records), "--metrics", str(tmp_path / "m.jsonl")]
    started = time.monotonic()
    rank_0, rank_1 = start_ranks(argv, 2, env={faults.VARIABLE: "hang:1:6"})
    _, stderr = rank_0.communicate(timeout=90)  # rank 0 gives up after --timeout
    assert time.monotonic() - started < 60
    rank_1.kill()  # as torchrun or srun would, once rank 0 has failed: the hung rank never returns
    rank_1.communicate()
    assert rank_0.returncode != 0
    assert f"python -m course_lib.tools.diagnose {records}" in stderr, stderr
    shown = run_tool("diagnose", str(records))
    assert shown.returncode == 1, shown.stdout + shown.stderr
    first = shown.stdout.splitlines()[0]
    assert first.startswith("rank 1 never reached collective #6 of group (0, 1)"), shown.stdout
    assert "rank 1 was instead at course_lib/" in shown.stdout


def _slow_steps(steps: int = 4) -> dict | None:
    from course_lib.observe import stragglers

    meter = stragglers.StragglerMeter()
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    for step in range(steps):
        with meter.step(step):
            model(torch.randn(4, 5)).sum().backward()
            for param in model.parameters():
                comm.all_reduce(param.grad, op="mean")
            comm.all_reduce(torch.tensor([float(step)]))
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    return {"summary": stragglers.summary(meter.reports), "text": stragglers.describe(meter.reports)}


@pytest.mark.timing
def test_a_slow_rank_is_named_with_what_it_cost_the_others(monkeypatch):
    """Rank 1 sleeps 40 ms before each of its 3 collectives a step: it arrives last at every one,
    about 120 ms a step after the first, and the two others lose that much each, every step."""
    monkeypatch.setenv(faults.VARIABLE, "slow:1:0.04")
    monkeypatch.delenv(flight_recorder.FOLDER_VARIABLE, raising=False)
    found = launch(_slow_steps, 3, timeout_s=60)[0]
    summary = found["summary"]
    assert summary["slowest_rank"] == 1 and summary["last_at"] == 1.0, found
    lateness = summary["lateness_per_step_s"]
    assert 0.10 < lateness[1] < 0.2 and max(lateness[0], lateness[2]) < 0.03, found
    assert 4 * 2 * 0.10 < summary["cost_s"] < 4 * 2 * 0.2, found
    assert found["text"].startswith("stragglers: rank 1 arrived last at 100% of the collectives")


def test_a_step_report_from_known_arrivals():
    from course_lib.observe import stragglers

    group = (0, 1, 2)
    notes = [  # per rank: two collectives; rank 2 is 0.5 s late at the first, rank 0 0.1 s at the second
        [(group, 0, 10.0, 0.5), (group, 1, 11.1, 0.0)],
        [(group, 0, 10.0, 0.5), (group, 1, 11.0, 0.1)],
        [(group, 0, 10.5, 0.0), (group, 1, 11.0, 0.1)],
    ]
    report = stragglers.step_report(7, notes)
    assert report.last_arrivals == [1, 0, 1] and report.collectives == 2
    assert report.lateness_s == pytest.approx([0.1, 0.0, 0.5])
    assert report.slowest_rank == 2 and report.cost_s == pytest.approx(1.0)
    assert report.waited_s == pytest.approx([0.5, 0.6, 0.1])


@pytest.mark.slow
@pytest.mark.timing
def test_the_training_command_reports_a_slow_rank_and_the_tool_plots_it(tmp_path):
    """2 ranks of the course's DDP, rank 1 sleeping 80 ms before each collective: the steps' lines
    name it, the run's last line says what it cost, and the tool draws the report. (A busy machine
    can hold rank 0 up longer than that now and then: most steps, not every one.)"""
    from conftest import run_ranks, run_tool

    report, picture = tmp_path / "stragglers.jsonl", tmp_path / "stragglers.png"
    argv = ["--epochs", "1", "--max-steps", "5", "--no-progress", "--sharding", "ddp", "--impl", "course"]
    outcomes = run_ranks(
        [*argv, "--straggler-report", str(report)], nprocs=2, env={faults.VARIABLE: "slow:1:0.08"}
    )
    assert [o.returncode for o in outcomes] == [0, 0], outcomes[0].stderr + outcomes[1].stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(lines) == 5 and sum(line["slowest_rank"] == 1 for line in lines) >= 4, lines
    # last at (nearly) every collective: on a busy machine rank 0 can now and then be held up longer
    found = re.search(r"stragglers: rank 1 arrived last at (\d+)% of the collectives", outcomes[0].stdout)
    assert found and int(found.group(1)) >= 60, outcomes[0].stdout[-600:]
    shown = run_tool("stragglers", str(report), "--plot", str(picture))
    assert shown.returncode == 0 and shown.stdout.startswith("stragglers: rank 1"), shown.stderr
    assert picture.stat().st_size > 10_000


def test_the_straggler_report_needs_the_courses_collectives(tmp_path, capsys):
    from course_lib.train import cli as train

    report = str(tmp_path / "s.jsonl")
    status = train.main(["--epochs", "1", "--max-steps", "1", "--no-progress", "--straggler-report", report])
    stderr = capsys.readouterr().err
    assert status == 2 and "--straggler-report times the collectives the course's own code makes" in stderr


def test_the_stragglers_tool_refuses_a_file_that_is_not_a_report(tmp_path):
    from conftest import run_tool

    (tmp_path / "m.jsonl").write_text('{"epoch": 1}\n')
    shown = run_tool("stragglers", str(tmp_path / "m.jsonl"))
    assert (
        shown.returncode == 2
        and shown.stderr.count("\n") == 1
        and "line 1: not a straggler report" in shown.stderr
    )


def _two_data_groups(steps: int = 3) -> bool:
    """4 ranks, data groups {0, 2} and {1, 3} (a 2 x 2 mesh's): each averages its gradients."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[dist.get_rank() % 2]
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    for _ in range(steps):
        model(torch.randn(4, 5)).sum().backward()
        for param in model.parameters():
            comm.all_reduce(param.grad, op="mean", group=mine)
    return True


def test_a_collective_on_the_wrong_group_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(flight_recorder.FOLDER_VARIABLE, str(tmp_path))
    monkeypatch.setenv(faults.VARIABLE, "wrong-group:1:2")
    with pytest.raises(Exception):  # noqa: B017 (the waiting ranks time out; the kind is gloo's)
        launch(_two_data_groups, 4, timeout_s=60, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    status, out = _diagnosis(tmp_path, capsys)
    first = out.splitlines()[0]
    assert status == 1, out
    assert first.startswith("rank 1 made collective #0 on group (0, 1, 2, 3), where no other rank made it"), (
        out
    )
    assert "instead of #2 on group (1, 3), where rank 3 waited: a collective on the wrong group" in first, out


def test_an_entry_missing_a_field_names_it(tmp_path, capsys):
    entry = {"sequence": 0, "op": "all_reduce", "group_ranks": [0, 1], "shape": [3], "dtype": "float32",
             "issued_s": 1.0, "completed_s": None, "caller": "x.py:1 in f", "peer": None}  # fmt: skip
    (tmp_path / "rank-0.json").write_text(json.dumps(_record(0, entries=[entry])))
    assert diagnose.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and "rank-0.json is not a complete flight record: its entry 0 has no 'state'" in err
    )


def test_a_request_left_by_an_earlier_run_is_not_answered_and_this_runs_is(tmp_path):
    """A folder reused after a failed run: its DUMP_REQUESTED made the rerun's ranks write empty
    records as they started. A request belongs to a run and a time."""
    flight_recorder.request_dumps(tmp_path, "rank 1: the earlier run hung", run_id="none")
    (tmp_path / flight_recorder.REQUEST).touch()  # its mtime says nothing: the time is inside
    time.sleep(0.05)
    recorder = flight_recorder.start(tmp_path, rank=0, world_size=2, run_id="none")
    try:
        time.sleep(4 * flight_recorder.POLL_S)
        assert recorder.dumped is None and not (tmp_path / "rank-0.json").exists()
        (tmp_path / flight_recorder.REQUEST).write_text("a request of an older version\n")
        time.sleep(4 * flight_recorder.POLL_S)
        assert recorder.dumped is None
        recorder.request_everyone("this run hangs")  # replaces the leftover: it is this run's
        deadline = time.monotonic() + 30
        while recorder.dumped is None and time.monotonic() < deadline:
            time.sleep(flight_recorder.POLL_S)
        assert recorder.dumped == "asked by rank 0: this run hangs"
    finally:
        flight_recorder.stop()


def _step_line(step: int, ranks: int) -> str:
    return json.dumps({
        "step": step, "lateness_s": [0.0] + [0.01] * (ranks - 1), "waited_s": [0.02] * ranks,
        "last_arrivals": [0] + [1] * (ranks - 1), "collectives": 1, "slowest_rank": ranks - 1, "cost_s": 0.01,
    })  # fmt: skip


def test_two_runs_appended_to_one_straggler_report_are_told_apart_and_the_last_is_read(tmp_path, capsys):
    from course_lib.tools import stragglers as straggler_tool

    report = tmp_path / "report.jsonl"
    lines = [_step_line(step, 2) for step in range(3)] + [_step_line(step, 4) for step in range(2)]
    report.write_text("\n".join(lines) + "\n")
    runs = straggler_tool.read_runs(report)
    assert [[number for number, _ in run] for run in runs] == [[1, 2, 3], [4, 5]]
    assert straggler_tool.main([str(report)]) == 0
    shown = capsys.readouterr()
    assert "holds 2 runs" in shown.err and "reading the last, from line 4 (step 0, 4 ranks)" in shown.err
    assert "rank 3" in shown.out
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(json.loads(_step_line(0, 2)) | {"waited_s": [0.1]}) + "\n")
    assert straggler_tool.main([str(broken)]) == 2
    assert "line 1: not a straggler report's line (its lists must hold one number for each rank)" in (
        capsys.readouterr().err
    )
