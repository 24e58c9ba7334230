"""The course's tools meet broken files, missing programs, bad variables and no network in one line.

Each case is what a student or an instructor runs into: a metrics file cut short by a killed run,
a CSV edited by hand, ``sbatch`` on a laptop, a study whose runs all failed, a Slurm variable
that is not a number, a download on a machine without internet, benchmark sizes that cannot fit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib.tools import bench, jobcheck, study

from conftest import REPO, clean_env

EXIT_USER_ERROR = 2


def _outcome(main, argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code
    return status, capsys.readouterr().err.strip().splitlines()


def _record(epoch: int) -> dict:
    return {
        "epoch": epoch,
        "sharding": "ddp",
        "impl": "torch",
        "world_size": 1,
        "global_batch_size": 64,
        "epoch_time_s": 1.0,
        "samples_per_s": 100.0,
        "val_acc": 0.9,
        "val_loss": 0.3,
        "peak_mem_mb": 500.0,
        "model_state_mb": 0.5,
    }


def _study(folder: Path, metrics_text: str, epochs: int = 2) -> Path:
    runs = [{"name": "ddp-1", "sharding": "ddp", "world_size": 1, "nodes": 1, "tasks_per_node": 1}]
    (folder / "study.json").write_text(json.dumps({"settings": {"epochs": epochs}, "runs": runs}))
    (folder / "ddp-1.jsonl").write_text(metrics_text)
    return folder


def test_collect_reads_the_whole_epochs_before_a_line_cut_short(tmp_path):
    whole = "".join(json.dumps(_record(epoch)) + "\n" for epoch in (1, 2))
    rows, failed = study.collect(_study(tmp_path, whole + '{"epoch": 3, "strat'))
    assert failed == [] and rows[0]["epochs"] == 2


def test_collect_names_a_file_that_is_not_metrics(tmp_path, capsys):
    _study(tmp_path, "not json at all\n" + json.dumps(_record(1)) + "\n")
    status, lines = _outcome(study.main, ["collect", "--results", str(tmp_path)], capsys)
    assert status == 1  # no run finished
    assert lines == [
        f"failed or missing: ddp-1: {tmp_path}/ddp-1.jsonl, line 1, is not a JSON record: is it a "
        "metrics file (--metrics) of a run?"
    ]


def test_plot_refuses_a_csv_with_an_empty_cell_in_one_line(tmp_path, capsys):
    _study(tmp_path, "")
    header = "run,sharding,world_size,time_per_epoch_s,speedup\n"
    (tmp_path / "scaling.csv").write_text(header + "ddp-1,ddp,1,,1.0\n")
    status, lines = _outcome(study.main, ["plot", "--results", str(tmp_path)], capsys)
    assert status == EXIT_USER_ERROR
    assert (
        len(lines) == 1 and "scaling.csv, line 2: column time_per_epoch_s holds '', not a number" in lines[0]
    )


def test_submit_without_sbatch_names_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    status, lines = _outcome(study.main, ["submit", "--results", str(tmp_path / "s"), "--gpus", "1"], capsys)
    assert status == EXIT_USER_ERROR and len(lines) == 1
    assert (
        "sbatch was not found: submit from a Slurm cluster's login node, or run the study on this machine "
        "with --local" in lines[0]
    )


def test_a_local_study_whose_data_is_missing_is_refused_before_any_run(tmp_path, capsys):
    argv = ["submit", "--local", "--results", str(tmp_path / "s"), "--gpus", "1", "2", "--dataset", "cifar10"]
    status, lines = _outcome(study.main, [*argv, "--data-dir", str(tmp_path / "nothing")], capsys)
    assert status == EXIT_USER_ERROR and len(lines) == 1
    assert "single-1: CIFAR-10 was not found in" in lines[0]  # the baseline is checked first
    assert not (tmp_path / "s" / "study.json").exists()  # nothing ran


def test_a_local_study_whose_runs_all_failed_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "run_locally", lambda *args, **kwargs: None)  # runs that left no metrics
    status, lines = _outcome(
        study.main,
        [
            "submit",
            "--local",
            "--results",
            str(tmp_path),
            "--gpus",
            "1",
            "--dataset",
            "digits",
            "--model",
            "digits_cnn",
            "--global-batch-size",
            "64",
        ],
        capsys,
    )
    assert status == 1
    assert lines[-1] == f"error: 3 of 3 runs failed (their logs are in {tmp_path})"  # single-1, ddp-1, fsdp-1


# (the Slurm variables of a batch shell, what the one line must say)
SLURM_MISTAKES = [
    (
        {"SLURM_GPUS_ON_NODE": "four"},
        "SLURM_GPUS_ON_NODE='four' is not a whole number 0 or more: Slurm sets it",
    ),
    (
        {"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_TASK": "gpu:x"},
        "SLURM_GPUS_PER_TASK='x' is not a whole number",
    ),
    ({"SLURM_GPUS_ON_NODE": "4", "SLURM_TASKS_PER_NODE": "many"}, "cannot read SLURM_TASKS_PER_NODE='many'"),
]


@pytest.mark.parametrize("variables, message", SLURM_MISTAKES)
def test_jobcheck_names_a_malformed_slurm_variable(variables, message, monkeypatch, capsys):
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    status, lines = _outcome(jobcheck.main, ["gpus"], capsys)
    assert status == EXIT_USER_ERROR and len(lines) == 1
    assert message in lines[0]


def test_a_download_without_internet_says_so_in_one_line(tmp_path):
    done = subprocess.run(
        [
            "unshare",
            "--net",
            "--map-root-user",
            sys.executable,
            "-m",
            "course_lib.data",
            "download",
            "cifar10",
            "--data-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: could not download cifar10 (") and "cannot reach the internet" in line


BENCH_MISTAKES = [
    (["ddp", "--width", "100000"], "these sizes need about "),
    (["cp", "--seq", "1000000"], "and this machine has"),
    (["attention", "--heads", "6"], "argument --heads: must be a multiple of --world-size 4 (Ulysses gives"),
    (["attention", "--ulysses-degree", "3"], "argument --ulysses-degree: must divide --world-size 4"),
    (["allreduce", "--max-mb", "100000"], "choose smaller sizes"),
    (["allreduce", "--min-bytes", "99999999999"], "argument --min-bytes: must be below half of the largest"),
]


@pytest.mark.parametrize("argv, message", BENCH_MISTAKES, ids=[" ".join(a) for a, _ in BENCH_MISTAKES])
def test_benchmark_sizes_that_cannot_run_are_refused_before_anything_starts(argv, message, capsys):
    status, lines = _outcome(bench.main, argv, capsys)
    assert status == EXIT_USER_ERROR and len(lines) == 1
    assert message in lines[0]


@pytest.mark.parametrize(
    "command, status",
    [
        (["plan", "--model", "llama3-8b", "--cluster", "alps", "--gpus", "8"], 1),  # a long table
        (["diagnose", "--help"], 0),  # argparse writes the help, ignoring a failed write, and exits 0
    ],
    ids=["plan", "diagnose --help"],
)
def test_a_reader_that_stops_early_ends_the_command_quietly(command, status):
    """``| head``: the reader closes the pipe; the command ends without a traceback (status 1 where
    its own output could not be written)."""
    process = subprocess.Popen(
        [sys.executable, "-m", f"course_lib.tools.{command[0]}", *command[1:]],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    process.stdout.close()  # before the command has even imported its modules, let alone written
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == status
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.mark.parametrize(
    "argv, fault, message",
    [
        (
            ["--standalone", "--nproc-per-node", "2", "-m", "course_lib.trian"],
            "",
            "no module named 'course_lib.trian'",
        ),
        (["--standalone", "--nproc-per-node", "2", "missing_script.py"], "", "missing_script.py"),
        (["--nproc-per-node"], "", "argument --nproc-per-node/--nproc_per_node: expected one argument"),
        (
            ["--standalone", "--nproc-per-node", "2", "-m", "course_lib.train"],
            "kill:5:3",
            "COURSE_FAULT='kill:5:3' names rank 5, but the job has 2 ranks (0 to 1)",
        ),
        (
            ["--standalone", "--nproc-per-node", "2", "-m", "course_lib.train"],
            "kill:one:3",
            "write KIND:RANK:AT",
        ),
        (["--nproc-per-node", "two", "-m", "course_lib.train"], "", "--nproc-per-node 'two': give a number"),
        (["--nproc-per-node", "0", "-m", "course_lib.train"], "", "--nproc-per-node '0': give a number"),
        (["--nproc-per-node", "gpu", "-m", "course_lib.train"], "", "this machine has none"),
        (
            ["--nproc-per-node", "2", "--max-restarts", "-1", "-m", "course_lib.train"],
            "",
            "--max-restarts must be",
        ),
        (
            ["--standalone", "--nnodes", "2", "--nproc-per-node", "2", "-m", "course_lib.train"],
            "",
            "--standalone runs one node by itself, but --nnodes 2 asks for more",
        ),
        (
            ["--nnodes", "3:2", "--nproc-per-node", "2", "-m", "course_lib.train"],
            "",
            "the least nodes (3) is above",
        ),
    ],
    ids=[
        "module typo",
        "missing script",
        "torchrun's own flag",
        "fault outside the world",
        "malformed fault",
        "processes not a number",
        "no processes",
        "gpu without a GPU",
        "negative restarts",
        "standalone with two nodes",
        "nodes backwards",
    ],
)
def test_the_torchrun_wrapper_refuses_before_any_worker_starts(argv, fault, message, monkeypatch, capsys):
    from course_lib.observe import faults
    from course_lib.tools import torchrun

    from conftest import call_main

    monkeypatch.setenv(faults.VARIABLE, fault)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "gpu" is refused where there is none
    shown = call_main(torchrun.main, argv, capsys)
    assert shown.returncode == 2 and message in shown.stderr
    assert shown.stderr.count("\n") == 1 and "Traceback" not in shown.stderr


def test_the_torchrun_wrapper_runs_a_script_of_ones_own_that_reports_nothing(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text("print('my own work done')\n")
    shown = subprocess.run(
        [sys.executable, "-m", "course_lib.tools.torchrun", "--standalone", "--nproc-per-node", "2",
         str(script)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("my own work done") == 2 and "without reporting" not in shown.stderr


def test_a_fault_for_a_rank_the_run_lacks_is_refused_by_the_dry_run(tmp_path):
    shown = subprocess.run(
        [sys.executable, "-m", "course_lib.train", "--dry-run"],
        cwd=REPO, env=clean_env(COURSE_FAULT="kill:3:2"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 2 and "names rank 3, but the job has 1 rank" in shown.stderr
