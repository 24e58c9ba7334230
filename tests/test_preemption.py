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

from course_lib.errors import EXIT_REQUEUE

from conftest import REPO, clean_env, latest_weights

TRAINING = [
    "-m",
    "course_lib.train",
    "--strategy",
    "ddp",
    "--dataset",
    "synthetic",
    "--model",
    "cifar_cnn",
    "--epochs",
    "2",
    "--global-batch-size",
    "64",
    "--checkpoint-every",
    "8",
    "--resume",
    "latest",
    "--no-progress",
]
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found += [int(child) for child in children]
    return found


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
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("straight")
    process = _start(directory)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return latest_weights(directory)


@pytest.mark.slow
def test_a_stop_signal_checkpoints_exits_3_and_the_rerun_ends_identical(tmp_path, uninterrupted):
    process = _start(tmp_path)
    _wait_for(lambda: (tmp_path / "step-00000008").is_dir(), what="the first checkpoint")
    workers = _children(process.pid)
    for worker in workers:  # as `scancel --signal=USR1` does: every training process hears it
        os.kill(worker, signal.SIGUSR1)
    output, _ = process.communicate(timeout=120)
    assert "stopped by SIGUSR1 after step" in output and "rerun with --resume latest" in output
    # "requeue me"
    assert process.returncode != 0 and re.search(rf"exitcode\s*:\s*{EXIT_REQUEUE}\b", output), output
    stopped_at, _ = latest_weights(tmp_path)
    assert stopped_at not in ("step-00000008", uninterrupted[0])  # a checkpoint of the step it stopped at

    rerun = _start(tmp_path)
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    assert "resumed from" in output
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0]
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key  # bit for bit


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path, uninterrupted):
    process = _start(tmp_path, "--max-restarts", "1")
    _wait_for(lambda: (tmp_path / "step-00000008").is_dir(), what="the first checkpoint")
    os.kill(_children(process.pid)[-1], signal.SIGKILL)  # one rank dies without warning
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    assert output.count("resumed from") >= 1, output  # the restarted workers picked up the checkpoint
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0]
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key
