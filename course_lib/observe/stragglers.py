"""Which rank is slow, and what it costs the others: every rank's arrival at every collective.

A synchronous step runs at the pace of its slowest rank. Each collective completes only when
its last rank arrives, so a rank that is a little slower (a throttled GPU, a busy node, a rank
with longer sequences, a noisy neighbour on the network) makes every other rank wait at every
collective, and the step's time is the straggler's. Nothing in one rank's log shows it: each
rank sees only long collectives. Side by side, the ranks' arrival times do.

The meter: during a step, ``comm.CommLog`` notes each collective's arrival on this rank (the
wall clock when it was called) and how long it took. At the end of the step the ranks exchange
their notes (one ``all_gather_object``), and for each collective (its group and its number, the
same on every rank) each rank's *lateness* is its arrival after the first rank's. The rank
that arrives last is the straggler of that collective; what the others lost is the time between
their arrival and its. Summed over a step: each rank's lateness, each rank's time spent waiting
in collectives, the slowest rank, and the seconds it cost the others.

Cost: one small all-gather of Python objects per step. The clocks: on one machine the ranks
share one; across nodes, ``time.time()`` differs by the nodes' clock offset (NTP keeps it within
a millisecond or so), small beside a straggler worth finding.

Reference: Megatron-LM's ``StragglerDetector`` (each rank's kernel time, gathered and ranked),
and NVIDIA NeMo's straggler detection.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch.distributed as dist

from ..distributed import comm, runtime


@dataclass
class StepReport:
    """One step's arrivals, summed per rank (index = global rank).

    Args:
        step: the step's number.
        lateness_s: each rank's arrivals after the first rank's, summed over the step's collectives.
        waited_s: each rank's time inside collectives (waiting for the others, then the transfer).
        last_arrivals: how many of the step's collectives each rank arrived at last.
        collectives: how many collectives the step made.
        slowest_rank: the rank that arrived last at the most collectives (ties: the latest).
        cost_s: what the others lost waiting for it: their arrivals before its, summed.
    """

    step: int
    lateness_s: list[float]
    waited_s: list[float]
    last_arrivals: list[int]
    collectives: int
    slowest_rank: int
    cost_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def step_report(step: int, notes: list[list[tuple]]) -> StepReport:
    """Compare the ranks' notes of one step: who arrived when at each collective.

    Args:
        step: the step's number.
        notes: per rank, ``(group_ranks, sequence, arrival_s, seconds)`` for each collective it made.
    """
    world = len(notes)
    arrivals: dict[tuple, dict[int, float]] = defaultdict(dict)
    waited = [0.0] * world
    for rank, rank_notes in enumerate(notes):
        for group_ranks, sequence, arrival_s, seconds in rank_notes:
            if sequence >= 0:  # point to point has no common number: only the collectives
                arrivals[(tuple(group_ranks), sequence)][rank] = arrival_s
            waited[rank] += seconds or 0.0
    lateness, last_arrivals = [0.0] * world, [0] * world
    cost_by_rank = [0.0] * world  # what each rank, when it is the last, makes the others lose
    for by_rank in arrivals.values():
        first, last = min(by_rank.values()), max(by_rank.values())
        latest = max(by_rank, key=lambda rank: (by_rank[rank], rank))
        last_arrivals[latest] += 1
        for rank, arrival in by_rank.items():
            lateness[rank] += arrival - first
            cost_by_rank[latest] += last - arrival
    slowest = max(range(world), key=lambda rank: (last_arrivals[rank], lateness[rank]))
    return StepReport(step, lateness, waited, last_arrivals, len(arrivals), slowest, cost_by_rank[slowest])


class StragglerMeter:
    """Time every rank's arrivals at the collectives of each step; rank 0 gets the reports.

    >>> meter = StragglerMeter()
    >>> with meter.step(number):
    ...     train_step()
    >>> meter.reports  # rank 0: one StepReport per step

    Only the collectives made through ``course_lib.distributed.comm`` are seen (the course's DDP,
    ZeRO, FSDP and model parallelism); PyTorch's own DDP and FSDP call the transport directly.

    Args:
        group: the ranks compared (None: every rank).
    """

    def __init__(self, *, group=None):
        self.group = group
        self.reports: list[StepReport] = []

    @contextlib.contextmanager
    def step(self, number: int):
        """Note this rank's collectives while the block runs, then compare with the other ranks'.

        Args:
            number: the step's number, for the report.
        """
        with comm.CommLog() as log:
            yield
        mine = [(r.group_ranks, r.sequence, r.issued_s, r.seconds) for r in log.records]
        gathered = [None] * runtime.world_size(group=self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        if runtime.rank(group=self.group) == 0:
            self.reports.append(step_report(number, gathered))


def summary(reports: list[StepReport]) -> dict:
    """The run's straggler in a few numbers: who, how often, how late, at what cost to the others.

    Args:
        reports: the steps' reports (``StragglerMeter.reports``).
    """
    if not reports:
        return {"steps": 0}
    world = len(reports[0].lateness_s)
    slowest = statistics.mode(r.slowest_rank for r in reports)
    collectives = sum(r.collectives for r in reports)
    return {
        "steps": len(reports),
        "slowest_rank": slowest,
        "last_at": sum(r.last_arrivals[slowest] for r in reports) / max(collectives, 1),
        "lateness_per_step_s": [
            statistics.fmean(r.lateness_s[rank] for r in reports) for rank in range(world)
        ],
        "waited_per_step_s": [statistics.fmean(r.waited_s[rank] for r in reports) for rank in range(world)],
        "cost_s": sum(r.cost_s for r in reports if r.slowest_rank == slowest),
    }


def describe(reports: list[StepReport]) -> str:
    """The summary as one sentence a student can act on.

    Args:
        reports: the steps' reports.
    """
    found = summary(reports)
    if not found["steps"]:
        return "stragglers: no step made a collective through course_lib.distributed.comm"
    rank = found["slowest_rank"]
    others = [w for r, w in enumerate(found["waited_per_step_s"]) if r != rank]
    return (
        f"stragglers: rank {rank} arrived last at {found['last_at']:.0%} of the collectives, "
        f"{found['lateness_per_step_s'][rank] * 1e3:.1f} ms a step after the first; the others waited "
        f"{statistics.fmean(others) * 1e3 if others else 0:.1f} ms a step in collectives, "
        f"{found['cost_s']:.2f} s in {found['steps']} steps for rank {rank}"
    )
