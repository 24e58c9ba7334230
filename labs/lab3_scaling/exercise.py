"""Exercise: lab 3: reading a strong-scaling study.

After running the study (locally: ``python -m course_lib.tools.study submit --local --gpus 1 2``; on
the cluster: ``python -m course_lib.tools.study submit --gpus 1 2 4 8 16 --wait``, then ``collect``),
you have a time per epoch for each number of GPUs. Fill in the two functions marked TODO in
exercise.py, then check your work (on a reference table shipped with the lab):

    python -m course_lib.tools.labs check lab3_scaling

and run them on your own ``results/scaling/scaling.csv``:

    python labs/lab3_scaling/exercise.py results/scaling/scaling.csv
"""

from __future__ import annotations

import sys

# An invented table, shaped like a real study (seconds per epoch against GPUs), to check your
# functions on; it was not measured. Your own numbers come from results/scaling/scaling.csv.
REFERENCE = {
    "ddp": {1: 41.0, 2: 21.3, 4: 11.4, 8: 6.4, 16: 3.9},
    "fsdp": {1: 44.5, 2: 24.0, 4: 13.5, 8: 8.2, 16: 5.6},
}


def speedup_and_efficiency(seconds: dict[int, float]) -> dict[int, tuple[float, float]]:
    """For each number of GPUs N: (speedup T(1)/T(N), parallel efficiency speedup / N)."""
    # TODO: speedup = seconds[1] / seconds[n]; efficiency = speedup / n; return {n: (speedup, efficiency)}
    raise NotImplementedError(
        "TODO: speedup = seconds[1] / seconds[n]; efficiency = speedup / n; return {n: (speedup, efficiency)}"
    )


def amdahl_serial_fraction(speedups: dict[int, float]) -> float:
    """The serial fraction s (0..1, in steps of 0.001) whose Amdahl speedup 1 / (s + (1 - s) / N) fits best."""

    # TODO: try s = 0, 0.001, ..., 1 and keep the one with the smallest sum of squared errors
    raise NotImplementedError(
        "TODO: try s = 0, 0.001, ..., 1 and keep the one with the smallest sum of squared errors"
    )


def check_run(lab) -> dict:
    results = {}
    for strategy, seconds in REFERENCE.items():
        table = lab.speedup_and_efficiency(seconds)
        results[strategy] = {
            "table": table,
            "serial": lab.amdahl_serial_fraction({n: speedup for n, (speedup, _) in table.items()}),
        }
    return results


def compare(got: dict, expected: dict) -> list[str]:
    problems = []
    for strategy in expected:
        for n, (speedup, efficiency) in expected[strategy]["table"].items():
            ours = got[strategy]["table"].get(n)
            if ours is None or abs(ours[0] - speedup) > 1e-6 or abs(ours[1] - efficiency) > 1e-6:
                problems.append(
                    f"{strategy} on {n} GPUs: expected speedup {speedup:.3f} and efficiency "
                    f"{efficiency:.3f}, got {ours}"
                )
                break
        if abs(got[strategy]["serial"] - expected[strategy]["serial"]) > 1e-9:
            problems.append(
                f"{strategy}: serial fraction {got[strategy]['serial']} instead of "
                f"{expected[strategy]['serial']}"
            )
    return problems


def summary(result: dict) -> str:
    return ", ".join(
        f"{s} on 16 GPUs: {result[s]['table'][16][1]:.0%} efficient, serial fraction {result[s]['serial']}"
        for s in result
    )


if __name__ == "__main__":
    from course_lib.tools.study import read_csv

    rows = read_csv(sys.argv[1]) if len(sys.argv) > 1 else None
    tables = (
        {
            s: {r["world_size"]: r["time_per_epoch_s"] for r in rows if r["strategy"] == s}
            for s in {r["strategy"] for r in rows}
        }
        if rows
        else REFERENCE
    )
    for strategy, seconds in tables.items():
        if 1 not in seconds:
            print(f"{strategy}: no 1-GPU run to compare with")
            continue
        table = speedup_and_efficiency(seconds)
        print(
            strategy,
            {n: f"{s:.2f}x, {e:.0%}" for n, (s, e) in table.items()},
            "serial fraction",
            amdahl_serial_fraction({n: s for n, (s, _) in table.items()}),
        )
