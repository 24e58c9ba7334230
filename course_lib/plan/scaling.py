"""Strong scaling: the same job, the same global batch, more processes. How much faster?

Strong scaling keeps the total work fixed (same model, same global batch, same number of steps)
and adds processes. Ideally N processes take 1/N of the time: a *speedup* T(1)/T(N) equal to N,
a *parallel efficiency* speedup/N of 100%. In practice every step also pays for communication
(DDP's gradient all-reduce, FSDP's all-gathers and reduce-scatters) and for the part of the work
that does not split, so the curve bends away from the ideal line; where it bends tells you
how much compute each byte of communication has to hide behind.

Because ``DistributedSampler`` splits each global batch exactly (see ``data``), the runs at
different N train the *same* model. On one CPU, where every sum runs in the same order, the
accuracy column is then the same at every N, to the last digit; on GPUs it may move by
floating-point noise (NCCL's reductions and cuDNN's kernels add in another order, TF32 rounds),
but never by more than two runs with different seeds differ: that run-to-run noise is the bar,
and notebook 05 measures it. A change larger than it means something is wrong with the
distribution, not with the hardware.

This file turns a run's metrics (the JSON lines ``course_lib.train --metrics`` writes) into the
rows of a scaling table, and models the time as T(N) = T_compute/N + T_comm(N) + T_fixed, with
T_comm from the alpha-beta model of a ring all-reduce (Thakur, Rabenseifner and Gropp,
"Optimization of collective communication operations in MPICH", 2005). Amdahl's law (Amdahl,
1967) is kept for what it describes, a serial fraction that does not depend on N, and the
Karp-Flatt metric (1990) tells the two apart from measured speedups. Running a whole study on
Slurm or locally is a tool: ``python -m course_lib.tools.study`` (``course_lib/tools/study.py``),
and its pictures are drawn by ``course_lib.tools.plots``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..observe.anatomy import PARTS


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The epoch records of a JSON-lines metrics file (events such as a divergence are left out).

    A last line cut short (the run was killed while writing it, by a course before this one
    wrote lines whole) is left out; a broken line anywhere else means the file is not a metrics
    file, and is refused in one line.

    Args:
        path: the file ``--metrics`` named.
    """
    lines = Path(path).read_text(errors="replace").splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break  # cut short: the epochs before it are whole
            raise UserError(
                f"{path}, line {number}, is not a JSON record: is it a metrics file (--metrics) of a run?"
            ) from None
    return [record for record in records if isinstance(record, dict) and "event" not in record]


def time_per_epoch(records: list[dict[str, Any]]) -> float:
    """Median epoch time, leaving out the first epoch when there are others (it pays for warm-up).

    Args:
        records: one run's epoch records (``read_metrics``).
    """
    times = [record["epoch_time_s"] for record in records]
    return statistics.median(times[1:] if len(times) > 1 else times)


def summarize(label: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of a scaling table from one run's metrics.

    Args:
        label: the run's name in the table.
        records: its epoch records (``read_metrics``).
    """
    last = records[-1]
    seconds = time_per_epoch(records)
    return {
        "run": label,
        "sharding": last["sharding"],
        "impl": last["impl"],
        "world_size": last["world_size"],
        "global_batch_size": last["global_batch_size"],
        "epochs": len(records),
        "time_per_epoch_s": seconds,
        "samples_per_s": statistics.median(record["samples_per_s"] for record in records[1:] or records),
        "val_acc": last["val_acc"],
        "val_loss": last["val_loss"],
        "peak_mem_mb": max(record["peak_mem_mb"] for record in records),
        # parameters, gradients and optimizer state on the largest rank (NaN in older metrics)
        "model_state_mb": max(record.get("model_state_mb", float("nan")) for record in records),
    }


def add_speedup(
    rows: list[dict[str, Any]], baseline_seconds: float, *, baseline: str | None = None
) -> list[dict[str, Any]]:
    """Add ``speedup`` (baseline time / this time) and ``efficiency`` (speedup / ranks) to each row.

    A speedup means nothing without its baseline: strong scaling divides by the best serial run
    (one process, no wrapper), and the table says which run that was.

    Args:
        rows: table rows (``summarize``), changed in place and returned.
        baseline_seconds: the time per epoch of the reference run (usually one process).
        baseline: the reference run's name, kept in each row as ``baseline`` (None: not named).
    """
    for row in rows:
        row["speedup"] = baseline_seconds / row["time_per_epoch_s"]
        row["efficiency"] = row["speedup"] / row["world_size"]
        if baseline is not None:
            row["baseline"] = baseline
    return rows


def amdahl_speedup(processes: float, serial_fraction: float) -> float:
    """Amdahl's law: the speedup on N processes when a fraction s of the work cannot be split.

    Args:
        processes: N.
        serial_fraction: s, between 0 and 1.
    """
    return 1 / (serial_fraction + (1 - serial_fraction) / processes)


def karp_flatt(speedup: float, processes: int) -> float:
    """The serial fraction a measured speedup implies (Karp and Flatt, CACM 1990).

    e = (1/S - 1/N) / (1 - 1/N). Amdahl's serial fraction would give the same e at every N; an e
    that changes with N says the loss is overhead that depends on N, not a fixed serial part.
    Communication does: it is zero at N = 1, so a cost that appears with the second process
    weighs most at N = 2 and e falls after it, while latency (2(N - 1) alpha) and slower links
    beyond a node make e grow. Above 1 (a speedup below 1), the overhead outweighs the whole
    compute saved.

    Args:
        speedup: S, the measured T(1) / T(N).
        processes: N, at least 2.
    """
    if processes < 2:
        raise ValueError(f"the Karp-Flatt metric needs at least 2 processes, got {processes}")
    return (1 / speedup - 1 / processes) / (1 - 1 / processes)


def ring_all_reduce_seconds(
    processes: int, *, message_bytes: float, latency_s: float, bandwidth_bytes_per_s: float
) -> float:
    """The alpha-beta model of a ring all-reduce: 2(N - 1) messages of 1/N of the tensor each.

    T = 2 (N - 1) (alpha + bytes / (N beta)): the latency term grows with N, the bandwidth term
    approaches 2 bytes / beta. Zero on one process, where there is nothing to reduce.

    Args:
        processes: N.
        message_bytes: the bytes all-reduced (a step's gradients).
        latency_s: alpha, the fixed cost of one message.
        bandwidth_bytes_per_s: beta, bytes per second one link carries.
    """
    return 2 * (processes - 1) * (latency_s + message_bytes / processes / bandwidth_bytes_per_s)


def _least_squares_line(
    xs: list[float], ys: list[float], *, weights: list[float] | None = None
) -> tuple[float, float]:
    """(slope, intercept) of the straight line through the points with the least (weighted) squared error."""
    weights = weights or [1.0] * len(xs)
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys)) / total
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys)) / sum(
        w * (x - mean_x) ** 2 for w, x in zip(weights, xs)
    )
    return slope, mean_y - slope * mean_x


def fit_ring_all_reduce(
    processes: int, *, message_bytes: list[float], seconds: list[float]
) -> tuple[float, float]:
    """Fit ``ring_all_reduce_seconds`` to measured all-reduce times: return (alpha, beta).

    The model is linear in the message size, T = 2(N - 1) alpha + 2(N - 1)/N x bytes / beta, so a
    straight line through (bytes, seconds) gives both: its intercept is the latency of 2(N - 1)
    messages, its slope the time per byte. The fit weighs each point by 1/T^2 (it minimises the
    *relative* error): the times span orders of magnitude, and an ordinary fit would let the
    largest messages decide the intercept too.

    Args:
        processes: N, at least 2.
        message_bytes: the bytes all-reduced at each point (at least two different sizes).
        seconds: the measured time of each.
    """
    if processes < 2:
        raise ValueError(f"fitting an all-reduce needs at least 2 processes, got {processes}")
    if len(message_bytes) != len(seconds) or len(set(message_bytes)) < 2:
        raise ValueError("fitting needs one time per size and at least two different sizes")
    if min(seconds) <= 0:
        raise ValueError("every measured time must be positive")
    slope, intercept = _least_squares_line(message_bytes, seconds, weights=[1 / t**2 for t in seconds])
    steps = 2 * (processes - 1)
    latency = max(intercept, 0.0) / steps  # noise can push a tiny intercept below zero
    bandwidth = steps / processes / slope if slope > 0 else float("inf")
    return latency, bandwidth


LATENCY_REGIME_MAX_BYTES = 8 * 1024
"""Messages up to this size are timed for alpha: their bandwidth term is a few percent of a millisecond."""
BANDWIDTH_REGIME_MIN_BYTES = 512 * 1024
"""Messages from this size are timed for beta: their latency term is small beside their bytes."""


def fit_ring_all_reduce_by_regime(
    processes: int,
    *,
    message_bytes: list[float],
    seconds: list[float],
    latency_max_bytes: float = LATENCY_REGIME_MAX_BYTES,
    bandwidth_min_bytes: float = BANDWIDTH_REGIME_MIN_BYTES,
) -> tuple[float, float]:
    """Alpha from the small messages alone, beta from the large ones alone: (alpha, beta).

    One straight line through every size assumes one transport with one latency and one
    bandwidth; a real one changes regime (gloo and NCCL switch protocols and algorithms with the
    size, TCP's buffers fill, the operating system schedules the receiver). Each parameter is then
    fitted where it rules: alpha is the median of T / (2(N - 1)) over the small messages (the
    median: one late wake-up must not move it), beta the largest message's rate with that latency
    taken out, 2(N-1)/N x S / (T - 2(N-1) alpha). Not a slope through the large sizes: on a busy
    machine one of them can be slower than a larger one, and a slope through three such points
    once gave a beta a hundred times the rate the largest message reached. The residuals of the
    model they make show where neither regime describes a size.

    Args:
        processes: N, at least 2.
        message_bytes: the bytes all-reduced at each point.
        seconds: the measured time of each.
        latency_max_bytes: the largest message used for alpha (at least one is needed).
        bandwidth_min_bytes: the smallest size the sweep must reach for beta (two sizes at least
            that large: the largest of them gives beta).
    """
    if processes < 2:
        raise ValueError(f"fitting an all-reduce needs at least 2 processes, got {processes}")
    small = [t for x, t in zip(message_bytes, seconds) if x <= latency_max_bytes]
    large = [(x, t) for x, t in zip(message_bytes, seconds) if x >= bandwidth_min_bytes]
    if not small or len({x for x, _ in large}) < 2:
        raise ValueError(
            f"fitting by regime needs a message of at most {latency_max_bytes:.0f} bytes and two sizes "
            f"of at least {bandwidth_min_bytes:.0f} bytes: widen the sweep"
        )
    steps = 2 * (processes - 1)
    latency = statistics.median(small) / steps
    largest, time = max(large)
    sent = steps / processes * largest  # the bytes each rank sends
    # if its latency is all its time (a sweep too small for bandwidth to rule), its whole time counts
    bandwidth_time = time - steps * latency if time > steps * latency else time
    return latency, sent / bandwidth_time


def strong_scaling_seconds(
    processes: int, *, compute_s: float, communication_s: float, fixed_s: float
) -> float:
    """The time of a strong-scaling step or epoch: T(N) = T_compute / N + T_comm(N) + T_fixed.

    Unlike Amdahl's law, communication is its own term: zero at N = 1 and growing with N (from
    ``ring_all_reduce_seconds``). The speedup falls below 1 as soon as
    T_comm(N) > T_compute (1 - 1/N): the communication costs more than the compute it saves.

    Args:
        processes: N.
        compute_s: T_compute, the work that splits over the processes.
        communication_s: T_comm(N), at this N.
        fixed_s: T_fixed, what every process does whole (data loading, launch, Python).
    """
    return compute_s / processes + communication_s + fixed_s


def compute_share(processes: int, *, cores: int | None = None) -> float:
    """The share of the one-process compute each of N processes does in the same time: 1/N, or
    1/min(N, C) when the N processes share C cores (a laptop: past C, more processes only queue
    for the same cores). On a cluster each rank has a device of its own: ``cores`` None.

    Args:
        processes: N.
        cores: C, the cores the processes share, or None (one device each).
    """
    return 1 / (processes if cores is None else min(processes, cores))


def fit_strong_scaling(
    seconds: dict[int, float], communication_s: dict[int, float], *, cores: int | None = None
) -> tuple[float, float]:
    """T_compute and T_fixed from measured times, T_comm(N) given: (compute_s, fixed_s).

    With the communication term predicted (``ring_all_reduce_seconds`` from a measured alpha and
    beta), what is left, T(N) - T_comm(N) = T_compute / N + T_fixed, is a straight line in 1/N
    (in ``compute_share`` on shared cores): its slope is T_compute and its intercept T_fixed,
    fitted by least squares over every N.

    Args:
        seconds: N -> the measured time (of a step or an epoch) on N processes; at least two N.
        communication_s: N -> T_comm(N), the same unit, for every N of ``seconds``.
        cores: the cores the processes shared (a laptop), or None (a device each).
    """
    if len(seconds) < 2:
        raise ValueError(
            f"fitting T(N) needs runs at two numbers of processes at least, got {sorted(seconds)}"
        )
    return _least_squares_line(
        [compute_share(n, cores=cores) for n in seconds], [seconds[n] - communication_s[n] for n in seconds]
    )


def fit_strong_scaling_with_scale(
    seconds: dict[int, float], communication_s: dict[int, float], *, cores: int | None = None
) -> tuple[float, float, float]:
    """T_compute, the communication's scale k and T_fixed of T(N) = T_compute/N + k T_comm(N) + T_fixed.

    ``fit_strong_scaling`` trusts the predicted T_comm(N) as it is (k = 1). The all-reduce inside
    training is not the micro-benchmark's: DDP hides part of it under the backward (k < 1), and on
    shared cores it waits for the cores the compute holds, or the trainer adds collectives of its
    own (k > 1). When trusting the prediction gives a negative T_compute, that missing term is what
    the runs say; fitting k beside the other two terms measures it. Three unknowns need runs at
    three numbers of processes; with more, the fit is the least-squares one.

    Args:
        seconds: N -> the measured time (of a step or an epoch) on N processes; at least three N.
        communication_s: N -> T_comm(N) as the alpha-beta model predicts it, for every N of ``seconds``.
        cores: the cores the processes shared (a laptop), or None (a device each).
    """
    if len(seconds) < 3:
        raise ValueError(
            f"fitting T_compute, the communication's scale and T_fixed needs runs at three numbers of "
            f"processes at least, got {sorted(seconds)}"
        )
    sizes = sorted(seconds)
    columns, times = _scaling_system(seconds, communication_s, cores)
    if torch.linalg.matrix_rank(columns) < 3:  # e.g. a T_comm(N) that does not change with N
        raise ValueError(
            f"the predicted communication {[communication_s[n] for n in sizes]} at N = {sizes} cannot be "
            "told apart from the compute and fixed terms: run more numbers of processes"
        )
    compute, scale, fixed = torch.linalg.lstsq(columns, times[:, None]).solution.flatten().tolist()
    return compute, scale, fixed


def _scaling_system(
    seconds: dict[int, float], communication_s: dict[int, float], cores: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row [compute share, T_comm(N), 1] per run, by N, and the measured times: the linear system
    the three terms solve."""
    sizes = sorted(seconds)
    columns = torch.tensor(
        [[compute_share(n, cores=cores), communication_s[n], 1.0] for n in sizes], dtype=torch.float64
    )
    return columns, torch.tensor([seconds[n] for n in sizes], dtype=torch.float64)


def strong_scaling_standard_errors(
    seconds: dict[int, float], communication_s: dict[int, float], *, cores: int | None = None
) -> tuple[float, float, float]:
    """The standard errors of ``fit_strong_scaling_with_scale``'s three terms (T_compute, k, T_fixed).

    Least squares' own: the residuals' variance, s² = RSS / (n - 3), times the diagonal of
    (XᵀX)⁻¹. Three runs fit three terms exactly and leave no residual to estimate s² from, so
    the errors need four numbers of processes at least: a fit through three points says nothing
    about how well the model holds.

    Args:
        seconds: N -> the measured time on N processes; at least four N.
        communication_s: N -> T_comm(N) as predicted, for every N of ``seconds``.
        cores: the cores the processes shared (a laptop), or None (a device each).
    """
    if len(seconds) < 4:
        raise ValueError(
            f"standard errors of three fitted terms need runs at four numbers of processes at least "
            f"(three fit exactly, leaving no residual), got {sorted(seconds)}"
        )
    columns, times = _scaling_system(seconds, communication_s, cores)
    terms = torch.tensor(
        fit_strong_scaling_with_scale(seconds, communication_s, cores=cores), dtype=torch.float64
    )
    residual = times - columns @ terms
    variance = float(residual @ residual) / (len(seconds) - 3)
    covariance = variance * torch.linalg.inv(columns.T @ columns)
    compute, scale, fixed = covariance.diagonal().sqrt().tolist()
    return compute, scale, fixed


def step_budget(serial: dict[str, float], parallel: dict[str, float], *, processes: int) -> dict[str, float]:
    """Why a step on N processes takes longer than 1/N of the serial one, term by term, measured.

    Both steps are cut into the same parts (``anatomy.PARTS``: compute, exposed communication,
    idle, host overhead, unexplained), which add up to each step. Perfect strong scaling would
    divide every part by N; what each part of the parallel step exceeds its N-th of the serial
    one by is its share of the loss, and the shares add up to T(N) - T(1)/N exactly. Nothing is
    fitted: every term is a measurement, and the unexplained part stays a term of its own.

    Returns ``perfect_ms`` (T(1)/N) and, for each part, ``<part>_ms``: the part on N processes
    minus its N-th on one (compute that did not shrink N-fold, communication that one process
    never pays, waiting for a peer, per-step host work that does not split...).

    Args:
        serial: the serial step's parts in ms (``<part>_ms`` keys and ``step_ms``), e.g. an
            ``anatomy.json``'s summary of one process: the baseline, at best the best serial run.
        parallel: the same for the run on ``processes`` processes (its ranks' average).
        processes: N.
    """
    if processes < 1:
        raise UserError(f"processes must be at least 1, got {processes}")
    needed = ["step_ms"] + [f"{part}_ms" for part in PARTS]
    missing = [key for key in needed if key not in serial or key not in parallel]
    if missing:
        raise UserError(f"a step's budget needs {', '.join(missing)}: pass anatomy summaries (anatomy.json)")
    terms = {f"{part}_ms": parallel[f"{part}_ms"] - serial[f"{part}_ms"] / processes for part in PARTS}
    return {"perfect_ms": serial["step_ms"] / processes} | terms


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    """A fixed-width text table a student can read in a terminal: one row per run.

    Args:
        rows: table rows with speedup and efficiency (``summarize``, then ``add_speedup``); when
            they name one baseline, a last line says which.
    """
    rows = list(rows)
    header = (
        f"{'run':<10} {'ranks':>5} {'s/epoch':>9} {'samples/s':>10} {'speedup':>8} {'efficiency':>10} "
        f"{'val acc':>8} {'state MB':>8} {'peak MB':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['run']:<10} {row['world_size']:>5} {row['time_per_epoch_s']:>9.3f} "
            f"{row['samples_per_s']:>10.0f} {row['speedup']:>8.2f} {row['efficiency']:>10.0%} "
            f"{row['val_acc']:>8.2%} {row['model_state_mb']:>8.2f} {row['peak_mem_mb']:>8.0f}"
        )
    baselines = {row.get("baseline") for row in rows}
    if len(baselines) == 1 and None not in baselines:
        lines.append(f"speedup and efficiency against {baselines.pop()}")
    return "\n".join(lines)
