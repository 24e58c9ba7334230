"""Faults on purpose in the training command (2 ranks of DDP): each stops every rank, within the
timeout, with one line that names the rank and the cause."""

from __future__ import annotations

import pytest

from course_lib.observe import faults

from conftest import run_ranks

pytestmark = pytest.mark.slow  # each fault stops a real multi-process run: seconds each

BASE = ["--epochs", "2", "--max-steps", "30", "--no-progress", "--sharding", "ddp", "--timeout", "20"]

CASES = [
    # (fault, extra flags, exit status, what rank 0's error line says)
    ("nan:1:2", [], 4, "training diverged at step 3 (epoch 1): the loss is nan, first on rank 1"),
    (
        "corrupt:1:1",
        ["--check-replicas", "1"],
        2,
        "the replicas differ after step 2: parameter '0.0.weight' has 2 values (rank 0 and rank 1 each",
    ),
    ("seed:1:7", [], 2, "the ranks' samplers have different seeds (rank 0: 0, rank 1: 7)"),
    ("no-set-epoch:1:1", [], 2, "the ranks' samplers are at different epochs (rank 0: 1, rank 1: 0)"),
    ("no-set-epoch:all:1", [], 2, "epoch 1 draws its samples in epoch 0's order on every rank"),
]


@pytest.mark.parametrize("fault, flags, status, line", CASES, ids=[case[0] for case in CASES])
def test_a_fault_in_training_stops_every_rank_with_one_line_naming_it(fault, flags, status, line):
    outcomes = run_ranks([*BASE, *flags], nprocs=2, env={faults.VARIABLE: fault}, timeout=120)
    assert [o.returncode for o in outcomes] == [status, status], outcomes[0].stderr + outcomes[1].stderr
    errors = [text for text in outcomes[0].stderr.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], outcomes[0].stderr


def test_the_diagnosis_compares_the_replicas_the_ranks_ended_with(tmp_path):
    """No check during the run: the ranks' records at the end hold their weights' fingerprints."""
    from conftest import run_tool

    records = tmp_path / "records"
    argv = [*BASE, "--max-steps", "4", "--flight-recorder", str(records)]
    outcomes = run_ranks(argv, nprocs=2, env={faults.VARIABLE: "corrupt:1:1"}, timeout=120)
    assert [o.returncode for o in outcomes] == [0, 0], outcomes[0].stderr
    shown = run_tool("diagnose", str(records))
    assert shown.returncode == 1, shown.stdout
    assert shown.stdout.startswith("the replicas differ at the end: parameter '0.0.weight' has 2 values"), (
        shown.stdout
    )


def test_a_fault_stopping_the_trainer_is_named_in_its_record(tmp_path):
    from conftest import run_tool

    records = tmp_path / "records"
    outcomes = run_ranks(
        [*BASE, "--flight-recorder", str(records)], nprocs=2, env={faults.VARIABLE: "seed:1:7"}
    )
    assert [o.returncode for o in outcomes] == [2, 2], outcomes[0].stderr + "\n=====\n" + outcomes[1].stderr
    shown = run_tool("diagnose", str(records))
    first = shown.stdout.splitlines()[0]
    assert shown.returncode == 1 and first.startswith(
        "no collective went wrong; ranks 0, 1 stopped by an error"
    ), first
    assert "the ranks' samplers have different seeds (rank 0: 0, rank 1: 7)" in first
