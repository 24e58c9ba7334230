"""The strong-scaling models: Amdahl, Karp-Flatt, and T(N) = T_compute/N + T_comm(N) + T_fixed."""

from __future__ import annotations

import numpy
import pytest

from course_lib.errors import UserError
from course_lib.observe import anatomy
from course_lib.plan import scaling


@pytest.mark.parametrize("serial_fraction", [0.0, 0.05, 0.3])
def test_karp_flatt_recovers_amdahls_serial_fraction_at_every_size(serial_fraction):
    for processes in (2, 4, 16, 64):
        speedup = scaling.amdahl_speedup(processes, serial_fraction=serial_fraction)
        assert scaling.karp_flatt(speedup, processes) == pytest.approx(serial_fraction)


def test_karp_flatt_grows_with_n_when_the_loss_is_communication():
    speedups = {
        n: 100
        / scaling.strong_scaling_seconds(
            n,
            compute_s=100,
            communication_s=scaling.ring_all_reduce_seconds(
                n, message_bytes=1e8, latency_s=1e-3, bandwidth_bytes_per_s=1e10
            ),
            fixed_s=0,
        )
        for n in (2, 4, 8, 16)
    }
    metric = [scaling.karp_flatt(speedups[n], n) for n in sorted(speedups)]
    assert metric == sorted(metric) and metric[-1] > metric[0]
    with pytest.raises(ValueError, match="at least 2 processes"):
        scaling.karp_flatt(1.0, 1)


def test_a_speedup_below_one_means_communication_costs_more_than_the_compute_saved():
    for communication_s in (0.3, 0.5, 0.7):
        two = scaling.strong_scaling_seconds(2, compute_s=1.0, communication_s=communication_s, fixed_s=0.2)
        one = scaling.strong_scaling_seconds(1, compute_s=1.0, communication_s=0.0, fixed_s=0.2)
        assert (one / two < 1) == (communication_s > 1.0 * (1 - 1 / 2))
        assert scaling.karp_flatt(one / two, 2) > 1 or one / two >= 1


def test_the_ring_all_reduce_model():
    alpha, beta, size = 1e-5, 1e9, 4e6
    assert (
        scaling.ring_all_reduce_seconds(1, message_bytes=size, latency_s=alpha, bandwidth_bytes_per_s=beta)
        == 0
    )
    two = scaling.ring_all_reduce_seconds(2, message_bytes=size, latency_s=alpha, bandwidth_bytes_per_s=beta)
    assert two == pytest.approx(2 * (alpha + size / 2 / beta))
    # the bandwidth term approaches 2 x bytes / beta; the latency term keeps growing with N
    many = scaling.ring_all_reduce_seconds(1000, message_bytes=size, latency_s=0, bandwidth_bytes_per_s=beta)
    assert many == pytest.approx(2 * size / beta, rel=1e-2)


def _sweep(processes: int, latency: float, bandwidth: float, count: int) -> tuple[list[int], list[float]]:
    """Message sizes from 8 bytes, each 4 times the last, and the times the alpha-beta model gives them."""
    sizes = [8 * 4**k for k in range(count)]
    model = dict(latency_s=latency, bandwidth_bytes_per_s=bandwidth)
    return sizes, [scaling.ring_all_reduce_seconds(processes, message_bytes=s, **model) for s in sizes]


@pytest.mark.parametrize("processes", [2, 3, 4, 8])
def test_the_alpha_beta_fit_recovers_the_model_it_was_made_from(processes):
    latency, bandwidth = 7e-6, 23e9
    sizes, seconds = _sweep(processes, latency, bandwidth, 14)
    fitted = scaling.fit_ring_all_reduce(processes, message_bytes=sizes, seconds=seconds)
    assert fitted == pytest.approx((latency, bandwidth), rel=1e-9)
    # 5 % noise on every time still gives both within 10 %
    noisy = [t * (1.05 if i % 2 else 0.95) for i, t in enumerate(seconds)]
    assert scaling.fit_ring_all_reduce(processes, message_bytes=sizes, seconds=noisy) == pytest.approx(
        (latency, bandwidth), rel=0.1
    )


@pytest.mark.parametrize("processes", [2, 4])
def test_the_fit_by_regime_recovers_each_parameter_where_it_rules_and_ignores_a_late_wake_up(processes):
    latency, bandwidth = 50e-6, 1e9
    sizes, seconds = _sweep(processes, latency, bandwidth, 12)
    seconds[1] *= 20  # one small message waited for the scheduler
    seconds[7] *= 5  # a size between the regimes where the transport changes protocol
    alpha, beta = scaling.fit_ring_all_reduce_by_regime(processes, message_bytes=sizes, seconds=seconds)
    assert alpha == pytest.approx(latency, rel=0.02)  # the small messages' bytes cost ~1 %
    assert beta == pytest.approx(bandwidth, rel=1e-3)  # the largest message, its latency taken out
    # a large size slower than a larger one (a busy machine) does not tilt beta: it is the largest's
    seconds[-3] *= 3
    assert scaling.fit_ring_all_reduce_by_regime(processes, message_bytes=sizes, seconds=seconds)[1] == beta
    with pytest.raises(ValueError, match="widen the sweep"):
        scaling.fit_ring_all_reduce_by_regime(processes, message_bytes=sizes[:6], seconds=seconds[:6])


def test_the_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least 2 processes"):
        scaling.fit_ring_all_reduce(1, message_bytes=[8, 16], seconds=[1, 2])
    with pytest.raises(ValueError, match="two different sizes"):
        scaling.fit_ring_all_reduce(2, message_bytes=[8, 8], seconds=[1, 2])


def _epoch_seconds(sizes, *, compute, scale, fixed, noise=None):
    """Times made from T_compute/N + k T_comm(N) + T_fixed, T_comm a ring on a 20 us, 10 GB/s link."""
    communication = {
        n: 50
        * scaling.ring_all_reduce_seconds(n, message_bytes=4e6, latency_s=20e-6, bandwidth_bytes_per_s=1e10)
        for n in sizes
    }
    seconds = {n: compute / n + scale * communication[n] + fixed for n in sizes}
    return {n: t * (noise(n) if noise else 1) for n, t in seconds.items()}, communication


def test_the_communication_scale_is_the_term_a_negative_compute_time_misses():
    """Runs whose all-reduces cost 4.7 times the prediction: trusting the prediction gives a negative
    T_compute; fitting the scale too gives back all three terms, exactly from three runs."""
    seconds, communication = _epoch_seconds((1, 2, 3), compute=0.03, scale=4.7, fixed=0.05)
    compute, fixed = scaling.fit_strong_scaling(seconds, communication)
    assert compute < 0
    assert scaling.fit_strong_scaling_with_scale(seconds, communication) == pytest.approx((0.03, 4.7, 0.05))
    # with more runs than terms, and noise, it is the least-squares fit: numpy's, from its own equations
    sizes = (1, 2, 3, 4, 8)
    seconds, communication = _epoch_seconds(
        sizes, compute=40.0, scale=0.6, fixed=1.5, noise=lambda n: 1.03 if n % 2 else 0.98
    )
    rows = numpy.array([[1 / n, communication[n], 1.0] for n in sizes])
    wanted = numpy.linalg.lstsq(rows, numpy.array([seconds[n] for n in sizes]), rcond=None)[0]
    assert scaling.fit_strong_scaling_with_scale(seconds, communication) == pytest.approx(list(wanted))
    # its standard errors are least squares' own: numpy's covariance of the same fit
    residual = numpy.array([seconds[n] for n in sizes]) - rows @ wanted
    covariance = residual @ residual / (len(sizes) - 3) * numpy.linalg.inv(rows.T @ rows)
    errors = scaling.strong_scaling_standard_errors(seconds, communication)
    assert errors == pytest.approx(list(numpy.sqrt(covariance.diagonal())))
    exact, communication = _epoch_seconds((1, 2, 3, 4), compute=0.03, scale=4.7, fixed=0.05)
    assert scaling.strong_scaling_standard_errors(exact, communication) == pytest.approx((0, 0, 0), abs=1e-9)
    with pytest.raises(ValueError, match="four numbers of processes at least"):
        scaling.strong_scaling_standard_errors({n: exact[n] for n in (1, 2, 3)}, communication)


def test_the_scaled_fit_refuses_too_few_runs_and_a_communication_it_cannot_tell_apart():
    seconds, communication = _epoch_seconds((1, 2), compute=1.0, scale=1.0, fixed=0.1)
    with pytest.raises(ValueError, match=r"three numbers of processes at least, got \[1, 2\]"):
        scaling.fit_strong_scaling_with_scale(seconds, communication)
    with pytest.raises(ValueError, match="cannot be told apart"):
        scaling.fit_strong_scaling_with_scale({1: 1.0, 2: 0.6, 4: 0.4}, {1: 0.1, 2: 0.1, 4: 0.1})


def _steps(compute, exposed, idle, host, unexplained):
    parts = dict(zip(anatomy.PARTS, (compute, exposed, idle, host, unexplained)))
    return {f"{part}_ms": ms for part, ms in parts.items()} | {"step_ms": sum(parts.values())}


def test_the_step_budget_closes_term_by_term():
    serial = _steps(8.0, 0.0, 0.0, 2.0, 0.2)
    parallel = _steps(5.0, 3.0, 0.5, 1.5, 0.1)
    budget = scaling.step_budget(serial, parallel, processes=2)
    assert budget["perfect_ms"] == pytest.approx(5.1)
    assert budget["compute_ms"] == pytest.approx(1.0)  # 5 ms where 4 would have been perfect
    assert budget["exposed_communication_ms"] == pytest.approx(3.0)  # one process never pays it
    assert budget["host_overhead_ms"] == pytest.approx(0.5)
    assert budget["unexplained_ms"] == pytest.approx(0.0)
    losses = sum(budget[f"{part}_ms"] for part in anatomy.PARTS)
    assert budget["perfect_ms"] + losses == pytest.approx(parallel["step_ms"])


def test_the_step_budget_refuses_what_is_not_an_anatomy():
    with pytest.raises(UserError, match="needs step_ms, exposed_communication_ms, idle_ms.*anatomy.json"):
        scaling.step_budget({"compute_ms": 1.0}, {"compute_ms": 1.0}, processes=2)
    with pytest.raises(UserError, match="processes must be at least 1"):
        scaling.step_budget(_steps(1, 0, 0, 0, 0), _steps(1, 0, 0, 0, 0), processes=0)


def test_the_picture_of_a_budget_stacks_each_runs_parts_in_ms():
    from course_lib.tools.plots import plot_budget

    figure = plot_budget(
        {"single": _steps(8.0, 0.0, 0.0, 2.0, 0.2), "ddp, 2": _steps(5.0, 3.0, 0.5, 1.5, 0.1)},
        perfect_ms=5.1,
        perfect_label="T(1) / 2",
    )
    [axis] = figure.axes
    assert axis.get_ylabel() == "time per step (ms)"
    assert [label.get_text() for label in axis.get_xticklabels()] == ["single", "ddp, 2"]
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert legend[-1] == "T(1) / 2" and "exposed communication" in legend
    tops = sorted(text.get_text() for text in axis.texts)
    assert tops == ["10.1 ms", "10.2 ms"]  # each bar's parts add up to its step


def test_a_study_takes_every_speedup_against_its_one_process_baseline(tmp_path):
    import json

    from course_lib.tools import study

    runs = study.plan_runs([2], ["ddp", "fsdp"], gpus_per_node=4)
    assert [run.name for run in runs] == ["single-1", "ddp-2", "fsdp-2"]
    seconds = {"single-1": 1.0, "ddp-2": 0.8, "fsdp-2": 2.0}
    for run in runs:
        record = {
            "sharding": run.sharding, "impl": "torch", "world_size": run.world_size, "global_batch_size": 64,
            "epoch_time_s": seconds[run.name], "samples_per_s": 64 / seconds[run.name], "val_acc": 0.9,
            "val_loss": 0.3, "peak_mem_mb": 500.0, "model_state_mb": 0.5,
        }  # fmt: skip
        lines = [json.dumps(record | {"epoch": epoch}) for epoch in (1, 2)]
        run.metrics_path(tmp_path).write_text("\n".join(lines) + "\n")
    (tmp_path / "study.json").write_text(
        json.dumps({"settings": {"epochs": 2}, "runs": [vars(run) for run in runs]})
    )
    rows, failed = study.collect(tmp_path)
    assert failed == [] and [row["run"] for row in rows] == ["single-1", "ddp-2", "fsdp-2"]
    assert {row["run"]: row["speedup"] for row in rows} == pytest.approx(
        {"single-1": 1.0, "ddp-2": 1.25, "fsdp-2": 0.5}
    )
    assert scaling.format_table(rows).splitlines()[-1] == (
        "speedup and efficiency against single-1 (one process, no wrapper)"
    )
    written = study.read_csv(study.write_csv(rows, tmp_path / "scaling.csv"))
    assert {row["baseline"] for row in written} == {"single-1 (one process, no wrapper)"}


def test_the_study_figure_draws_the_baseline_as_one_point_and_each_sharding_from_its_own_runs():
    """A sharding's line starts at its own one-process run, not at the baseline's: no vertical
    drop at N = 1; the baseline is one labelled point on every panel."""
    from course_lib.tools import plots

    def row(sharding, world_size, seconds):
        return {
            "sharding": sharding, "world_size": world_size, "time_per_epoch_s": seconds,
            "speedup": 1.0 / seconds, "efficiency": 1.0 / seconds / world_size,
        }  # fmt: skip

    rows = [
        row("single", 1, 1.0),
        row("fsdp", 1, 2.5),
        row("fsdp", 2, 1.6),
        row("ddp", 1, 1.05),
        row("ddp", 2, 0.8),
    ]
    figure = plots.draw_study(rows, panels=("time_per_epoch_s", "speedup"))
    time_axis, speedup_axis = figure.axes
    lines = {line.get_label(): line for line in speedup_axis.get_lines()}
    assert list(lines["FSDP"].get_xdata()) == [1, 2] and list(lines["FSDP"].get_ydata()) == [0.4, 1 / 1.6]
    baseline = lines["one process, no wrapper (the baseline)"]
    assert list(baseline.get_xdata()) == [1] and baseline.get_linestyle() == "None"
    ideal = {line.get_label(): line for line in time_axis.get_lines()}["ideal 1/N"]
    assert list(ideal.get_ydata()) == [1.0, 0.5]  # from the baseline
    minor = time_axis.yaxis.get_minor_formatter()
    assert [minor(value, 0) for value in (0.2, 0.3, 0.5, 0.7, 2.0)] == ["0.2", "", "0.5", "", "2"]
