"""Timing two implementations fairly on a noisy machine: interleaved rounds, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ..distributed import collective_check, comm


def interleaved_medians(
    steps_by_name: dict[str, Callable[[], object]],
    steps: int,
    warmup: int,
    *,
    after_each_round: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median milliseconds of each step function, the variants run in rotating order round by round.

    Rotating makes slow drifts of the machine (clock, caches, the other processes on the cores)
    hit every variant alike, so their ratio is fair. Every rank starts each step together (a
    barrier), so one rank's lateness is not counted as another's communication. The cross-rank
    check of each collective (``collective_check.unchecked``) is off: it is a collective of its own.

    Args:
        steps_by_name: one step function per variant, the same on every rank (a collective).
        steps: timed rounds; each variant's median over them is returned.
        warmup: untimed rounds first (allocations, caches and lazy set-up settle in them).
        after_each_round: called after each timed round, untimed (to read what the round
            recorded, e.g. a pipeline's events), or None.
    """
    times = {name: [] for name in steps_by_name}
    names = list(steps_by_name)
    with collective_check.unchecked():
        for round_index in range(warmup + steps):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                comm.barrier()
                started = time.perf_counter()
                steps_by_name[name]()
                if round_index >= warmup:
                    times[name].append(time.perf_counter() - started)
            if round_index >= warmup and after_each_round is not None:
                after_each_round()
    return {name: 1000 * statistics.median(values) for name, values in times.items()}
