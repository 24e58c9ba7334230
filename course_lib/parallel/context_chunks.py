"""Context parallelism's chunks: which tokens each rank holds, the work and the bytes of its ring.

**Causal masking and balance.** With a causal mask, query i sees keys j <= i. A block whose keys
all come after its queries is entirely masked: it is skipped, not computed. With contiguous
chunks (rank r holds chunk r), rank 0 computes 1 block and rank C-1 computes C: the ring waits
for the slowest, so it runs at about 2x the ideal time. The **zig-zag** layout cuts the
sequence into 2C chunks and gives rank r chunks r and 2C-1-r (one early, one late): every rank
then computes the same work (``attention_work``). Chunks may be uneven: a sequence of 50 on 4
ranks cuts into pieces of 7 and 6.

Ulysses (``parallel.ulysses``) deals out the same chunks, and its hybrid with the ring sends what
``ring_bytes_per_rank`` counts: the layout is shared by both ways of splitting a sequence.

Papers: the zig-zag layout is that of the implementations rather than of a paper: Megatron-LM's
context parallelism (``get_batch_on_this_cp_rank`` cuts the sequence into 2C chunks and gives rank
r chunks r and 2C-1-r) and zhuzilin's ring-flash-attention (``zigzag_ring_flash_attn``). The
other balanced layout is Brandon et al.'s "Striped Attention", 2023 (arXiv:2311.09431):
round-robin *tokens* (rank r holds tokens r, r + C, r + 2C, ...), balanced at every ring step,
not only over the whole ring.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from ..checks import check_int
from ..errors import UserError


def chunk_lengths(total: int, pieces: int) -> list[int]:
    """``total`` tokens cut into ``pieces`` consecutive chunks, the first ``total % pieces`` one longer.

    Args:
        total: the sequence length.
        pieces: how many chunks.
    """
    return [total // pieces + (i < total % pieces) for i in range(pieces)]


@dataclass(frozen=True)
class Segment:
    """A run of consecutive positions of the sequence: ``start`` to ``start + length``."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def check_context_split(seq_len: int, degree: int, *, zigzag: bool) -> None:
    """Refuse, before any process waits, a sequence too short to give every rank its chunk(s)."""
    check_int("sequence length", seq_len, minimum=1)
    check_int("context-parallel degree", degree, minimum=1)
    pieces = 2 * degree if zigzag else degree
    if seq_len < pieces:
        need = f"zig-zag needs 2 x {degree}" if zigzag else f"{degree} ranks need"
        raise UserError(
            f"a sequence of {seq_len} tokens does not split over context-parallel degree {degree}: {need} "
            f"= {pieces} chunks of at least one token; use sequences of at least {pieces} tokens or a "
            "smaller degree"
        )


@dataclass(frozen=True)
class SequenceChunks:
    """Which positions of a sequence each context-parallel rank holds.

    Args:
        seq_len: S, the whole sequence.
        degree: C, the ranks sharing it.
        zigzag: cut into 2C chunks and give rank r chunks r and 2C-1-r (balanced causal work);
            otherwise rank r holds chunk r of C.
    """

    seq_len: int
    degree: int
    _: KW_ONLY
    zigzag: bool = True

    def __post_init__(self):
        check_context_split(self.seq_len, self.degree, zigzag=self.zigzag)

    def segments(self, rank: int) -> list[Segment]:
        """The runs of positions rank ``rank`` holds, in the order they sit in its local tensors."""
        pieces = 2 * self.degree if self.zigzag else self.degree
        lengths = chunk_lengths(self.seq_len, pieces)
        starts = [sum(lengths[:i]) for i in range(pieces)]
        owned = [rank, pieces - 1 - rank] if self.zigzag else [rank]
        return [Segment(starts[i], lengths[i]) for i in owned]

    def tokens(self, rank: int) -> int:
        return sum(segment.length for segment in self.segments(rank))

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions of rank ``rank``'s tokens (what its position embedding looks up)."""
        return torch.cat([torch.arange(s.start, s.end) for s in self.segments(rank)])

    def local(self, tensor: torch.Tensor, rank: int, *, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of a whole-sequence ``tensor`` (sequence along ``dim``)."""
        return torch.cat([tensor.narrow(dim, s.start, s.length) for s in self.segments(rank)], dim=dim)

    def whole(self, pieces: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
        """The inverse of ``local``: every rank's piece (rank order) put back in sequence order."""
        parts = []
        for rank, piece in enumerate(pieces):
            offset = 0
            for segment in self.segments(rank):
                parts.append((segment.start, piece.narrow(dim, offset, segment.length)))
                offset += segment.length
        return torch.cat([part for _, part in sorted(parts, key=lambda item: item[0])], dim=dim)


def block_is_needed(query: Segment, key: Segment, *, causal: bool) -> bool:
    """Does any query of ``query`` see a key of ``key``? (Causal: not if every key comes later.)"""
    return not causal or key.start < query.end


def attention_work(chunks: SequenceChunks, *, causal: bool = True) -> list[int]:
    """Query-key scores each rank computes in one ring attention (per batch entry and head).

    The sum over ranks is S² (non-causal) or what the mask keeps of it; the largest entry is
    what the ring's time follows.

    Args:
        chunks: who holds which positions.
        causal: skip the blocks a causal mask hides entirely.
    """
    work = []
    for rank in range(chunks.degree):
        total = 0
        for owner in range(chunks.degree):
            for query in chunks.segments(rank):
                for key in chunks.segments(owner):
                    if block_is_needed(query, key, causal=causal):
                        total += query.length * key.length
        work.append(total)
    return work


def ring_bytes_per_rank(chunks: SequenceChunks, rank: int, *, bytes_per_token: int) -> int:
    """What rank ``rank`` sends in one ring attention, forward and backward (the theory).

    Forward it passes on C-1 K/V chunks (all but the last it holds); backward the same C-1
    chunks again, and C chunks of their gradients (the last pass takes them home).

    Args:
        chunks: who holds which positions.
        rank: the rank that sends.
        bytes_per_token: K and V of one token (2 x batch x heads x head_dim x element size).
    """
    if chunks.degree == 1:
        return 0
    held = [chunks.tokens((rank - step) % chunks.degree) for step in range(chunks.degree)]
    return bytes_per_token * (2 * sum(held[:-1]) + sum(held))


def ring_schedule(chunks: SequenceChunks, *, causal: bool = True) -> list[list[dict]]:
    """What happens at every step of the ring, for drawing it: ``steps[s][rank]``.

    Each entry holds ``"owner"`` (whose K/V chunk the rank holds at that step), ``"blocks"`` (the
    (query segment, key segment) pairs it computes) and ``"skipped"`` (the pairs the mask hides).

    Args:
        chunks: who holds which positions.
        causal: skip the blocks a causal mask hides entirely.
    """
    steps = []
    for step in range(chunks.degree):
        row = []
        for rank in range(chunks.degree):
            owner = (rank - step) % chunks.degree
            pairs = [(q, k) for q in chunks.segments(rank) for k in chunks.segments(owner)]
            row.append(
                {
                    "owner": owner,
                    "blocks": [p for p in pairs if block_is_needed(*p, causal=causal)],
                    "skipped": [p for p in pairs if not block_is_needed(*p, causal=causal)],
                }
            )
        steps.append(row)
    return steps
