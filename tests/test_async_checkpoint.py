"""Checkpoints written in the background (``--checkpoint-mode async``): the same checkpoints as a
blocking save, and a run killed while one is being written resumes from the one before, bit for bit."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from course_lib.distributed.launch import launch
from course_lib.train import async_checkpoint, checkpoint

from conftest import latest_weights

WORLD = 4  # FSDP2's reduce-scatters add the ranks' values in the same order after a resume
STEPS = dict(epochs=2, global_batch_size=64, checkpoint_every=8, progress=False, sharding="fsdp")


def _train(folder: str, mode: str, resume: str | None = None) -> None:
    from course_lib.train.config import TrainConfig
    from course_lib.train.loop import train

    train(TrainConfig(**STEPS, checkpoint_dir=folder, checkpoint_mode=mode, resume=resume))


def _killed_during_a_background_write(folder: str) -> None:
    """Train with asynchronous saves; the write of step 16's checkpoint never ends on any rank, and
    every rank is killed (SIGKILL) at step 20, while it is still in flight."""
    from torch.distributed.checkpoint import filesystem

    from course_lib.train import loop

    real_write, real_step = filesystem.FileSystemWriter.write_data, loop.Trainer._train_step

    def stuck(self, plan, planner):
        if "step-00000016" in str(self.path):
            threading.Event().wait()  # the disk never answers
        return real_write(self, plan, planner)

    def step(self, batches):
        if self.position.global_step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self, batches)

    filesystem.FileSystemWriter.write_data, loop.Trainer._train_step = stuck, step
    _train(folder, "async")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blocking")
    launch(_train, WORLD, str(folder), "blocking")
    return latest_weights(folder)


def test_asynchronous_saves_write_the_checkpoints_a_blocking_save_writes(tmp_path, uninterrupted):
    launch(_train, WORLD, str(tmp_path), "async")
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0] and not list(tmp_path.glob("*.tmp"))
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key


@pytest.mark.slow
def test_a_kill_during_the_background_write_resumes_from_the_previous_checkpoint_bit_for_bit(
    tmp_path, uninterrupted
):
    with pytest.raises(Exception, match="exited with code -9"):
        launch(_killed_during_a_background_write, WORLD, str(tmp_path))
    assert [path.name for path in checkpoint.checkpoint_dirs(tmp_path)] == ["step-00000008"]
    assert [path.name.split(".")[0] for path in tmp_path.glob("*.tmp")] == ["step-00000016"]  # never renamed
    # the training went on to step 20 while step 16's write hung: the save did not hold it
    launch(_train, WORLD, str(tmp_path), "async", "latest")
    name, weights = latest_weights(tmp_path)
    assert name == uninterrupted[0]
    for key, tensor in uninterrupted[1].items():
        assert torch.equal(weights[key], tensor), key  # resumed from step 8: the same run


@pytest.mark.timing
def test_the_checkpoint_benchmark_times_both_kinds_of_save_beside_the_steps():
    from conftest import run_bench

    result = run_bench(*"checkpoint --width 128 --layers 2 --batch 8 --steps 2 --saves 2".split())
    assert result["parameters"] == 2 * 128 * 129 and result["checkpoint_bytes"] == 12 * result["parameters"]
    for key in ("step_ms", "blocking_pause_s", "async_pause_s", "async_write_s", "step_during_write_ms"):
        assert result[key] > 0, key
    assert result["async_write_s"] >= result["async_pause_s"]  # the write ends after the copy that starts it
    assert result["pause_saved"] == pytest.approx(1 - result["async_pause_s"] / result["blocking_pause_s"])


def _save_then_change_everything(folder: str, fail: bool) -> str:
    """Start a background save, then change the weights, the history and the sums at once; or make
    the writer meet a full disk."""
    import errno

    from torch.distributed.checkpoint import filesystem

    from course_lib.errors import UserError

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    position = checkpoint.TrainingPosition(
        epoch=1, step_in_epoch=5, global_step=21, config={"epochs": 2},
        history=[{"epoch": 0, "loss": 2.0}], run_id="run-a", epoch_sums={"loss": 1.5},
    )  # fmt: skip
    if fail:

        def full(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device")

        filesystem.FileSystemWriter.write_data = full
    saves = async_checkpoint.AsyncSaves()
    path = saves.start(folder, model, optimizer, position)
    with torch.no_grad():
        model.weight.add_(1.0)
    position.history.append({"epoch": 1, "loss": 1.0})  # what the run does after the save returned
    position.epoch_sums["loss"] = 99.0
    position.config["epochs"] = 7
    try:
        saves.finish()
    except UserError as error:
        return f"refused: {error}"
    return str(path)


def test_a_background_save_keeps_the_state_of_the_moment_it_was_called(tmp_path):
    path = launch(_save_then_change_everything, 2, str(tmp_path), False)[0]
    meta = checkpoint.read_meta(path)
    assert meta["history"] == [{"epoch": 0, "loss": 2.0}]  # epoch 1 was not finished at step 21
    assert meta["epoch_sums"] == {"loss": 1.5} and meta["config"] == {"epochs": 2}
    torch.manual_seed(0)
    assert torch.equal(latest_weights(tmp_path)[1]["weight"], torch.nn.Linear(5, 3).weight.detach())


def test_a_background_write_that_fails_is_one_line_on_every_rank_and_leaves_no_temporary_folder(tmp_path):
    for outcome in launch(_save_then_change_everything, 2, str(tmp_path), True):
        assert outcome.startswith("refused: could not write checkpoint step-00000021"), outcome
        assert "No space left on device" in outcome and "no checkpoint was kept" in outcome
    assert list(tmp_path.iterdir()) == []
