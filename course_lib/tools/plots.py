"""Every picture the course draws from data: pipeline timelines, scaling studies, loss curves, networks.

The lessons compute; this module draws. Each function takes what a lesson returns (a timeline
of events, the rows of a scaling table, loss curves) and returns a matplotlib ``Figure``, saved
as a PNG only when given a ``path``. Nothing here chooses a backend: a ``Figure`` built without
``pyplot`` needs none to be saved, and a notebook shows a returned ``Figure`` inline.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib import ticker
from matplotlib.backend_bases import FigureCanvasBase  # a list of formats: no backend is chosen
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .. import checks
from ..errors import UserError
from ..observe import anatomy
from ..parallel.collective_matmul import chunk_compute_to_transfer
from ..parallel.pipeline import bubble_fraction
from ..plan import network_model, rooflines
from ..plan.memory_phases import MEMORY_PARTS
from ..plan.specs import GIB

PNG_DPI = 120


IMAGE_SUFFIXES = tuple(
    dict.fromkeys(f".{kind}" for kind in ("png", "pdf", "svg", *FigureCanvasBase.get_supported_filetypes()))
)
"""The kinds of picture matplotlib writes, by the suffix that names them (.png first)."""

image_to_write = checks.named_file(IMAGE_SUFFIXES, "kind of picture", to_write=True)
"""argparse type: a picture's file to write, of a kind matplotlib writes."""


def save(
    figure: Figure, path: str | Path | None, *, dpi: int = PNG_DPI, metadata: dict | None = None
) -> Figure:
    """Write ``figure`` as a PNG at ``path`` (its folder created), unless ``path`` is None; return the figure.

    Args:
        figure: what to write.
        path: the PNG file, or None to write nothing.
        dpi: dots per inch of the PNG.
        metadata: PNG metadata (``{"Software": None}`` leaves out matplotlib's version).
    """
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=dpi, metadata=metadata)
    return figure


# -- pipeline schedules -------------------------------------------------------------------------


def plot_timeline(
    events: dict[int, list[tuple[str, int, int, float, float]]],
    *,
    path: str | Path | None = None,
    title: str = "",
    pipeline_size: int | None = None,
    measured: bool = False,
) -> Figure:
    """A Gantt chart of a pipeline step, one row per rank: forwards blue, backwards green (and, in a
    schedule that splits the backward, W's orange), each box numbered with its micro-batch; white is
    idle.

    Args:
        events: per rank, ``(kind, stage, microbatch, start, end)`` tuples, as
            ``pipeline.simulate_timeline`` computes them or ``PipelineStats.events`` measures them.
        path: save the chart as a PNG here (None: only return it).
        title: the chart's title (default: the bubble fraction).
        pipeline_size: ranks in the pipeline, to shade virtual stages differently (default: the rows).
        measured: the times are measured seconds (drawn in ms); False: a schedule's time units,
            where one forward of a rank's whole share of the model takes 1.
    """
    ranks = sorted(events)
    pipeline_size = pipeline_size or len(ranks)
    scale = 1000.0 if measured else 1.0
    split = any(event[0] == "W" for rank_events in events.values() for event in rank_events)
    legend_inches = 0.5 if split else 0.0  # a split schedule's legend takes two rows under the axis
    figure = Figure(figsize=(10, 0.6 * len(ranks) + 1.7 + legend_inches))
    axis = figure.subplots()
    colours = {"F": ("#4c72b0", "#8fb0e0"), "B": ("#55a868", "#9fd4ad"), "W": ("#dd8452", "#f2bf99")}
    names = (
        {"F": "forward", "B": "B (input gradient)", "W": "W (weight gradient)"}
        if split
        else {"F": "forward", "B": "backward"}
    )
    chunks = set()
    for row, rank in enumerate(ranks):
        for kind, stage, microbatch, start, end in events[rank]:
            chunk = (stage // pipeline_size) % 2  # alternate shades for virtual stages (and a V's two arms)
            chunks.add(chunk)
            left, width = start * scale, (end - start) * scale
            axis.barh(row, width, left=left, color=colours[kind][chunk], edgecolor="black", linewidth=0.5)
            axis.text(left + width / 2, row, str(microbatch), ha="center", va="center", fontsize=7)
    axis.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    axis.invert_yaxis()
    axis.set_xlim(left=0)
    axis.set_xlabel("time since the step started (ms)" if measured else "time (one forward = 1)")
    axis.set_title(title or f"bubble {bubble_fraction(events):.0%}")
    handles = []
    for chunk in sorted(chunks):
        which = f" (chunk {'1, 3, ...' if chunk else '0, 2, ...'})" if len(chunks) > 1 else ""
        handles += [
            Patch(facecolor=colours[kind][chunk], edgecolor="black", label=f"{name}{which}")
            for kind, name in names.items()
        ]
    handles.append(Patch(facecolor="white", edgecolor="black", label="idle (the bubble)"))
    if split:  # under the whole figure, with room kept for it, so it never covers the axis label
        figure.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
        figure.tight_layout(rect=(0, legend_inches / figure.get_figheight(), 1, 1))
    else:
        axis.legend(
            handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(handles), fontsize=8
        )
        figure.tight_layout()
    return save(figure, path)


# -- strong scaling -------------------------------------------------------------------------------

STUDY_COLUMNS = 3
"""Panels per row of the study's figure."""
STUDY_PANELS = {
    "time_per_epoch_s": "time per epoch (s)",
    "speedup": "speedup",
    "efficiency": "parallel efficiency",
    "val_acc": "validation accuracy",
    "model_state_mb": "model states per rank (MB)",
}


def draw_study(
    rows: list[dict[str, Any]],
    *,
    panels: tuple[str, ...] = tuple(STUDY_PANELS),
    panel_size: tuple[float, float] = (4.4, 4.0),
) -> Figure:
    """The study as a matplotlib figure: one panel per metric of ``panels`` against the number of
    processes (log scale), one line per sharding from its own runs, and the ideal where there is
    one (time 1/N, speedup N, efficiency 1).

    A one-process ``single`` row, as the lab has, is the baseline every speedup is taken against:
    it is drawn as one labelled point (a star), not as the start of every line, so that a
    sharding's own one-process run (its wrapper's cost) shows where it is.
    """
    columns = min(len(panels), STUDY_COLUMNS)  # wrapped into rows: five panels in a row are unreadable
    rows_of_panels = -(-len(panels) // columns)
    figure = Figure(figsize=(panel_size[0] * columns, panel_size[1] * rows_of_panels), layout="constrained")
    grid = figure.subplots(rows_of_panels, columns, squeeze=False).flatten()
    for unused in grid[len(panels) :]:
        unused.set_visible(False)
    axes = dict(zip(panels, grid))
    sizes = sorted({row["world_size"] for row in rows})
    baseline = sorted((row for row in rows if row["sharding"] == "single"), key=lambda row: row["world_size"])
    for sharding in sorted({row["sharding"] for row in rows} - {"single"}):
        mine = sorted((row for row in rows if row["sharding"] == sharding), key=lambda row: row["world_size"])
        ranks = [row["world_size"] for row in mine]
        for key, axis in axes.items():
            (line,) = axis.plot(ranks, [row[key] for row in mine], "o-", label=sharding.upper())
        if "time_per_epoch_s" in axes and not baseline:  # without a baseline, each line its own ideal
            first = mine[0]
            ideal = [first["time_per_epoch_s"] * first["world_size"] / n for n in sizes]
            label = f"ideal 1/N ({sharding.upper()})"
            axes["time_per_epoch_s"].plot(sizes, ideal, ":", color=line.get_color(), lw=1.5, label=label)
    if baseline:
        for key, axis in axes.items():
            axis.plot(
                [row["world_size"] for row in baseline], [row[key] for row in baseline], "*", color="black",
                markersize=13, label="one process, no wrapper (the baseline)", zorder=3,
            )  # fmt: skip
        if "time_per_epoch_s" in axes:
            first = baseline[0]
            ideal = [first["time_per_epoch_s"] * first["world_size"] / n for n in sizes]
            axes["time_per_epoch_s"].plot(sizes, ideal, "--", color="black", lw=1, label="ideal 1/N")
    if "speedup" in axes:
        axes["speedup"].plot(sizes, sizes, "k-.", lw=1, label="ideal speedup N")
    if "efficiency" in axes:
        axes["efficiency"].axhline(1.0, color="k", ls=":", lw=1, label="ideal efficiency 1")
    for key, axis in axes.items():
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes)
        axis.get_xaxis().set_major_formatter(ticker.ScalarFormatter())
        axis.set_xlabel("processes (GPUs)")
        axis.set_title(STUDY_PANELS[key], fontsize="large")
        axis.grid(True, alpha=0.3)
    # one legend for every panel, under them: inside a panel it would cover the lines it names
    named = {}
    for axis in axes.values():
        for handle, label in zip(*axis.get_legend_handles_labels()):
            named.setdefault(label, handle)
    figure.legend(list(named.values()), list(named), loc="outside lower center", ncol=min(len(named), 4))
    if "time_per_epoch_s" in axes:
        time_axis = axes["time_per_epoch_s"]
        time_axis.set_yscale("log")
        time_axis.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))  # 1, 10 rather than 10^0
        time_axis.yaxis.set_minor_formatter(ticker.FuncFormatter(_two_and_five))
    return figure


def _two_and_five(value: float, _position) -> str:
    """A log axis's minor label only at 2 and 5 times a power of ten: every minor tick labelled
    crowds into unreadable digits."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2, 5) else ""


def plot_study(
    rows: list[dict[str, Any]],
    *,
    path: str | Path | None = None,
    title: str = "Strong scaling study",
    panels: tuple[str, ...] = tuple(STUDY_PANELS),
) -> Figure:
    """``draw_study`` with ``title`` above it, saved as a PNG at ``path`` when one is given.

    Args:
        rows: the scaling table (``scaling.summarize`` rows with ``scaling.add_speedup`` applied).
        path: the PNG to write (None: only return the figure).
        title: the figure's title.
        panels: which columns of ``STUDY_PANELS`` to draw.
    """
    figure = draw_study(rows, panels=panels)
    figure.suptitle(title)
    return save(figure, path, dpi=110)


# -- loss curves ----------------------------------------------------------------------------------


def plot_loss_curves(curves: dict[str, list[float]], *, path: str | Path | None = None) -> Figure:
    """Training loss against step, one line per run (the first drawn thick, so a match shows).

    Args:
        curves: label -> the loss of every step.
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(6, 3.5))
    axis = figure.subplots()
    for index, (label, losses) in enumerate(curves.items()):
        if index == 0:
            axis.plot(losses, label=label, linewidth=3, alpha=0.5)
        else:
            axis.plot(losses, "--", label=label)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.legend()
    figure.tight_layout()
    return save(figure, path)


def plot_load_balancing(result: dict[str, Any], *, path: str | Path | None = None) -> Figure:
    """A mixture of experts' load imbalance step by step, one line per balancing (``bench balance``),
    and beside it the tokens the capacity design drops at each capacity factor against dropless.

    Args:
        result: what ``bench balance`` prints.
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(10, 3.6))
    load, drops = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    names = {"none": "no balancing", "aux_loss": "Switch's auxiliary loss", "bias": "DeepSeek-V3's bias"}
    for method, values in result["load_imbalance"].items():
        load.plot(range(1, len(values) + 1), values, label=names.get(method, method))
    load.axhline(1.0, color="grey", linestyle=":", label="even (1)")
    load.set_xlabel("optimizer step")
    load.set_ylabel("busiest expert's load / mean load")
    load.set_title(f"{result['experts']} experts, top-{result['top_k']}")
    load.legend()
    labels = list(result["dropped"])
    drops.bar(
        labels, [result["dropped"][label] for label in labels], color=["C3"] * (len(labels) - 1) + ["C2"]
    )
    drops.set_xlabel("capacity factor (dropless: none)")
    drops.set_ylabel(f"assignments dropped of {result['assignments_last_batch']}")
    drops.set_title("the last batch, unbalanced run")
    figure.tight_layout()
    return save(figure, path)


# -- the network ----------------------------------------------------------------------------------


def plot_allreduce(
    result: dict[str, Any], *, path: str | Path | None = None, expected_gbps: float | None = None
) -> Figure:
    """An all-reduce sweep (``bench allreduce``): time and bus bandwidth against message size.

    Left, the measured time of each size beside the fitted alpha-beta model: flat where latency
    rules, a slope of one where bandwidth does. Right, the bus bandwidth climbing towards beta,
    the fitted bandwidth, and towards the link's speed when one is expected.

    Args:
        result: the benchmark's JSON object (its ``rows`` and, with 2 or more ranks, its ``fit``).
        path: save the chart as a PNG here (None: only return it).
        expected_gbps: the link's speed in GB/s, drawn as a line (None: not drawn).
    """
    rows = result["rows"]
    sizes = [row["bytes"] for row in rows]
    figure = Figure(figsize=(10, 3.8))
    timing, bandwidth = figure.subplots(1, 2)
    timing.loglog(sizes, [row["time_us"] for row in rows], "o", label="measured")
    fit, by_regime = result.get("fit"), result.get("fit_by_regime")
    for parameters, column, style, name in (
        (fit, "model_time_us", "-", "alpha-beta fit"),
        (by_regime, "regime_model_time_us", "--", "fitted by regime"),
    ):
        if parameters:
            alpha, beta = parameters["latency_us"], parameters["bandwidth_gbps"]
            label = f"{name}: alpha {alpha:.1f} us, beta {beta:.2f} GB/s"
            timing.loglog(sizes, [row[column] for row in rows], style, label=label)
    timing.set_xlabel("message size (bytes)")
    timing.set_ylabel("time of one all-reduce (us)")
    timing.legend(fontsize="small")
    bandwidth.semilogx(sizes, [row["busbw_gbps"] for row in rows], "o-", label="bus bandwidth")
    bandwidth.semilogx(sizes, [row["algbw_gbps"] for row in rows], ".--", label="algorithm bandwidth")
    if fit:
        bandwidth.axhline(fit["bandwidth_gbps"], color="C1", linewidth=1, label="beta (one fit)")
    if by_regime:
        bandwidth.axhline(
            by_regime["bandwidth_gbps"], color="C2", linestyle="--", linewidth=1, label="beta (by regime)"
        )
    if expected_gbps is not None:
        bandwidth.axhline(expected_gbps, color="C3", linestyle=":", label=f"link: {expected_gbps:g} GB/s")
    bandwidth.set_xlabel("message size (bytes)")
    bandwidth.set_ylabel("GB/s")
    bandwidth.legend(fontsize="small")
    figure.suptitle(
        f"all-reduce on {result['world_size']} ranks, {result['nodes']} node(s), {result['backend']}"
    )
    figure.tight_layout()
    return save(figure, path)


# -- sequence, context and expert parallelism -----------------------------------------------------


def plot_ring_attention(schedules: dict[str, list[list[dict]]], seq_len: int, *, path=None) -> Figure:
    """The attention matrix each rank computes, coloured by the ring step that computes each block.

    One row of panels per layout (``context_chunks.ring_schedule``), one panel per rank: query positions
    down, key positions across; a block is coloured by the step at which its keys reached the
    rank, grey where the causal mask let it be skipped, white where it belongs to another rank.

    Args:
        schedules: a title (e.g. "contiguous") -> ``ring_schedule(layout)``.
        seq_len: the sequence's length S (the matrices are S x S).
        path: save the chart as a PNG here (None: only return it).
    """
    import numpy as np
    from matplotlib import colormaps

    rows, degree = len(schedules), len(next(iter(schedules.values()))[0])
    figure = Figure(figsize=(2.3 * degree + 0.6, 2.8 * rows + 0.4))
    panels = np.atleast_2d(figure.subplots(rows, degree, squeeze=False))
    colours = colormaps["viridis"].resampled(degree)
    for row, (title, schedule) in enumerate(schedules.items()):
        for rank in range(degree):
            picture = np.ones((seq_len, seq_len, 3))
            work = 0
            for step, entries in enumerate(schedule):
                entry = entries[rank]
                for query, key in entry["blocks"]:
                    block = picture[query.start : query.end, key.start : key.end]
                    block[:] = colours(step)[:3]
                    work += query.length * key.length
                    if key.start == query.start:  # the diagonal block: the mask hides its upper half
                        hidden = np.triu(np.ones((query.length, key.length), dtype=bool), k=1)
                        block[hidden] = 0.85
                for query, key in entry["skipped"]:
                    picture[query.start : query.end, key.start : key.end] = 0.85
            axis = panels[row][rank]
            axis.imshow(picture, interpolation="nearest")
            ticks = [0, seq_len // 2, seq_len - 1]
            axis.set_xticks(ticks)
            axis.set_yticks(ticks)
            axis.tick_params(labelsize=7)
            axis.set_xlabel("key position", fontsize=8)
            if rank == 0:
                axis.set_ylabel("query position", fontsize=8)
            axis.set_title(f"{title}: rank {rank}\n{work} scores computed", fontsize=8)
    handles = [Patch(color=colours(step), label=f"step {step}") for step in range(degree)]
    figure.legend(handles=handles, loc="lower center", ncol=degree, fontsize="small", frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    return save(figure, path)


def plot_sequence_methods(
    curves: dict[str, dict[str, list[float]]], seq_lens: list[int], *, path=None
) -> Figure:
    """Predicted time of one attention layer per method over its compute alone, against sequence length.

    One panel per link; 1 means the communication is entirely hidden.

    Args:
        curves: a panel title (e.g. "NVLink, 150 GB/s") -> {method name: seconds at each length},
            with a ``"compute alone"`` entry that the others are divided by.
        seq_lens: the sequence lengths (the x axis, tokens).
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(4.2 * len(curves), 3.4))
    axes = figure.subplots(1, len(curves), squeeze=False, sharey=True)[0]
    for axis, (title, methods) in zip(axes, curves.items()):
        compute = methods["compute alone"]
        axis.axhline(1.0, color="grey", linestyle=":", label="compute alone")
        for name, seconds in methods.items():
            if name != "compute alone":
                ratios = [s / c for s, c in zip(seconds, compute)]
                axis.plot(seq_lens, ratios, "-" if "ring" in name else "--", marker="o", label=name)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length (tokens)")
        axis.set_ylabel("time / compute alone (forward + backward)")
        axis.set_title(title, fontsize=10)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, path)


def plot_activation_memory(rows: list[dict], *, path=None) -> Figure:
    """Saved activation bytes per rank against sequence length, one line per degree.

    Args:
        rows: dicts with ``seq``, ``label`` (e.g. "cp 2") and ``bytes``.
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(6, 3.5))
    axis = figure.subplots()
    for label in dict.fromkeys(row["label"] for row in rows):
        mine = [row for row in rows if row["label"] == label]
        axis.plot([r["seq"] for r in mine], [r["bytes"] / 1e6 for r in mine], "o-", label=label)
    axis.set_xlabel("sequence length (tokens)")
    axis.set_ylabel("attention activations per rank (MB)")
    axis.legend()
    figure.tight_layout()
    return save(figure, path)


def plot_expert_load(loads: dict[str, tuple[list[int], int]], *, path=None) -> Figure:
    """Assignments per expert against the capacity, one panel per routing: what is above the line is dropped.

    Args:
        loads: a title -> (the assignments each expert was chosen for, ``Routing.tokens_per_expert``;
            the most one expert takes, ``Routing.capacity``).
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(4 * len(loads), 3.2))
    panels = figure.subplots(1, len(loads), squeeze=False)[0]
    for axis, (title, (counts, capacity)) in zip(panels, loads.items(), strict=True):
        kept = [min(count, capacity) for count in counts]
        dropped = [count - k for count, k in zip(counts, kept, strict=True)]
        experts = range(len(counts))
        axis.bar(experts, kept, label="processed")
        axis.bar(experts, dropped, bottom=kept, color="C3", label="dropped")
        axis.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity}")
        axis.set_xlabel("expert")
        axis.set_ylabel("assignments")
        axis.set_title(f"{title}: {sum(dropped)} dropped", fontsize=9)
        axis.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, path)


MOE_PHASES = {
    "route": ("#8c8c8c", "route (router, top-k, counts)"),
    "dispatch": ("#c44e52", "dispatch: post, then wait for the rows"),
    "experts": ("#4c72b0", "experts (grouped matmul)"),
    "combine": ("#dd8452", "combine: post, then wait for the results"),
    "mix": ("#55a868", "mix (gates, add to the tokens)"),
}


def plot_moe_overlap(events: dict[int, list[tuple[int, str, float, float]]], *, path=None) -> Figure:
    """Two or more micro-batches through an expert-parallel layer, their phases over time: one row
    per rank and micro-batch, so one micro-batch's all-to-all shows beside another's work.

    Args:
        events: per rank, ``(micro-batch, phase, start, end)`` in seconds
            (``parallel.moe_overlap.overlapped_forward``'s events).
        path: save the chart as a PNG here (None: only return it).
    """
    rows = [(rank, batch) for rank in sorted(events) for batch in sorted({e[0] for e in events[rank]})]
    figure = Figure(figsize=(10, 0.45 * len(rows) + 1.8))
    axis = figure.subplots()
    for row, (rank, batch) in enumerate(rows):
        for index, phase, start, end in events[rank]:
            if index == batch:
                axis.barh(row, (end - start) * 1e3, left=start * 1e3, color=MOE_PHASES[phase][0],
                          edgecolor="black", linewidth=0.4)  # fmt: skip
    axis.set_yticks(range(len(rows)), [f"rank {rank}, micro-batch {batch}" for rank, batch in rows])
    axis.invert_yaxis()
    axis.set_xlim(left=0)
    axis.set_xlabel("time since the layer started (ms)")
    axis.set_title("one micro-batch's all-to-all in flight while the other routes or computes")
    handles = [
        Patch(facecolor=colour, edgecolor="black", label=label) for colour, label in MOE_PHASES.values()
    ]
    axis.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8)
    figure.tight_layout()
    return save(figure, path)


def plot_grouped_experts(
    rates: dict[str, list[float]], experts: list[int], *, title: str, path=None
) -> Figure:
    """The rate a rank's experts reach as their count grows with the rows fixed: one launch each
    against one grouped kernel (``plan.kernels``' model of the GPU's record).

    Args:
        rates: a line's label -> its TFLOP/s at each count of ``experts``.
        experts: the experts on the rank, the x axis.
        title: what is fixed (the GPU, the rows, the experts' shape, whether measured).
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(5.2, 3.4))
    axis = figure.subplots()
    for label, values in rates.items():
        axis.plot(experts, values, marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xticks(experts, [str(count) for count in experts])
    axis.set_ylim(bottom=0)
    axis.set_xlabel("experts on the rank (the same rows split among them)")
    axis.set_ylabel("TFLOP/s")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, path)


# -- the anatomy of a step ------------------------------------------------------------------------

ANATOMY_COLOURS = {
    "compute": "#4c72b0",
    "exposed_communication": "#c44e52",
    "idle": "#8c8c8c",
    "host_overhead": "#dd8452",
    "unexplained": "#ffffff",
}
ANATOMY_LABELS = {
    "compute": "compute",
    "exposed_communication": "exposed communication",
    "idle": "idle (waiting for a peer)",
    "host_overhead": "host overhead",
    "unexplained": "unexplained",
}
COLLECTIVE_COLOURS = {"all_reduce": "#937860", "all_gather": "#55a868", "reduce_scatter": "#8172b3"}


def plot_budget(
    summaries: dict[str, dict],
    *,
    perfect_ms: float | None = None,
    perfect_label: str = "perfect scaling",
    title: str = "",
    path: str | Path | None = None,
) -> Figure:
    """Runs' typical steps side by side, each bar cut into its measured parts (stacked, in ms).

    Args:
        summaries: {run name: its anatomy summary} (``Anatomy.summary()`` or an ``anatomy.json``).
        perfect_ms: a line at this step time, e.g. T(1) / N (None: no line).
        perfect_label: that line's name in the legend.
        title: the chart's title.
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(1.6 * len(summaries) + 4.2, 3.8))
    axis = figure.subplots()
    names = list(summaries)
    for index, name in enumerate(names):
        bottom = 0.0
        for part, colour in ANATOMY_COLOURS.items():
            height = summaries[name][f"{part}_ms"]
            axis.bar(index, height, bottom=bottom, color=colour, edgecolor="black", linewidth=0.5, width=0.6)
            bottom += height
        axis.text(index, bottom, f"{bottom:.1f} ms", ha="center", va="bottom", fontsize=8)
    handles = [
        Patch(facecolor=c, edgecolor="black", label=ANATOMY_LABELS[p]) for p, c in ANATOMY_COLOURS.items()
    ]
    if perfect_ms is not None:
        handles.append(
            axis.axhline(perfect_ms, color="black", linestyle="--", linewidth=1, label=perfect_label)
        )
    axis.set_xticks(range(len(names)), names)
    axis.set_ylabel("time per step (ms)")
    axis.set_title(title)
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    figure.tight_layout()
    return save(figure, path)


def plot_anatomy(
    recorded, *, step: int | None = None, title: str = "", path: str | Path | None = None
) -> Figure:
    """One recorded step, rank by rank: what each millisecond was (compute, exposed communication,
    idle, host overhead, unexplained), and under it the collectives in flight, hidden or not.

    Args:
        recorded: what ``profiling.record_steps`` (or a ``Recorder``) returned.
        step: which recorded step (None: the one of median length on rank 0).
        title: the chart's title (default: the step's length and its exposed communication).
        path: save the chart as a PNG here (None: only return it).
    """
    recorded_steps = len(recorded.timelines[0])
    if step is not None and not 0 <= step < recorded_steps:
        raise UserError(f"step {step} was not recorded: the anatomy holds steps 0 to {recorded_steps - 1}")
    ranks = len(recorded.timelines)
    figure = Figure(figsize=(11, 1.1 * ranks + 1.6))
    axis = figure.subplots()
    step = recorded.typical_step() if step is None else step
    longest = max(timeline[step].step_ms for timeline in recorded.timelines)
    _draw_anatomy(axis, recorded, step, longest, title)
    _anatomy_legend(axis, below=0.22)
    figure.tight_layout()
    return save(figure, path)


def plot_anatomies(recorded: dict, *, path: str | Path | None = None) -> Figure:
    """Several recorded steps one above the other, on one time scale: what changed between them.

    Args:
        recorded: a title for each anatomy (``profiling.record_steps``' result); each panel draws its
            typical step.
        path: save the chart as a PNG here (None: only return it).
    """
    ranks = max(len(recording.timelines) for recording in recorded.values())
    figure = Figure(figsize=(11, len(recorded) * (0.8 * ranks + 0.8) + 1.0))
    axes = figure.subplots(len(recorded), 1, sharex=True, squeeze=False)[:, 0]
    steps = {title: recording.typical_step() for title, recording in recorded.items()}
    longest = max(
        timeline[steps[title]].step_ms
        for title, recording in recorded.items()
        for timeline in recording.timelines
    )
    for axis, (title, recording) in zip(axes, recorded.items()):
        _draw_anatomy(axis, recording, steps[title], longest, title)
    for axis in axes[:-1]:
        axis.set_xlabel("")
    _anatomy_legend(axes[-1], below=0.3)
    figure.tight_layout()
    return save(figure, path)


def _anatomy_legend(axis, *, below: float) -> None:
    """The anatomy's legend under ``axis``, ``below`` axis heights down: each part, each collective."""
    handles = [
        Patch(facecolor=c, edgecolor="black", label=ANATOMY_LABELS[p]) for p, c in ANATOMY_COLOURS.items()
    ]
    handles += [
        Patch(facecolor=c, label=f"{op} in flight (lower lane)") for op, c in COLLECTIVE_COLOURS.items()
    ]
    handles.append(Patch(facecolor="#da8bc3", label="other message in flight"))
    axis.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=4, fontsize=8, frameon=False
    )


def _draw_anatomy(axis, recorded, step: int, longest: float, title: str) -> None:
    """One recorded step's lanes on ``axis``: each rank's parts above, its collectives below."""
    ranks = len(recorded.timelines)
    for rank in range(ranks):
        cut = anatomy.parts(recorded.timelines, rank, step)
        for part, colour in ANATOMY_COLOURS.items():
            spans = [(start, end - start) for start, end in cut[part]]
            axis.broken_barh(spans, (rank - 0.4, 0.5), facecolors=colour, edgecolor="none")
        axis.broken_barh(
            [(0, recorded.timelines[rank][step].step_ms)],
            (rank - 0.4, 0.5),
            facecolors="none",
            edgecolor="black",
            linewidth=0.6,
        )
        for collective in recorded.timelines[rank][step].collectives:  # the lane under the step
            named = (op for op in COLLECTIVE_COLOURS if op in collective.name)
            name = collective.operation or next(named, None)
            colour = COLLECTIVE_COLOURS.get(name, "#da8bc3")
            axis.broken_barh(
                [(collective.start_ms, collective.end_ms - collective.start_ms)],
                (rank + 0.15, 0.22),
                facecolors=colour,
                edgecolor="none",
            )
    axis.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axis.set_ylim(ranks - 0.5, -0.6)
    axis.set_xlim(0, longest * 1.01)
    axis.set_xlabel("time since the step started (ms)")
    summary = recorded.summary()
    axis.set_title(
        title
        or f"one step: {summary['step_ms']:.1f} ms, {summary['exposed_communication_share']:.0%} exposed "
        f"communication, {summary['unexplained_share']:.0%} unexplained (mean over ranks)"
    )


def plot_memory_breakdown(predictions: list, *, capacity_bytes: float | None = None, path=None) -> Figure:
    """What each layout's fullest GPU holds at its step's peak, as a stacked bar (model states,
    activations, buffers, the allocator's fragmentation, the CUDA context and NCCL's buffers).

    Args:
        predictions: ``cost_model.Prediction`` objects, one bar each, in this order.
        capacity_bytes: one GPU's memory as the device reports it, drawn as a line (None: no line).
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(8, 4))
    axis = figure.subplots()
    labels = [p.layout.name() for p in predictions]
    bottoms = [0.0] * len(predictions)
    for part in MEMORY_PARTS:
        heights = [p.memory.get(part, 0.0) / GIB for p in predictions]
        if any(heights):
            axis.bar(range(len(predictions)), heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if capacity_bytes is not None:
        axis.axhline(capacity_bytes / GIB, color="black", linestyle="--", label="GPU memory")
    axis.set_xticks(range(len(predictions)), labels, rotation=30, ha="right", fontsize=8)
    axis.set_xlabel("layout")
    axis.set_ylabel("per GPU at the peak (GiB)")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return save(figure, path)


def plot_memory_phases(checked: list, *, capacity_bytes: float | None = None, path=None) -> Figure:
    """Each measured run's allocated peak phase by phase as the planner predicts it (bars), beside
    what the run measured: its allocated and reserved peaks (markers), and the predicted reserved.

    Args:
        checked: ``gpu_runs.Checked`` rows (a run and its prediction).
        capacity_bytes: the GPU's memory as it reports it, drawn as a line (None: no line).
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(9, 4.2))
    axis = figure.subplots()
    phases = list(checked[0].prediction.peak.phases)
    width = 0.8 / len(phases)
    for index, phase in enumerate(phases):
        heights = [c.prediction.peak.phases[phase] / GIB for c in checked]
        offsets = [i - 0.4 + (index + 0.5) * width for i in range(len(checked))]
        axis.bar(offsets, heights, width=width, label=f"predicted: {phase}", alpha=0.8)
    x = range(len(checked))
    axis.plot(x, [c.prediction.peak.reserved / GIB for c in checked], "_", color="red", markersize=14,
              markeredgewidth=2, label="predicted reserved")  # fmt: skip
    axis.plot(x, [c.run.allocated_gib for c in checked], "x", color="black", label="measured allocated")
    axis.plot(
        x, [c.run.reserved_gib for c in checked], "o", mfc="none", color="red", label="measured reserved"
    )
    if capacity_bytes is not None:
        axis.axhline(capacity_bytes / GIB, color="black", linestyle="--", linewidth=0.8, label="GPU memory")
    axis.set_xticks(list(x), [c.run.name for c in checked], rotation=40, ha="right", fontsize=7)
    axis.set_xlabel("run")
    axis.set_ylabel("memory per GPU (GiB)")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return save(figure, path)


def plot_memory_timeline(timeline: dict, *, path=None) -> Figure:
    """One training step's memory by category, allocation by allocation (``gpu_check.step_timeline``):
    the parameters and optimizer state underneath, the activations growing in the forward and
    freed in the backward while the gradients grow, the phases' starts marked.

    Args:
        timeline: ``positions`` (the x of each event), ``bytes`` (category -> bytes after each
            event) and ``marks`` ((position, label) of each phase's start).
        path: save the chart as a PNG here (None: only return it).
    """
    figure = Figure(figsize=(8, 4))
    axis = figure.subplots()
    x = list(range(len(timeline["positions"])))
    series = timeline["bytes"]
    highest = max((sum(column) for column in zip(*series.values(), strict=True)), default=0)
    unit, size = ("GiB", GIB) if highest >= GIB else ("MiB", 2**20)
    axis.stackplot(x, *[[b / size for b in values] for values in series.values()], labels=list(series))
    events = timeline["positions"]
    for position, label in timeline["marks"]:
        if label == "end":
            continue
        at = next((i for i, p in enumerate(events) if p >= position), len(events))
        axis.axvline(at, color="black", linewidth=0.8, linestyle=":")
        axis.annotate(label, (at, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", fontsize=8)
    axis.set_xlabel("allocation or free, in the order the step made them")
    axis.set_ylabel(f"allocated ({unit})")
    axis.set_title(f"one step of {timeline['run']}")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return save(figure, path)


def plot_prediction_check(result: dict, *, path=None) -> Figure:
    """``plan --validate``'s result: measured over predicted, per layout, for memory, bytes and time.

    Args:
        result: what ``plan_validation.validate`` returns.
        path: save the chart as a PNG here (None: only return it).
    """
    rows = result["layouts"]
    figure = Figure(figsize=(8, 4))
    axis = figure.subplots()
    kinds = (
        ("model_state_bytes", "model states", "o"),
        ("activation_bytes", "activations", "s"),
        ("sent_bytes", "bytes sent", "^"),
        ("step_s", "step time", "D"),
    )
    for offset, (key, label, marker) in zip((-0.21, -0.07, 0.07, 0.21), kinds, strict=True):
        ratios = [row[key]["measured_over_predicted"] for row in rows]
        axis.plot([i + offset for i in range(len(rows))], ratios, marker, linestyle="none", label=label)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.axhspan(1 / 1.33, 1.33, color="grey", alpha=0.15, label="within a factor 1.33")
    axis.set_xticks(range(len(rows)), [row["layout"] for row in rows], rotation=30, ha="right", fontsize=8)
    axis.set_xlabel("layout (processes on this machine)")
    axis.set_ylabel("measured / predicted")
    # above the axes, in one row: inside, it would hide the points of the first layouts
    axis.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=5, frameon=False)
    figure.tight_layout()
    return save(figure, path)


# -- stragglers ---------------------------------------------------------------------------------


def plot_stragglers(reports: list[dict], *, path: str | Path | None = None) -> Figure:
    """Each rank's lateness and its time waiting in collectives, step by step.

    The straggler's line is high on the left (it arrives late) and low on the right (nobody makes
    it wait); every other rank mirrors it: the time it waits is the straggler's lateness.

    Args:
        reports: one ``stragglers.StepReport.as_dict()`` per step (the lines of ``--straggler-report``).
        path: save the chart as a PNG here (None: only return it).
    """
    if not reports:
        raise UserError("no steps to draw: the report is empty (did the run make any step?)")
    steps = [report["step"] for report in reports]
    ranks = range(len(reports[0]["lateness_s"]))
    figure = Figure(figsize=(10, 3.8))
    late, waited = figure.subplots(1, 2, sharex=True)
    for rank in ranks:
        late.plot(steps, [1e3 * r["lateness_s"][rank] for r in reports], marker="o", label=f"rank {rank}")
        waited.plot(steps, [1e3 * r["waited_s"][rank] for r in reports], marker="o", label=f"rank {rank}")
    late.set_title("arrival after the first rank, summed per step")
    waited.set_title("time inside collectives, per step")
    for axis in (late, waited):
        axis.set_xlabel("step")
        axis.set_ylabel("milliseconds")
        axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    waited.legend(loc="best", fontsize=8)
    figure.tight_layout()
    return save(figure, path)


def plot_rooflines(model, clusters: list, *, path=None) -> Figure:
    """FSDP's data axis: compute per parameter grows with the tokens a GPU computes a step, its
    traffic per parameter does not; they cross at ``rooflines``' threshold, one line per cluster.

    Args:
        model: the model (``specs.MODELS``), whose products set each GPU's FLOP/s.
        clusters: the clusters (``specs.CLUSTERS``), each with its data axis over two nodes.
        path: also save the figure here.
    """
    figure = Figure(figsize=(6.4, 3.6))
    axis = figure.subplots()
    tokens = [10 ** (2 + i / 20) for i in range(61)]  # 100 to 100,000
    bytes_per_parameter = 2 * 2 + 2  # FSDP in bf16: two gathers and a reduce-scatter (the course's profile)
    colours = ("#4c72b0", "#c44e52", "#55a868", "#8172b2", "#ccb974")
    limits = {
        cluster.name: rooflines.rooflines(model, cluster, data_gpus=2 * cluster.gpus_per_node)
        for cluster in clusters
    }
    by_rate = {}  # clusters of one GPU compute on one line
    for name, limit in limits.items():
        by_rate.setdefault(round(limit.flops / 1e12), []).append(name)
    for (name, limit), colour in zip(limits.items(), colours, strict=False):
        same_gpu = by_rate[round(limit.flops / 1e12)]
        if same_gpu[0] == name:
            label = f"{' and '.join(same_gpu)}: compute"
            axis.plot(tokens, [6 * t / limit.flops for t in tokens], color=colour, label=label)
        traffic = 6 * limit.data_tokens_fsdp / limit.flops  # = bytes / bandwidth, where compute meets it
        axis.axhline(traffic, color=colour, linestyle="--", label=f"{name}: FSDP traffic")
        axis.plot([limit.data_tokens_fsdp], [traffic], "o", color=colour)
        axis.annotate(f"{limit.data_tokens_fsdp:,.0f}", (limit.data_tokens_fsdp, traffic),
                      textcoords="offset points", xytext=(4, 6), fontsize=8, color=colour)  # fmt: skip
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("tokens each GPU computes per step")
    axis.set_ylabel("seconds per parameter per step")
    axis.set_title(
        f"{model.name}, FSDP over two nodes ({bytes_per_parameter} bytes a parameter): hidden past it",
        fontsize=10,
    )
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    return save(figure, path)


# -- what production stacks do now ------------------------------------------------------------------


def plot_overlap_ratio(links: dict[str, tuple[float, float]], marked: dict[str, int], *, path=None) -> Figure:
    """Collective matmul: how much longer a chunk's matmul takes than its transfer, against the
    width of a rank's slice (``collective_matmul.chunk_compute_to_transfer``), one line per link.
    Above 1 the transfer hides under the matmul.

    Args:
        links: a label -> (the matmul's FLOP/s, the link's bytes/s one way) for each line.
        marked: a label -> a slice width, marked on every line (a model's matmuls at some degree).
        path: also save the figure here.
    """
    figure = Figure(figsize=(6.4, 3.6))
    axis = figure.subplots()
    widths = [2 ** (6 + i / 8) for i in range(8 * 10 + 1)]  # 64 to 65,536 features
    colours = ("#4c72b0", "#c44e52", "#55a868", "#8172b2")
    for (label, (flops, link)), colour in zip(links.items(), colours, strict=False):
        ratio = [
            chunk_compute_to_transfer(features_per_rank=w, flops_per_s=flops, bytes_per_s=link)
            for w in widths
        ]
        axis.plot(widths, ratio, color=colour, label=label)
        for width in marked.values():
            value = chunk_compute_to_transfer(features_per_rank=width, flops_per_s=flops, bytes_per_s=link)
            axis.plot([width], [value], "o", color=colour)
    for name, width in marked.items():
        axis.axvline(width, color="0.6", linewidth=0.8, linestyle=":")
        axis.annotate(name, (width, 80), rotation=90, fontsize=7, color="0.35", va="top",
                      textcoords="offset points", xytext=(3, 0))  # fmt: skip
    axis.axhline(1, color="black", linewidth=1)
    axis.annotate(
        "hidden above this line", (widths[0], 1), textcoords="offset points", xytext=(2, 4), fontsize=8
    )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_ylim(0.01, 100)
    axis.set_xlabel("features of a rank's slice (out / T or in / T)")
    axis.set_ylabel("chunk's matmul time / its transfer time")
    axis.set_title("collective matmul, bf16: when a ring step's transfer hides", fontsize=10)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    return save(figure, path)


COMPILE_VARIANTS = {
    "one_process": "one process",
    "course_tp": "course's TP",
    "dtensor_tp": "DTensor's TP",
    "fsdp2": "FSDP2",
}
"""``bench compile``'s variants, as the figures name them."""


def plot_compile_cost(result: dict, *, path=None) -> Figure:
    """``bench compile``'s result: what compiling cost (seconds before the first step) beside what
    it pays (the step eager and compiled), per variant, with the graphs each block became.

    Args:
        result: the JSON ``python -m course_lib.tools.bench compile`` printed.
        path: also save the figure here.
    """
    figure = Figure(figsize=(8.4, 3.4))
    cost, steps = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    names = [name for name in COMPILE_VARIANTS if name in result]
    places = list(range(len(names)))
    cost.bar(places, [result[name]["first_compiled_step_s"] for name in names], color="#8172b2")
    cost.set_xticks(places, [COMPILE_VARIANTS[name] for name in names], fontsize=7, rotation=20)
    cost.set_ylabel("seconds before the first step")
    cost.set_title("compile time (Inductor's caches off)", fontsize=10)
    width = 0.38
    steps.bar([p - width / 2 for p in places], [result[name]["eager_step_ms"] for name in names], width,
              color="#4c72b0", label="eager")  # fmt: skip
    steps.bar([p + width / 2 for p in places], [result[name]["compiled_step_ms"] for name in names], width,
              color="#55a868", label="compiled")  # fmt: skip
    tallest = 0.0
    for place, name in zip(places, names, strict=True):
        top = max(result[name]["eager_step_ms"], result[name]["compiled_step_ms"])
        tallest = max(tallest, top)
        ratio = result[name]["compiled_over_eager"]
        steps.annotate(f"{ratio:.2f}x", (place, top), textcoords="offset points", xytext=(0, 3), ha="center",
                       fontsize=8)  # fmt: skip
    steps.set_ylim(0, tallest * 1.35)
    graphs = [result[name]["graphs_per_block"] for name in names]
    labels = [
        f"{COMPILE_VARIANTS[name]}\n{n} graph{'s' if n > 1 else ''}"
        for name, n in zip(names, graphs, strict=True)
    ]
    steps.set_xticks(places, labels, fontsize=7)
    steps.set_ylabel("ms per step (forward + backward)")
    steps.set_title("a step, timed in turns: compiled / eager (graphs a block)", fontsize=10)
    steps.legend(fontsize=8, loc="upper left", ncol=2)
    shape = result["shape"]
    figure.suptitle(
        f"{shape['layers']} blocks, width {shape['d_model']}, {shape['seq']} tokens x {shape['batch']}, "
        f"{result['compiler']} on {result['world_size']} CPU processes",
        fontsize=10,
    )
    figure.tight_layout()
    return save(figure, path)


def plot_allreduce_algorithms(clusters: list, *, nodes: int, path=None) -> Figure:
    """One ring (the course's), NCCL's ring of channels, the hierarchy and the double binary tree
    across ``nodes`` nodes of each cluster:
    the all-reduce's time against the message's size (``network_model``'s prices per link class).

    Args:
        clusters: the clusters (``specs.CLUSTERS``), one panel each.
        nodes: K, the nodes the all-reduce spans.
        path: also save the figure here.
    """
    figure = Figure(figsize=(8.4, 3.4))
    axes = figure.subplots(1, len(clusters), sharey=True, squeeze=False)[0]
    sizes = [10 ** (3 + i / 8) for i in range(8 * 7 + 1)]  # 1 kB to 10 GB
    for axis, cluster in zip(axes, clusters, strict=True):
        g, inside, across = cluster.gpus_per_node, cluster.inside_node, cluster.between_nodes
        world = g * nodes
        lines = {
            "one ring, the course's (one NIC a node)": [
                network_model.flat_ring_seconds(s, world=world, across=across) for s in sizes
            ],
            "NCCL's ring (a channel per NIC)": [
                network_model.channel_rings_seconds(s, world=world, gpus_per_node=g, across=across)
                for s in sizes
            ],
            "hierarchical (every NIC)": [
                network_model.hierarchical_seconds(
                    s, gpus_per_node=g, nodes=nodes, inside=inside, across=across
                )
                for s in sizes
            ],
            "double binary tree": [network_model.tree_seconds(s, world=world, across=across) for s in sizes],
        }
        for (label, seconds), style in zip(lines.items(), ("-", ":", "-", "--"), strict=True):
            axis.plot(sizes, [1e3 * t for t in seconds], style, label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("message (bytes)")
        axis.set_title(f"{cluster.name}: {nodes} nodes of {g} GPUs ({world})", fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("all-reduce time (ms)")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    return save(figure, path)
