"""Lab 6's three training scripts as they were first written: each breaks, in its own way.

The scripts are the exercise's (``exercise.py``); the four small functions below are how they were
first written, and each of them breaks one script.

Run one on 2 local processes, with every rank keeping a flight record::

    .venv/bin/python labs/lab6_when_it_breaks/broken.py report      # or: classifier, epochs
    .venv/bin/python -m course_lib.tools.diagnose records/report

Then write the same function in ``exercise.py`` so that the script trains like one process, and
check: ``.venv/bin/python -m course_lib.tools.labs check lab6_when_it_breaks``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the data and helpers are the exercise's

import exercise  # noqa: E402
from exercise import THRESHOLD  # noqa: E402

from course_lib.distributed import comm, runtime
from course_lib.observe import flight_recorder  # noqa: E402


def report_high_loss(loss: torch.Tensor, step: int) -> None:
    if loss.item() > THRESHOLD:  # a high loss: print the mean over the ranks
        mean = loss.detach().clone()
        comm.all_reduce(mean, op="mean")
        runtime.print0(f"step {step}: mean loss {mean.item():.3f}")


def number_of_classes(labels: torch.Tensor) -> int:
    return int(labels.max()) + 1  # one output per class


def make_sampler(dataset: TensorDataset, rank: int, world_size: int) -> DistributedSampler:
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=rank)


def start_epoch(sampler: DistributedSampler, epoch: int) -> None:
    pass  # nothing to do before an epoch


def _with_these(function):
    """The exercise's script, with this file's versions of the four functions above."""

    def run(*args, **kwargs):
        for name in ("report_high_loss", "number_of_classes", "make_sampler", "start_epoch"):
            setattr(exercise, name, globals()[name])
        return function(*args, **kwargs)

    run.__name__ = function.__name__
    return run


SCRIPTS = {
    "report": _with_these(exercise.train_and_report),
    "classifier": _with_these(exercise.train_classifier),
    "epochs": _with_these(exercise.train_epochs),
}


def main(argv: list[str] | None = None) -> int:
    from course_lib.distributed.launch import launch

    parser = argparse.ArgumentParser(description="Run one of lab 6's broken scripts on 2 local processes.")
    parser.add_argument("script", choices=sorted(SCRIPTS))
    parser.add_argument("--records", default="records", help="the flight records go to RECORDS/SCRIPT")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    folder = Path(args.records) / args.script
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():  # one run's records per folder
        old.unlink()
    os.environ[flight_recorder.FOLDER_VARIABLE] = str(folder)
    try:
        launch(SCRIPTS[args.script], args.ranks, timeout_s=60, collective_timeout_s=10)
        print(f"{args.script}: every rank finished")
    except Exception as error:  # what the job's log would say
        print(
            f"{args.script} failed: {str(error).splitlines()[0][:300] if str(error) else type(error).__name__}"
        )
    print(f"the ranks' records: .venv/bin/python -m course_lib.tools.diagnose {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
