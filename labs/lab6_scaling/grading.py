"""The grading suite of lab 6: what ``python -m course_lib.tools.labs check lab6_scaling`` checks.

Your speedup, efficiency and Karp-Flatt functions on the lab's reference table and on tables of
other shapes (sizes that are not powers of two, a speedup below one), against the course's
``course_lib.scaling``.
"""

from __future__ import annotations

import math

from course_lib import scaling
from course_lib.tools.labs import Property, Question

TABLES = {
    "the lab's DDP table": {1: 41.0, 2: 21.4, 4: 11.5, 8: 7.3, 16: 4.9},
    "the lab's FSDP table": {1: 44.5, 2: 23.6, 4: 13.0, 8: 8.9, 16: 6.3},
    "sizes 1, 3, 6": {1: 30.0, 3: 11.0, 6: 6.5},
    "a slowdown (gloo on shared cores)": {1: 0.128, 2: 0.161},
}


def check_speedup_and_efficiency(lab) -> None:
    for name, seconds in TABLES.items():
        got = lab.speedup_and_efficiency(seconds)
        assert sorted(got) == sorted(seconds), f"{name}: one entry per number of GPUs, got {sorted(got)}"
        for n, time in seconds.items():
            speedup = seconds[1] / time
            wanted = (speedup, speedup / n)
            assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got[n], wanted)), (
                f"{name}, N = {n}: you give speedup and efficiency {got[n]}"
            )


def check_karp_flatt(lab) -> None:
    for name, seconds in TABLES.items():
        speedups = {n: seconds[1] / time for n, time in seconds.items()}
        got = lab.karp_flatt_metric(speedups)
        assert sorted(got) == sorted(n for n in seconds if n > 1), (
            f"{name}: one metric per N above 1, got {sorted(got)}"
        )
        for n, metric in got.items():
            wanted = scaling.karp_flatt(speedups[n], n)
            assert math.isclose(metric, wanted, rel_tol=1e-9), f"{name}, N = {n}: you give {metric:.4f}"
    # Amdahl's own speedups give back Amdahl's serial fraction at every N
    amdahl = {n: scaling.amdahl_speedup(n, 0.05) for n in (1, 2, 4, 8, 16)}
    assert all(math.isclose(e, 0.05, rel_tol=1e-9) for e in lab.karp_flatt_metric(amdahl).values()), (
        "on Amdahl's speedups with a serial fraction of 0.05, the metric must be 0.05 at every N"
    )


PROPERTIES = [
    Property(
        "speedup T(1)/T(N) and efficiency speedup/N, for every N of the table",
        check_speedup_and_efficiency,
        "Strong scaling compares each run with the one-GPU run of the same work; the efficiency is the "
        "share of the ideal N-fold speedup. Keep N = 1 in the table (speedup 1, efficiency 100 %).",
    ),
    Property(
        "the Karp-Flatt metric inverts Amdahl's law at every N above 1",
        check_karp_flatt,
        "Write Amdahl's law S = 1 / (e + (1 - e)/N) and solve it for e; a measured S then gives the serial "
        "fraction that would explain it. N = 1 has no metric.",
    ),
]


def _table(strategy: str) -> dict[int, float]:
    return TABLES[f"the lab's {strategy} table"]


QUESTIONS = [
    Question(
        "ddp_efficiency_on_16_gpus",
        lambda: _table("DDP")[1] / _table("DDP")[16] / 16,
        "T(1) / T(16) / 16 from the lab's DDP table (course_lib/scaling.py)",
        rel_tol=1e-2,
    ),
    Question(
        "ddp_karp_flatt_on_8_gpus",
        lambda: scaling.karp_flatt(_table("DDP")[1] / _table("DDP")[8], 8),
        "the Karp-Flatt metric of the DDP speedup on 8 GPUs",
        rel_tol=1e-2,
    ),
    Question(
        "fsdp_karp_flatt_on_8_gpus",
        lambda: scaling.karp_flatt(_table("FSDP")[1] / _table("FSDP")[8], 8),
        "the same for FSDP: which is larger, and why (its traffic per step)?",
        rel_tol=1e-2,
    ),
]
