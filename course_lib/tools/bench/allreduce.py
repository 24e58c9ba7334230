"""``allreduce``: the network itself, as ``nccl-tests``' ``all_reduce_perf`` measures it. For each
message size from a few bytes to hundreds of MB (16 MB on CPUs), the time of one all-reduce
(the slowest rank's median over 3 blocks of ``--iterations``), its algorithm bandwidth S/T and its bus
bandwidth S/T x 2(N-1)/N (``comm.bus_bandwidth``), and the alpha-beta model fitted to all of
them (``scaling.fit_ring_all_reduce``): alpha, the latency of one message, and beta, the
bandwidth a link sustains, which the bus bandwidth approaches for large messages; each row's
measured time over the model's (the residual), and, when the sweep reaches both regimes, alpha
and beta each fitted where it rules (``scaling.fit_ring_all_reduce_by_regime``). Locally it
starts ``--world-size`` processes on gloo; under ``srun`` or ``torchrun`` every started process
is a rank (NCCL on GPUs), so ``slurm/network_check.sbatch`` measures a cluster's network with
it and ``--expect-gbps`` turns the result into a verdict."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ...distributed import comm, environment, runtime
from ...plan import scaling

ALLREDUCE_MIN_BYTES = 8
"""The smallest message of the all-reduce sweep: two float32 numbers, where latency is everything."""
ALLREDUCE_MAX_MB = {"cpu": 16, "cuda": 512}
"""The largest message by default: 512 MB on GPUs (bandwidth is everything), 16 MB on a laptop's CPU."""
ALLREDUCE_SIZE_FACTOR = 4
"""Each message of the sweep is this many times the previous one."""
ALLREDUCE_BLOCKS = 3
"""Timed blocks of ``--iterations`` all-reduces per size."""
HEALTHY_LINK_FRACTION = 0.7
"""A network is healthy when the bus bandwidth of large messages reaches this share of the link's
speed: NCCL over RDMA typically reaches 80-90 %; TCP sockets (a missing plugin) reach far less."""


def allreduce_sizes(*, min_bytes: int, max_bytes: int, factor: int = ALLREDUCE_SIZE_FACTOR) -> list[int]:
    """Message sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the last, in whole float32s.

    Args:
        min_bytes: the first size (rounded up to a multiple of 4 bytes).
        max_bytes: no size above it; it is the last one when the steps do not land on it.
        factor: the ratio of two neighbouring sizes, at least 2.
    """
    size = max(4, -(-min_bytes // 4) * 4)
    sizes = []
    while size < max_bytes:
        sizes.append(size)
        size *= factor
    sizes.append(max(4, max_bytes // 4 * 4))
    return sorted(set(sizes))


def allreduce_benchmark(*, sizes: list[int], iterations: int, warmup: int) -> dict | None:
    """Time a float32 all-reduce of every size on every rank; the JSON result on rank 0, None elsewhere.

    Run it on every rank of a process group (``launch`` locally, ``srun``/``torchrun`` on a cluster).

    Args:
        sizes: message sizes in bytes (multiples of 4).
        iterations: all-reduces timed in each of ``ALLREDUCE_BLOCKS`` blocks per size; the size's
            time is the median of the blocks' means on GPUs, of every call's time on CPUs.
        warmup: untimed all-reduces per size first (NCCL sets up each size's channels on first use).
    """

    process = runtime.process_info()
    world, device = process.world_size, process.device

    def synchronized() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def wrong_elements() -> int:
        """One all-reduce whose sum is known: every rank gives rank + 1, so every element must be
        N(N + 1)/2; the elements that are not (nccl-tests' #wrong). A transport that corrupts data
        now and then (NCCL's LL128 between some nodes) is caught only by checking often."""
        check = torch.full((size // 4,), float(process.rank + 1), device=device)
        dist.all_reduce(check)
        return int(torch.count_nonzero(check != world * (world + 1) / 2))

    rows = []
    for size in sizes:
        wrong = wrong_elements()  # correctness first, then after every timed block
        # Then speed, on zeros: repeated sums of zeros stay zeros (never overflow to inf).
        message = torch.zeros(size // 4, device=device)
        for _ in range(warmup):
            dist.all_reduce(message)
        times = []
        for _ in range(ALLREDUCE_BLOCKS):
            dist.barrier()
            if device.type == "cuda":
                # A GPU collective is only queued when the call returns: time a block of them
                # between two synchronizations, as nccl-tests do, and keep the block's mean.
                start = synchronized()
                for _ in range(iterations):
                    dist.all_reduce(message)
                times.append((synchronized() - start) / iterations)
            else:
                # A CPU collective has finished when the call returns: time each one, so that
                # the median ignores the moments another process had the core.
                for _ in range(iterations):
                    start = time.perf_counter()
                    dist.all_reduce(message)
                    times.append(time.perf_counter() - start)
            wrong += wrong_elements()  # after every block, outside the timing
        wrong += int(torch.count_nonzero(message))  # the timed sums of zeros must still be zeros
        elapsed = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends when its slowest rank does
        seconds = float(elapsed)
        algorithm = size / seconds
        rows.append(
            {
                "bytes": size,
                "time_us": seconds * 1e6,
                "algbw_gbps": algorithm / 1e9,
                "busbw_gbps": comm.bus_bandwidth("all_reduce", algorithm, world) / 1e9,
                "correct": wrong == 0,
                "wrong": wrong,
            }
        )
    nodes = [None] * world
    dist.all_gather_object(nodes, environment.node_name())
    if not process.is_main:
        return None
    result = {
        "benchmark": "allreduce",
        "backend": process.backend,
        "device": device.type,
        "world_size": world,
        "nodes": len(set(nodes)),
        "iterations": iterations,
        "all_correct": all(row["correct"] for row in rows),
        "rows": rows,
    }
    if world > 1:
        latency, bandwidth = scaling.fit_ring_all_reduce(
            world,
            message_bytes=[row["bytes"] for row in rows],
            seconds=[row["time_us"] / 1e6 for row in rows],
        )
        for row in rows:
            row["model_time_us"] = 1e6 * scaling.ring_all_reduce_seconds(
                world, message_bytes=row["bytes"], latency_s=latency, bandwidth_bytes_per_s=bandwidth
            )
        result["fit"] = {"latency_us": latency * 1e6, "bandwidth_gbps": bandwidth / 1e9}
        for row in rows:
            row["measured_over_model"] = row["time_us"] / row["model_time_us"]  # the residual, as a ratio
        try:  # each parameter where it rules, when the sweep reaches both regimes
            latency, bandwidth = scaling.fit_ring_all_reduce_by_regime(
                world,
                message_bytes=[row["bytes"] for row in rows],
                seconds=[row["time_us"] / 1e6 for row in rows],
            )
        except ValueError:
            pass
        else:
            result["fit_by_regime"] = {"latency_us": latency * 1e6, "bandwidth_gbps": bandwidth / 1e9}
            for row in rows:
                row["regime_model_time_us"] = 1e6 * scaling.ring_all_reduce_seconds(
                    world, message_bytes=row["bytes"], latency_s=latency, bandwidth_bytes_per_s=bandwidth
                )
    result["largest_message_busbw_gbps"] = rows[-1]["busbw_gbps"]
    return result


def network_verdict(*, busbw_gbps: float, expected_gbps: float) -> tuple[bool, str]:
    """(healthy?, one line) for a measured bus bandwidth against the link's speed.

    Args:
        busbw_gbps: the bus bandwidth of the largest message, in GB/s.
        expected_gbps: the link's speed, in GB/s (a cluster profile's COURSE_LINK_GBPS).
    """
    share = busbw_gbps / expected_gbps
    measured = f"bus bandwidth {busbw_gbps:.2f} GB/s is {share:.0%} of the link's {expected_gbps:g} GB/s"
    if share >= HEALTHY_LINK_FRACTION:
        return True, f"network OK: {measured}"
    return False, (
        f"network SLOW: {measured} "
        f"(healthy: at least {HEALTHY_LINK_FRACTION:.0%}); check that NCCL uses the network plugin "
        "(the job's preflight line, NCCL_DEBUG=INFO), the profile's variables, and which nodes you got"
    )
