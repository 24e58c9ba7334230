"""``pipeline``: for each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages) at 2 and
4 stages and 4 and 8 micro-batches, the course executor's step time, measured bubble and peak
activations against theory, and ``torch.distributed.pipelining`` on the same split (ratio). Then
the compute-bound rows (GPipe and 1F1B, equal stages of wide MLP blocks whose compute per
micro-batch dwarfs its message): there the measured bubble meets (p - 1) / (m + p - 1); they run
only where each stage has a core of its own."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm, runtime
from ..timing import interleaved_medians
from .common import anatomies, transformer

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


def pipeline_benchmark(
    *, d_model: int, seq: int, batch: int, steps: int, warmup: int, profile: str | None = None
) -> list[dict] | None:
    """Each schedule's step time, bubble and peak activations against theory and against PyTorch.

    Args:
        d_model: the transformer's width.
        seq: characters per sequence.
        batch: sequences per step, for the whole pipeline.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
        profile: a folder for the 1F1B rows' per-rank traces (None: none are written).
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from ... import models
    from ...parallel import pipeline as pp

    p, rank = runtime.world_size(), runtime.rank()
    rows = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in PIPELINE_MICROBATCHES:
            # two pipeline entries per stage
            model, inputs, targets = transformer(2 * p * v - 2, d_model, seq)
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
            where = {}
            if schedule == "1f1b" and m == PIPELINE_MICROBATCHES[-1]:  # one row per size: anatomies are slow
                where = anatomies(
                    {"course": course_step, "torch": torch_step},
                    trace_dir=f"{profile}/{p}_stages" if profile else None,
                )
            rows.append(
                where
                | {
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

    Every rank's events are gathered and put on the machine's monotonic clock (the benchmark's
    processes share one machine, ``pipeline.on_one_clock``); ``pipeline.bubble_fraction`` then
    counts, on each rank, the time from the first action of any rank to the last one of any rank
    that it did not compute.

    Args:
        stats: this rank's ``PipelineStats`` of the step just run (call it on every rank).
    """
    from ...parallel import pipeline as pp

    everyone = [None] * runtime.world_size()
    torch.distributed.all_gather_object(everyone, stats)
    return pp.bubble_fraction(pp.on_one_clock(dict(enumerate(everyone))))


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
    from ...parallel import pipeline as pp

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
