"""The grading suite of lab 7: what ``python -m course_lib.tools.labs check lab7_scaling`` checks.

Your functions on tables made from the model with known terms (so the right answer is known):
speedup, efficiency and Karp-Flatt against ``course_lib.plan.scaling``, the communication term against
the alpha-beta model, and both fits, which must give back the terms the table was made from. Then
your answers against *your own* measurements: the ``[measured]`` block of your answers.toml (your
study's seconds per epoch, your network's alpha and beta) is fitted again with the course's
``scaling.fit_strong_scaling`` and ``fit_strong_scaling_with_scale``, and your fitted terms and
prediction must agree with them. Fewer than four sizes, or a negative term even with the
communication's scale, is refused with what to measure instead.
"""

from __future__ import annotations

import math
import random

from course_lib.plan import scaling
from course_lib.tools.labs import Property, Question, Refused, case_seed

_DRAW = random.Random(case_seed(6))  # this grading's own numbers: a recording of another cannot answer
_SCALE = _DRAW.uniform(0.5, 2.0)
TABLES = {
    name: {n: seconds * _SCALE for n, seconds in table.items()}
    for name, table in {
        "a cluster-shaped DDP table": {1: 41.0, 2: 21.4, 4: 11.5, 8: 7.3, 16: 4.9},
        "a cluster-shaped FSDP table": {1: 44.5, 2: 23.6, 4: 13.0, 8: 8.9, 16: 6.3},
        "sizes 1, 3, 6": {1: 30.0, 3: 11.0, 6: 6.5},
        "a slowdown (gloo on shared cores)": {1: 0.128, 2: 0.161},
    }.items()
}
LINK = dict(
    alpha_s=20e-6 * _DRAW.uniform(0.5, 2.0),
    beta_bytes_per_s=12e9 * _DRAW.uniform(0.5, 2.0),
    gradient_bytes=4 * 11_689_512,
    all_reduces=98,
)
"""A ResNet-18's fp32 gradients, 98 steps an epoch, a link of about 20 us and 12 GB/s."""
COMPUTE_S, FIXED_S = 40.0 * _SCALE, 1.5 * _DRAW.uniform(0.5, 2.0)
"""The terms the fit must give back."""
COMMUNICATION_SCALE = _DRAW.uniform(0.3, 5.0)
"""The communication's scale the three-term fit must give back: below 1 where DDP hides some of it."""


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


def _model_communication(n: int) -> float:
    return LINK["all_reduces"] * scaling.ring_all_reduce_seconds(
        n,
        message_bytes=LINK["gradient_bytes"],
        latency_s=LINK["alpha_s"],
        bandwidth_bytes_per_s=LINK["beta_bytes_per_s"],
    )


def check_communication(lab) -> None:
    for n in (1, 2, 3, 8, 16):
        got = lab.communication_seconds(n, **LINK)
        assert math.isclose(got, _model_communication(n), rel_tol=1e-9, abs_tol=1e-12), (
            f"N = {n}: you give T_comm = {got:.6g} s for 98 all-reduces of 46.8 MB at "
            f"{LINK['alpha_s'] * 1e6:.3g} us and {LINK['beta_bytes_per_s'] / 1e9:.3g} GB/s"
        )


def check_fit(lab) -> None:
    compute, fixed = COMPUTE_S, FIXED_S
    for sizes in ((1, 2, 4, 8, 16), (1, 2), (2, 4, 8)):
        communication = {n: _model_communication(n) for n in sizes}
        seconds = {n: compute / n + communication[n] + fixed for n in sizes}
        got = lab.fit_compute_and_fixed(seconds, communication)
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, (compute, fixed))), (
            f"runs at N = {sizes} made with T_compute {compute:.4g} s and T_fixed {fixed:.4g} s: you give {got}"
        )
    sizes = (1, 2, 4, 8, 16)  # measured times are noisy: the fit is the least-squares one
    communication = {n: _model_communication(n) for n in sizes}
    seconds = {n: (compute / n + communication[n] + fixed) * (1.04 if n % 4 else 0.97) for n in sizes}
    got = lab.fit_compute_and_fixed(seconds, communication)
    wanted = scaling.fit_strong_scaling(seconds, communication)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, wanted)), (
        f"noisy runs: you give {got}, the least-squares fit is {wanted}"
    )
    sizes = (1, 2, 3, 4)  # four processes on two cores: past two, the compute no longer divides
    communication = {n: _model_communication(n) for n in sizes}
    seconds = {n: compute / min(n, 2) + communication[n] + fixed for n in sizes}
    got = lab.fit_compute_and_fixed(seconds, communication, cores=2)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, (compute, fixed))), (
        f"runs at N = 1-4 on 2 cores made with T_compute {compute:.4g} s and T_fixed {fixed:.4g} s: you give "
        f"{got} (cores=2)"
    )


def check_fit_with_scale(lab) -> None:
    compute, scale, fixed = COMPUTE_S, COMMUNICATION_SCALE, FIXED_S
    for sizes in ((1, 2, 3), (1, 2, 4, 8, 16), (2, 4, 8)):
        communication = {n: _model_communication(n) for n in sizes}
        seconds = {n: compute / n + scale * communication[n] + fixed for n in sizes}
        got = lab.fit_with_communication_scale(seconds, communication)
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, (compute, scale, fixed))), (
            f"runs at N = {sizes} made with T_compute {compute:.4g} s, k {scale:.4g} and T_fixed {fixed:.4g} s: "
            f"you give {got}"
        )
    sizes = (1, 2, 3, 4, 8, 16)  # measured times are noisy: the fit is the least-squares one
    communication = {n: _model_communication(n) for n in sizes}
    seconds = {n: (compute / n + scale * communication[n] + fixed) * (1.04 if n % 4 else 0.97) for n in sizes}
    got = lab.fit_with_communication_scale(seconds, communication)
    wanted = scaling.fit_strong_scaling_with_scale(seconds, communication)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, wanted)), (
        f"noisy runs: you give {got}, the least-squares fit is {wanted}"
    )
    sizes = (1, 2, 3, 4)  # four processes on two cores
    communication = {n: _model_communication(n) for n in sizes}
    seconds = {n: compute / min(n, 2) + scale * communication[n] + fixed for n in sizes}
    got = lab.fit_with_communication_scale(seconds, communication, cores=2)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, (compute, scale, fixed))), (
        f"runs at N = 1-4 on 2 cores made with T_compute {compute:.4g} s, k {scale:.4g} and T_fixed "
        f"{fixed:.4g} s: you give {got} (cores=2)"
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
    Property(
        "T_comm(N) is the alpha-beta model of a ring all-reduce, times the all-reduces of an epoch",
        check_communication,
        "A ring all-reduce over N ranks is 2(N-1) steps; each step pays one latency and moves 1/N of the "
        "bytes (notebook 02). Watch the units: alpha in seconds, beta in bytes per second.",
    ),
    Property(
        "the fit gives back the T_compute and T_fixed a table was made from, and least squares on noise",
        check_fit,
        "Subtract the predicted communication from each time: what is left is T_compute x (1/N) + T_fixed, "
        "a straight line in x = 1/N. Its least-squares slope and intercept are the two terms.",
    ),
    Property(
        "with the communication's scale k fitted too, the fit gives back all three terms, and least squares",
        check_fit_with_scale,
        "The model stays linear in its three unknowns; one equation per run. Solve them together in float64 "
        "(with three runs exactly, with more in the least-squares sense).",
    ),
]


def _fitted(answers: dict) -> dict[str, float]:
    """The course's fits of the student's own measurements: with T_comm as predicted, and with its scale."""
    measured = answers["measured"]
    seconds = {int(n): float(t) for n, t in measured["seconds_per_epoch"].items()}
    cores = measured.get("cores")  # a local study: the processes shared this many cores

    def communication(n):
        return measured["all_reduces_per_epoch"] * scaling.ring_all_reduce_seconds(
            n,
            message_bytes=measured["gradient_bytes"],
            latency_s=measured["alpha_us"] * 1e-6,
            bandwidth_bytes_per_s=measured["beta_gbps"] * 1e9,
        )

    predicted = {n: communication(n) for n in seconds}
    plain, _ = scaling.fit_strong_scaling(seconds, predicted, cores=cores)
    if len(seconds) < 4:
        raise Refused(
            f"your [measured] block has runs at N = {sorted(seconds)}: three terms fitted through three runs "
            "go through them exactly and say nothing of how well the model holds; run the study with "
            "--gpus 1 2 3 4 (or more) and paste the block again"
        )
    compute, scale, fixed = scaling.fit_strong_scaling_with_scale(seconds, predicted, cores=cores)
    negative = {
        name: value
        for name, value in (
            ("T_compute", compute),
            ("the communication's scale k", scale),
            ("T_fixed", fixed),
        )
        if value < 0 or (name == "T_compute" and value == 0)
    }
    if negative:
        said = ", ".join(f"{name} = {value:.3g}" for name, value in negative.items())
        raise Refused(
            f"your runs give {said} even with the communication's scale: no time is negative, so this "
            "model still lacks a term your runs pay (more processes than cores? a step that waits for "
            "data?); measure where the step goes (--profile) before you fit"
        )
    return {
        "plain_fit_compute_s": plain,
        "fitted_compute_s": compute,
        "communication_scale": scale,
        "fitted_fixed_s": fixed,
        "predicted_seconds_at_8": compute * scaling.compute_share(8, cores=cores)
        + scale * communication(8)
        + fixed,
    }


QUESTIONS = [
    Question(key, lambda answers, key=key: _fitted(answers)[key], how, rel_tol=1e-2, from_answers=True)
    for key, how in (
        (
            "plain_fit_compute_s",
            "the slope of T(N) - T_comm(N) against 1/N, with T_comm as predicted: negative if the model "
            "lacks a term",
        ),
        ("fitted_compute_s", "T_compute of the three-term fit of your [measured] block"),
        (
            "communication_scale",
            "k of the same fit: how many of the micro-benchmark's all-reduces one inside training costs",
        ),
        ("fitted_fixed_s", "the fit's T_fixed: what no number of processes removes"),
        (
            "predicted_seconds_at_8",
            "T_compute/8 + k T_comm(8) + T_fixed, with your three fitted terms and your network's alpha "
            "and beta",
        ),
    )
]
