"""Benchmarks: ``python -m course_lib.bench ddp`` prints one JSON object on stdout.

How to compare two implementations honestly on a noisy machine: run them in the *same*
processes, on the same model and data, interleaved step by step (their order rotating every
round), and compare medians. Background load then slows both alike, and the ratio is stable
even when the absolute times are not. Unit tests never time anything; this command does.

``ddp``: PyTorch's ``DistributedDataParallel`` against the course's ``DataParallel`` in its
three modes, on an MLP of a few million parameters so that the gradient all-reduce is a real
share of the step. Besides times, it reports the bytes each rank sent per step, measured by
``CommLog``, against the ring formula 2(N-1)/N x gradient bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import comm, runtime
from .launch import launch


def mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` square linear layers with ReLU: (width + 1) x width parameters each."""
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def _time_step(model: nn.Module, optimizer, inputs, targets) -> float:
    comm.barrier()  # start together, so one rank's lateness is not counted as the other's communication
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    F.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    return time.perf_counter() - started


def _ddp_benchmark(width: int, layers: int, batch: int, steps: int, warmup: int, bucket_mb: float) -> dict | None:
    from torch.nn.parallel import DistributedDataParallel

    from .parallel.ddp import DataParallel

    world = comm.get_world_size()
    torch.manual_seed(0)
    reference = mlp(width, layers)
    variants = {}
    for name in ("torch", "overlapped", "bucketed", "naive"):
        replica = mlp(width, layers)
        replica.load_state_dict(reference.state_dict())
        if name == "torch":
            wrapped = DistributedDataParallel(replica, bucket_cap_mb=bucket_mb)
        else:
            wrapped = DataParallel(replica, bucket_mb=bucket_mb, sync=name)
        variants[name] = (wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(comm.get_rank())
    inputs, targets = torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)

    times = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(warmup + steps):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            seconds = _time_step(*variants[name], inputs, targets)
            if round_index >= warmup:
                times[name].append(seconds)

    with comm.CommLog() as log:
        _time_step(*variants["overlapped"], inputs, targets)
    params = sum(p.numel() for p in reference.parameters())
    gradient_bytes = 4 * params
    if not runtime.is_main():
        return None
    median_ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
    return {
        "benchmark": "ddp",
        "world_size": world,
        "params": params,
        "threads_per_rank": torch.get_num_threads(),
        "batch_per_rank": batch,
        "bucket_mb": bucket_mb,
        "steps_timed": steps,
        "torch_step_ms": median_ms["torch"],
        "course_step_ms": median_ms["overlapped"],
        "bucketed_step_ms": median_ms["bucketed"],
        "naive_step_ms": median_ms["naive"],
        "ratio": median_ms["overlapped"] / median_ms["torch"],
        "all_reduce_calls_per_step": log.count("all_reduce"),
        "bytes_per_rank_measured": log.bytes_per_rank("all_reduce"),
        "bytes_per_rank_theory": comm.ring_bytes("all_reduce", gradient_bytes, world),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    ddp = sub.add_parser("ddp", help="course DDP (3 modes) against torch DDP",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ddp.add_argument("--world-size", type=int, default=2)
    ddp.add_argument("--width", type=int, default=1024)
    ddp.add_argument("--layers", type=int, default=4)
    ddp.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ddp.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ddp.add_argument("--warmup", type=int, default=3)
    ddp.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size, the same for both implementations")
    args = parser.parse_args(argv)

    print(f"benchmarking {args.benchmark} on {args.world_size} processes...", file=sys.stderr, flush=True)
    results = launch(_ddp_benchmark, args.world_size, args.width, args.layers, args.batch, args.steps,
                     args.warmup, args.bucket_mb, timeout_s=1800)
    print(json.dumps(results[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
