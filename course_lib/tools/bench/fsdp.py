"""``fsdp``: PyTorch's FSDP2 ``fully_shard`` against the course's ``FullyShardedDataParallel``
(FULL_SHARD, with prefetch and without), with the same units (each linear layer), and the course's
other sharding strategies beside them, interleaved the same way."""

from __future__ import annotations

import torch
from torch import nn

from ...distributed import comm, runtime
from ...parallel import memory
from ...parallel.fsdp import FullyShardedDataParallel
from ..timing import interleaved_medians
from .common import anatomies, data_parallel_header, mlp, rank_batch, training_step


def fsdp_benchmark(
    *, width: int, layers: int, batch: int, steps: int, warmup: int, profile: str | None = None
) -> dict | None:
    """FSDP2 and the course's FSDP (four sharding strategies), interleaved; the JSON row on rank 0.

    Args:
        width: the MLP's width (its layers are width x width).
        layers: its linear layers.
        batch: samples per rank per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
        profile: a folder for each variant's per-rank traces (None: none are written).
    """
    from torch.distributed.fsdp import fully_shard

    world = runtime.world_size()
    hybrid_size = world // 2 if world % 2 == 0 else world
    torch.manual_seed(0)
    reference = mlp(width, layers)
    strategies = {
        "FULL_SHARD": {},
        "SHARD_GRAD_OP": {},
        "NO_SHARD": {},
        "HYBRID_SHARD": {"hybrid_shard_size": hybrid_size},
        "FULL_SHARD, no prefetch": {"forward_prefetch": False, "backward_prefetch": False},
    }
    inputs, targets = rank_batch(batch, width)
    variants = {}
    for name in ("torch", *strategies):
        model = mlp(width, layers)
        model.load_state_dict(reference.state_dict())
        units = [m for m in model if isinstance(m, nn.Linear)]
        if name == "torch":
            for unit in units:
                fully_shard(unit)
            wrapped = fully_shard(model)
        else:
            wrapped = FullyShardedDataParallel(
                model, auto_wrap_policy=units, sharding_strategy=name.split(",")[0], **strategies[name]
            )
        variants[name] = training_step(wrapped, inputs, targets)
    median_ms = interleaved_medians(variants, steps, warmup)

    with comm.CommLog() as log:
        variants["FULL_SHARD"]()
    where = anatomies(
        {
            "torch": variants["torch"],
            "course": variants["FULL_SHARD"],
            "course_no_prefetch": variants["FULL_SHARD, no prefetch"],
        },
        trace_dir=profile,
    )
    params = sum(p.numel() for p in reference.parameters())
    if not runtime.is_main():
        return None
    return (
        where
        | data_parallel_header("fsdp", params=params, batch=batch, steps=steps)
        | {
            "units": layers,
            "torch_step_ms": median_ms["torch"],
            "course_step_ms": median_ms["FULL_SHARD"],
            "ratio": median_ms["FULL_SHARD"] / median_ms["torch"],
            "course_no_prefetch_step_ms": median_ms["FULL_SHARD, no prefetch"],
            "ratio_no_prefetch": median_ms["FULL_SHARD, no prefetch"] / median_ms["torch"],
            "step_ms_by_sharding_strategy": {name: median_ms[name] for name in strategies},
            "hybrid_shard_size": hybrid_size,
            "full_shard_bytes_per_rank_measured": log.bytes_per_rank(),
            "full_shard_bytes_per_rank_theory": 4 * memory.traffic_elements_per_rank(params, world, "fsdp"),
        }
    )
