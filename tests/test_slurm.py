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


# The quick jobs: every script, and every mistake a job must refuse in its first second. They are
# submitted together (the cluster runs them side by side) and each test waits for its own.
QUICK_JOBS = {
    # name: (script, settings, sbatch options)
    "single_gpu": ("single_gpu", {}, ()),
    "ddp_1node": ("ddp_1node", {}, ()),
    "fsdp": ("fsdp", {}, ()),
    "ddp_multinode": ("ddp_multinode", {}, ()),
    # The generic profile leaves OMP_NUM_THREADS to the rule: a task's 8 cores shared by 4 workers.
    "torchrun_per_node": ("torchrun_per_node", {"COURSE_CLUSTER": "generic"}, ("--cpus-per-task=8",)),
    "network_check": ("network_check", {"COURSE_LINK_GBPS": "0.05", "COURSE_NETWORK_MAX_MB": "1"}, ()),
    "no_cifar": (
        "ddp_1node",
        dict(COURSE_DATASET="cifar10", COURSE_MODEL="cifar_cnn", COURSE_DATA_DIR="/nonexistent/course-data"),
        (),
    ),
    "no_profile": ("ddp_1node", {"COURSE_CLUSTER": "nosuch"}, ()),
    "no_account": ("ddp_1node", {"COURSE_CLUSTER": "alps"}, ()),
    "no_plugin": ("ddp_1node", {"COURSE_CLUSTER": "alps", "LD_LIBRARY_PATH": ""}, ("--account=course",)),
    "container_without_hook": (
        "ddp_1node",
        {"COURSE_CLUSTER": "alps", "COURSE_NCCL_PLUGIN_FROM": "container", "COURSE_EDF": "{tmp}/plain.toml"},
        ("--account=course",),
    ),
    "more_tasks_than_gpus": (
        "ddp_1node",
        {},
        ("--ntasks-per-node=8", "--gpus-per-task=0", "--gpus-per-node=4"),
    ),
    "ranks_without_a_gpu": ("torchrun_per_node", {"COURSE_PROCS_PER_NODE": "4"}, ("--gpus-per-node=2",)),
    "no_gpus": ("single_gpu", {}, ("--gpus-per-task=0",)),
    "no_link_speed": ("network_check", {}, ()),
}


@pytest.fixture(scope="module")
def quick_jobs(cluster, tmp_path_factory):
    """Submit every quick job at once; name -> (job id, its output file, its results folder)."""
    folder = tmp_path_factory.mktemp("quick-jobs")
    (folder / "plain.toml").write_text('image = "nvcr.io#nvidia/pytorch:26.01-py3"\n')
    jobs = {}
    for name, (script, settings, options) in QUICK_JOBS.items():
        results = folder / name
        settings = {key: value.replace("{tmp}", str(folder)) for key, value in settings.items()}
        submitted = _sbatch(script, _job_env(results, **settings), folder / f"{name}.out", *options)
        assert submitted.returncode == 0, f"{name}: {submitted.stderr}"
        jobs[name] = (submitted.stdout.strip().split(";")[0], folder / f"{name}.out", results)
    yield jobs
    subprocess.run(["scancel", *(job_id for job_id, _, _ in jobs.values())], capture_output=True)


def _finished(quick_jobs, name: str) -> tuple[str, str, Path]:
    """Wait for one quick job: (its final state, its output, its results folder)."""
    job_id, output, results = quick_jobs[name]
    state = _wait(job_id)
    return state, output.read_text(), results


@pytest.mark.parametrize("script", JOB_SCRIPTS)
def test_every_job_script_runs_unmodified_on_the_cluster(quick_jobs, script):
    state, output, results = _finished(quick_jobs, script)
    assert state == "COMPLETED", output
    assert f"configuration OK for {JOB_SCRIPTS[script]} process(es)" in output
    assert "training exited with status 0" in output
    (metrics,) = results.glob("*.jsonl")
    record = json.loads(metrics.read_text().splitlines()[-1])
    assert record["world_size"] == JOB_SCRIPTS[script] and record["backend"] == "gloo"
    assert record["val_samples"] == 359 and 0 < record["val_acc"] <= 1


def test_multi_node_jobs_prove_the_network_with_an_all_reduce_before_training(quick_jobs):
    for script, ranks in (("ddp_multinode", 8), ("torchrun_per_node", 8)):
        state, output, _ = _finished(quick_jobs, script)
        line = f"preflight: {ranks} ranks on 2 node(s) all-reduced correctly"
        assert state == "COMPLETED" and line in output, output
        assert output.index(line) < output.index("training digits_cnn")
    # one node: no preflight
    assert "preflight" not in _finished(quick_jobs, "ddp_1node")[1]


def test_threads_per_process_are_the_cores_each_process_was_given(quick_jobs):
    # torchrun: one task of 8 cores starts 4 workers, so each gets 2 threads
    output = _finished(quick_jobs, "torchrun_per_node")[1]
    assert "OMP_NUM_THREADS=2 (8 core(s) a task, 4 process(es) a task)" in output, output


def test_the_network_check_sweeps_fits_and_gives_a_verdict(quick_jobs):
    state, output, results = _finished(quick_jobs, "network_check")
    assert state == "COMPLETED", output
    assert "preflight: 2 ranks on 2 node(s)" in output
    assert "network OK: bus bandwidth" in output and "of the link's 0.05 GB/s" in output
    (sweep,) = results.glob("*.json")
    result = json.loads(sweep.read_text())
    assert result["world_size"] == 2 and result["nodes"] == 2 and result["all_correct"]
    assert result["rows"][0]["bytes"] == 8 and result["rows"][-1]["bytes"] == 2**20
    assert result["fit"]["latency_us"] > 0 and result["fit"]["bandwidth_gbps"] > 0
    assert sweep.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_cifar", "CIFAR-10 was not found in /nonexistent/course-data"),
        (
            "no_profile",
            "cluster profile 'nosuch' does not exist: set COURSE_CLUSTER to one of: alps generic local",
        ),
        ("no_account", "cluster alps charges every job to a project: submit with sbatch --account=<project>"),
        (
            "no_plugin",
            "error: NCCL_NET='AWS Libfabric' needs the aws-ofi-nccl plugin (libnccl-net.so), and no folder "
            "on LD_LIBRARY_PATH has it: submit with a uenv that provides it",
        ),
        (
            "container_without_hook",
            "plain.toml does not enable the plugin hook: add com.hooks.aws_ofi_nccl.enabled",
        ),
        ("more_tasks_than_gpus", "error: 8 processes would share 4 GPU(s) (the node has 4 GPU(s))"),
        (
            "ranks_without_a_gpu",
            "error: 4 processes would share 2 GPU(s) (the node has 2 GPU(s)): ranks would find no GPU",
        ),
        ("no_gpus", "error: this job has no GPUs: request one per process, e.g. sbatch --gpus-per-task=1"),
        ("no_link_speed", "cluster profile local does not say how fast its link is: set COURSE_LINK_GBPS"),
    ],
)
def test_mistakes_fail_at_once_with_a_clear_message(quick_jobs, name, message):
    state, output, _ = _finished(quick_jobs, name)
    assert state == "FAILED"
    assert message in output
    assert "training exited" not in output and "preflight:" not in output  # no process was started
    assert output.count("error: ") == 1  # one line says what to change


# Two tasks, not four: a resumed DDP builds its gradient buckets afresh, and with more than two
# ranks the ring all-reduce then adds each element's N values in another order, which changes the
# last bit of some sums (measured: ~1e-9 after one epoch). Two values add up the same either way,
# so with two ranks the resumed run must match the uninterrupted one bit for bit.
TWO_TASKS = ("--ntasks-per-node=2",)
LONGER = dict(
    COURSE_EPOCHS="2",
    # 30 steps: past the end of the first epoch (22 steps), so a resumed run crosses an epoch
    COURSE_EXTRA_ARGS="--checkpoint-every 6 --max-steps 30",
    # rank 1 sleeps 0.1 s before each collective, which paces both ranks: the run lasts seconds
    # after its first checkpoint, time for the signal to land mid-run
    COURSE_FAULT="slow:1:0.1",
)


def test_a_stop_signal_reaches_every_worker_which_checkpoint_requeue_and_end_identical(cluster, tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit), under srun
    tasks and under torchrun (which forwards it: --signals-to-handle): both runs requeue, resume,
    and end bit for bit where an uninterrupted run ends. The three jobs run side by side."""
    # Placed so that all three fit at once (each node has 4 GPUs): the uninterrupted run on n2, the
    # srun run on n1, and the torchrun run (two nodes, one worker each: 2 ranks, as above) on two
    # GPUs of each node. Otherwise the torchrun job waits for both others to end.
    runs = {
        "straight": ("ddp_1node", {}, (*TWO_TASKS, "--nodelist=n2")),
        "srun": ("ddp_1node", {}, (*TWO_TASKS, "--nodelist=n1")),
        "torchrun": ("torchrun_per_node", {"COURSE_PROCS_PER_NODE": "1"}, ("--gpus-per-node=2",)),
    }
    jobs = {}
    for name, (script, settings, options) in runs.items():
        submitted = _sbatch(
            script,
            _job_env(tmp_path / name, COURSE_RUN_NAME="run", **LONGER, **settings),
            tmp_path / f"{name}.out",
            *options,
        )
        assert submitted.returncode == 0, submitted.stderr
        jobs[name] = submitted.stdout.strip().split(";")[0]
    signalled = set()
    deadline = time.monotonic() + 300
    while signalled != {"srun", "torchrun"}:
        for name in {"srun", "torchrun"} - signalled:
            if (tmp_path / name / "ckpt" / "run" / "step-00000006").is_dir():
                subprocess.run(["scancel", "--batch", "--signal=USR1", jobs[name]], check=True)
                signalled.add(name)
            else:
                assert time.monotonic() < deadline and _job_state(jobs[name]) in (
                    "PENDING",
                    "RUNNING",
                    "CONFIGURING",
                ), (tmp_path / f"{name}.out").read_text()
        time.sleep(0.2)
    states = {name: _wait(job_id, timeout=400) for name, job_id in jobs.items()}
    outputs = {name: (tmp_path / f"{name}.out").read_text() for name in jobs}
    for name in jobs:
        assert states[name] == "COMPLETED", outputs[name]
    expected_step, expected = latest_weights(tmp_path / "straight" / "ckpt" / "run")
    for name in ("srun", "torchrun"):
        output = outputs[name]
        assert "stop requested" in output and "stopped by SIGUSR1" in output, output
        assert f"requeueing job {jobs[name]}" in output and "restart 1" in output and "resumed from" in output
        step, weights = latest_weights(tmp_path / name / "ckpt" / "run")
        assert step == expected_step
        for key, tensor in expected.items():
            assert torch.equal(weights[key], tensor), f"{name}: {key}"  # bit for bit the uninterrupted run
    assert "closing signal SIGUSR1" in outputs["torchrun"]  # torchrun passed the signal to its worker


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
        "--shardings",
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
        ("single-1", 1, 1),  # the baseline of every speedup
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
    assert "speedup and efficiency against single-1 (one process, no wrapper)" in collected.stdout
    assert rows[0].startswith("run,sharding,world_size") and [r.split(",")[0] for r in rows[1:]] == [
        "single-1",
        "ddp-1",
        "ddp-2",
        "ddp-4",
    ]
    plotted = scaling("plot")
    assert plotted.returncode == 0, plotted.stderr
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_larger_than_the_cluster_is_rejected_at_submission(cluster, tmp_path):
    rejected = _sbatch("ddp_1node", _job_env(tmp_path), tmp_path / "%j.out", "--ntasks-per-node=8")  # 8 GPUs
    assert rejected.returncode != 0
    assert "Requested node configuration is not available" in rejected.stderr
    # nothing pending
    assert subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip() == ""
