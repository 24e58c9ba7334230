"""``ddp``: PyTorch's ``DistributedDataParallel`` against the course's ``DataParallel`` in its three
modes, on an MLP of a few million parameters so that the gradient all-reduce is a real share of
the step. Besides times, the bytes each rank sent per step, measured by ``CommLog``, against the
ring formula 2(N-1)/N x gradient bytes."""

from __future__ import annotations

import torch

from ...distributed import comm, runtime
from ...parallel.ddp import DataParallel
from ..timing import interleaved_medians
from .common import anatomies, data_parallel_header, mlp, rank_batch, training_step

DDP_BUCKET_MB = 4.0
"""The ddp benchmark's bucket size, the same for PyTorch's DDP and the course's."""


def ddp_benchmark(
    *,
    width: int,
    layers: int,
    batch: int,
    steps: int,
    warmup: int,
    bucket_mb: float,
    profile: str | None = None,
) -> dict | None:
    """PyTorch's DDP and the course's three DDPs, interleaved on one MLP; the JSON row on rank 0.

    Run it on every rank (``launch(ddp_benchmark, 2, width=..., ...)``); other ranks return None.

    Args:
        width: the MLP's width (its layers are width x width).
        layers: its linear layers.
        batch: samples per rank per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
        bucket_mb: the all-reduce message size, for both implementations.
        profile: a folder for each variant's per-rank traces (None: none are written).
    """
    from torch.nn.parallel import DistributedDataParallel

    world = runtime.world_size()
    torch.manual_seed(0)
    reference = mlp(width, layers)
    inputs, targets = rank_batch(batch, width)
    variants = {}
    for name in ("torch", "overlapped", "bucketed", "naive"):
        replica = mlp(width, layers)
        replica.load_state_dict(reference.state_dict())
        if name == "torch":
            wrapped = DistributedDataParallel(replica, bucket_cap_mb=bucket_mb)
        else:
            wrapped = DataParallel(replica, bucket_mb=bucket_mb, sync=name)
        variants[name] = training_step(wrapped, inputs, targets)
    median_ms = interleaved_medians(variants, steps, warmup)

    with comm.CommLog() as log:
        variants["overlapped"]()
    where = anatomies({"torch": variants["torch"], "course": variants["overlapped"]}, trace_dir=profile)
    params = sum(p.numel() for p in reference.parameters())
    gradient_bytes = 4 * params
    if not runtime.is_main():
        return None
    return (
        where
        | data_parallel_header("ddp", params=params, batch=batch, steps=steps)
        | {
            "bucket_mb": bucket_mb,
            "torch_step_ms": median_ms["torch"],
            "course_step_ms": median_ms["overlapped"],
            "bucketed_step_ms": median_ms["bucketed"],
            "naive_step_ms": median_ms["naive"],
            "ratio": median_ms["overlapped"] / median_ms["torch"],
            "all_reduce_calls_per_step": log.count("all_reduce"),
            "bytes_per_rank_measured": log.bytes_per_rank("all_reduce"),
            "bytes_per_rank_theory": comm.ring_bytes("all_reduce", gradient_bytes, world),
        }
    )
