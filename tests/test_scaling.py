"""The strong-scaling models: Amdahl, Karp-Flatt, and T(N) = T_compute/N + T_comm(N) + T_fixed."""

from __future__ import annotations

import pytest

from course_lib import scaling


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


@pytest.mark.parametrize("processes", [2, 3, 4, 8])
def test_the_alpha_beta_fit_recovers_the_model_it_was_made_from(processes):
    latency, bandwidth = 7e-6, 23e9
    sizes = [8 * 4**k for k in range(14)]
    seconds = [
        scaling.ring_all_reduce_seconds(
            processes, message_bytes=s, latency_s=latency, bandwidth_bytes_per_s=bandwidth
        )
        for s in sizes
    ]
    fitted = scaling.fit_ring_all_reduce(processes, message_bytes=sizes, seconds=seconds)
    assert fitted == pytest.approx((latency, bandwidth), rel=1e-9)
    # 5 % noise on every time still gives both within 10 %
    noisy = [t * (1.05 if i % 2 else 0.95) for i, t in enumerate(seconds)]
    assert scaling.fit_ring_all_reduce(processes, message_bytes=sizes, seconds=noisy) == pytest.approx(
        (latency, bandwidth), rel=0.1
    )


def test_the_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least 2 processes"):
        scaling.fit_ring_all_reduce(1, message_bytes=[8, 16], seconds=[1, 2])
    with pytest.raises(ValueError, match="two different sizes"):
        scaling.fit_ring_all_reduce(2, message_bytes=[8, 8], seconds=[1, 2])
