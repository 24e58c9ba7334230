"""The grading suite of lab 8: what ``python -m course_lib.tools.labs check lab8_activations`` checks.

Your formulas against what real processes keep: a ``models.Block`` (converted by the course's own
tensor and sequence parallelism, recomputed by ``course_lib.parallel.recompute``) runs one forward, and
``memory.live_tensor_bytes`` counts every byte it leaves alive for backward, at 1, 2 and 3 ranks
and shapes that divide by nothing in particular.
"""

from __future__ import annotations

import random

import torch

from course_lib import models
from course_lib.distributed import runtime
from course_lib.parallel import recompute
from course_lib.parallel import sequence as sp
from course_lib.parallel import tensor as tp
from course_lib.parallel.memory import live_tensor_bytes
from course_lib.plan import activations
from course_lib.tools.labs import Property, Question, case_seed, on_ranks

_DRAW = random.Random(case_seed(7))  # this grading's own shapes: a recording of another's answers lacks them
_HEADS = _DRAW.randint(2, 6)
SHAPES = (
    (5, 12, 24, 6),
    (3, 7, 20, 5),
    (2, 24, 36, 6),
    (_DRAW.randint(1, 6), _DRAW.randint(2, 24), _HEADS * _DRAW.randint(2, 6), _HEADS),
)  # batch, seq, d_model, heads
SPLIT_BATCH = _DRAW.randint(1, 6)  # with 12 tokens and 6 heads, which split 2 and 3 ways


def _kept(batch: int, seq: int, d_model: int, heads: int, sequence_parallel: bool, policy: str) -> int:
    """Elements one block leaves alive after its forward on this rank, its input included."""
    size, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    block = models.Block(d_model, heads)
    x = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1))
    if size > 1 and sequence_parallel:
        sp.sequence_parallel_block(block, regather_in_backward=True)
        x = x.chunk(size, dim=1)[rank]
    elif size > 1:
        tp.apply_tensor_parallel(block)
    recompute.apply_recomputation(block, policy=policy)
    x = x.contiguous().requires_grad_()
    with live_tensor_bytes() as live:
        out = block(x)
        kept = (live.now - out.numel() * out.element_size()) // 4 + x.numel()  # the input: the layer before's
        out.sum().backward()
    return kept


def _measure(cases):
    return [_kept(*case) for case in cases]


# Each check asks your formulas first, then measures: an unfinished formula says so before any
# process starts.
def check_one_process(lab) -> None:
    said = [lab.one_process_terms(batch=b, seq=s, d_model=d, heads=h) for b, s, d, h in SHAPES]
    measured = on_ranks(1, _measure, [(*shape, False, "none") for shape in SHAPES])[0]
    for shape, terms, kept in zip(SHAPES, said, measured, strict=True):
        batch, seq, d_model, heads = shape
        assert set(terms) == {"norms", "projection_inputs", "attention", "mlp"}, (
            f"one_process_terms returned the terms {sorted(terms)}, not norms, projection_inputs, attention, mlp"
        )
        total = sum(terms.values())
        assert total == kept, (
            f"batch {batch}, seq {seq}, d_model {d_model}, {heads} heads: your terms add up to {total:g} elements, "
            f"the block kept {kept} ({kept - total:+g})"
        )


def check_tensor_and_sequence_parallel(lab) -> None:
    batch, seq, d_model, heads = SPLIT_BATCH, 12, 24, 6
    for degree in (2, 3):
        for sequence_parallel in (False, True):
            one = lab.one_process_terms(batch=batch, seq=seq, d_model=d_model, heads=heads)
            terms = lab.tensor_parallel_terms(one, degree=degree, sequence_parallel=sequence_parallel)
            total = sum(terms.values())
            kept = on_ranks(degree, _measure, [(batch, seq, d_model, heads, sequence_parallel, "none")])
            what = "sequence parallel" if sequence_parallel else "tensor parallel"
            for rank, measured in enumerate(kept):
                assert total == measured[0], (
                    f"{what} over {degree} ranks: your terms add up to {total:g} elements, rank {rank} kept "
                    f"{measured[0]} ({measured[0] - total:+g})"
                )


def check_recomputation(lab) -> None:
    batch, seq, d_model, heads = SPLIT_BATCH, 12, 24, 6
    for degree, sequence_parallel in ((1, False), (2, False), (2, True), (3, True)):
        cases = [(batch, seq, d_model, heads, sequence_parallel, policy) for policy in recompute.POLICIES]
        said = [
            lab.recomputed_total(
                batch=batch, seq=seq, d_model=d_model, heads=heads, degree=degree,
                sequence_parallel=sequence_parallel, policy=policy,
            )
            for policy in recompute.POLICIES
        ]  # fmt: skip
        kept = on_ranks(degree, _measure, cases)[0]
        for policy, total, measured in zip(recompute.POLICIES, said, kept, strict=True):
            where = f"{degree} rank(s){', sequence parallel' if sequence_parallel else ''}"
            assert total == measured, (
                f"policy {policy!r} on {where}: you say {total:g} elements, the block kept {measured} "
                f"({measured - total:+g})"
            )


PROPERTIES = [
    Property(
        "one process: the terms add up to what a block keeps, at four shapes (one drawn for this grading)",
        check_one_process,
        "List the operations of Block.forward in order (norm, q/k/v, attention, out, add, norm, fc1, GELU, fc2, "
        "add) and, for each, the tensors its backward reads; count a tensor once however many read it.",
    ),
    Property(
        "tensor and sequence parallelism over 2 and 3 ranks: every rank keeps your terms",
        check_tensor_and_sequence_parallel,
        "Between f and g each rank holds only its heads and its slice of the MLP's hidden units; outside "
        "them everything is whole unless the sequence is cut.",
    ),
    Property(
        "recomputation, none, full and selective, at 1 to 3 ranks",
        check_recomputation,
        "A checkpointed region keeps its input; the selective policy also keeps the results of the ops in "
        "recompute.SAVED_BY_SELECTIVE, but not every one of them: read what it does under tensor "
        "parallelism.",
    ),
]


# -- the README's questions -------------------------------------------------------------------------------

BATCH, SEQ, D_MODEL, HEADS = 1, 8192, 4096, 32


def _bytes(**layout) -> float:
    return (
        4
        * activations.block_activation_elements(batch=BATCH, seq=SEQ, d_model=D_MODEL, heads=HEADS, **layout)[
            "total"
        ]
    )


QUESTIONS = [
    Question(
        "block_bytes_s8192_h4096_a32_one_process_fp32",
        lambda: _bytes(),
        "your one_process_terms at batch 1, seq 8192, d_model 4096, 32 heads, times 4 bytes",
    ),
    Question(
        "block_bytes_same_tp8_sequence_parallel_fp32",
        lambda: _bytes(tensor_degree=8, sequence_parallel=True, regather_in_backward=True),
        "every term falls to 1/8 with Megatron-LM's sequence parallelism",
    ),
    Question(
        "block_bytes_same_tp8_sequence_parallel_selective_fp32",
        lambda: _bytes(tensor_degree=8, sequence_parallel=True, recomputation="selective"),
        "the selective policy's list at T = 8: which results does it not keep under tensor parallelism?",
    ),
]
