"""The planner against the runs the course measured on one H200 (``plan check-gpu-runs``)."""

import csv
from pathlib import Path

import pytest

from course_lib.plan.specs import CLUSTERS
from course_lib.tools import plan as plan_tool
from course_lib.tools.evidence import gpu_runs

from conftest import call_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checked():
    return gpu_runs.check(gpu_runs.read_runs(), CLUSTERS["h200-node"])


def test_every_h200_run_that_ran_fits_and_its_peaks_and_speed_are_predicted(checked):
    """No run that ran is called too big; reserved within 10 % on at least 12 of 13 and throughput
    within 1.15x on at least 11 (the targets); allocated within 10 % on every run (where it is
    now, held so that a change can only keep it)."""
    result = gpu_runs.summary(checked)
    assert result["runs"] == result["ran"] == 13
    assert result["ran_but_called_too_big"] == []
    assert result["reserved_within_10pct"] >= 12
    assert result["throughput_within_1_15"] >= 11
    assert result["allocated_within_10pct"] == 13


def test_the_phase_that_sets_the_peak_is_the_loss_without_recomputation_and_the_gradients_with_it(checked):
    """Without recomputation the loss's backward (the activations all alive, the fp32 logit
    gradients on top) is the peak; with full recomputation at one sequence of the larger models the
    backward's end is (every gradient, the root's gathered parameters and reduction buffer)."""
    phases = {c.run.name: c.prediction.peak.phase for c in checked}
    assert phases["3b-fsdp-s8k-mb1"] == phases["1b-amp-s8k-mb2"] == "loss backward"
    assert phases["8b-fsdp-s8k-mb1-ac"] == phases["3b-fsdp-s8k-mb1-ac"] == "backward end"


def test_the_8b_at_8k_fits_only_by_the_allocator_releasing_its_cache(checked):
    """Reserved as the allocator would grow it is more than the card has; the allocated peak fits,
    and the allocator frees cached blocks rather than fail: it runs, and the planner says so."""
    run = next(c for c in checked if c.run.name == "8b-fsdp-s8k-mb1-ac")
    assert run.prediction.fits and "releases cached blocks" in run.prediction.note
    capacity = CLUSTERS["h200-node"].gpu_memory_bytes
    assert run.prediction.memory["total"] > capacity > run.prediction.peak.reserved


def test_the_command_prints_the_table_and_the_readme_states_its_counts(capsys):
    shown = call_main(plan_tool.main, ["check-gpu-runs"], capsys)
    assert shown.returncode == 0, shown.stderr
    assert "8b-fsdp-s8k-mb1-ac" in shown.stdout and "backward end" in shown.stdout
    result = gpu_runs.summary(gpu_runs.check(gpu_runs.read_runs(), CLUSTERS["h200-node"]))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        f"reserved within 10 % on {result['reserved_within_10pct']} of {result['runs']}, throughput within "
        f"1.15x on {result['throughput_within_1_15']}"
    ) in readme
    lecture = " ".join((ROOT / "slides" / "09-choosing-a-layout.md").read_text().split())
    assert (
        f"reserved within 10 % on {result['reserved_within_10pct']} of {result['runs']}, throughput within "
        f"1.15x on {result['throughput_within_1_15']} of {result['runs']}"
    ) in lecture
    eight = next(run for run in gpu_runs.read_runs() if run.name == "8b-fsdp-s8k-mb1-ac")
    capacity = CLUSTERS["h200-node"].gpu_memory_bytes / 2**30
    assert f"it ran at {eight.reserved_gib:.0f} GiB reserved of the card's {capacity:.0f}" in lecture


@pytest.mark.parametrize(
    "change, message",
    [
        ({"framework": "deepspeed"}, "line 2: framework 'deepspeed': choose one of"),
        ({"status": "crashed"}, "line 2: status 'crashed': choose one of ok, oom"),
        ({"tokens_per_s_per_gpu": "fast"}, "line 2: tokens_per_s_per_gpu must be a number"),
        ({"model": "configs/missing.json"}, "configs/missing.json"),
    ],
)
def test_a_bad_row_is_named_with_its_line(tmp_path, capsys, change, message):
    source = gpu_runs.RUNS_CSV
    rows = list(csv.DictReader(source.open()))
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerow(rows[0] | change)
    (tmp_path / "configs").mkdir()
    for config in (source.parent / "configs").iterdir():
        (tmp_path / "configs" / config.name).write_text(config.read_text())
    shown = call_main(plan_tool.main, ["check-gpu-runs", str(path)], capsys)
    assert shown.returncode == 2, shown.stdout
    assert message in shown.stderr and "Traceback" not in shown.stderr
