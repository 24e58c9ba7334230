"""``pipeline``: for each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages) at 2 and
4 stages and 4 and 8 micro-batches, the course executor's step time, measured bubble and peak
activations against theory, and ``torch.distributed.pipelining`` on the same split (ratio). Then
the compute-bound rows (GPipe and 1F1B, equal stages of wide MLP blocks whose compute per
micro-batch dwarfs its message): there the measured bubble meets (p - 1) / (m + p - 1); they run
only where each stage has a core of its own."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ... import models
from ...distributed import comm, runtime
from ...parallel import pipeline as pp
from ...parallel import recompute
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

    p, rank = runtime.world_size(), runtime.rank()
    rows = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in PIPELINE_MICROBATCHES:
            # two pipeline entries per stage
            model, inputs, targets = transformer(2 * p * v - 2, d_model, seq)
            stages = pp.split_model(model, p * v)
            mine = {s: stages[s] for s in pp.stages_on_rank(rank, p, virtual_stages=v)}
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
    """The step's bubble as the theory defines it (``_bubble_and_events_on_one_time_line``).

    Args:
        stats: this rank's ``PipelineStats`` of the step just run (call it on every rank).
    """
    return _bubble_and_events_on_one_time_line(stats)[0]


def _bubble_and_events_on_one_time_line(stats) -> tuple[float, dict, dict]:
    """The step's bubble as the theory defines it: idle time within one window common to all ranks.

    Every rank's events are gathered and put on the machine's monotonic clock (the benchmark's
    processes share one machine, ``pipeline.on_one_clock``); ``pipeline.bubble_fraction`` then
    counts, on each rank, the time from the first action of any rank to the last one of any rank
    that it did not compute.

    Args:
        stats: this rank's ``PipelineStats`` of the step just run (call it on every rank).
    """
    everyone = [None] * runtime.world_size()
    torch.distributed.all_gather_object(everyone, stats)
    by_rank = dict(enumerate(everyone))
    events = pp.on_one_clock(by_rank)
    return pp.bubble_fraction(events), events, by_rank


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


ZERO_BUBBLE_MICROBATCHES = 8
"""Micro-batches per step in the zero-bubble rows (enough for ZB-V's steady state at 2 and 4 stages)."""
ZERO_BUBBLE_CASES = (
    ("1f1b", "none"),
    ("zb_h1", "none"),
    ("zb_v", "none"),
    ("1f1b", "full"),
    ("zb_h1", "full"),
)
"""(schedule, recomputation) of the zero-bubble rows: the last two reproduce pytorch/torchtitan#773."""


def zero_bubble_benchmark(
    *, width: int, hidden: int, blocks_per_stage: int, batch: int, steps: int, warmup: int
) -> list[dict] | None:
    """ZB-H1 and ZB-V beside 1F1B on the compute-bound MLP stages, and each beside PyTorch's own.

    Every rank's share of the model is the same ``blocks_per_stage`` MLP blocks: one stage under
    1F1B and ZB-H1, two chunks of half of it in a V under ZB-V. For each schedule: the step time
    (the course's executor and ``torch.distributed.pipelining``'s schedule, timed in turns), the
    bubble measured on one clock against the schedule simulated with the F, B and W times
    measured in the same steps, the gradients against PyTorch's, and, with full recomputation
    (the last rows), how many times each block's forward ran per micro-batch.

    Args:
        width: features of the activation sent between stages.
        hidden: features inside each block.
        blocks_per_stage: MLP blocks on each rank.
        batch: samples per step, for the whole pipeline.
        steps: timed steps; the median is reported.
        warmup: untimed steps first.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    p, rank, m = runtime.world_size(), runtime.rank(), ZERO_BUBBLE_MICROBATCHES
    inputs, targets = torch.randn(batch, width, requires_grad=True), torch.randn(batch, width)
    torch_schedule = {
        "1f1b": Schedule1F1B,
        "zb_h1": ScheduleInterleavedZeroBubble,
        "zb_v": ScheduleZBVZeroBubble,
    }
    rows = []
    for schedule, policy in ZERO_BUBBLE_CASES:
        v = 2 if schedule in pp.V_SHAPED else 1
        mine = pp.stages_on_rank(rank, p, virtual_stages=v, placement=pp.placement_of(schedule))
        actions = pp.build_schedule(schedule, p, m, virtual_stages=v)  # every rank's, for the simulations
        course, theirs = (
            zero_bubble_stages(p * v, mine, width=width, hidden=hidden, blocks_per_stage=blocks_per_stage)
            for _ in range(2)
        )
        for stages in (course, theirs):
            for stage in stages.values():
                recompute.recompute_modules(list(stage), policy=policy)
        executor = pp.PipelineExecutor(course, p * v, schedule, m, F.mse_loss, (batch // m, width))
        torch_stages = [PipelineStage(theirs[s], s, p * v, torch.device("cpu")) for s in mine]
        # Schedule1F1B takes its one stage, the others the list of this rank's stages
        runner = torch_schedule[schedule](
            torch_stages[0] if schedule == "1f1b" else torch_stages, m, loss_fn=F.mse_loss
        )
        first, last = 0 in mine, p * v - 1 in mine

        def course_step():
            executor.step(inputs if first else None, targets if last else None)
            comm.barrier()

        def torch_step():
            runner.step(
                inputs if first else None, target=targets if last else None, losses=[] if last else None
            )
            comm.barrier()

        bubbles, replayed, latencies, posting, times = [], [], [], [], {"F": [], "B": [], "W": []}

        def record():
            bubble, events, everyone = _bubble_and_events_on_one_time_line(executor.stats)
            bubbles.append(bubble)
            latencies.extend(pp.message_latencies(everyone))
            posting.append(1000 * executor.stats.posting_s)
            # the same step with every action as long as it was and nothing between them
            took = {
                (kind, s, i): end - start
                for rank_events in events.values()
                for kind, s, i, start, end in rank_events
            }
            replayed.append(pp.bubble_fraction(pp.simulate_timeline(actions, p, durations=took)))
            for kind, spans in times.items():  # a rank's whole share per micro-batch: its chunks summed
                done = [end - start for k, *_, start, end in executor.stats.events if k == kind]
                if done:
                    spans.append(1000 * sum(done) / m)

        median_ms = interleaved_medians(
            {"course": course_step, "torch": torch_step}, steps, warmup, after_each_round=record
        )
        for stage in (*course.values(), *theirs.values()):
            stage.zero_grad(set_to_none=True)
        # one more step each, for the gradients, counting how often each block's forward runs
        course_forwards = _block_forwards_per_microbatch(course, course_step, m)
        torch_forwards = _block_forwards_per_microbatch(theirs, torch_step, m)
        difference = max(
            (
                (a.grad - b.grad).abs().max().item()
                for s in mine
                for a, b in zip(course[s].parameters(), theirs[s].parameters())
            ),
            default=0.0,
        )
        gathered = [None] * p
        torch.distributed.all_gather_object(
            gathered,
            {
                "bubble": statistics.median(bubbles),
                **{kind: statistics.median(spans) if spans else 0.0 for kind, spans in times.items()},
                "difference": difference,
                "course_forwards": course_forwards,
                "torch_forwards": torch_forwards,
                "posting_ms": statistics.median(posting),
            },
        )

        def mean(key: str) -> float:
            return statistics.mean(g[key] for g in gathered)

        forward_ms, backward_ms, weight_ms = mean("F"), mean("B"), mean("W")
        message_ms = _message_ms((batch // m, width))
        in_step_ms = 1000 * statistics.median(latencies) if latencies else 0.0

        def simulated(message_time: float) -> float:
            return pp.bubble_fraction(
                pp.simulate_timeline(
                    actions,
                    p,
                    forward_time=forward_ms,
                    backward_time=backward_ms,
                    message_time=message_time,
                    **({"weight_time": weight_ms} if schedule in pp.SPLIT_BACKWARD else {}),
                )
            )

        measured = gathered[0]["bubble"]  # the same on every rank: one time line
        theory, with_messages = simulated(0.0), simulated(in_step_ms)
        rows.append(
            {
                "schedule": schedule,
                "recomputation": policy,
                "stages": p,
                "chunks_per_rank": v,
                "microbatches": m,
                "course_step_ms": median_ms["course"],
                "torch_step_ms": median_ms["torch"],
                "ratio_to_torch": median_ms["course"] / median_ms["torch"],
                # per micro-batch, a rank's whole share: F, then B (the whole backward under 1F1B), then W
                "forward_ms": forward_ms,
                "backward_ms": backward_ms,
                "weight_ms": weight_ms,
                "message_ms": message_ms,  # one activation's send to the next rank, measured alone
                "bubble_measured": measured,
                "bubble_theory": theory,  # the schedule simulated with the F, B and W measured
                "bubble_error": measured - theory,
                # a message inside the step (its send to its arrival, where the receiver waited): slower,
                # since the communication thread waits for a core the computing threads hold
                "message_in_step_ms": in_step_ms,
                # the schedule simulated with each message taking that: what message latency explains
                "bubble_theory_with_messages": with_messages,
                "bubble_error_with_messages": measured - with_messages,
                # each action as long as it was measured, nothing between actions: measured - replayed
                # is the time between actions (the executor's own work, messages); replayed - theory,
                # what unequal actions cost the schedule
                "bubble_replayed": statistics.median(replayed),
                # of the time between actions: handing messages to the backend, per step and rank
                "posting_ms_per_step": mean("posting_ms"),
                "max_grad_difference_to_torch": max(g["difference"] for g in gathered),
                # 1 without recomputation; each recomputation of a checkpointed block adds 1
                "block_forwards_per_microbatch": mean("course_forwards"),
                "torch_block_forwards_per_microbatch": mean("torch_forwards"),
            }
        )
    for row in rows:
        same = next(r for r in rows if r["schedule"] == "1f1b" and r["recomputation"] == row["recomputation"])
        row["step_vs_1f1b"] = row["course_step_ms"] / same["course_step_ms"]
        row["torch_step_vs_1f1b"] = row["torch_step_ms"] / same["torch_step_ms"]
        # what splitting costs: B + W against the whole backward that 1F1B runs in one pass
        row["split_backward_cost"] = (row["backward_ms"] + row["weight_ms"]) / same["backward_ms"]
        # the idle time the replay does not explain, per rank and step; posting_ms_per_step is part of it
        row["between_actions_ms_per_step"] = (row["bubble_measured"] - row["bubble_replayed"]) * row[
            "course_step_ms"
        ]
    return rows if runtime.is_main() else None


def zero_bubble_stages(
    num_stages: int, mine: list[int], *, width: int, hidden: int, blocks_per_stage: int
) -> dict[int, nn.Sequential]:
    """This rank's stages of the same MLP (seeded): p stages of ``blocks_per_stage`` blocks, or 2p
    chunks of half as many in a V; every rank holds the same compute.

    Args:
        num_stages: the pipeline's stages (ranks x chunks per rank).
        mine: the stages this rank holds (``pipeline.rank_of_stage``).
        width: features between blocks (what a message holds).
        hidden: features inside each block.
        blocks_per_stage: MLP blocks each rank holds in all.
    """
    torch.manual_seed(0)
    per_stage = blocks_per_stage * runtime.world_size() // num_stages
    blocks = [
        nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
        for _ in range(per_stage * num_stages)
    ]
    return {s: nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]) for s in mine}


def _block_forwards_per_microbatch(stages: dict[int, nn.Sequential], step, microbatches: int) -> float:
    """Run ``step`` once, counting the forwards of this rank's blocks (recomputations included)."""
    blocks = [block for stage in stages.values() for block in stage]
    calls = [0]

    def count(*_):
        calls[0] += 1

    # the block's first layer: a checkpoint replaces the block's own forward, not its layers'
    handles = [block[0].register_forward_pre_hook(count) for block in blocks]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return calls[0] / (microbatches * len(blocks))


MESSAGE_ROUND_TRIPS = 20
"""Timed round trips (after 3 untimed) when the zero-bubble rows measure one message's time."""


def _message_ms(shape: tuple[int, ...]) -> float:
    """Half the median round trip of one ``shape`` float tensor between ranks 0 and 1, on every rank.

    What a pipeline message costs on its own (latency, copy, wake-up); the simulation with it says
    how much of the measured bubble the messages explain. Ranks past 1 only wait.

    Args:
        shape: one micro-batch's activation between stages.
    """
    message, rank, trips = torch.zeros(shape), runtime.rank(), []
    comm.barrier()
    for trip in range(3 + MESSAGE_ROUND_TRIPS):
        begin = time.perf_counter()
        if rank == 0:
            comm.isend(message, dst=1).wait()
            comm.irecv(message, src=1).wait()
        elif rank == 1:
            comm.irecv(message, src=0).wait()
            comm.isend(message, dst=0).wait()
        if trip >= 3:
            trips.append(time.perf_counter() - begin)
    shared = [statistics.median(trips)]
    torch.distributed.broadcast_object_list(shared, src=0)
    return 1000 * shared[0] / 2
