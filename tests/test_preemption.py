"""Stop signals end training at a step boundary with a checkpoint; torchrun restarts resume from it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_lib.errors import EXIT_CRASH, EXIT_DIVERGED, EXIT_REQUEUE, EXIT_USER_ERROR
from course_lib.observe import faults
from course_lib.tools.torchrun import verdict

from conftest import REPO, children, clean_env, communicate_or_explain, descendants, latest_weights

pytestmark = pytest.mark.slow  # runs trained, stopped by a signal and resumed: seconds each

TRAINING = [
    "-m",
    "course_lib.train",
    "--sharding",
    "ddp",
    "--dataset",
    "digits",
    "--model",
    "digits_cnn",
    "--epochs",
    "2",
    "--global-batch-size",
    "64",
    "--checkpoint-every",
    "6",
    "--max-steps",  # past the first epoch's 22 steps: a resumed run crosses an epoch's end
    "30",
    "--resume",
    "latest",
    "--no-progress",
]
FIRST_CHECKPOINT = "step-00000006"
PACED = {faults.VARIABLE: "slow:1:0.1"}
"""Rank 1 sleeps 0.1 s before each collective (DDP's bucket all-reduces pace every rank): the run
lasts seconds after its first checkpoint, time to signal it mid-run, at a fraction of the cores
a CIFAR-sized model would take."""
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]


def _wait_for(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _start(checkpoint_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*TORCHRUN, *extra, *TRAINING, "--checkpoint-dir", str(checkpoint_dir)],
        cwd=REPO,
        env=clean_env(**PACED),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("straight")
    process = _start(directory)
    output = communicate_or_explain(process, 300)
    assert process.returncode == 0, output
    return latest_weights(directory)


@pytest.mark.slow
def test_a_stop_signal_checkpoints_exits_3_and_the_rerun_ends_identical(tmp_path, uninterrupted):
    process = _start(tmp_path)
    _wait_for(lambda: (tmp_path / FIRST_CHECKPOINT).is_dir(), what="the first checkpoint")
    workers = children(process.pid)
    for worker in workers:  # as `scancel --signal=USR1` does: every training process hears it
        os.kill(worker, signal.SIGUSR1)
    output = communicate_or_explain(process, 120)
    assert "stopped by SIGUSR1 after step" in output and "rerun with --resume latest" in output
    # "requeue me"
    assert process.returncode != 0 and re.search(rf"exitcode\s*:\s*{EXIT_REQUEUE}\b", output), output
    stopped_at, _ = latest_weights(tmp_path)
    assert stopped_at not in (FIRST_CHECKPOINT, uninterrupted[0])  # a checkpoint of the step it stopped at

    rerun = _start(tmp_path)
    output = communicate_or_explain(rerun, 300)
    assert rerun.returncode == 0, output
    assert "resumed from" in output
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0]
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key  # bit for bit


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path, uninterrupted):
    process = _start(tmp_path, "--max-restarts", "1")
    _wait_for(lambda: (tmp_path / FIRST_CHECKPOINT).is_dir(), what="the first checkpoint")
    os.kill(children(process.pid)[-1], signal.SIGKILL)  # one rank dies without warning
    output = communicate_or_explain(process, 300)
    assert process.returncode == 0, output
    assert output.count("resumed from") >= 1, output  # the restarted workers picked up the checkpoint
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0]
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key


# -- SIGTERM to every process of a run, data loaders included (scancel, preemption, time limit) ------
COURSE_TORCHRUN = [sys.executable, "-m", "course_lib.tools.torchrun", "--standalone", "--nproc-per-node", "2"]
LOADERS = ["--workers", "2"]


def _terminate_everything(process: subprocess.Popen) -> None:
    """SIGTERM to the launcher and every process under it, as Slurm does to a job's processes."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_sigterm_to_a_single_process_and_its_data_loaders_stops_cleanly(tmp_path):
    # one process makes no collective, so nothing paces it: ten epochs keep it running seconds past
    # its first checkpoint (it is stopped long before their end)
    longer = ["--epochs", "10", "--max-steps", "220"]
    command = [
        sys.executable,
        *TRAINING,
        *longer,
        "--sharding",
        "single",
        *LOADERS,
        "--checkpoint-dir",
        str(tmp_path),
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    _wait_for(lambda: (tmp_path / FIRST_CHECKPOINT).is_dir(), what="the first checkpoint")
    assert len(descendants(process.pid)) >= 2  # the loaders are running
    _terminate_everything(process)
    output = communicate_or_explain(process, 120)
    assert process.returncode == EXIT_REQUEUE, output
    assert "stopped by SIGTERM after step" in output and "Traceback" not in output, output
    stopped_at, _ = latest_weights(tmp_path)
    assert stopped_at != FIRST_CHECKPOINT  # the step it stopped at was checkpointed


@pytest.mark.slow
def test_sigterm_to_every_process_under_torchrun_stops_cleanly_with_status_3(tmp_path, uninterrupted):
    process = subprocess.Popen(
        [*COURSE_TORCHRUN, *TRAINING, *LOADERS, "--checkpoint-dir", str(tmp_path)],
        cwd=REPO,
        env=clean_env(**PACED),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for(lambda: (tmp_path / FIRST_CHECKPOINT).is_dir(), what="the first checkpoint")
    _terminate_everything(process)
    output = communicate_or_explain(process, 120)
    assert process.returncode == EXIT_REQUEUE, output
    assert "Traceback" not in output, output
    assert output.count("torchrun: stopped by SIGTERM: every rank stopped at the same step") == 1, output
    rerun = subprocess.Popen(
        [*COURSE_TORCHRUN, *TRAINING, *LOADERS, "--checkpoint-dir", str(tmp_path)],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = communicate_or_explain(rerun, 300)
    assert rerun.returncode == 0, output
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0]
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key  # bit for bit, data loaders or not


def test_the_torchrun_wrapper_passes_on_a_refused_flag_as_status_2_in_one_line():
    shown = subprocess.run(
        [*COURSE_TORCHRUN, *TRAINING, "--lr", "nan"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == EXIT_USER_ERROR, shown.stderr
    assert shown.stderr.count("--lr must be a finite number") == 1 and "Traceback" not in shown.stderr


VERDICTS = [
    ({0: 0, 1: 0}, 2, 0, None),
    ({0: 3, 1: 3}, 2, EXIT_REQUEUE, "every rank stopped at the same step and wrote its checkpoint"),
    ({0: 2, 1: 1}, 2, EXIT_USER_ERROR, None),  # the rank that refused its input said why
    ({1: 2}, 2, EXIT_USER_ERROR, None),  # rank 0 said why, and torchrun stopped it before it reported
    ({0: 4}, 2, EXIT_DIVERGED, None),
    ({0: 4, 1: 4}, 2, EXIT_DIVERGED, None),
    ({0: 3, 1: 1}, 2, EXIT_CRASH, "rank 1 exited with status 1"),
    ({0: 3}, 2, EXIT_CRASH, "1 of the 2 ranks started here ended without reporting their status"),
]


@pytest.mark.parametrize("statuses, workers, status, line", VERDICTS)
def test_the_run_exits_with_the_status_that_describes_it(statuses, workers, status, line):
    got_status, got_line = verdict(statuses, workers)
    assert got_status == status
    assert (got_line is None) if line is None else (line in got_line)


def test_a_run_that_hangs_fails_saying_where_each_of_its_processes_waits():
    """What these tests print when a run never ends: every process of its tree and its stacks."""
    child = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    waiting = f"import subprocess, sys, time; {child}; time.sleep(60)"
    process = subprocess.Popen(
        [sys.executable, "-c", waiting], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    time.sleep(1)
    with pytest.raises(AssertionError, match="where each process waits") as failed:
        communicate_or_explain(process, 1)
    assert str(failed.value).count("--- process ") == 2 and "sleep" in str(failed.value), failed.value
    assert process.returncode == -signal.SIGKILL
