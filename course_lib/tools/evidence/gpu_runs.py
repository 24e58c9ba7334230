"""The planner held to training runs measured on one GPU: ``plan check-gpu-runs [FILE]``.

Each row of the file is one run: a model (a ``config.json`` beside the file), the stack that ran it
(``framework``, a profile of ``plan.frameworks``, and ``compiled``), its layout, and what it
measured: the median step's tokens per second, ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` in GiB, and whether it ran (``ok``) or ran out of memory (``oom``). Every
run is predicted with its own row's profile on the cluster given, and printed beside its
measurement: allocated and reserved, the phase the planner says sets the peak, throughput.

The committed file, ``slides/recorded/gpu/h200-runs.csv``, holds 13 runs of Llama-shaped models
(1.5B, 3.6B, 8B) on one H200: PyTorch's autocast recipe (profile ``fp32-master``) and FSDP2 on a
world of one (``torchtitan``), with and without full recomputation, one compiled. ``make
gpu-check`` writes more of them on any GPU.

The targets the tests hold (``summary``): no run that ran called too big; the reserved peak within
10 % on at least 12 of 13; throughput within 1.15x on at least 11 of 13.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ... import checks
from ...errors import UserError
from ...plan.cost_model import Prediction, predict
from ...plan.frameworks import FRAMEWORKS, Framework
from ...plan.from_files import cluster_named, model_named
from ...plan.kernels import GPU_RECORDS
from ...plan.layout import Layout
from ...plan.specs import GIB, ClusterSpec, ModelSpec

RUNS_CSV = GPU_RECORDS / "h200-runs.csv"
"""The runs measured on one H200 (``plan check-gpu-runs``' default)."""

GPU_RUN_COLUMNS = (
    "run", "model", "framework", "layout", "seq_len", "global_batch", "tokens_per_s_per_gpu",
    "peak_allocated_gib", "peak_reserved_gib", "status",
)  # fmt: skip
"""The columns a file of GPU runs must have (``compiled``, yes or no, is optional)."""

RESERVED_WITHIN = 0.10
THROUGHPUT_WITHIN = 1.15


@dataclass(frozen=True)
class GpuRun:
    """One measured run.

    Args:
        name: the run's name (``run``).
        model: its shapes.
        framework: the stack's profile that ran it (``compiled`` applied).
        layout: its layout.
        seq_len: tokens per sequence.
        global_batch: sequences per step.
        tokens_per_s: measured tokens per second per GPU (None: it ran out of memory).
        allocated_gib: ``max_memory_allocated`` in GiB (None: not measured).
        reserved_gib: ``max_memory_reserved`` in GiB (None: not measured).
        status: ``"ok"`` or ``"oom"``.
    """

    name: str
    model: ModelSpec
    framework: Framework
    layout: Layout
    seq_len: int
    global_batch: int
    tokens_per_s: float | None
    allocated_gib: float | None
    reserved_gib: float | None
    status: str


def _number(row: dict, key: str, number: int) -> float | None:
    if not row[key]:
        return None
    try:
        value = float(row[key])
    except ValueError as error:
        raise UserError(f"line {number}: {key} must be a number, got {row[key]!r}") from error
    return checks.check_number(f"line {number}: {key}", value, above=0)


def row_stack(row: dict, number: int, default: Framework | None = None) -> Framework:
    """The stack a CSV row names: its ``framework`` (where it has none, ``default``), compiled where
    its ``compiled`` says yes.

    Args:
        row: the row, by column.
        number: its line in the file (for the messages).
        default: the stack of a row without a ``framework`` (None: the row must name one).
    """
    framework = default
    if row.get("framework") or default is None:
        chosen = checks.check_choice(
            f"line {number}: framework", row.get("framework", ""), tuple(sorted(FRAMEWORKS))
        )
        framework = FRAMEWORKS[chosen]
    compiled = checks.check_choice(f"line {number}: compiled", row.get("compiled") or "no", ("yes", "no"))
    return framework.with_(compiled=True) if compiled == "yes" else framework


def row_shape(row: dict, number: int) -> tuple[int, int]:
    """A CSV row's ``seq_len`` and ``global_batch``, whole numbers (else the line is named)."""
    try:
        return int(row["seq_len"]), int(row["global_batch"])
    except ValueError as error:
        raise UserError(f"line {number}: seq_len and global_batch must be whole numbers ({error})") from error


def beside(name: str, folder: Path) -> str:
    """A model a CSV row names: the config at ``folder / name`` where there is one (a path from the
    CSV's folder), else ``name`` as it is (a built-in model, or a path from here)."""
    return str(folder / name) if (folder / name).is_file() else name


def read_runs(*, path: Path = RUNS_CSV) -> list[GpuRun]:
    """The runs of a CSV file (``GPU_RUN_COLUMNS``); a model's path is read from the file's folder.

    Args:
        path: the file.
    """
    path = Path(path)
    runs = []
    for number, row in checks.read_csv_rows(path, what="GPU runs", columns=GPU_RUN_COLUMNS):
        status = checks.check_choice(f"line {number}: status", row["status"], ("ok", "oom"))
        runs.append(
            GpuRun(
                row["run"] or f"line {number}",
                model_named(beside(row["model"], path.parent)),
                row_stack(row, number),
                Layout.from_name(row["layout"]),
                *row_shape(row, number),
                _number(row, "tokens_per_s_per_gpu", number) if status == "ok" else None,
                _number(row, "peak_allocated_gib", number),
                _number(row, "peak_reserved_gib", number),
                status,
            )
        )
    return runs


@dataclass
class Checked:
    """A run and the planner's prediction of it."""

    run: GpuRun
    prediction: Prediction

    @property
    def throughput_ratio(self) -> float | None:
        """Measured over predicted tokens per second (None: it did not run)."""
        if self.run.tokens_per_s is None:
            return None
        return self.run.tokens_per_s * self.run.layout.gpus / self.prediction.tokens_per_s

    def memory_ratio(self, which: str) -> float | None:
        """Predicted over measured ``"allocated"`` or ``"reserved"`` peak (None: not measured)."""
        measured = self.run.allocated_gib if which == "allocated" else self.run.reserved_gib
        if measured is None:
            return None
        return getattr(self.prediction.peak, which) / GIB / measured


def check(runs: list[GpuRun], cluster: ClusterSpec) -> list[Checked]:
    """Every run predicted with its own stack's profile on ``cluster``.

    Args:
        runs: ``read_runs``'.
        cluster: the machine they ran on.
    """
    checked = []
    for run in runs:
        prediction = predict(
            run.model, cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch,
            framework=run.framework,
        )  # fmt: skip
        if not prediction.time:
            raise UserError(f"{run.name}: {run.layout.name()} cannot be predicted ({prediction.problem})")
        checked.append(Checked(run, prediction))
    return checked


def summary(checked: list[Checked]) -> dict:
    """What the tests hold: counts of runs within each target, and the runs called too big."""
    ran = [c for c in checked if c.run.status == "ok"]
    reserved = [c.memory_ratio("reserved") for c in ran if c.memory_ratio("reserved") is not None]
    allocated = [c.memory_ratio("allocated") for c in ran if c.memory_ratio("allocated") is not None]
    speeds = [c.throughput_ratio for c in ran]
    return {
        "runs": len(checked),
        "ran": len(ran),
        "ran_but_called_too_big": [c.run.name for c in ran if not c.prediction.fits],
        "oom_called_fitting": [c.run.name for c in checked if c.run.status == "oom" and c.prediction.fits],
        "reserved_within_10pct": sum(abs(r - 1) <= RESERVED_WITHIN for r in reserved),
        "allocated_within_10pct": sum(abs(r - 1) <= RESERVED_WITHIN for r in allocated),
        "throughput_within_1_15": sum(1 / THROUGHPUT_WITHIN <= s <= THROUGHPUT_WITHIN for s in speeds),
        "median_throughput_ratio": sorted(speeds)[len(speeds) // 2] if speeds else math.nan,
    }


def table(checked: list[Checked]) -> str:
    """One line a run: allocated and reserved GiB measured/predicted, the peak's phase, tokens/s.

    Args:
        checked: ``check``'s rows.
    """
    lines = [
        f"{'run':<26} {'allocated GiB':>14} {'reserved GiB':>14}  {'peak at':<14} "
        f"{'tokens/s per GPU':>18} {'ratio':>6}"
    ]
    for c in checked:
        peak, run = c.prediction.peak, c.run

        def pair(measured, predicted) -> str:
            return (
                f"{measured:.1f}/{predicted / GIB:.1f}"
                if measured is not None
                else f"-/{predicted / GIB:.1f}"
            )

        speed = (
            f"{run.tokens_per_s:,.0f}/{c.prediction.tokens_per_s / run.layout.gpus:,.0f}"
            if run.tokens_per_s is not None
            else "out of memory"
        )
        ratio = f"{c.throughput_ratio:.2f}" if c.throughput_ratio is not None else ""
        verdict = f"  [{c.prediction.problem}]" if c.prediction.problem else ""
        lines.append(
            f"{run.name:<26} {pair(run.allocated_gib, peak.allocated):>14} "
            f"{pair(run.reserved_gib, peak.reserved):>14}  {peak.phase:<14} {speed:>18} {ratio:>6}{verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``plan check-gpu-runs [FILE] [--cluster NAME] [--json OUT]``."""
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.plan check-gpu-runs",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "file", nargs="?", type=checks.file_to_read, default=RUNS_CSV, help="a CSV of GPU runs"
    )
    parser.add_argument("--cluster", default="h200-node", help="the cluster whose GPU ran them")
    parser.add_argument("--json", type=checks.json_to_write, default=None, help="write the summary here")
    args = parser.parse_args(argv)
    try:
        checked = check(read_runs(path=args.file), cluster_named(args.cluster))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = summary(checked)
    print("measured/predicted\n" + table(checked))
    print(
        f"\n{result['ran']} of {result['runs']} ran; called too big: "
        f"{len(result['ran_but_called_too_big'])}; "
        f"reserved within 10 %: {result['reserved_within_10pct']}; throughput within 1.15x: "
        f"{result['throughput_within_1_15']}; median measured/predicted throughput "
        f"{result['median_throughput_ratio']:.2f}"
    )
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0
