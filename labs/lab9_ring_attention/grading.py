"""The grading suite of lab 9: what ``python -m course_lib.tools.labs check lab9_ring_attention`` checks.

Your merge against one softmax over both blocks; your zig-zag layout against the course's
``SequenceChunks``; your ring at 2, 3 and 4 processes, causal and not, contiguous and zig-zag, on
a sequence of a prime number of tokens, drawn for each grading (uneven chunks at every degree), against one process's
``scaled_dot_product_attention`` and the course's ``context.ring_attention``; its messages (C-1
key/value chunks per rank, posted with their receives) against the theory; its balance.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from course_lib.distributed import comm, runtime
from course_lib.parallel import context as cp
from course_lib.parallel import context_chunks, ulysses
from course_lib.tools.labs import Property, Question, case_seed, on_ranks

WORLD_SIZES = (2, 3, 4)
BATCH, HEADS, HEAD_DIM = 2, 3, 8
SEQ = random.Random(case_seed(9)).choice((11, 13, 17, 19, 23))  # a prime: uneven chunks at every degree


def check_merge(lab) -> None:
    generator = torch.Generator().manual_seed(case_seed(0))  # this grading's own numbers
    scores = torch.randn(BATCH, HEADS, 5, 11, generator=generator) * 4
    values = torch.randn(BATCH, HEADS, 11, HEAD_DIM, generator=generator)
    whole = scores.softmax(-1) @ values
    whole_lse = torch.logsumexp(scores, -1)
    for cut in (1, 4, 10):
        parts = []
        for piece, piece_values in (
            (scores[..., :cut], values[..., :cut, :]),
            (scores[..., cut:], values[..., cut:, :]),
        ):
            parts.append((piece.softmax(-1) @ piece_values, torch.logsumexp(piece, -1)))
        first = lab.merge_partial(None, None, *parts[0])
        assert first[0] is parts[0][0] or torch.equal(first[0], parts[0][0]), (
            "merging a first block into nothing (out and lse None) must give the block's own result"
        )
        out, lse = lab.merge_partial(*first, *parts[1])
        error = (out - whole).abs().max().item()
        assert error < 1e-5, (
            f"two blocks of {cut} and {11 - cut} keys merged differ from one softmax by {error:.2e}"
        )
        assert (lse - whole_lse).abs().max().item() < 1e-5, (
            "the merged lse is not the log of the summed denominators"
        )
    huge = torch.full((1, 1, 1), 1000.0)  # exp(1000) overflows float32
    out, lse = lab.merge_partial(torch.ones(1, 1, 1, 1), huge, torch.zeros(1, 1, 1, 1), huge)
    assert torch.isfinite(out).all() and abs(out.item() - 0.5) < 1e-3, (
        "two equal denominators of exp(1000) should weigh their blocks 1/2 each: stay in log space"
    )


def check_zigzag(lab) -> None:
    drawn = random.Random(case_seed(10))
    for seq, degree in (
        (13, 2),
        (13, 3),
        (16, 4),
        (13, 4),
        (50, 4),
        (drawn.randint(8, 80), drawn.randint(2, 4)),
    ):
        chunks = context_chunks.SequenceChunks(seq, degree, zigzag=True)
        for rank in range(degree):
            got = [tuple(s) for s in lab.zigzag_segments(seq, degree, rank)]
            wanted = [(s.start, s.length) for s in chunks.segments(rank)]
            assert got == wanted, (
                f"a sequence of {seq} on {degree} ranks: rank {rank} holds {got}, zig-zag gives {wanted}"
            )


def _qkv() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(case_seed(1))
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(3)]


def _ring(lab, causal: bool, zigzag: bool):
    """On a rank: the course's ring (computed before your file is loaded), then yours, and what yours
    sent; the judge compares."""
    rank, size = runtime.rank(), runtime.world_size()
    chunks = context_chunks.SequenceChunks(SEQ, size, zigzag=zigzag)
    mine = [chunks.local(t, rank, dim=2) for t in _qkv()]
    course = cp.ring_attention(*mine, chunks=chunks, causal=causal)
    with comm.CommLog() as log:
        yours = lab.ring_attention(*mine, seq_len=SEQ, causal=causal, zigzag=zigzag)
    return {
        "yours": yours.detach() if torch.is_tensor(yours) else None,
        "course": course.detach(),
        "sent": log.bytes_per_rank("send"),
        "exchanges": log.count("send"),
        "other_calls": log.count() - log.count("send") - log.count("recv"),
    }


def _check_ring(lab, causal: bool, zigzag: bool) -> None:
    name = ("causal " if causal else "") + ("zig-zag" if zigzag else "contiguous")
    expected = F.scaled_dot_product_attention(*_qkv(), is_causal=causal)
    for world in WORLD_SIZES:
        chunks = context_chunks.SequenceChunks(SEQ, world, zigzag=zigzag)
        for rank, result in enumerate(on_ranks(world, _ring, lab, causal, zigzag)):
            yours, wanted = result["yours"], chunks.local(expected, rank, dim=2)
            shape = None if yours is None else tuple(yours.shape)
            assert shape == tuple(wanted.shape), (
                f"{name} on {world} ranks: rank {rank} returned {shape}, not its rows {tuple(wanted.shape)}"
            )
            error = (yours - wanted).abs().max().item()
            assert error < 1e-5, (
                f"{name} on {world} ranks: rank {rank}'s output differs from one process's attention by "
                f"{error:.2e}"
            )
            assert (yours - result["course"]).abs().max().item() < 1e-5, (
                f"{name} on {world} ranks: rank {rank} differs from the course's ring"
            )


def check_ring_not_causal(lab) -> None:
    _check_ring(lab, causal=False, zigzag=False)


def check_ring_causal(lab) -> None:
    _check_ring(lab, causal=True, zigzag=False)
    _check_ring(lab, causal=True, zigzag=True)


def check_messages(lab) -> None:
    for world in WORLD_SIZES:
        chunks = context_chunks.SequenceChunks(SEQ, world, zigzag=True)
        for rank, result in enumerate(on_ranks(world, _ring, lab, True, True)):
            assert result["other_calls"] == 0, (
                f"on {world} ranks rank {rank} made {result['other_calls']} collective(s): a ring needs only "
                "the exchanges with its neighbours"
            )
            assert result["exchanges"] == world - 1, (
                f"on {world} ranks rank {rank} posted {result['exchanges']} exchanges, not C-1 = {world - 1}: "
                "the last chunk it holds need not travel on"
            )
            held = [chunks.tokens((rank - step) % world) for step in range(world - 1)]
            wanted = sum(held) * 2 * BATCH * HEADS * HEAD_DIM * 4
            assert result["sent"] == wanted, (
                f"on {world} ranks rank {rank} sent {result['sent']:.0f} bytes, not {wanted}: each step passes on "
                "the keys and values it holds (one message of both), once"
            )


PROPERTIES = [
    Property(
        "two blocks' partial softmaxes merge into one softmax over both keys",
        check_merge,
        "A block's lse is log Σ exp(scores) over its keys: the merged one adds the two sums "
        "(torch.logaddexp), and each block's output counts in proportion to its sum's share.",
    ),
    Property(
        "the zig-zag layout gives rank r chunks r and 2C-1-r of the 2C chunks",
        check_zigzag,
        "Cut into 2 x degree pieces with chunk_lengths; a chunk starts where the ones before it end.",
    ),
    Property(
        "the ring without a mask equals one process (2, 3, 4 ranks, uneven chunks)",
        check_ring_not_causal,
        "At step s you hold the chunk of rank (rank - s) % size; post the exchange before you compute, "
        "and size the receive buffer for the chunk that arrives, which may be a token shorter.",
    ),
    Property(
        "the causal ring equals one process, contiguous and zig-zag",
        check_ring_causal,
        "attend_block masks by global position: give it the positions of the chunk you hold (its "
        "owner's), not yours; a block it returns None for is skipped, not merged.",
    ),
    Property(
        "each rank passes on C-1 chunks of keys and values, each once, posted with its receive",
        check_messages,
        "One comm.send_recv per step but the last; stack k and v so they travel as one message.",
    ),
]


# -- the README's questions -------------------------------------------------------------------------------

LONG, DEGREE, LONG_HEADS, LONG_HEAD_DIM = 131072, 8, 32, 128  # bf16, batch 1: 2 bytes an element


def _ring_bytes() -> float:
    chunks = context_chunks.SequenceChunks(LONG, DEGREE, zigzag=True)
    return context_chunks.ring_bytes_per_rank(chunks, 0, bytes_per_token=2 * LONG_HEADS * LONG_HEAD_DIM * 2)


def _ulysses_bytes() -> float:
    chunks = context_chunks.SequenceChunks(LONG, DEGREE, zigzag=False)
    return ulysses.ulysses_bytes_per_rank(chunks, 0, bytes_per_token=LONG_HEADS * LONG_HEAD_DIM * 2)


def _imbalance() -> float:
    work = context_chunks.attention_work(context_chunks.SequenceChunks(LONG, 16, zigzag=False))
    return max(work) / (sum(work) / len(work))


def _attention_kept() -> float:
    from course_lib.plan.activations import block_activation_elements

    return block_activation_elements(
        batch=1, seq=LONG, d_model=LONG_HEADS * LONG_HEAD_DIM, heads=LONG_HEADS, context_degree=DEGREE
    )["attention"]


QUESTIONS = [
    Question(
        "ring_bytes_per_rank_s131072_c8_h32_d128_bf16",
        _ring_bytes,
        "forward: C-1 chunks of K and V (S/C tokens x heads x head_dim x 2 bytes, twice); backward: the "
        "same C-1 chunks again and C chunks of their gradients (course_lib/parallel/context.py)",
    ),
    Question(
        "contiguous_causal_work_max_over_mean_c16",
        _imbalance,
        "with contiguous chunks rank r computes r + 1 blocks (the diagonal one counted whole): compare the "
        "busiest rank with the mean (context_chunks.attention_work)",
        rel_tol=1e-3,
    ),
    Question(
        "attention_kept_elements_per_rank_s131072_c8_h32_d128",
        _attention_kept,
        "for its S/C tokens a rank keeps q, k, v, the output and the copy of it the out projection reads "
        "(S/C x heads x head_dim each), and one log-sum-exp per token and head "
        "(course_lib/plan/activations.py, block_activation_elements)",
    ),
    Question(
        "ulysses_bytes_per_rank_s131072_u8_h32_d128_bf16",
        _ulysses_bytes,
        "four all-to-alls forward (q, k, v and the output) and four backward, each sending (U-1)/U of the "
        "S/U tokens x heads x head_dim a rank holds (course_lib/parallel/ulysses.py)",
    ),
]
