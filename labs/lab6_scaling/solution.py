"""Solution of lab 6: reading a strong-scaling study.

After running the study (locally: ``python -m course_lib.tools.study submit --local --gpus 1 2``; on
the cluster: ``python -m course_lib.tools.study submit --gpus 1 2 4 8 16 --wait``, then ``collect``),
you have a time per epoch for each number of GPUs. Fill in the two functions marked TODO in
exercise.py, then check your work (the grading suite, on a reference table shipped with the lab):

    python -m course_lib.tools.labs check lab6_scaling

and run them on your own ``results/scaling/scaling.csv``:

    python labs/lab6_scaling/exercise.py results/scaling/scaling.csv
"""

from __future__ import annotations

import sys

# An invented table, shaped like a real study (seconds per epoch against GPUs), to check your
# functions on; it was not measured. It follows T(N) = T_compute/N + T_comm(N) + T_fixed with the
# gradients on NVLink up to 4 GPUs (one node) and on the network beyond. Your own numbers come from
# results/scaling/scaling.csv.
REFERENCE = {
    "ddp": {1: 41.0, 2: 21.4, 4: 11.5, 8: 7.3, 16: 4.9},
    "fsdp": {1: 44.5, 2: 23.6, 4: 13.0, 8: 8.9, 16: 6.3},
}


def speedup_and_efficiency(seconds: dict[int, float]) -> dict[int, tuple[float, float]]:
    """For each number of GPUs N: (speedup T(1)/T(N), parallel efficiency speedup / N)."""
    # BEGIN SOLUTION: strong scaling compares each run with the one-GPU run of the same work: the speedup is how many times faster, the efficiency how much of the ideal N-fold speedup that is; one entry per N, the one-GPU run included
    return {n: (seconds[1] / t, seconds[1] / t / n) for n, t in sorted(seconds.items())}
    # END SOLUTION


def karp_flatt_metric(speedups: dict[int, float]) -> dict[int, float]:
    """For each N > 1, the serial fraction the measured speedup implies: e = (1/S - 1/N) / (1 - 1/N).

    Amdahl's serial fraction would give the same e at every N; communication gives an e that
    changes with N (Karp and Flatt, 1990).
    """
    # BEGIN SOLUTION: Amdahl's law gives S from e and N; solve it for e and apply it at each N above 1 (N = 1 tells nothing)
    return {n: (1 / speedup - 1 / n) / (1 - 1 / n) for n, speedup in sorted(speedups.items()) if n > 1}
    # END SOLUTION


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
            "Karp-Flatt",
            {n: round(e, 3) for n, e in karp_flatt_metric({n: s for n, (s, _) in table.items()}).items()},
        )
