"""Every flag checked at the front door: a bad number or path ends in one line and exit 2, never a traceback.

The training command is tested in-process for every numeric and path flag (its ``main`` is the
real entry point: parsing, then ``validate_config``), then for a representative subset as real
processes, alone and under torchrun on 2 processes. The lab, the study and the benchmarks are
tested through their ``main`` too: their checks are argparse types, so they never start a process.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.errors import EXIT_DIVERGED
from course_lib.plan import scaling
from course_lib.tools import bench, lab, study, three_d
from course_lib.train import cli as train

from conftest import REPO, clean_env, finish, latest_weights, run_ranks, start_ranks

EXIT_USER_ERROR = 2
UNWRITABLE = Path("/proc/course-cannot-write-here")  # /proc refuses new entries even to root


def exit_and_stderr(main, argv: list[str], capsys) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse
        status = stop.code
    return status, capsys.readouterr().err


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("not a folder\n")
    return path


QUICK = ["--epochs", "1", "--max-steps", "1", "--no-progress"]

HYBRID = ["--sharding", "fsdp", "--impl", "course", "--sharding-strategy", "HYBRID_SHARD"]

# (flags, what the one line must say); {file}, {folder} and {tmp} are filled in per test.

TRAIN_MISTAKES = [
    (["--epochs", "0"], "--epochs must be a whole number, 1 or more, got 0"),
    (["--global-batch-size", "-4"], "--global-batch-size must be a whole number, 1 or more, got -4"),
    (["--grad-accum", "0"], "--grad-accum must be a whole number, 1 or more, got 0"),
    (["--lr", "nan"], "--lr must be a finite number above 0 and at most 1e+06, got nan"),
    (["--lr", "inf"], "--lr must be a finite number above 0 and at most 1e+06, got inf"),
    (["--lr", "0"], "--lr must be a finite number above 0 and at most 1e+06, got 0.0"),
    (["--lr", "1e9"], "--lr must be a finite number above 0 and at most 1e+06, got 1000000000.0"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number at least 0, got -0.1"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number at least 0, got nan"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a finite number above 0, got 0.0"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a finite number above 0, got inf"),
    (["--seed", "-1"], "--seed must be a whole number, from 0 to 4294967295, got -1"),
    (["--seed", str(2**40)], f"--seed must be a whole number, from 0 to 4294967295, got {2**40}"),
    (["--max-steps", "0"], "--max-steps must be a whole number, 1 or more, got 0"),
    (["--workers", "-1"], "--workers must be a whole number, from 0 to 64, got -1"),
    (["--workers", "1000"], "--workers must be a whole number, from 0 to 64, got 1000"),
    (
        ["--checkpoint-every", "-3", "--checkpoint-dir", "{tmp}/ck"],
        "--checkpoint-every must be a whole number, 0 or more, got -3",
    ),
    (
        ["--checkpoint-every", "auto", "--checkpoint-dir", "{tmp}/ck"],
        "--checkpoint-every auto needs --mtbf-hours (the job's mean time between failures",
    ),
    (
        ["--checkpoint-every", "auto", "--mtbf-hours", "0", "--checkpoint-dir", "{tmp}/ck"],
        "--mtbf-hours must be a finite number above 0 and at most 1e+06, got 0.0",
    ),
    (
        ["--checkpoint-every", "soon"],
        "argument --checkpoint-every: a whole number of steps or auto, got 'soon'",
    ),
    (["--mtbf-hours", "5"], "--mtbf-hours is used by --checkpoint-every auto only"),
    (
        ["--checkpoint-every", "auto", "--mtbf-hours", "1e306", "--checkpoint-dir", "{tmp}/ck"],
        "--mtbf-hours must be a finite number above 0 and at most 1e+06, got 1e+306",
    ),
    (
        ["--checkpoint-mode", "async"],
        "--checkpoint-mode async changes how checkpoints are written, and this run",
    ),
    (["--profile-steps", "5"], "--profile-steps says how many steps --profile records: add --profile DIR"),
    (
        [*HYBRID, "--hybrid-shard-size", "0"],
        "--hybrid-shard-size must be a whole number, from 1 to 1, got 0",
    ),
    (["--sharding", "zero3"], "argument --sharding: invalid choice: 'zero3'"),
    (["--recomputation", "all"], "argument --recomputation: invalid choice: 'all'"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--flight-recorder", "{file}"], "is a file, but a folder is expected"),
    (["--timeout", "-1"], "--timeout must be a finite number above 0 and at most 86400, got -1.0"),
    (["--timeout", "nan"], "--timeout must be a finite number above 0 and at most 86400, got nan"),
    (["--timeout", "inf"], "--timeout must be a finite number above 0 and at most 86400, got inf"),
    (
        ["--data-dir", "{file}"],
        "--data-dir {file} is a file, but a folder is expected: name a folder instead",
    ),
    (["--checkpoint-dir", "{file}"], "--checkpoint-dir {file} is a file, but a folder is expected"),
    (
        ["--checkpoint-dir", "{file}/inside"],
        "--checkpoint-dir {file}/inside cannot be a folder: {file} is a file",
    ),
    (["--checkpoint-dir", str(UNWRITABLE)], f"--checkpoint-dir {UNWRITABLE} cannot be written"),
    (["--metrics", "{folder}"], "--metrics {folder} is a folder, but a file is expected"),
    (["--metrics", "{file}/m.jsonl"], "--metrics {file}/m.jsonl cannot be a file: {file} is a file"),
    (["--metrics", f"{UNWRITABLE}/m.jsonl"], f"--metrics {UNWRITABLE}/m.jsonl cannot be written"),
    (["--resume", "{file}"], "--resume {file} is a file, but a folder is expected"),
    (["--profile", "{file}"], "--profile {file} is a file, but a folder is expected"),
    (["--profile", str(UNWRITABLE)], f"--profile {UNWRITABLE} cannot be written"),
    (
        ["--profile", "{tmp}/p", "--profile-steps", "0"],
        "--profile-steps must be a whole number, 1 or more, got 0",
    ),
    (
        ["--checkpoint-dir", "{tmp}/" + "n" * 300],
        "cannot be created: the name nnnnnnnnnnnnnnnnnnnnnnnn... is 300 bytes long, more than the 255 this "
        "file system allows; choose a shorter name",
    ),
    (
        ["--metrics", "{tmp}/" + "m" * 300 + ".jsonl"],
        "cannot be created: the name mmmmmmmmmmmmmmmmmmmmmmmm... is 306 bytes long",
    ),
    (
        ["--checkpoint-dir", "{tmp}/" + "/".join(["d" * 250] * 17)],
        "bytes long (plus the names written inside it), more than the 4096 this file system allows",
    ),
    (
        ["--global-batch-size", "5000"],
        "--global-batch-size 5000 is larger than the 1438 training samples of digits: use at most 1438",
    ),
]


def _filled(items: list[str], a_file: Path, tmp_path: Path) -> list[str]:
    return [item.format(file=a_file, folder=tmp_path, tmp=tmp_path) for item in items]


@pytest.mark.parametrize("flags, message", TRAIN_MISTAKES, ids=[" ".join(f) for f, _ in TRAIN_MISTAKES])
def test_every_train_flag_refuses_a_senseless_value(flags, message, a_file, tmp_path, capsys):
    status, stderr = exit_and_stderr(train.main, [*QUICK, *_filled(flags, a_file, tmp_path)], capsys)
    assert status == EXIT_USER_ERROR, stderr
    assert _filled([message], a_file, tmp_path)[0] in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr  # one line, no traceback
    assert "Traceback" not in stderr


# Under torchrun, one number (the timeout that once reached the rendezvous) and one path.
SUBSET = [
    (["--lr", "nan"], "--lr must be a finite number above 0"),
    (["--timeout", "-1"], "--timeout must be a finite number above 0 and at most 86400, got -1.0"),
    (["--checkpoint-dir", "{file}"], "is a file, but a folder is expected"),
    (["--metrics", "{folder}"], "is a folder, but a file is expected"),
    (["--profile", "{file}"], "is a file, but a folder is expected"),
]


@pytest.mark.parametrize("flags, message", SUBSET, ids=[" ".join(f) for f, _ in SUBSET])
def test_a_bad_flag_stops_a_real_process_with_one_line(flags, message, a_file, tmp_path):
    [outcome] = run_ranks([*QUICK, *_filled(flags, a_file, tmp_path)])
    assert outcome.returncode == EXIT_USER_ERROR, outcome.stderr
    assert outcome.stderr.count(message) == 1 and "Traceback" not in outcome.stderr, outcome.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", SUBSET[1:3], ids=[" ".join(f) for f, _ in SUBSET[1:3]])
def test_a_bad_flag_under_torchrun_is_reported_once_before_the_ranks_meet(flags, message, a_file, tmp_path):
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "course_lib.train",
            "--sharding",
            "ddp",
            *QUICK,
            *_filled(flags, a_file, tmp_path),
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = shown.stdout + shown.stderr
    assert shown.returncode != 0
    assert output.count(message) == 1, output  # printed by rank 0 only
    assert "exitcode  : 2" in output  # torchrun's own summary follows our line, naming our status
    our_frames = [
        line for line in output.splitlines() if line.strip().startswith('File "') and "/course_lib/" in line
    ]
    assert not our_frames, output


# -- what the run would refuse, the dry run refuses -------------------------------------------------


@pytest.fixture(scope="module")
def course_fsdp_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the course's FSDP (flat shards), and a copy whose DCP index is missing."""
    folder = tmp_path_factory.mktemp("course_fsdp")
    [outcome] = run_ranks(
        [*QUICK, "--sharding", "fsdp", "--impl", "course", "--checkpoint-dir", str(folder / "run")]
    )
    assert outcome.returncode == 0, outcome.stderr
    [saved] = (folder / "run").iterdir()
    broken = folder / "broken" / saved.name
    shutil.copytree(saved, broken)
    (broken / ".metadata").unlink()
    return saved


# (flags, launcher variables, the one line both runs print); {ckpt} is the course FSDP checkpoint.
REFUSED_BEFORE_THE_RANKS_MEET = [
    (
        [*HYBRID, "--hybrid-shard-size", "3"],
        {"WORLD_SIZE": "4"},
        "HYBRID_SHARD needs a shard group size that divides the 4 ranks, got 3: pass --hybrid-shard-size",
    ),
    (
        HYBRID,
        {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"},
        "divides the 4 ranks, got 3 (the ranks of one node, 3, by default)",
    ),
    (["--global-batch-size", "2000"], {"WORLD_SIZE": "2"}, "is larger than the 1438 training samples"),
    (
        ["--resume", "{ckpt}"],
        {"WORLD_SIZE": "2"},
        "holds FullyShardedDataParallel flat parameters 0.flat_param, 1.flat_param, 2.flat_param, "
        "3.flat_param, but this run lays its model out as named parameters: resume with the --sharding",
    ),
    (["--resume", "{broken}"], {"WORLD_SIZE": "2"}, "is incomplete (.metadata is missing)"),
    (
        ["--checkpoint-dir", "{run}"],
        {"WORLD_SIZE": "2"},
        "already holds another run's checkpoints (the newest is step-00000001): continue that run with "
        "--resume latest, or give this one an empty --checkpoint-dir",
    ),
]


@pytest.mark.parametrize(
    "flags, variables, message",
    REFUSED_BEFORE_THE_RANKS_MEET,
    ids=[" ".join(f) for f, _, _ in REFUSED_BEFORE_THE_RANKS_MEET],
)
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "real run"])
def test_the_dry_run_refuses_what_the_run_refuses(
    flags, variables, message, dry_run, course_fsdp_checkpoint, monkeypatch, capsys
):
    from course_lib.distributed.launch import free_port

    places = dict(
        ckpt=course_fsdp_checkpoint,
        broken=course_fsdp_checkpoint.parent.parent / "broken" / course_fsdp_checkpoint.name,
        run=course_fsdp_checkpoint.parent,
    )
    launcher = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} | variables
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    argv = [*QUICK, "--sharding", "ddp", "--timeout", "5", *[f.format(**places) for f in flags]]
    status, stderr = exit_and_stderr(train.main, argv + (["--dry-run"] if dry_run else []), capsys)
    assert status == EXIT_USER_ERROR, stderr
    assert stderr.strip().splitlines() == [f"error: {stderr.strip().removeprefix('error: ')}"]
    assert message in stderr, stderr


# -- the other commands: argparse types, so nothing starts -----------------------------------------
OTHER_MISTAKES = [
    (lab.main, ["--epochs", "0"], "argument --epochs: must be a whole number, 1 or more, got 0"),
    (lab.main, ["--lr", "nan"], "argument --lr: must be a finite number above 0 and at most 1e+06, got nan"),
    (lab.main, ["--global-batch-size", "255"], "argument --global-batch-size: must be a multiple of 2"),
    (
        lab.main,
        ["--threads-per-process", "0"],
        "argument --threads-per-process: must be a whole number, from 1 to",
    ),
    (
        lab.main,
        ["--results-dir", "{file}"],
        "argument --results-dir: {file} is a file, but a folder is expected",
    ),
    (lab.main, ["--results-dir", str(UNWRITABLE)], f"argument --results-dir: {UNWRITABLE} cannot be written"),
    (lab.main, ["--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
    (study.main, ["submit", "--gpus", "0"], "argument --gpus: must be a whole number, 1 or more, got 0"),
    (study.main, ["submit", "--gpus-per-node", "-4"], "argument --gpus-per-node: must be a whole number"),
    (study.main, ["submit", "--epochs", "nan"], "argument --epochs: must be a whole number, got 'nan'"),
    (
        study.main,
        ["submit", "--gpus", "1", "3", "--global-batch-size", "100"],
        "argument --global-batch-size: 100 does not divide over [3] processes",
    ),
    (
        study.main,
        ["submit", "--gpus", "6", "--global-batch-size", "48"],
        "argument --gpus: 6 GPUs do not fill whole nodes",
    ),
    (
        study.main,
        ["submit", "--results", "{file}"],
        "argument --results: {file} is a file, but a folder is expected",
    ),
    (study.main, ["submit", "--data-dir", "{file}"], "argument --data-dir: {file} is a file"),
    (study.main, ["collect", "--results", "{tmp}/none"], "argument --results: {tmp}/none does not exist"),
    (study.main, ["plot", "--results", "{file}"], "argument --results: {file} is a file"),
    (
        bench.main,
        ["recompute", "--seq", "2000"],
        "argument --seq: a sequence of 2000 characters does not fit",
    ),
    (bench.main, ["float8", "--seq", "900"], "argument --seq: a sequence of 900 characters does not fit"),
    (bench.main, ["ddp", "--steps", "0"], "argument --steps: must be a whole number, 1 or more, got 0"),
    (bench.main, ["ddp", "--warmup", "-1"], "argument --warmup: must be a whole number, 0 or more, got -1"),
    (
        bench.main,
        ["ddp", "--bucket-mb", "nan"],
        "argument --bucket-mb: must be a finite number above 0, got nan",
    ),
    (bench.main, ["ddp", "--world-size", "1000"], "argument --world-size: must be a whole number, from 1 to"),
    (bench.main, ["fsdp", "--width", "0"], "argument --width: must be a whole number, 1 or more, got 0"),
    (
        bench.main,
        ["recompute", "--d-model", "30"],
        "argument --d-model: must be a multiple of the 4 heads, got 30",
    ),
    (bench.main, ["memory", "--world-sizes", "2", "0"], "argument --world-sizes: must be a whole number"),
    (bench.main, ["memory", "--layers", "-2"], "argument --layers: must be a whole number, 1 or more"),
    (bench.main, ["pipeline", "--stages", "1"], "argument --stages: must be a whole number, from 2 to"),
    (bench.main, ["pipeline", "--batch", "12"], "argument --batch: must be a multiple of 8"),
    (
        bench.main,
        ["tp", "--d-model", "100", "--world-size", "3"],
        "argument --d-model: must be a multiple of 12",
    ),
    (bench.main, ["tp", "--seq", "0"], "argument --seq: must be a whole number, 1 or more, got 0"),
    (
        bench.main,
        ["allreduce", "--world-size", "1"],
        "argument --world-size: must be a whole number, from 2 to",
    ),
    (bench.main, ["allreduce", "--max-mb", "0"], "argument --max-mb: must be a finite number above 0, got 0"),
    (
        bench.main,
        ["allreduce", "--expect-gbps", "-3"],
        "argument --expect-gbps: must be a finite number above 0",
    ),
    (
        bench.main,
        ["allreduce", "--plot", "{folder}"],
        "argument --plot: {folder} is a folder, but a file is expected",
    ),
    (three_d.main, ["--layout", "d2.t0"], "argument --layout: layout 'd2.t0': 't0' is not an axis"),
    (three_d.main, ["--steps", "-1"], "argument --steps: must be a whole number, 1 or more, got -1"),
    (
        three_d.main,
        ["--layout", "c4.t2 ulysses"],
        "2 attention heads do not divide by the Ulysses degree 4",
    ),
    (three_d.main, ["--layout", "d8.p2.t4"], "64 processes on"),
    (three_d.main, ["--layout", "d2 fsdp"], "a 3-D run cannot run sharding 'fsdp'"),
    (three_d.main, ["--plot", "{folder}"], "argument --plot: {folder} is a folder, but a file is expected"),
    (three_d.main, ["--profile", "{file}"], "argument --profile: {file} is a file, but a folder is expected"),
    (
        bench.main,
        ["ddp", "--profile", str(UNWRITABLE)],
        f"argument --profile: {UNWRITABLE} cannot be written",
    ),
]


@pytest.mark.parametrize(
    "main, flags, message",
    OTHER_MISTAKES,
    ids=[f"{m.__module__.split('.')[-1]} {' '.join(f)}" for m, f, _ in OTHER_MISTAKES],
)
def test_the_lab_study_and_benchmarks_refuse_senseless_values(main, flags, message, a_file, tmp_path, capsys):
    status, stderr = exit_and_stderr(main, _filled(flags, a_file, tmp_path), capsys)
    assert status == EXIT_USER_ERROR, stderr
    assert _filled([message], a_file, tmp_path)[0] in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


# -- training that diverges stops, together ---------------------------------------------------------
DIVERGING = ["--optimizer", "sgd", "--lr", "1e6", "--epochs", "1", "--no-progress", "--checkpoint-every", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_diverging_run_stops_every_rank_at_the_same_step_and_keeps_the_last_good_checkpoint(
    nprocs, tmp_path
):
    args = [
        *DIVERGING,
        "--sharding",
        "ddp" if nprocs > 1 else "single",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--metrics",
        str(tmp_path / "m.jsonl"),
    ]
    processes = start_ranks(args, nprocs)
    exited: dict[int, float] = {}
    deadline = time.monotonic() + 120
    while len(exited) < nprocs and time.monotonic() < deadline:
        exited.update(
            {
                rank: time.monotonic()
                for rank, process in enumerate(processes)
                if rank not in exited and process.poll() is not None
            }
        )
        time.sleep(0.05)
    outcomes = finish(processes, timeout=10)
    # together, not one rank left waiting for the others
    assert max(exited.values()) - min(exited.values()) < 5
    assert [o.returncode for o in outcomes] == [EXIT_DIVERGED] * nprocs, [o.stderr for o in outcomes]
    stderr = "".join(o.stderr for o in outcomes)
    assert stderr.count("error: training diverged at step ") == 1 and "Traceback" not in stderr, stderr
    step = int(stderr.split("diverged at step ")[1].split()[0])
    assert step >= 2, stderr  # a step that trained, and wrote a checkpoint, came first
    assert "try a lower --lr (this run: 1e+06) or --clip-grad-norm 1.0" in stderr
    [event] = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert event["event"] == "diverged" and event["step"] == step and event["loss"] in ("nan", "inf")

    name, weights = latest_weights(tmp_path / "ck")
    assert name == f"step-{step - 1:08d}"  # nothing was written at or after the step that diverged
    assert all(math.isfinite(value) for tensor in weights.values() for value in tensor.flatten().tolist())

    # The checkpoint resumes exactly: the same data meets the same weights, so it diverges at the same step.
    again = run_ranks([*args, "--resume", "latest"], nprocs, timeout=120)
    assert [o.returncode for o in again] == [EXIT_DIVERGED] * nprocs
    again_stderr = "".join(o.stderr for o in again)
    assert f"diverged at step {step} " in again_stderr and f"step-{step - 1:08d}" in again_stderr


def test_a_metrics_file_with_a_divergence_still_reads_as_its_epochs(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"epoch": 1, "epoch_time_s": 1.0}\n{"event": "diverged", "step": 9, "loss": "nan"}\n')
    assert scaling.read_metrics(metrics) == [{"epoch": 1, "epoch_time_s": 1.0}]
