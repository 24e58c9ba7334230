"""The grading suite of lab 5: what ``python -m course_lib.tools.labs check lab5_pipeline`` checks.

Your 1F1B schedule for pipelines of 1 to 4 ranks and fewer, as many, or more micro-batches than
stages: checked by ``check_schedule``, its memory and its bubble against theory, then run with real
sends and receives in the course's ``PipelineExecutor`` at 2, 3 and 4 ranks, whose gradients must
equal one process's on the whole batch. The optional part, ZB-H1, the same way: its order, its
bubble against the zero-bubble paper's, and its gradients at 2 and 3 ranks.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import runtime
from course_lib.parallel import pipeline
from course_lib.tools.labs import Property, Question, case_seed, on_ranks

_DRAW = random.Random(case_seed(5))
CASES = [(1, 3), (2, 4), (3, 5), (4, 8), (4, 3), (4, 4), (_DRAW.randint(2, 4), _DRAW.randint(1, 12))]
"""(p, m): m below, at and above p, and a pipeline drawn for this grading (a recording of another's
answers does not have it)."""
WIDTH, BATCH = 9, 24  # 24 samples split into 3, 4 or 8 micro-batches


def check_compute_order(lab) -> None:
    for p, m in CASES:
        _check_order(lab.compute_order_1f1b, "1f1b", p, m)


def _check_order(yours, schedule: str, p: int, m: int) -> None:
    """Every rank's compute actions from ``yours(rank, p, m)`` against the course's ``schedule``."""
    name = {"1f1b": "1F1B", "zb_h1": "ZB-H1"}[schedule]
    for rank in range(p):
        got = [str(a) for a in yours(rank, p, m)]
        wanted = [str(a) for a in pipeline.compute_order(schedule, p, m)[rank]]
        assert got == wanted, f"p={p}, m={m}, rank {rank}: your order starts {got[:6]}, {name}'s {wanted[:6]}"


def check_schedule_is_valid(lab) -> None:
    for p, m in CASES:
        try:
            pipeline.check_schedule(lab.schedule_1f1b(p, m), p, m)
        except ValueError as error:
            raise AssertionError(f"p={p}, m={m}: check_schedule says: {error}") from None


def check_memory(lab) -> None:
    for p, m in CASES:
        schedule = lab.schedule_1f1b(p, m)
        for rank in range(p):
            peak, wanted = (
                pipeline.peak_in_flight(schedule[rank]),
                pipeline.peak_activations_theory("1f1b", p, m, rank),
            )
            assert peak == wanted, (
                f"p={p}, m={m}: rank {rank} holds up to {peak} micro-batches' activations, 1F1B at most {wanted}"
            )


def check_bubble(lab) -> None:
    for p, m in CASES:
        events = pipeline.simulate_timeline(lab.schedule_1f1b(p, m), p)
        bubble, theory = pipeline.bubble_fraction(events), pipeline.bubble_fraction_theory(p, m)
        assert abs(bubble - theory) < 1e-9, (
            f"p={p}, m={m}: the simulated bubble is {bubble:.3f}, the theory's (p-1)/(m+p-1) is {theory:.3f}"
        )


def _stages(p: int) -> list[nn.Module]:
    torch.manual_seed(case_seed(0))  # this grading's own weights
    hidden = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(p - 1)]
    return [*hidden, nn.Linear(WIDTH, 5)]


def _batch():
    generator = torch.Generator().manual_seed(case_seed(7))
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator)


def _run_in_executor(lab, microbatches: int, schedule: str = "1f1b"):
    p, rank = runtime.world_size(), runtime.rank()
    stages = _stages(p)
    executor = pipeline.PipelineExecutor(
        {rank: stages[rank]},
        p,
        schedule,
        microbatches,
        F.cross_entropy,
        (BATCH // microbatches, WIDTH),
    )
    yours = lab.schedule_zb_h1 if schedule == "zb_h1" else lab.schedule_1f1b
    executor.actions = yours(p, microbatches)[rank]  # your schedule, not the course's
    inputs, targets = _batch()
    executor.step(inputs if rank == 0 else None, targets if rank == p - 1 else None)
    return [param.grad for param in stages[rank].parameters()]  # the judge compares them


def _gradient_errors(p: int, gradients_by_rank: list) -> list[float]:
    """Each rank's largest difference from one process's gradients of its stage, on the whole batch."""
    reference = nn.Sequential(*_stages(p))
    inputs, targets = _batch()
    F.cross_entropy(reference(inputs), targets).backward()
    errors = []
    for stage, gradients in zip(reference, gradients_by_rank):
        wanted = [param.grad for param in stage.parameters()]
        same_shapes = len(gradients) == len(wanted) and all(
            got is not None and got.shape == want.shape for got, want in zip(gradients, wanted)
        )
        errors.append(
            max((got - want).abs().max().item() for got, want in zip(gradients, wanted))
            if same_shapes
            else float("inf")
        )
    return errors


def check_runs_in_the_executor(lab) -> None:
    for p, m in ((2, 4), (3, 3), (4, 8)):
        for rank, error in enumerate(_gradient_errors(p, on_ranks(p, _run_in_executor, lab, m))):
            assert error < 1e-6, (
                f"your schedule on {p} ranks with {m} micro-batches: rank {rank}'s gradients differ from one "
                f"process's by {error:.2e}"
            )


def check_zb_h1_order_and_bubble(lab) -> None:
    for p, m in CASES:
        _check_order(lab.compute_order_zb_h1, "zb_h1", p, m)
        schedule = lab.schedule_zb_h1(p, m)
        try:
            pipeline.check_schedule(schedule, p, m)
        except ValueError as error:
            raise AssertionError(f"p={p}, m={m}: check_schedule says of your ZB-H1: {error}") from None
        if m < p:  # the closed form needs the steady state
            continue
        for times in ((1, 1, 1), (1, 2, 1)):
            forward, backward, weight = times
            kw = dict(forward_time=forward, backward_time=backward, weight_time=weight)
            bubble = pipeline.bubble_fraction(pipeline.simulate_timeline(schedule, p, **kw))
            theory = pipeline.bubble_fraction_theory(p, m, schedule="zb_h1", **kw)
            assert abs(bubble - theory) < 1e-9, (
                f"p={p}, m={m}, T_F, T_B, T_W = {times}: your simulated bubble is {bubble:.3f}, ZB-H1's "
                f"(p-1)(T_F + T_B - T_W) gives {theory:.3f}"
            )


def check_zb_h1_runs_in_the_executor(lab) -> None:
    for p, m in ((2, 3), (3, 4)):
        for rank, error in enumerate(_gradient_errors(p, on_ranks(p, _run_in_executor, lab, m, "zb_h1"))):
            assert error < 1e-6, (
                f"your ZB-H1 on {p} ranks with {m} micro-batches: rank {rank}'s gradients differ from one "
                f"process's by {error:.2e}"
            )


PROPERTIES = [
    Property(
        "each rank's forwards and backwards come in 1F1B's order",
        check_compute_order,
        "A backward can start only once its micro-batch has reached the last stage; 1F1B runs just "
        "enough forwards to get there, then alternates, so that as few micro-batches as possible are "
        "alive. The pitfall: with fewer micro-batches than stages, m caps the warm-up.",
    ),
    Property(
        "the schedule is complete, causal and deadlock-free (check_schedule)",
        check_schedule_is_valid,
        "Around each compute action put what it needs: a forward receives the previous stage's output "
        "and sends its own onward; a backward receives the next stage's gradient and sends its input's "
        "gradient back. The first and the last stage have no neighbour on one side.",
    ),
    Property(
        "no rank holds more activations than 1F1B allows (p - rank)",
        check_memory,
        "A micro-batch's activations live from its forward to its backward: the warm-up length decides "
        "how many are alive at once.",
    ),
    Property(
        "the simulated bubble is (p - 1)/(m + p - 1)",
        check_bubble,
        "1F1B idles as long as GPipe: only the order of work changes, not the amount.",
    ),
    Property(
        "run with real sends and receives, the gradients equal one process's (2, 3, 4 ranks)",
        check_runs_in_the_executor,
        "The executor matches a receive to its send by the receiving stage and the micro-batch: name "
        "the stage that receives the message, and the rank at the other end as the peer.",
    ),
    Property(
        "optional: ZB-H1's order is valid and idles (p - 1)(T_F + T_B - T_W)",
        check_zb_h1_order_and_bubble,
        "A W needs no message, so it can run wherever its rank would otherwise idle; ZB-H1 moves some"
        " W's of 1F1B into the idle time without keeping more micro-batches alive than 1F1B. The "
        "pitfall: a W must still follow its own B.",
        optional=True,
    ),
    Property(
        "optional: run with real sends and receives, ZB-H1's gradients equal one process's (2, 3 ranks)",
        check_zb_h1_runs_in_the_executor,
        "The executor runs a B (input gradient only) and a W (weight gradients) as two actions: each "
        "micro-batch needs both, in that order, on the stage's own rank.",
        optional=True,
    ),
]


QUESTIONS = [
    Question(
        "bubble_fraction_p6_m12",
        lambda: pipeline.bubble_fraction_theory(6, 12),
        "the idle share of each rank's step: (p - 1)/(m + p - 1), course_lib/parallel/pipeline/theory.py",
        rel_tol=1e-2,
    ),
    Question(
        "peak_microbatches_in_flight_rank0_1f1b_p6_m12",
        lambda: pipeline.peak_activations_theory("1f1b", 6, 12, 0),
        "count the forwards rank 0 runs before its first backward, plus the one that pairs with it",
    ),
    Question(
        "peak_microbatches_in_flight_rank0_gpipe_p6_m12",
        lambda: pipeline.peak_activations_theory("gpipe", 6, 12, 0),
        "GPipe runs every forward before any backward",
    ),
    Question(
        "microbatches_for_a_bubble_below_10_percent_p6",
        lambda: next(m for m in range(1, 1000) if pipeline.bubble_fraction_theory(6, m) < 0.1),
        "the smallest m with (p - 1)/(m + p - 1) below 0.1",
    ),
]
