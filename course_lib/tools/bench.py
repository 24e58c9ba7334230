"""Benchmarks: ``python -m course_lib.tools.bench NAME`` prints JSON (see ``--help`` for the names).

How to compare two implementations honestly on a noisy machine: run them in the *same*
processes, on the same model and data, interleaved step by step (their order rotating every
round), and compare medians. Background load then slows both alike, and the ratio is stable
even when the absolute times are not. Unit tests never time anything; this command does.

``ddp``: PyTorch's ``DistributedDataParallel`` against the course's ``DataParallel`` in its
three modes, on an MLP of a few million parameters so that the gradient all-reduce is a real
share of the step. Besides times, it reports the bytes each rank sent per step, measured by
``CommLog``, against the ring formula 2(N-1)/N x gradient bytes.

``fsdp``: PyTorch's FSDP2 ``fully_shard`` against the course's ``FullyShardedDataParallel``
(FULL_SHARD), with the same units (each linear layer), and the course's other sharding
strategies beside them, interleaved the same way.

``memory``: DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) at 2 and 4 ranks, with Adam in fp32: the
bytes of parameters, gradients and optimizer state a rank really holds after two steps, against
``memory.model_state_bytes``; and the bytes it sent during the second step, measured by
``CommLog``, against ``memory.traffic_elements_per_rank``.

``pipeline``: for each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages) at 2 and
4 stages and 4 and 8 micro-batches, the course executor's step time, measured bubble and peak
activations against theory, and ``torch.distributed.pipelining`` on the same split (ratio). Then
the compute-bound rows (GPipe and 1F1B, equal stages of wide MLP blocks whose compute per
micro-batch dwarfs its message): there the measured bubble meets (p - 1) / (m + p - 1); they run
only where each stage has a core of its own.

``sp``, ``cp``, ``ep``: sequence, context and expert parallelism (``bench_sequence``).

``tp``: the course's tensor-parallel MLP and attention against DTensor's ``parallelize_module``
(ColwiseParallel / RowwiseParallel), and the bytes moved per forward+backward against theory:
two all-reduces of the activation per sub-layer.

``allreduce``: the network itself, as ``nccl-tests``' ``all_reduce_perf`` measures it. For each
message size from a few bytes to hundreds of MB (16 MB on CPUs), the time of one all-reduce
(the slowest rank's median over 3 blocks of ``--iterations``), its algorithm bandwidth S/T and its bus
bandwidth S/T x 2(N-1)/N (``comm.bus_bandwidth``), and the alpha-beta model fitted to all of
them (``scaling.fit_ring_all_reduce``): alpha, the latency of one message, and beta, the
bandwidth a link sustains, which the bus bandwidth approaches for large messages. Locally it
starts ``--world-size`` processes on gloo; under ``srun`` or ``torchrun`` every started process
is a rank (NCCL on GPUs), so ``slurm/network_check.sbatch`` measures a cluster's network with
it and ``--expect-gbps`` turns the result into a verdict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import checks, comm, memory, runtime
from ..errors import EXIT_USER_ERROR, UserError
from ..launch import launch, max_processes
from .timing import interleaved_medians

MLP_WIDTH = 1024
"""Width of the MLP the ddp, fsdp and memory benchmarks train (layers of width x width)."""
MLP_LAYERS = 4
"""Linear layers of that MLP: 4.2M parameters at width 1024."""
MLP_BATCH = 64
"""Samples per rank per step in the ddp, fsdp and memory benchmarks."""
TIMED_STEPS = 30
"""Timed steps per variant in the ddp and fsdp benchmarks (the median is reported)."""
WARMUP_STEPS = 3
"""Untimed steps per variant before them."""
DDP_BUCKET_MB = 4.0
"""The ddp benchmark's bucket size, the same for PyTorch's DDP and the course's."""
PIPELINE_MICROBATCHES = (4, 8)
"""Micro-batches per step in the pipeline benchmark: the bubble shrinks as they grow."""
PIPELINE_BUBBLE_WIDTH = 256
"""Features sent between stages in the compute-bound pipeline rows: messages of 128-256 kB."""
PIPELINE_BUBBLE_BATCH = 1024
"""Samples per step in the compute-bound pipeline rows: tens of milliseconds per micro-batch."""
PIPELINE_BUBBLE_HIDDEN = 8192
"""Hidden features of the compute-bound rows' MLP blocks: 20-70 ms of forward per micro-batch on a
CPU core, so that what each message costs is a few percent of it."""
PIPELINE_BUBBLE_BLOCKS_PER_STAGE = 2
"""MLP blocks each stage holds in the compute-bound pipeline rows."""
TP_HEADS_PER_RANK = 4
"""Attention heads each rank owns in the tensor-parallel benchmark."""


def mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` square linear layers with ReLU: (width + 1) x width parameters each."""
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def _training_step(model: nn.Module, inputs, targets) -> Callable[[], None]:
    """One SGD step of ``model`` on a fixed batch, as a function to time."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()

    return step


def _rank_batch(batch: int, width: int):
    generator = torch.Generator().manual_seed(runtime.rank())
    return torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)


def ddp_benchmark(
    *, width: int, layers: int, batch: int, steps: int, warmup: int, bucket_mb: float
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
    """
    from torch.nn.parallel import DistributedDataParallel

    from ..parallel.ddp import DataParallel

    world = runtime.world_size()
    torch.manual_seed(0)
    reference = mlp(width, layers)
    inputs, targets = _rank_batch(batch, width)
    variants = {}
    for name in ("torch", "overlapped", "bucketed", "naive"):
        replica = mlp(width, layers)
        replica.load_state_dict(reference.state_dict())
        if name == "torch":
            wrapped = DistributedDataParallel(replica, bucket_cap_mb=bucket_mb)
        else:
            wrapped = DataParallel(replica, bucket_mb=bucket_mb, sync=name)
        variants[name] = _training_step(wrapped, inputs, targets)
    median_ms = interleaved_medians(variants, steps, warmup)

    with comm.CommLog() as log:
        variants["overlapped"]()
    params = sum(p.numel() for p in reference.parameters())
    gradient_bytes = 4 * params
    if not runtime.is_main():
        return None
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


def fsdp_benchmark(*, width: int, layers: int, batch: int, steps: int, warmup: int) -> dict | None:
    """FSDP2 and the course's FSDP (four sharding strategies), interleaved; the JSON row on rank 0.

    Args:
        width: the MLP's width (its layers are width x width).
        layers: its linear layers.
        batch: samples per rank per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
    """
    from torch.distributed.fsdp import fully_shard

    from ..parallel.fsdp import FullyShardedDataParallel

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
    inputs, targets = _rank_batch(batch, width)
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
        variants[name] = _training_step(wrapped, inputs, targets)
    median_ms = interleaved_medians(variants, steps, warmup)

    with comm.CommLog() as log:
        variants["FULL_SHARD"]()
    params = sum(p.numel() for p in reference.parameters())
    if not runtime.is_main():
        return None
    return {
        "benchmark": "fsdp",
        "world_size": world,
        "params": params,
        "threads_per_rank": torch.get_num_threads(),
        "batch_per_rank": batch,
        "steps_timed": steps,
        "units": layers,
        "torch_step_ms": median_ms["torch"],
        "course_step_ms": median_ms["FULL_SHARD"],
        "ratio": median_ms["FULL_SHARD"] / median_ms["torch"],
        "course_no_prefetch_step_ms": median_ms["FULL_SHARD, no prefetch"],
        "ratio_no_prefetch": median_ms["FULL_SHARD, no prefetch"] / median_ms["torch"],
        "step_ms_by_sharding_strategy": {name: median_ms[name] for name in strategies},
        "hybrid_shard_size": hybrid_size,
        "full_shard_bytes_per_rank_measured": log.bytes_per_rank(),
        "full_shard_bytes_per_rank_theory": 4 * memory.traffic_elements_per_rank(params, world, "zero3"),
    }


def wrap_for_stage(model: nn.Module, stage: str, units: list[nn.Module] | None = None) -> nn.Module:
    """The model as ``stage`` (ddp, zero1, zero2, zero3) trains it, with the course's implementations."""
    from ..parallel.ddp import DataParallel
    from ..parallel.fsdp import FullyShardedDataParallel
    from ..parallel.zero import ZeroDataParallel

    if stage == "ddp":
        return DataParallel(model)
    if stage in ("zero1", "zero2"):
        return ZeroDataParallel(model, stage=int(stage[-1]))
    return FullyShardedDataParallel(model, auto_wrap_policy=units)


def measure_stage(
    model: nn.Module,
    stage: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    units: list[nn.Module] | None = None,
    loss=F.cross_entropy,
):
    """Two Adam steps of ``model`` under ``stage``; returns (model-state bytes held, bytes sent in step 2).

    Args:
        model: the model, the same on every rank.
        stage: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` (the course's wrappers).
        inputs: this rank's batch.
        targets: its labels.
        units: the FSDP units for ``"zero3"`` (None: the whole model is one unit).
        loss: ``loss(outputs, targets)``.
    """
    model = wrap_for_stage(model, stage, units)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        with comm.CommLog() as log:  # ZeRO-1/2 gather the previous update in this step's forward
            loss(model(inputs), targets).backward()
            optimizer.step()
    return memory.measure_model_states(model, optimizer=optimizer), log.bytes_per_rank()


def memory_benchmark(*, width: int, layers: int, batch: int) -> list[dict] | None:
    """Model-state bytes held and bytes sent by DDP and ZeRO-1/2/3, against the memory model.

    Args:
        width: the MLP's width (its layers are width x width).
        layers: its linear layers.
        batch: samples per rank per step.
    """
    world = runtime.world_size()
    inputs, targets = _rank_batch(batch, width)
    rows = []
    for stage in memory.STAGES:
        torch.manual_seed(0)
        model = mlp(width, layers)
        params = sum(p.numel() for p in model.parameters())
        units = [m for m in model if isinstance(m, nn.Linear)]
        measured, sent = measure_stage(model, stage, inputs, targets, units=units, loss=F.mse_loss)
        expected = memory.model_state_bytes(params, world, stage, **memory.FP32_ADAM)
        traffic = 4 * memory.traffic_elements_per_rank(params, world, stage)
        rows.append(
            {
                "world_size": world,
                "stage": stage,
                "params": params,
                "measured_bytes": measured.total,
                "model_bytes": expected.total,
                "ratio": measured.total / expected.total,
                "measured_by_kind": {
                    "params": measured.params,
                    "grads": measured.grads,
                    "optimizer": measured.optimizer,
                },
                "model_by_kind": {
                    "params": expected.params,
                    "grads": expected.grads,
                    "optimizer": expected.optimizer,
                },
                "traffic_bytes_measured": sent,
                "traffic_bytes_model": traffic,
                "traffic_ratio": sent / traffic,
            }
        )
    return rows if runtime.is_main() else None


def _transformer(layers: int, d_model: int, seq: int):
    from .. import data, models

    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    torch.manual_seed(0)
    return (
        models.TinyTransformer(len(vocabulary), d_model=d_model, n_heads=4, n_layers=layers, max_seq_len=seq),
        inputs,
        targets,
    )


def pipeline_benchmark(*, d_model: int, seq: int, batch: int, steps: int, warmup: int) -> list[dict] | None:
    """Each schedule's step time, bubble and peak activations against theory and against PyTorch.

    Args:
        d_model: the transformer's width.
        seq: characters per sequence.
        batch: sequences per step, for the whole pipeline.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from .. import models
    from ..parallel import pipeline as pp

    p, rank = runtime.world_size(), runtime.rank()
    rows = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in PIPELINE_MICROBATCHES:
            # two pipeline entries per stage
            model, inputs, targets = _transformer(2 * p * v - 2, d_model, seq)
            stages = pp.split_model(model, p * v)
            mine = {s: stages[s] for s in range(p * v) if pp.rank_of_stage(s, p) == rank}
            executor = pp.PipelineExecutor(
                mine, p * v, schedule, m, models.lm_loss, (batch // m, seq, d_model)
            )
            torch_stages = [PipelineStage(stages[s], s, p * v, torch.device("cpu")) for s in mine]
            runner = (
                ScheduleInterleaved1F1B(torch_stages, m, loss_fn=models.lm_loss)
                if v > 1
                else {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
                    torch_stages[0], m, loss_fn=models.lm_loss
                )
            )
            x, y = inputs[:batch], targets[:batch]
            first, last = 0 in mine, p * v - 1 in mine

            def course_step():
                executor.step(x if first else None, y if last else None)
                comm.barrier()  # a pipeline step ends when its last stage is done

            def torch_step():
                runner.step(x if first else None, target=y if last else None, losses=[] if last else None)
                comm.barrier()

            bubbles = []
            median_ms = interleaved_medians(
                {"course": course_step, "torch": torch_step},
                steps,
                warmup,
                after_each_round=lambda: bubbles.append(_bubble_on_one_time_line(executor.stats)),
            )
            for module in mine.values():
                module.zero_grad(set_to_none=True)
            gathered = [None] * p
            torch.distributed.all_gather_object(
                gathered,
                (
                    statistics.median(bubbles),
                    executor.stats.peak_activations,
                    executor.stats.peak_activation_bytes,
                ),
            )
            course_ms, torch_ms = median_ms["course"], median_ms["torch"]
            rows.append(
                {
                    "schedule": schedule,
                    "stages": p,
                    "virtual_stages": v,
                    "microbatches": m,
                    "course_step_ms": course_ms,
                    "torch_step_ms": torch_ms,
                    "ratio": course_ms / torch_ms,
                    "bubble_measured": statistics.mean(g[0] for g in gathered),
                    "bubble_theory": pp.bubble_fraction_theory(p, m, virtual_stages=v),
                    "peak_activations_measured": [g[1] for g in gathered],
                    "peak_activations_theory": [
                        pp.peak_activations_theory(schedule, p, m, r, virtual_stages=v) for r in range(p)
                    ],
                    "peak_activation_bytes_measured": [g[2] for g in gathered],
                }
            )
    return rows if runtime.is_main() else None


def stage_counts_with_a_core_each(stage_counts: list[int], *, cores: int) -> list[int]:
    """The pipeline sizes whose processes each get a core of their own.

    Processes that share a core wait for each other's time slices as well as for the pipeline,
    so the bubble they measure is not the schedule's.

    Args:
        stage_counts: the pipeline sizes asked for.
        cores: the CPU cores this machine lets the processes use.
    """
    return [stages for stages in stage_counts if stages <= cores]


def _bubble_on_one_time_line(stats) -> float:
    """The step's bubble as the theory defines it: idle time within one window common to all ranks.

    Every rank's events are gathered onto the machine's monotonic clock (the benchmark's processes
    share one machine); ``pipeline.bubble_fraction`` then counts, on each rank, the time from the
    first action of any rank to the last one of any rank that it did not compute.

    Args:
        stats: this rank's ``PipelineStats`` of the step just run (call it on every rank).
    """
    from ..parallel import pipeline as pp

    on_the_clock = [
        (kind, stage, microbatch, stats.clock_start + start, stats.clock_start + end)
        for kind, stage, microbatch, start, end in stats.events
    ]
    everyone = [None] * runtime.world_size()
    torch.distributed.all_gather_object(everyone, on_the_clock)
    return pp.bubble_fraction(dict(enumerate(everyone)))


def pipeline_bubble_benchmark(
    *, width: int, hidden: int, blocks_per_stage: int, batch: int, steps: int, warmup: int
) -> list[dict] | None:
    """The bubble measured where the theory's assumptions hold, against (p - 1) / (m + p - 1).

    The theory assumes equal stages and free messages. Here every stage is the same stack of wide
    MLP blocks (width -> hidden -> width) and the loss is cheap, so each stage computes for
    tens of milliseconds per micro-batch while the activation it sends (a few hundred kB)
    crosses in a fraction of a millisecond. The transformer
    rows of ``pipeline_benchmark`` break both assumptions (the embedding and the head make the
    first and last stages longer, and each micro-batch's compute is as short as a message).

    Args:
        width: features of the activation sent between stages (what a message holds).
        hidden: features inside each block (what the compute scales with).
        blocks_per_stage: MLP blocks each stage holds.
        batch: samples per step, for the whole pipeline.
        steps: timed steps; the median bubble is reported.
        warmup: untimed steps first.
    """
    from ..parallel import pipeline as pp

    p, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    stages = [
        nn.Sequential(
            *(
                nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                for _ in range(blocks_per_stage)
            )
        )
        for _ in range(p)
    ]
    # The first stage computes its input's gradient too, so that it does the same work as the others.
    inputs, targets = torch.randn(batch, width, requires_grad=True), torch.randn(batch, width)
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in PIPELINE_MICROBATCHES:
            executor = pp.PipelineExecutor(
                {rank: stages[rank]}, p, schedule, m, F.mse_loss, (batch // m, width)
            )

            def step():
                executor.step(inputs if rank == 0 else None, targets if rank == p - 1 else None)
                comm.barrier()

            bubbles, forward_ms, backward_ms = [], [], []

            def record():
                bubbles.append(_bubble_on_one_time_line(executor.stats))
                for kind, times in (("F", forward_ms), ("B", backward_ms)):
                    spans = [end - start for done, *_, start, end in executor.stats.events if done == kind]
                    times.append(1000 * statistics.mean(spans))

            median_ms = interleaved_medians({"step": step}, steps, warmup, after_each_round=record)["step"]
            stages[rank].zero_grad(set_to_none=True)
            gathered = [None] * p
            torch.distributed.all_gather_object(
                gathered,
                (statistics.median(bubbles), statistics.median(forward_ms), statistics.median(backward_ms)),
            )
            measured = gathered[0][0]  # the same on every rank: one time line
            theory = pp.bubble_fraction_theory(p, m)
            rows.append(
                {
                    "schedule": schedule,
                    "stages": p,
                    "microbatches": m,
                    "step_ms": median_ms,
                    "forward_ms_per_microbatch": statistics.mean(g[1] for g in gathered),
                    # the theory assumes equal stages: how equal they really were, per micro-batch
                    "forward_ms_by_stage": [g[1] for g in gathered],
                    "backward_ms_by_stage": [g[2] for g in gathered],
                    "message_bytes": (batch // m) * width * 4,
                    "bubble_measured": measured,
                    "bubble_theory": theory,
                    "bubble_error": measured - theory,
                }
            )
    return rows if runtime.is_main() else None


def tp_benchmark(*, d_model: int, seq: int, batch: int, steps: int, warmup: int) -> dict | None:
    """The course's tensor-parallel MLP and attention against DTensor's, and their bytes against theory.

    Args:
        d_model: the transformer's width.
        seq: characters per sequence.
        batch: sequences per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
    """
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from .. import models
    from ..parallel import tensor as tp

    degree = runtime.world_size()
    mesh = init_device_mesh("cpu", (degree,))
    torch.manual_seed(0)
    heads = TP_HEADS_PER_RANK * degree
    dense = {"mlp": models.MLP(d_model, 4 * d_model), "attention": models.SelfAttention(d_model, heads)}
    plans = {
        "mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
        "attention": {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "out": RowwiseParallel(),
        },
    }
    course = {
        "mlp": tp.parallel_mlp(copy.deepcopy(dense["mlp"])),
        "attention": tp.parallel_attention(copy.deepcopy(dense["attention"]), heads),
    }
    # the input requires grad, as a block's input does inside a model: backward then all-reduces its gradient
    inputs = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    result = {
        "benchmark": "tp",
        "tensor_degree": degree,
        "threads_per_rank": torch.get_num_threads(),
        "activation_shape": [batch, seq, d_model],
    }
    activation_bytes = 4 * batch * seq * d_model
    for name in ("mlp", "attention"):
        theirs = parallelize_module(copy.deepcopy(dense[name]), mesh, plans[name])
        median_ms = interleaved_medians(
            {
                "course": lambda block=course[name]: block(inputs).sum().backward(),
                "torch": lambda block=theirs: block(inputs).sum().backward(),
            },
            steps,
            warmup,
        )
        with comm.CommLog() as log:
            course[name](inputs).sum().backward()
        course_ms, torch_ms = median_ms["course"], median_ms["torch"]
        result[name] = {
            "course_step_ms": course_ms,
            "torch_step_ms": torch_ms,
            "ratio": course_ms / torch_ms,
            "all_reduces_per_step": log.count("all_reduce"),
            "bytes_per_rank_measured": log.bytes_per_rank(),
            "bytes_per_rank_theory": 2 * comm.ring_bytes("all_reduce", activation_bytes, degree),
        }
    return result if runtime.is_main() else None


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
    import torch.distributed as dist

    from .. import scaling

    context = runtime.context()
    world, device = context.world_size, context.device

    def synchronized() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    rows = []
    for size in sizes:
        # Correctness first: every rank gives rank + 1, so every element must sum to N(N + 1)/2.
        check = torch.full((size // 4,), float(context.rank + 1), device=device)
        dist.all_reduce(check)
        correct = bool(torch.all(check == world * (world + 1) / 2))
        del check
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
                "correct": correct,
            }
        )
    nodes = [None] * world
    dist.all_gather_object(nodes, runtime.node_name())
    if not context.is_main:
        return None
    result = {
        "benchmark": "allreduce",
        "backend": context.backend,
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


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.bench", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="benchmark", required=True)
    formatter = argparse.ArgumentDefaultsHelpFormatter
    ddp = sub.add_parser("ddp", help="course DDP (3 modes) against torch DDP", formatter_class=formatter)
    fsdp = sub.add_parser(
        "fsdp", help="course FSDP (4 sharding strategies) against FSDP2", formatter_class=formatter
    )
    mem = sub.add_parser(
        "memory",
        help="measured memory and traffic of DDP, ZeRO-1/2/3 against the model",
        formatter_class=formatter,
    )
    pipe = sub.add_parser(
        "pipeline",
        help="course pipeline schedules against torch.distributed.pipelining",
        formatter_class=formatter,
    )
    tensor = sub.add_parser(
        "tp", help="course tensor parallelism against DTensor parallelize_module", formatter_class=formatter
    )
    sequence = sub.add_parser(
        "sp", help="course sequence parallelism against DTensor's SequenceParallel", formatter_class=formatter
    )
    context = sub.add_parser(
        "cp", help="ring attention: contiguous against zig-zag, bytes and memory", formatter_class=formatter
    )
    experts = sub.add_parser(
        "ep", help="a mixture-of-experts layer spread over the ranks (all-to-all)", formatter_class=formatter
    )
    reduce = sub.add_parser(
        "allreduce",
        help="all-reduce time, algorithm and bus bandwidth per message size, and the alpha-beta fit",
        formatter_class=formatter,
    )
    positive, processes = checks.int_at_least(1), checks.int_at_least(1, max_processes())
    reduce.add_argument(
        "--world-size",
        type=checks.int_at_least(2, max_processes()),
        default=2,
        help="local processes (under srun or torchrun, the launcher's processes are the ranks)",
    )
    reduce.add_argument(
        "--min-bytes", type=positive, default=ALLREDUCE_MIN_BYTES, help="the smallest message"
    )
    reduce.add_argument(
        "--max-mb",
        type=checks.number_above(0),
        default=None,
        help=f"the largest message in MB [GPUs: {ALLREDUCE_MAX_MB['cuda']}, CPUs: {ALLREDUCE_MAX_MB['cpu']}]",
    )
    reduce.add_argument("--iterations", type=positive, default=20, help="timed all-reduces per size")
    reduce.add_argument(
        "--warmup", type=checks.int_at_least(0), default=3, help="untimed all-reduces per size"
    )
    reduce.add_argument("--output", type=checks.file_to_write, default=None, help="also write the JSON here")
    reduce.add_argument(
        "--plot", type=checks.file_to_write, default=None, help="draw the sweep as a PNG here"
    )
    reduce.add_argument(
        "--expect-gbps",
        type=checks.number_above(0),
        default=None,
        help="the link's speed in GB/s: print a verdict, exit 1 when the bus bandwidth is far below it",
    )
    for command in (pipe, tensor):
        command.add_argument("--d-model", type=positive, default=128)
        command.add_argument("--seq", type=positive, default=64)
        command.add_argument(
            "--batch", type=positive, default=16, help="samples per step (the whole pipeline's batch)"
        )
        command.add_argument("--steps", type=positive, default=10, help="timed steps per variant")
        command.add_argument("--warmup", type=checks.int_at_least(0), default=2)
    pipe.add_argument(
        "--bubble-hidden",
        type=positive,
        default=PIPELINE_BUBBLE_HIDDEN,
        help="hidden features of the compute-bound rows' MLP blocks (their compute per micro-batch)",
    )
    pipe.add_argument(
        "--stages",
        type=checks.int_at_least(2, max_processes()),
        nargs="+",
        default=[2, 4],
        help="pipeline sizes (one run each)",
    )
    tensor.add_argument("--world-size", type=processes, default=2, help="the tensor-parallel degree")
    sequence.add_argument("--world-size", type=processes, default=2, help="the tensor/sequence degree")
    sequence.add_argument("--d-model", type=positive, default=128)
    sequence.add_argument("--heads", type=positive, default=8)
    sequence.add_argument("--seq", type=positive, default=256)
    sequence.add_argument("--batch", type=positive, default=8)
    context.add_argument("--world-size", type=processes, default=4, help="the context-parallel degree")
    context.add_argument("--seq", type=positive, default=2048, help="tokens of the whole sequence")
    context.add_argument("--heads", type=positive, default=4)
    context.add_argument("--head-dim", type=positive, default=32)
    context.add_argument("--batch", type=positive, default=1)
    experts.add_argument("--world-size", type=processes, default=2, help="the expert-parallel degree")
    experts.add_argument("--d-model", type=positive, default=128)
    experts.add_argument("--hidden", type=positive, default=256, help="each expert's hidden width")
    experts.add_argument("--experts", type=positive, default=8)
    experts.add_argument("--tokens", type=positive, default=2048, help="tokens per rank per step")
    experts.add_argument("--top-k", type=positive, default=2)
    experts.add_argument("--capacity-factor", type=checks.number_above(0), default=1.25)
    for command in (sequence, context, experts):
        command.add_argument("--steps", type=positive, default=10, help="timed steps per variant")
        command.add_argument("--warmup", type=checks.int_at_least(0), default=2)
    for command in (ddp, fsdp, mem):
        command.add_argument("--width", type=positive, default=MLP_WIDTH)
        command.add_argument("--layers", type=positive, default=MLP_LAYERS)
        command.add_argument("--batch", type=positive, default=MLP_BATCH, help="samples per rank per step")
    for command in (ddp, fsdp):
        command.add_argument("--world-size", type=processes, default=2)
        command.add_argument("--steps", type=positive, default=TIMED_STEPS, help="timed steps per variant")
        command.add_argument("--warmup", type=checks.int_at_least(0), default=WARMUP_STEPS)
    ddp.add_argument(
        "--bucket-mb",
        type=checks.number_above(0),
        default=DDP_BUCKET_MB,
        help="bucket size, the same for both implementations",
    )
    mem.add_argument("--world-sizes", type=processes, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    parser = sub.choices[args.benchmark]  # later mistakes are reported as this subcommand's
    if args.benchmark == "pipeline" and args.batch % PIPELINE_MICROBATCHES[-1]:
        parser.error(
            f"argument --batch: must be a multiple of {PIPELINE_MICROBATCHES[-1]} (it is cut into "
            f"{' and '.join(map(str, PIPELINE_MICROBATCHES))} micro-batches), got {args.batch}"
        )
    if args.benchmark == "tp" and args.d_model % (heads := TP_HEADS_PER_RANK * args.world_size):
        parser.error(
            f"argument --d-model: must be a multiple of {heads} (the attention's {TP_HEADS_PER_RANK} heads "
            f"per rank x --world-size {args.world_size}), got {args.d_model}"
        )
    if args.benchmark == "sp":
        for flag, value in (("--seq", args.seq), ("--heads", args.heads), ("--d-model", args.d_model)):
            if value % args.world_size:
                parser.error(
                    f"argument {flag}: must be a multiple of --world-size {args.world_size}, got {value}"
                )
        if args.d_model % args.heads:
            parser.error(
                f"argument --d-model: must be a multiple of --heads {args.heads}, got {args.d_model}"
            )
    if args.benchmark == "cp" and args.seq < 2 * args.world_size:
        parser.error(
            f"argument --seq: must be at least 2 x --world-size ({2 * args.world_size}), got {args.seq}"
        )
    if args.benchmark == "ep" and (args.experts % args.world_size or args.top_k > args.experts):
        parser.error(
            f"argument --experts: must be a multiple of --world-size {args.world_size} and at least --top-k "
            f"{args.top_k}, got {args.experts}"
        )
    if args.benchmark == "allreduce":
        largest_mb = args.max_mb if args.max_mb is not None else ALLREDUCE_MAX_MB["cpu"]
        if args.min_bytes >= largest_mb * 2**19:
            parser.error(
                f"argument --min-bytes: must be below half of the largest message ({largest_mb:g} MB; "
                f"--max-mb sets it), so that the sweep has two sizes to fit a model to, got {args.min_bytes}"
            )
    needed, processes = memory_needed(args)
    available = available_memory_bytes()
    if available is not None and needed * processes > available:
        parser.error(
            f"these sizes need about {needed / 1e9:.1f} GB on each of {processes} process(es), "
            f"{needed * processes / 1e9:.1f} GB in all, and this machine has {available / 1e9:.1f} GB "
            "available: choose smaller sizes"
        )
    try:
        return _run_benchmark(args)
    except UserError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


PROCESS_BASE_BYTES = 400e6
"""What one process holds before it computes anything: Python, torch and its libraries."""


def available_memory_bytes() -> float | None:
    """Memory this machine can still give (Linux's MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_needed(args: argparse.Namespace) -> tuple[float, int]:
    """(bytes one process of this benchmark may hold at most, processes on this machine): a generous
    estimate from its sizes alone, so that sizes that cannot fit are refused before anything starts."""
    word = 4  # fp32
    if args.benchmark == "allreduce":
        largest = args.max_mb * 2**20 if args.max_mb is not None else ALLREDUCE_MAX_MB["cpu"] * 2**20
        return PROCESS_BASE_BYTES + 4 * largest, args.world_size  # the message, gloo's copies, the check
    if args.benchmark in ("ddp", "fsdp", "memory"):
        params = args.layers * args.width * (args.width + 1)
        # up to 5 models alive (course and torch variants), each with weights, gradients, Adam's two
        # moments and a gradient bucket, plus the activations of a batch through every layer
        per_process = 5 * 5 * word * params + 3 * word * args.batch * args.width * args.layers
        processes = max(args.world_sizes) if args.benchmark == "memory" else args.world_size
        return PROCESS_BASE_BYTES + per_process, processes
    if args.benchmark in ("pipeline", "tp"):
        tokens = args.batch * args.seq
        attention = args.batch * TP_HEADS_PER_RANK * 4 * args.seq**2  # scores of up to 4 x 4 heads
        per_process = (
            3 * word * (40 * tokens * args.d_model + attention) + 5 * 16 * word * args.d_model**2 * 8
        )
        processes = max(args.stages) if args.benchmark == "pipeline" else args.world_size
        return PROCESS_BASE_BYTES + per_process, processes
    if args.benchmark in ("sp", "cp"):
        heads = args.heads
        width = args.d_model if args.benchmark == "sp" else args.heads * args.head_dim
        tokens = args.batch * args.seq
        # the one-process reference holds the whole sequence's attention scores
        per_process = 3 * word * (40 * tokens * width + args.batch * heads * args.seq**2)
        return PROCESS_BASE_BYTES + per_process, args.world_size
    # ep: every expert of the one-process reference, and the routed tokens of every rank
    params = args.experts * 2 * args.d_model * args.hidden
    tokens = args.tokens * args.world_size * args.top_k
    per_process = 5 * word * params + 3 * word * tokens * (args.d_model + args.hidden) * 2
    return PROCESS_BASE_BYTES + per_process, args.world_size


def _run_benchmark(args: argparse.Namespace) -> int:
    def given(*flags: str) -> dict:
        """The values of these flags, by the benchmark function's argument names."""
        return {flag: getattr(args, flag) for flag in flags}

    def on(world: int, benchmark: Callable, options: dict):
        return _on_local_processes(args.benchmark, world, benchmark, options)

    mlp, transformer, timing = ("width", "layers", "batch"), ("d_model", "seq", "batch"), ("steps", "warmup")
    if args.benchmark == "allreduce":
        return _run_allreduce(args)
    if args.benchmark == "pipeline":
        options = given(*transformer, *timing)
        rows = [row for stages in args.stages for row in on(stages, pipeline_benchmark, options)]
        cores = runtime.usable_cpus()
        fits = stage_counts_with_a_core_each(args.stages, cores=cores)
        bubble_options = dict(
            width=PIPELINE_BUBBLE_WIDTH,
            hidden=args.bubble_hidden,
            blocks_per_stage=PIPELINE_BUBBLE_BLOCKS_PER_STAGE,
            batch=PIPELINE_BUBBLE_BATCH,
            **given(*timing),
        )
        compute_bound = [
            row for stages in fits for row in on(stages, pipeline_bubble_benchmark, bubble_options)
        ]
        result = {
            "benchmark": "pipeline",
            "threads_per_rank": "cores / ranks",
            "rows": rows,
            "compute_bound_rows": compute_bound,
            "compute_bound_max_bubble_error": max(
                (abs(row["bubble_error"]) for row in compute_bound), default=None
            ),
            "compute_bound_not_run": [
                f"{stages} stages: more processes than the {cores} cores"
                for stages in args.stages
                if stages not in fits
            ],
        }
    elif args.benchmark == "tp":
        result = on(args.world_size, tp_benchmark, given(*transformer, *timing))
    elif args.benchmark in ("sp", "cp", "ep"):
        from . import bench_sequence

        benchmark, flags = {
            "sp": (bench_sequence.sp_benchmark, ("d_model", "heads", "seq", "batch")),
            "cp": (bench_sequence.cp_benchmark, ("seq", "heads", "head_dim", "batch")),
            "ep": (
                bench_sequence.ep_benchmark,
                ("d_model", "hidden", "experts", "tokens", "top_k", "capacity_factor"),
            ),
        }[args.benchmark]
        result = on(args.world_size, benchmark, given(*flags, *timing))
    elif args.benchmark == "memory":
        rows = [row for world in args.world_sizes for row in on(world, memory_benchmark, given(*mlp))]
        result = {
            "benchmark": "memory",
            "optimizer": "Adam, fp32 (K = 8 bytes of state per parameter)",
            "max_ratio_error": max(abs(row["ratio"] - 1) for row in rows),
            "max_traffic_ratio_error": max(abs(row["traffic_ratio"] - 1) for row in rows),
            "rows": rows,
        }
    elif args.benchmark == "ddp":
        result = on(args.world_size, ddp_benchmark, given(*mlp, *timing, "bucket_mb"))
    else:
        result = on(args.world_size, fsdp_benchmark, given(*mlp, *timing))
    print(json.dumps(result, indent=2))
    return 0


def _on_local_processes(name: str, world: int, benchmark: Callable, options: dict):
    """Rank 0's result of ``benchmark`` run on ``world`` local processes."""
    print(f"benchmarking {name} on {world} processes...", file=sys.stderr, flush=True)
    return launch(benchmark, world, timeout_s=1800, check_collectives=False, **options)[0]


def _run_allreduce(args: argparse.Namespace) -> int:
    """The sweep on this launcher's ranks (srun, torchrun), or on ``--world-size`` local processes."""
    launched = runtime.resolve_environment().world_size > 1
    if launched:
        context = runtime.init()
        device = context.device.type
    else:
        device = "cpu"  # local processes share one machine: gloo on its CPU
    max_mb = args.max_mb if args.max_mb is not None else ALLREDUCE_MAX_MB[device]
    options = dict(
        sizes=allreduce_sizes(min_bytes=args.min_bytes, max_bytes=int(max_mb * 2**20)),
        iterations=args.iterations,
        warmup=args.warmup,
    )
    if launched:
        result = allreduce_benchmark(**options)
        runtime.shutdown()
        if result is None:
            return 0
    else:
        result = _on_local_processes("allreduce", args.world_size, allreduce_benchmark, options)
    healthy = True
    if args.expect_gbps is not None:
        healthy, line = network_verdict(
            busbw_gbps=result["largest_message_busbw_gbps"], expected_gbps=args.expect_gbps
        )
        result["verdict"] = line
        print(line, file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if args.plot is not None:
        from .plots import plot_allreduce

        plot_allreduce(result, path=args.plot, expected_gbps=args.expect_gbps)
    if not result["all_correct"]:
        print("error: some all-reduce gave a wrong sum: the network corrupts data", file=sys.stderr)
        return 1
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
