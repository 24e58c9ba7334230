"""Exercise: lab 9: ring attention, from the online softmax up.

A sequence too long for one rank is cut over C ranks; attention needs every key for every query,
so the keys and values travel around a ring of the ranks while each rank computes the block of
attention they allow. Three pieces:

- **the online-softmax merge**: two blocks' partial results (each a softmax over its own keys,
  with the log of its denominator, ``lse``) combined exactly as if one softmax had covered both;
- **the ring loop**: at each of C steps, pass on the chunk of keys and values you hold to the
  next rank while you receive the previous rank's (posted together, so no rank waits on a
  neighbour that is itself waiting), compute your block with what you hold, merge it, and only
  then wait for the message;
- **the zig-zag layout**: with a causal mask, contiguous chunks give rank C-1 C times the work of
  rank 0; cutting the sequence into 2C chunks and giving rank r chunks r and 2C-1-r balances it.

Check your work (every property, at 2, 3 and 4 processes):

    python -m course_lib.tools.labs check lab9_ring_attention
"""

from __future__ import annotations

import torch

from course_lib.distributed import comm, runtime
from course_lib.parallel.context_chunks import (
    chunk_lengths,  # total tokens in consecutive pieces, the first longer
)


def contiguous_segments(seq_len: int, degree: int, rank: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s positions as (start, length) runs: chunk ``rank`` of ``degree``."""
    lengths = chunk_lengths(seq_len, degree)
    return [(sum(lengths[:rank]), lengths[rank])]


def zigzag_segments(seq_len: int, degree: int, rank: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s positions as (start, length) runs: chunks ``rank`` and ``2·degree-1-rank`` of 2·degree."""
    # TODO: cut the sequence into 2 x degree chunks with chunk_lengths (uneven lengths are fine), find where each starts, and return this rank's early chunk then its late one (2 x degree - 1 - rank), in that order
    raise NotImplementedError(
        "TODO: cut the sequence into 2 x degree chunks with chunk_lengths (uneven lengths are fine), find where each starts, and return this rank's early chunk then its late one (2 x degree - 1 - rank), in that order"
    )


def positions(segments: list[tuple[int, int]]) -> torch.Tensor:
    """The global positions of a rank's tokens, in the order its tensors hold them."""
    return torch.cat([torch.arange(start, start + length) for start, length in segments])


def local_tokens(tensor: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """A rank's tokens of a whole-sequence (batch, heads, tokens, head_dim) tensor."""
    return torch.cat([tensor.narrow(2, start, length) for start, length in segments], dim=2)


def attend_block(q, k, v, q_positions, k_positions, *, causal: bool):
    """One block of attention: (output, lse) of ``q`` over these keys only, or None if the mask hides all.

    ``lse`` is the log of each query's softmax denominator over this block's keys: -inf for a
    query that sees none of them (its output row is then 0).
    """
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        hidden = k_positions[None, :] > q_positions[:, None]
        if bool(hidden.all()):
            return None  # every key comes after every query: nothing to compute
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees nothing: 0
    return weights @ v, lse


def merge_partial(out, lse, block_out, block_lse):
    """The online softmax: the running (out, lse) and a new block's merged, as one softmax over both.

    ``out`` and ``lse`` are None before the first block.
    """
    # TODO: each partial result is a softmax over its own keys only, and its log-sum-exp says how much weight those keys carry; the merged result weights each part by its keys' share of all the keys' weight. Pitfall: the weights are exponentials of large numbers, so stay in log space (torch has a function for log(exp(a) + exp(b))), and mind the broadcast over head_dim
    raise NotImplementedError(
        "TODO: each partial result is a softmax over its own keys only, and its log-sum-exp says how much weight those keys carry; the merged result weights each part by its keys' share of all the keys' weight. Pitfall: the weights are exponentials of large numbers, so stay in log space (torch has a function for log(exp(a) + exp(b))), and mind the broadcast over head_dim"
    )


def ring_attention(q, k, v, *, seq_len: int, causal: bool = True, zigzag: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, the keys and values travelling a ring.

    ``q``, ``k`` and ``v`` are this rank's tokens, (batch, heads, local tokens, head_dim), cut by
    ``zigzag_segments`` (or ``contiguous_segments``). Returns this rank's rows of the output.
    """
    rank, size = runtime.rank(), runtime.world_size()
    layout = zigzag_segments if zigzag else contiguous_segments
    mine = positions(layout(seq_len, size, rank))
    following, preceding = (rank + 1) % size, (rank - 1) % size
    held = torch.stack([k, v])  # one message carries both
    # TODO: at each step you compute attention against the chunk you hold while the next one travels to you; after size steps every rank has seen every chunk once. Pitfall: a rank that sends, waits, and only then receives can wait forever for a neighbour doing the same; and the chunk you hold is not yours: attend_block needs its owner's positions
    raise NotImplementedError(
        "TODO: at each step you compute attention against the chunk you hold while the next one travels to you; after size steps every rank has seen every chunk once. Pitfall: a rank that sends, waits, and only then receives can wait forever for a neighbour doing the same; and the chunk you hold is not yours: attend_block needs its owner's positions"
    )
