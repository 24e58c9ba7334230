"""Strong scaling: the same job, the same global batch, more processes. How much faster?

Strong scaling keeps the total work fixed (same model, same global batch, same number of steps)
and adds processes. Ideally N processes take 1/N of the time: a *speedup* T(1)/T(N) equal to N,
a *parallel efficiency* speedup/N of 100%. In practice every step also pays for communication
(DDP's gradient all-reduce, FSDP's all-gathers and reduce-scatters) and for the part of the work
that does not split, so the curve bends away from the ideal line; where it bends tells you
how much compute each byte of communication has to hide behind.

Because ``DistributedSampler`` splits each global batch exactly (see ``data``), the runs at
different N train the *same* model: the accuracy column must not change with N, and if it
does, something is wrong with the distribution, not with the hardware.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file (one per epoch)."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def time_per_epoch(records: list[dict[str, Any]]) -> float:
    """Median epoch time, leaving out the first epoch when there are others (it pays for warm-up)."""
    times = [record["epoch_time_s"] for record in records]
    return statistics.median(times[1:] if len(times) > 1 else times)


def summarize(label: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of a scaling table from one run's metrics."""
    last = records[-1]
    seconds = time_per_epoch(records)
    return {
        "run": label,
        "strategy": last["strategy"],
        "impl": last["impl"],
        "world_size": last["world_size"],
        "global_batch_size": last["global_batch_size"],
        "epochs": len(records),
        "time_per_epoch_s": seconds,
        "samples_per_s": statistics.median(record["samples_per_s"] for record in records[1:] or records),
        "val_acc": last["val_acc"],
        "val_loss": last["val_loss"],
        "peak_mem_mb": max(record["peak_mem_mb"] for record in records),
    }


def add_speedup(rows: list[dict[str, Any]], baseline_seconds: float) -> list[dict[str, Any]]:
    for row in rows:
        row["speedup"] = baseline_seconds / row["time_per_epoch_s"]
        row["efficiency"] = row["speedup"] / row["world_size"]
    return rows


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    """A fixed-width text table a student can read in a terminal."""
    header = f"{'run':<8} {'ranks':>5} {'s/epoch':>9} {'samples/s':>10} {'speedup':>8} {'efficiency':>10} {'val acc':>8}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['run']:<8} {row['world_size']:>5} {row['time_per_epoch_s']:>9.3f} {row['samples_per_s']:>10.0f} "
            f"{row['speedup']:>8.2f} {row['efficiency']:>10.0%} {row['val_acc']:>8.2%}"
        )
    return "\n".join(lines)


def plot_strong_scaling(rows: list[dict[str, Any]], path: str | Path, title: str = "Strong scaling") -> Path:
    """Time per epoch and speedup against processes, one line per strategy, with the ideal lines.

    ``rows`` need ``strategy``, ``world_size``, ``time_per_epoch_s``; the single-process row (if
    any) is the starting point of every strategy's line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = [row for row in rows if row["world_size"] == 1 and row["strategy"] == "single"]
    strategies = sorted({row["strategy"] for row in rows if row["strategy"] != "single"})
    figure, (ax_time, ax_speedup) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    largest = max(row["world_size"] for row in rows)
    reference = baseline[0]["time_per_epoch_s"] if baseline else None
    for strategy in strategies or ["single"]:
        points = baseline + [row for row in rows if row["strategy"] == strategy and row not in baseline]
        points.sort(key=lambda row: row["world_size"])
        ranks = [row["world_size"] for row in points]
        seconds = [row["time_per_epoch_s"] for row in points]
        start = reference or seconds[0] * ranks[0]
        ax_time.plot(ranks, seconds, "o-", label=strategy.upper())
        ax_speedup.plot(ranks, [start / s for s in seconds], "o-", label=strategy.upper())
    ideal_ranks = list(range(1, largest + 1))
    if reference:
        ax_time.plot(ideal_ranks, [reference / n for n in ideal_ranks], "k--", lw=1, label="ideal (1/N)")
    ax_speedup.plot(ideal_ranks, ideal_ranks, "k--", lw=1, label="ideal (N)")
    for axis in (ax_time, ax_speedup):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ideal_ranks if largest <= 8 else [2**k for k in range(largest.bit_length())])
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_xlabel("processes")
        axis.grid(True, alpha=0.3)
        axis.legend()
    ax_time.set_yscale("log")
    ax_time.set_ylabel("time per epoch (s)")
    ax_time.set_title("time per epoch")
    ax_speedup.set_ylabel("speedup over 1 process")
    ax_speedup.set_title("speedup")
    figure.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
