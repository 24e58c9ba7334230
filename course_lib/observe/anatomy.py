"""Where a training step's time goes: computing, communicating, waiting, overhead, and what is left.

A step takes T milliseconds. Knowing T says nothing about what to do; knowing what fills it
does. This lesson records a few warm steps of any strategy on every rank with ``torch.profiler``
(CPU activities, and CUDA ones where there is a GPU, so the same code reads a GPU trace) and cuts
each rank's step into five parts that add up to the step, exactly:

=====================  ================================================================================
compute                the rank computes: an operator runs on the training thread (CPU), or a kernel
                       that is not communication runs on the GPU
exposed communication  a collective or a message is in flight and the rank computes nothing
idle                   the part of that waiting that is *for a peer*: the rank issued collective #k
                       before the last rank of its group did (or waits for a pipeline message)
host overhead          the rank computes nothing and nothing is in flight, but the training thread is
                       inside the step's phases (forward, backward, optimizer...): Python, hooks, the
                       framework's dispatch, a GPU waiting for its kernels to be launched
unexplained            none of the above: time the record does not account for. It is reported,
                       never hidden, and small when the phases cover the step
=====================  ================================================================================

Beside the parts, each step records how long the training thread was ready to run but waited for
a core (``waited_for_core_ms``: Linux counts it per thread, ``/proc/thread-self/schedstat``). That
is the machine's load, not the program: on a shared machine, another process holding the core.
It is not a part (it falls inside the others: an operator that waited lasted longer), but where
it falls outside every phase and operator it shows up as unexplained, so ``unexplained_ms``
beyond it is what the record truly misses (``Budget.unexplained_beyond_load_ms``).

Communication *hidden* behind computation (a bucket's all-reduce while backward goes on, FSDP's
prefetched all-gather) costs nothing in this budget: that is what overlap buys, and the budget
measures it (``hidden_communication_ms``).

How the parts are measured. The profiler records every operator of the training thread, the
collectives executed by the backend's threads (gloo's ``gloo:all_reduce``...) or on the GPU
(NCCL's kernels), and the phases the step marks with ``phase()``. Each rank's step starts right
after a barrier, so times are measured from there on every rank and the ranks' clocks agree to
within the barrier's skew (tens of microseconds on one machine). Collective #k of a group is
matched across ranks through ``comm.CommRecord.sequence`` when every collective went through
``course_lib.distributed.comm``; otherwise (PyTorch's own DDP or FSDP2, a single group) by issue order.

Cost: the profiler slows each operator by a few microseconds, so record only a few steps; the
times it shows are those of a profiled step.

This file is the budget: the parts, and how they are cut from a step's timeline
(``parts``, ``budget``, with the interval algebra they need). ``profiling.py`` records the
timelines with ``torch.profiler`` on every rank and reads them back.

Papers and tools: the FSDP paper's exposed-communication analysis (Zhao et al., VLDB 2023,
section 3.3); ``torch.profiler`` and its Chrome/Perfetto traces (``export_chrome_trace``),
which ``profiling.record_steps`` writes per rank when asked (open them in https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import UserError

PHASE_PREFIX = "phase:"


STEP_MARK = "anatomy:step"

Intervals = list[tuple[float, float]]


def union(intervals: Intervals) -> Intervals:
    """The same time, as sorted, disjoint intervals."""
    merged: Intervals = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The time in both (each argument disjoint and sorted, as ``union`` returns)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The time in ``a`` and not in ``b`` (both disjoint and sorted)."""
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def phase(name: str):
    """Mark a part of the step (``with anatomy.phase("forward"):``); free when nothing records."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


@dataclass
class Collective:
    """One collective or message as one rank saw it, in milliseconds from its step's start."""

    name: str  # the backend's event: gloo:all_reduce, an NCCL kernel...
    start_ms: float  # it starts executing
    end_ms: float
    issued_ms: float | None  # the training thread asked for it (None: not known)
    key: tuple | None = None  # the same on every rank of its group: (group's ranks, sequence)
    point_to_point: bool = False
    tensor_bytes: int | None = None
    operation: str | None = None  # what the course asked for (gloo runs a reduce_scatter as an all_reduce)


@dataclass
class StepTimeline:
    """One recorded step of one rank: what ran when, in milliseconds from the step's start."""

    rank: int
    step_ms: float
    compute: Intervals
    collectives: list[Collective]
    phases: list[tuple[str, float, float]]
    host_busy: Intervals  # the training thread inside a phase or a non-compute operator
    waited_for_core_ms: float = 0.0  # ready to run, waiting for a core another process held


PARTS = ("compute", "exposed_communication", "idle", "host_overhead", "unexplained")
"""The parts a step is cut into; they add up to the step."""


@dataclass
class Budget:
    """Where one rank's step went. The five parts add up to ``step_ms``."""

    rank: int
    step_ms: float
    compute_ms: float
    exposed_communication_ms: float
    idle_ms: float
    host_overhead_ms: float
    unexplained_ms: float
    communication_ms: float  # every collective's time in flight, hidden or not
    hidden_communication_ms: float  # of which the rank was computing meanwhile
    waited_for_core_ms: float = 0.0  # the machine's load: inside the parts, not one of them

    @property
    def unexplained_beyond_load_ms(self) -> float:
        """The unexplained time the machine's load cannot account for: what the record misses."""
        return max(0.0, self.unexplained_ms - self.waited_for_core_ms)

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of the step."""
        return {f"{part}_share": getattr(self, f"{part}_ms") / self.step_ms for part in PARTS}

    def as_dict(self) -> dict:
        return asdict(self) | self.shares()


# #region budget
def parts(timelines: list[list[StepTimeline]], rank: int, step: int) -> dict[str, Intervals]:
    """When, in ``rank``'s recorded step ``step``, it computed, communicated exposed, idled...

    At each moment of the step, the first that holds names it: the rank computes; a collective
    or message is in flight and a peer has not issued it yet (idle) or has (exposed
    communication); the training thread is inside a phase (host overhead); nothing (unexplained).
    Also ``"communication"``: every collective's time in flight, hidden or not.

    Args:
        timelines: every rank's recorded steps (``Anatomy.timelines``).
        rank: whose step.
        step: which of its recorded steps.
    """
    mine = timelines[rank][step]
    window = [(0.0, mine.step_ms)]
    compute = intersect(mine.compute, window)
    in_flight = intersect(union([(c.start_ms, c.end_ms) for c in mine.collectives]), window)
    # A collective issued before the last rank of its group issued it waits for that rank.
    last_issue: dict[tuple, float] = {}
    for other in timelines:
        if step < len(other):
            for c in other[step].collectives:
                if c.key is not None and c.issued_ms is not None:
                    last_issue[c.key] = max(last_issue.get(c.key, c.issued_ms), c.issued_ms)
    waiting = []
    for c in mine.collectives:
        if c.point_to_point:  # a pipeline's message: waiting for it is the bubble
            waiting.append((c.start_ms, c.end_ms))
        elif c.key in last_issue and c.issued_ms is not None:
            waiting.append((c.issued_ms, min(c.end_ms, last_issue[c.key])))
    idle = subtract(intersect(union(waiting), window), compute)
    exposed = subtract(subtract(in_flight, compute), idle)
    accounted = union(compute + in_flight + idle)
    host = subtract(intersect(mine.host_busy, window), accounted)
    return {
        "compute": compute,
        "exposed_communication": exposed,
        "idle": idle,
        "host_overhead": host,
        "unexplained": subtract(subtract(window, accounted), host),
        "communication": in_flight,
    }


def budget(timelines: list[list[StepTimeline]], rank: int, step: int) -> Budget:
    """How long each of ``parts`` lasts in ``rank``'s recorded step ``step``; they add up to the step.

    Args:
        timelines: every rank's recorded steps (``Anatomy.timelines``).
        rank: whose step.
        step: which of its recorded steps.
    """
    cut = parts(timelines, rank, step)
    return Budget(
        rank=rank,
        step_ms=timelines[rank][step].step_ms,
        compute_ms=length(cut["compute"]),
        exposed_communication_ms=length(cut["exposed_communication"]),
        idle_ms=length(cut["idle"]),
        host_overhead_ms=length(cut["host_overhead"]),
        unexplained_ms=length(cut["unexplained"]),
        communication_ms=length(cut["communication"]),
        hidden_communication_ms=length(intersect(cut["communication"], cut["compute"])),
        waited_for_core_ms=timelines[rank][step].waited_for_core_ms,
    )


# #endregion budget


@dataclass
class Anatomy:
    """Every rank's recorded steps and their budgets (every rank holds all of them)."""

    timelines: list[list[StepTimeline]]  # [rank][step]
    budgets: list[list[Budget]] = field(default_factory=list)  # [rank][step]
    conditions: dict = field(default_factory=dict)

    @classmethod
    def of(cls, timelines: list[list[StepTimeline]], conditions: dict | None = None) -> Anatomy:
        """The anatomy of recorded timelines: every rank's budget of every step, computed from them."""
        budgets = [
            [budget(timelines, rank, i) for i in range(len(steps))] for rank, steps in enumerate(timelines)
        ]
        return cls(timelines=timelines, budgets=budgets, conditions=dict(conditions or {}))

    def save(self, path: str | Path) -> None:
        """Write the summary, the table and the recorded timelines as JSON (what ``--profile`` writes
        as ``anatomy.json``); ``load`` reads it back, computing the budgets again from the timelines.

        Args:
            path: the JSON file to write.
        """
        timelines = [[asdict(timeline) for timeline in steps] for steps in self.timelines]
        record = self.summary() | {"table": self.table().splitlines(), "timelines": timelines}
        Path(path).write_text(json.dumps(record, indent=1) + "\n")

    def typical(self, rank: int) -> Budget:
        """The rank's step of median length (its five parts add up, unlike medians of each part).

        Args:
            rank: whose step, from 0 to the number of ranks recorded - 1.
        """
        if not 0 <= rank < len(self.budgets):
            raise UserError(
                f"rank {rank} was not recorded: the anatomy holds ranks 0 to {len(self.budgets) - 1}"
            )
        steps = sorted(self.budgets[rank], key=lambda budget: budget.step_ms)
        return steps[len(steps) // 2]

    def typical_step(self) -> int:
        """Which recorded step has the median length on rank 0, for a picture of one step."""
        steps = sorted(range(len(self.budgets[0])), key=lambda i: self.budgets[0][i].step_ms)
        return steps[len(steps) // 2]

    def summary(self) -> dict:
        """The typical step's parts, averaged over the ranks, in ms and as shares of the step, and
        ``steps_ms``: every recorded step's length (its slowest rank's), to see the noise."""
        typical = [self.typical(rank) for rank in range(len(self.budgets))]
        fields = [name for name in Budget.__dataclass_fields__ if name != "rank"]
        averaged = {name: statistics.fmean(getattr(b, name) for b in typical) for name in fields}
        step = averaged["step_ms"]
        averaged |= {f"{part}_share": averaged[f"{part}_ms"] / step for part in PARTS}
        # how much the steps differ from one another: the noise any one number carries
        steps_ms = [max(rank[i].step_ms for rank in self.budgets) for i in range(len(self.budgets[0]))]
        return averaged | {
            "steps_ms": steps_ms,
            "per_rank": [b.as_dict() for b in typical],
            "conditions": self.conditions,
        }

    def table(self) -> str:
        """The typical step of every rank, one line each, in ms and percent of the step."""
        head = (
            f"{'rank':>4} {'step ms':>8} {'compute':>14} {'exposed comm':>14} {'idle':>13} "
            f"{'host':>13} {'unexplained':>13} {'comm hidden':>12}"
        )
        lines = [head]
        for rank in range(len(self.budgets)):
            b = self.typical(rank)

            def cell(ms: float, width: int = 13) -> str:
                return f"{ms:6.2f} ({ms / b.step_ms:4.0%})".rjust(width)

            lines.append(
                f"{rank:>4} {b.step_ms:8.2f} {cell(b.compute_ms, 14)} {cell(b.exposed_communication_ms, 14)} "
                f"{cell(b.idle_ms)} {cell(b.host_overhead_ms)} {cell(b.unexplained_ms)} "
                f"{b.hidden_communication_ms:12.2f}"
            )
        return "\n".join(lines)
