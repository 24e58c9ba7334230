"""Every script in slurm/ on a real (local, CPU-only) Slurm: it runs, requeues, scales, and refuses mistakes.

A session fixture installs Slurm and munge from Debian's packages (once), starts a cluster of two
simulated nodes with 4 fake GPUs each on this machine (``slurm/local_cluster.sh``), and always
tears it down. The job scripts are submitted unmodified; only environment variables make the
training tiny (digits, a few steps) and choose the ``local`` cluster profile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, latest_weights

pytestmark = pytest.mark.slurm
CLUSTER = REPO / "slurm" / "local_cluster.sh"
JOB_SCRIPTS = {"single_gpu": 1, "ddp_1node": 4, "fsdp": 4, "ddp_multinode": 8, "torchrun_per_node": 8}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start slurmctld, slurmd and munged and need root (as in CI)")
    state = tmp_path_factory.mktemp("slurm-state")
    env = dict(os.environ, SLURM_LOCAL_DIR=str(state))
    up = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, f"the local Slurm cluster did not start:\n{up.stderr[-3000:]}"
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=120)


def _job_env(results: Path, **settings: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "COURSE_"))}
    env.update(
        COURSE_CLUSTER="local",
        COURSE_DATASET="digits",
        COURSE_MODEL="digits_cnn",
        COURSE_EPOCHS="1",
        COURSE_GLOBAL_BATCH="64",
        COURSE_RESULTS=str(results),
        COURSE_EXTRA_ARGS="--max-steps 3",
    )
    env.update(settings)
    return env


def _sbatch(script: str, env: dict, output: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", *options, f"slurm/{script}.sbatch"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _job_state(job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True)
    for field in shown.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def _wait(job_id: str, timeout: float = 300) -> str:
    """Poll until the job has ended (a requeued job counts as still going); return its final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _job_state(job_id)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not end within {timeout} s")


def _submit_and_wait(script: str, env: dict, output: Path, *options: str) -> tuple[str, str]:
    submitted = _sbatch(script, env, output, *options)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    return _wait(job_id), output.with_name(output.name.replace("%j", job_id)).read_text()


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_every_job_script_runs_unmodified_on_the_cluster(cluster, tmp_path, script):
    state, output = _submit_and_wait(script, _job_env(tmp_path), tmp_path / "%j.out")
    assert state == "COMPLETED", output
    assert f"configuration OK for {JOB_SCRIPTS[script]} process(es)" in output
    assert "training exited with status 0" in output
    (metrics,) = tmp_path.glob("*.jsonl")
    record = json.loads(metrics.read_text().splitlines()[-1])
    assert record["world_size"] == JOB_SCRIPTS[script] and record["backend"] == "gloo"
    assert record["val_samples"] == 359 and 0 < record["val_acc"] <= 1


# Two tasks, not four: a resumed DDP builds its gradient buckets afresh, and with more than two
# ranks the ring all-reduce then adds each element's N values in another order, which changes the
# last bit of some sums (measured: ~1e-9 after one epoch). Two values add up the same either way,
# so with two ranks the resumed run must match the uninterrupted one bit for bit.
TWO_TASKS = ("--ntasks-per-node=2", "--gpus-per-node=2")


def test_a_preempted_job_checkpoints_requeues_resumes_and_ends_identical(cluster, tmp_path):
    longer = dict(
        COURSE_DATASET="synthetic",
        COURSE_MODEL="cifar_cnn",
        COURSE_EPOCHS="2",
        COURSE_EXTRA_ARGS="--checkpoint-every 8",
    )
    state, output = _submit_and_wait(
        "ddp_1node",
        _job_env(tmp_path / "straight", COURSE_RUN_NAME="run", **longer),
        tmp_path / "straight-%j.out",
        *TWO_TASKS,
    )
    assert state == "COMPLETED", output
    expected_step, expected = latest_weights(tmp_path / "straight" / "ckpt" / "run")

    results = tmp_path / "preempted"
    submitted = _sbatch(
        "ddp_1node",
        _job_env(results, COURSE_RUN_NAME="run", **longer),
        tmp_path / "preempted.out",
        *TWO_TASKS,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    checkpoints = results / "ckpt" / "run"
    deadline = time.monotonic() + 240
    while not (checkpoints / "step-00000008").is_dir():
        assert time.monotonic() < deadline and _job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), (
            tmp_path / "preempted.out"
        ).read_text()
        time.sleep(0.2)
    # what --signal=B:USR1@120 does before the time limit, now
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
    state = _wait(job_id, timeout=400)
    output = (tmp_path / "preempted.out").read_text()
    assert state == "COMPLETED", output
    assert "stop requested" in output and "training exited with status 3" in output
    assert f"requeueing job {job_id}" in output and "restart 1" in output and "resumed from" in output
    step, weights = latest_weights(checkpoints)
    assert step == expected_step
    for key, tensor in expected.items():
        assert torch.equal(weights[key], tensor), key  # bit for bit the uninterrupted run


def test_the_scaling_study_runs_collects_a_failed_run_and_plots(cluster, tmp_path):
    env = _job_env(tmp_path)
    env.pop("COURSE_EXTRA_ARGS")
    results = tmp_path / "study"

    def scaling(*args):
        return subprocess.run(
            [sys.executable, "-m", "course_lib.tools.study", *args, "--results", str(results)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    # A global batch that splits over 8 ranks is refused up front, before any job is submitted.
    refused = scaling("submit", "--gpus", "1", "8", "--global-batch-size", "60")
    assert refused.returncode == 2 and "60 does not divide over [8] processes" in refused.stderr
    assert not (results / "study.json").exists()

    # The 8-rank run is cancelled as soon as it is submitted (as a time limit or an operator would):
    # collect must list it as failed and tabulate the others.
    submitted = scaling(
        "submit",
        "--gpus",
        "1",
        "2",
        "4",
        "8",
        "--strategies",
        "ddp",
        "--gpus-per-node",
        "4",
        "--dataset",
        "digits",
        "--model",
        "digits_cnn",
        "--epochs",
        "2",
        "--global-batch-size",
        "64",
    )
    assert submitted.returncode == 0, submitted.stderr
    plan = json.loads((results / "study.json").read_text())
    assert [(r["name"], r["nodes"], r["tasks_per_node"]) for r in plan["runs"]] == [
        ("ddp-1", 1, 1),
        ("ddp-2", 1, 2),
        ("ddp-4", 1, 4),
        ("ddp-8", 2, 4),
    ]
    subprocess.run(["scancel", plan["runs"][-1]["job_id"]], check=True)
    for run in plan["runs"]:
        _wait(run["job_id"])
    collected = scaling("collect")
    assert collected.returncode == 0, collected.stderr
    assert (
        "failed or missing: ddp-8: no metrics (exit status: no status; see ddp-8-*.out)" in collected.stderr
    )
    rows = (results / "scaling.csv").read_text().splitlines()
    assert rows[0].startswith("run,strategy,world_size") and [r.split(",")[0] for r in rows[1:]] == [
        "ddp-1",
        "ddp-2",
        "ddp-4",
    ]
    plotted = scaling("plot")
    assert plotted.returncode == 0, plotted.stderr
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_larger_than_the_cluster_is_rejected_at_submission(cluster, tmp_path):
    rejected = _sbatch("ddp_1node", _job_env(tmp_path), tmp_path / "%j.out", "--gpus-per-node=8")
    assert rejected.returncode != 0
    assert "Requested node configuration is not available" in rejected.stderr
    # nothing pending
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip() == ""


@pytest.mark.parametrize(
    "settings, options, message",
    [
        (
            dict(
                COURSE_DATASET="cifar10", COURSE_MODEL="cifar_cnn", COURSE_DATA_DIR="/nonexistent/course-data"
            ),
            (),
            "CIFAR-10 was not found in /nonexistent/course-data",
        ),
        (
            dict(COURSE_CLUSTER="nosuch"),
            (),
            "cluster profile 'nosuch' does not exist: set COURSE_CLUSTER to one of: alps generic local",
        ),
        (
            dict(COURSE_CLUSTER="alps"),
            (),
            "cluster alps charges every job to a project: submit with sbatch --account=<project>",
        ),
    ],
)
def test_mistakes_fail_at_once_with_a_clear_message(cluster, tmp_path, settings, options, message):
    started = time.monotonic()
    state, output = _submit_and_wait(
        "ddp_1node", _job_env(tmp_path, **settings), tmp_path / "%j.out", *options
    )
    assert state == "FAILED"
    assert message in output
    assert "training exited" not in output  # no process was started
    assert time.monotonic() - started < 60
