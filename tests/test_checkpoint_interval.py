"""How often to checkpoint: Young's and Daly's intervals, the table by job size, and
``--checkpoint-every auto`` saving at the interval it measured."""

from __future__ import annotations

import math
import re

import pytest

from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.train import checkpoint_interval as ci


def test_the_interval_minimises_what_saving_and_failures_lose():
    save, mtbf = 30.0, 3 * 3600.0
    young = ci.young_interval_s(save, mtbf)
    assert young == pytest.approx(math.sqrt(2 * save * mtbf))
    # the first-order loss is smallest there: a little shorter or longer loses more
    assert ci.lost_share(young, save, mtbf) < min(ci.lost_share(young * f, save, mtbf) for f in (0.8, 1.25))
    daly = ci.daly_interval_s(save, mtbf)
    assert abs(daly - young) < save  # the higher-order terms move it by less than one save here
    assert ci.daly_interval_s(10.0, 4.0) == 4.0  # a save longer than 2 MTBFs: save every MTBF


def test_the_table_by_job_size_at_llama_3s_failure_rate():
    """The module's numbers: about 50,700 GPU-hours between failures; 16,384 GPUs fail every 3.1
    hours, 8 about every 9 months; a 30 s save at 16,384 GPUs, every 13 minutes or so."""
    assert ci.PER_GPU_MTBF_HOURS == pytest.approx(50_680, rel=1e-3)
    rows = ci.interval_table(30.0, [8, 64, 1024, 16_384])
    assert [row["gpus"] for row in rows] == [8, 64, 1024, 16_384]
    assert rows[-1]["mtbf_hours"] == pytest.approx(3.09, abs=0.01)
    assert rows[0]["mtbf_hours"] / 24 / 30.4 == pytest.approx(8.7, abs=0.1)  # months
    assert rows[-1]["interval_minutes"] == pytest.approx(13.3, abs=0.1)
    minutes = [row["interval_minutes"] for row in rows]
    assert minutes == sorted(minutes, reverse=True)  # larger jobs save more often
    assert all(0 < row["lost_share"] < 0.1 for row in rows)
    # each failure's restart adds R / M, whatever the interval
    for row in rows:
        restarts = ci.RESTART_S / (3600 * row["mtbf_hours"])
        assert row["lost_with_restarts"] == pytest.approx(row["lost_share"] + restarts)
    with pytest.raises(UserError, match="restart_s must be a finite number of seconds, 0 or more"):
        ci.lost_share(60.0, 1.0, 100.0, restart_s=-5)


@pytest.mark.parametrize(
    "save, mtbf, message",
    [
        (-1.0, 10.0, "save time of 0 s or more"),
        (1.0, 0.0, "an MTBF above 0 s"),
        (float("nan"), 1.0, "finite"),
    ],
)
def test_impossible_times_are_refused_in_one_line(save, mtbf, message):
    with pytest.raises(UserError, match=message):
        ci.daly_interval_s(save, mtbf)


def _auto_run(folder: str) -> str:
    import contextlib
    import io

    from course_lib.train.config import TrainConfig
    from course_lib.train.loop import train

    config = TrainConfig(
        epochs=2, checkpoint_dir=folder, checkpoint_every="auto", mtbf_hours=2e-5, progress=False
    )
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        train(config)
    return shown.getvalue()


def test_checkpoint_every_auto_measures_a_save_then_saves_at_the_interval(tmp_path):
    from course_lib.train import checkpoint
    from course_lib.train.config import AUTO_FIRST_SAVE_STEP, TrainConfig
    from course_lib.train.config import steps_per_epoch as config_steps_per_epoch

    shown = launch(_auto_run, 1, str(tmp_path))[0]
    said = re.search(
        r"checkpoint interval: every (\d+) steps \(Daly: .* save of ([\d.e-]+) s .* at ([\d.e-]+) s a step\)",
        shown,
    )
    assert said, shown
    every = int(said[1])
    # from the three digits printed: within one step of the interval the run computed
    assert abs(every - ci.steps_between_saves(float(said[2]), 2e-5, float(said[3]))) <= 1
    steps_per_epoch = config_steps_per_epoch(TrainConfig(epochs=2))
    saves = {AUTO_FIRST_SAVE_STEP + k * every for k in range(100)} | {steps_per_epoch, 2 * steps_per_epoch}
    kept = [checkpoint.step_of(path) for path in checkpoint.checkpoint_dirs(tmp_path)]
    expected = sorted(step for step in saves if step <= 2 * steps_per_epoch)[-checkpoint.KEEP_LAST :]
    assert sorted(kept) == expected, (kept, shown)
