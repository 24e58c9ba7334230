"""All-to-all sequence parallelism (DeepSpeed-Ulysses): trade a sequence split for a head split.

Ring attention (``context.py``) keeps the sequence split inside attention and moves keys and
values around a ring. Ulysses notices that attention is independent *per head*: if a rank held
the whole sequence for a few heads, it could compute those heads' attention alone. So around
attention it changes what is split:

    this rank: q, k, v of its S/U tokens, every head          (b, H, S/U, d)
    all-to-all: send heads j·H/U .. (j+1)·H/U of my tokens to rank j, receive theirs
    this rank: q, k, v of every token, H/U heads               (b, H/U, S, d)
    attention of those heads over the whole sequence (any kernel: FlashAttention, causal, ...)
    all-to-all back: send rank j the output of its tokens
    this rank: the output of its S/U tokens, every head        (b, H, S/U, d)

Everything outside attention works token by token on S/U tokens, as in ring attention.

**Cost.** Per attention layer, forward: one all-to-all of q, k and v together and one of the
output; backward the same two, reversed. An all-to-all sends (U-1)/U of what a rank holds, so a
rank sends, forward and backward, 8 x (U-1)/U x (S/U) x H x d elements (``ulysses_bytes_per_rank``).
That *falls* as U grows: with S and U grown together (one GPU per 1/U of the sequence) the bytes
per rank stay constant, where ring attention's stay (3U-2)/U x 2 x S/U x H x d and Megatron's
sequence parallelism's grow with S. The paper's count: 4Nh/P per link against Megatron-SP's 4Nh.

**Limits.** The degree U cannot exceed the number of *query* heads, and must divide it (the heads
are dealt out whole). Grouped-query attention (H_kv key/value heads, each read by H/H_kv query
heads) does not lower that limit: where U divides H_kv each rank receives H_kv/U key/value heads,
and where U exceeds H_kv each key/value head is copied U/H_kv times before the all-to-all, so that
every rank receives the one its query heads read (``kv_copies``; the copies' gradients add up in
backward). The price is bytes: the all-to-all then carries U key/value heads where the model has
H_kv (DeepSpeed-Ulysses' GQA scheme; verl and InternEvo do the same). The all-to-all is a
collective over all U ranks, which wants a fast all-to-all network (one node's NVLink), while
ring attention talks only to neighbours and hides behind compute. Every rank computes the whole
sequence's attention for its heads, so a causal mask costs every rank the same: no zig-zag needed.

**The hybrid (USP).** Ulysses inside a group of U ranks (a node: fast all-to-all, U <= heads),
ring attention across R groups (slow links, overlapped, no limit from the heads): the sequence is
cut into R ring chunks (zig-zag), each cut again into U pieces. A rank all-to-alls with its
Ulysses group to hold its ring chunk for H/U heads, runs the ring over its ring group on those
heads, and all-to-alls back (``usp_attention``).

PyTorch has no Ulysses of its own (torchtitan's context parallelism is the ring); DeepSpeed's
``DistributedAttention`` is the reference implementation, and on CPU the course compares with
one process's ``scaled_dot_product_attention``.

Papers: Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models", 2023 (arXiv:2309.14509); Fang and Zhao, "USP: A Unified
Sequence Parallelism Approach for Long Context Generative AI", 2024 (arXiv:2405.07719).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_group, check_int, check_module
from ..distributed import comm, runtime
from ..errors import UserError
from ..models import SelfAttention
from .context import check_attention_inputs, ring_attention, split_model_tokens
from .context_chunks import SequenceChunks, ring_bytes_per_rank

HEADS_DIM, SEQUENCE_DIM = -3, -2  # q, k, v are (..., heads, tokens, head_dim)


def check_heads(heads: int, degree: int, *, kv_heads: int | None = None) -> None:
    """Refuse, before any process waits, heads that do not deal out whole over ``degree`` ranks.

    Args:
        heads: the query heads (H).
        degree: the Ulysses degree (U).
        kv_heads: the key/value heads (H_kv; None: as many as the query heads).
    """
    check_int("attention heads", heads, minimum=1)
    check_int("Ulysses degree", degree, minimum=1)
    kv_heads = heads if kv_heads is None else kv_heads
    check_int("key/value heads", kv_heads, minimum=1)
    if heads % degree:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        raise UserError(
            f"{heads} attention heads do not divide by the Ulysses degree {degree}: each rank computes whole "
            f"heads, so use a degree among {fits}, or put the remaining ranks on a ring (usp_attention)"
        )
    if heads % kv_heads:
        raise UserError(
            f"{heads} query heads do not share {kv_heads} key/value heads evenly: grouped-query attention "
            "needs the query heads to be a multiple of the key/value heads"
        )
    if (kv_heads % degree) if degree <= kv_heads else (degree % kv_heads):
        raise UserError(
            f"{kv_heads} key/value heads and a Ulysses degree of {degree}: the degree must divide them, or "
            "be a multiple of them (each key/value head is then copied to degree / key/value heads ranks)"
        )


def kv_copies(heads: int, kv_heads: int, degree: int) -> int:
    """How many copies of each key/value head the first all-to-all sends: 1 where the degree divides
    the key/value heads, U / H_kv where it exceeds them (each rank then receives the one key/value
    head its H/U query heads read).

    Args:
        heads: the query heads (H).
        kv_heads: the key/value heads (H_kv).
        degree: the Ulysses degree (U).
    """
    check_heads(heads, degree, kv_heads=kv_heads)
    return max(1, degree // kv_heads)


# #region all-to-all
def _heads_to_sequence(x: torch.Tensor, tokens: list[int], group) -> torch.Tensor:
    """(..., H, my tokens, d) -> (..., H/U, every token, d): send heads group j to rank j."""
    size = len(tokens)
    heads = x.shape[HEADS_DIM]
    # (U, ..., H/U, s, d): the piece for rank j first, so the exchange cuts dimension 0
    outgoing = x.unflatten(HEADS_DIM, (size, heads // size)).movedim(HEADS_DIM - 1, 0).contiguous()
    piece = outgoing[0].shape  # what rank j's piece looks like, with rank j's token count
    receive = [outgoing[0].numel() // piece[SEQUENCE_DIM] * n for n in tokens]
    incoming = x.new_empty(sum(receive))
    send = [outgoing[0].numel()] * size
    comm.all_to_all_single(
        incoming, outgoing.reshape(-1), output_split_sizes=receive, input_split_sizes=send, group=group
    )
    pieces = [
        flat.view(*piece[:SEQUENCE_DIM], n, piece[-1])
        for flat, n in zip(incoming.split(receive), tokens, strict=True)
    ]
    return torch.cat(pieces, dim=SEQUENCE_DIM)  # rank order is sequence order


def _sequence_to_heads(y: torch.Tensor, tokens: list[int], group) -> torch.Tensor:
    """The inverse: (..., H/U, every token, d) -> (..., H, my tokens, d)."""
    size, rank = len(tokens), runtime.rank(group=group)
    outgoing = [piece.contiguous().reshape(-1) for piece in y.split(tokens, dim=SEQUENCE_DIM)]
    mine = outgoing[rank].numel()
    incoming = y.new_empty(size * mine)
    comm.all_to_all_single(
        incoming, torch.cat(outgoing), output_split_sizes=[mine] * size,
        input_split_sizes=[piece.numel() for piece in outgoing], group=group,
    )  # fmt: skip
    shape = (*y.shape[:SEQUENCE_DIM], tokens[rank], y.shape[-1])
    pieces = incoming.view(size, *shape)  # (U, ..., H/U, s, d): rank j sent heads group j
    return pieces.movedim(0, HEADS_DIM - 1).flatten(HEADS_DIM - 1, HEADS_DIM)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens, group):
        ctx.tokens, ctx.group = tokens, group
        return _heads_to_sequence(x, tokens, group)

    @staticmethod
    def backward(ctx, grad):  # the gradient goes back the way it came
        return _sequence_to_heads(grad, ctx.tokens, ctx.group), None, None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, tokens, group):
        ctx.tokens, ctx.group = tokens, group
        return _sequence_to_heads(y, tokens, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.tokens, ctx.group), None, None


# #endregion all-to-all


def heads_to_sequence(x: torch.Tensor, *, tokens: list[int], group=None) -> torch.Tensor:
    """The first all-to-all: this rank's tokens for every head -> every token for this rank's heads.

    Args:
        x: (..., heads, this rank's tokens, head_dim); the heads must divide by the group's size.
        tokens: every rank's token count, in rank order (``SequenceChunks(..., zigzag=False)``).
        group: the Ulysses process group (None: every rank).
    """
    return _HeadsToSequence.apply(x, list(tokens), group)


def sequence_to_heads(y: torch.Tensor, *, tokens: list[int], group=None) -> torch.Tensor:
    """The second all-to-all, the inverse of ``heads_to_sequence``.

    Args:
        y: (..., heads / U, every token, head_dim).
        tokens: every rank's token count, in rank order.
        group: the Ulysses process group (None: every rank).
    """
    return _SequenceToHeads.apply(y, list(tokens), group)


# #region ulysses
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunks: SequenceChunks,
    causal: bool = True,
    group=None,
) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence, by two all-to-alls around local attention.

    Equal, on every rank's tokens, to ``scaled_dot_product_attention`` on the whole sequence (with
    grouped-query attention: each key/value head repeated for the query heads that read it).

    Args:
        q: this rank's queries, (batch, heads, local tokens, head_dim), contiguous chunks.
        k: this rank's keys, (batch, key/value heads, local tokens, head_dim): as many heads as q,
            or fewer (grouped-query attention; see ``check_heads`` for the degrees that deal out).
        v: this rank's values, the shape of k.
        chunks: which positions each rank holds: contiguous chunks (``zigzag=False``; its degree
            is the group's size).
        causal: each query sees only the keys at or before its position.
        group: the Ulysses process group (None: every rank).
    """
    check_attention_inputs(q, k, v, chunks=chunks, group=group, grouped_kv=True)
    size = runtime.world_size(group=group)
    if chunks.zigzag:
        raise UserError(
            "Ulysses gathers the sequence in rank order, so it needs contiguous chunks: build the layout "
            "with zigzag=False (every rank computes the whole sequence for its heads, so it is balanced)"
        )
    copies = kv_copies(q.shape[HEADS_DIM], k.shape[HEADS_DIM], size)
    tokens = [chunks.tokens(r) for r in range(size)]
    if copies > 1:  # more ranks than key/value heads: each rank gets a copy of the one its queries read
        k, v = (t.repeat_interleave(copies, dim=HEADS_DIM) for t in (k, v))  # backward adds the copies up
    if size > 1 and k.shape == q.shape:
        # one all-to-all for q, k and v together: the same bytes as three, a third of the latency
        q, k, v = heads_to_sequence(torch.stack([q, k, v]), tokens=tokens, group=group)
    elif size > 1:  # grouped-query attention: q in one all-to-all, k and v (fewer heads) in another
        q = heads_to_sequence(q, tokens=tokens, group=group)
        k, v = heads_to_sequence(torch.stack([k, v]), tokens=tokens, group=group)
    group_size = q.shape[HEADS_DIM] // k.shape[HEADS_DIM]  # query heads per key/value head, here
    if group_size > 1:  # (a copy of each would be kept for backward: only where the heads differ)
        k, v = (t.repeat_interleave(group_size, dim=HEADS_DIM) for t in (k, v))
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out if size == 1 else sequence_to_heads(out, tokens=tokens, group=group)


# #endregion ulysses


def ulysses_bytes_per_rank(
    chunks: SequenceChunks, rank: int, *, bytes_per_token: int, kv_bytes_per_token: int | None = None
) -> int:
    """What rank ``rank`` sends in one Ulysses attention, forward and backward (the theory).

    Forward, q, k and v leave for the other ranks' heads: (U-1)/U of the rank's s_r tokens, three
    times; the output comes home: the other ranks' S - s_r tokens of this rank's H/U heads.
    Backward sends the same again, reversed: the output's gradient as q, k, v went, the q, k, v
    gradients as the output came. With even chunks: 8 x (U-1)/U x S/U tokens.

    Args:
        chunks: who holds which positions (contiguous chunks).
        rank: the rank that sends.
        bytes_per_token: one token's q (or k, or v) over every head: batch x heads x head_dim x
            element size.
        kv_bytes_per_token: one token's k (or v) over the key/value heads the all-to-all carries,
            where grouped-query attention makes it differ from q's: max(H_kv, U) heads (None: as q).
    """
    size = chunks.degree
    kv = bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token
    mine, others = chunks.tokens(rank), chunks.seq_len - chunks.tokens(rank)
    # forward: q, k, v out and the output back; backward: the output's gradient out, q, k, v's back.
    # What leaves for the others is (U-1)/U of this rank's tokens; what comes back, 1/U of theirs.
    qkv, out = bytes_per_token + 2 * kv, bytes_per_token
    return ((qkv + out) * mine * (size - 1) + (out + qkv) * others) // size


class UlyssesAttention(nn.Module):
    """The attention core of ``models.SelfAttention`` on a chunk of the sequence, by all-to-all (causal).

    Args:
        chunks: contiguous chunks of the sequence over the group.
        group: the Ulysses process group (None: every rank).
    """

    def __init__(self, chunks: SequenceChunks, *, group=None):
        super().__init__()
        self.chunks, self.group = chunks, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(q, k, v, chunks=self.chunks, causal=True, group=self.group)


def apply_ulysses_parallel(model: nn.Module, group=None, *, chunks: SequenceChunks) -> nn.Module:
    """Make a ``models.TinyTransformer`` run on this rank's contiguous chunk, attention by all-to-all.

    As ``context.apply_context_parallel``: the embedding looks positions up from the chunks, every
    attention core becomes ``UlyssesAttention``; the model then takes ``chunks.local(ids)`` and
    returns those tokens' logits (``context.context_parallel_loss``).

    Args:
        model: the transformer, changed in place; its heads must divide by the group's size.
        group: the Ulysses process group (None: every rank).
        chunks: contiguous chunks (``SequenceChunks(..., zigzag=False)``) over the group.
    """
    check_module("model", model)
    check_group("group", group)
    size = runtime.world_size(group=group)
    for module in model.modules():  # every block refused before any is changed
        if isinstance(module, SelfAttention):
            check_heads(module.q.weight.shape[0] // module.head_dim, size)  # the heads on this rank
    return split_model_tokens(
        model, chunks, attention_core=lambda: UlyssesAttention(chunks, group=group), group=group
    )


# -- the hybrid: Ulysses inside a group, ring attention across groups ---------------------------


@dataclass(frozen=True)
class UspChunks:
    """Which tokens each rank of a ring x Ulysses grid holds (rank = ring rank x U + Ulysses rank).

    The sequence is cut into ``ring_degree`` ring chunks (zig-zag), and each ring chunk, in the
    order its rank holds it, into ``ulysses_degree`` contiguous pieces.

    Args:
        seq_len: S, the whole sequence.
        ring_degree: R, the ranks of a ring (across groups).
        ulysses_degree: U, the ranks of a Ulysses group (consecutive ranks: one node).
    """

    seq_len: int
    ring_degree: int
    ulysses_degree: int

    def __post_init__(self):
        check_int("Ulysses degree", self.ulysses_degree, minimum=1)
        shortest = min(self.ring.tokens(r) for r in range(self.ring_degree))
        if shortest < self.ulysses_degree:
            raise UserError(
                f"a ring chunk of {shortest} tokens does not cut into {self.ulysses_degree} Ulysses pieces: "
                f"use a sequence of at least {2 * self.ring_degree * self.ulysses_degree} tokens"
            )

    @property
    def ring(self) -> SequenceChunks:
        return SequenceChunks(self.seq_len, self.ring_degree, zigzag=True)

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(ring rank, Ulysses rank) of global rank ``rank``."""
        return divmod(rank, self.ulysses_degree)

    def inside(self, ring_rank: int) -> SequenceChunks:
        """Ring chunk ``ring_rank``, in the order its rank holds it, cut over the Ulysses group."""
        return SequenceChunks(self.ring.tokens(ring_rank), self.ulysses_degree, zigzag=False)

    def pieces(self, ring_rank: int) -> list[int]:
        """The token counts of the Ulysses pieces of ring chunk ``ring_rank``."""
        inside = self.inside(ring_rank)
        return [inside.tokens(r) for r in range(self.ulysses_degree)]

    def local(self, tensor: torch.Tensor, rank: int, *, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of a whole-sequence ``tensor`` (sequence along ``dim``)."""
        ring_rank, ulysses_rank = self.coordinates(rank)
        chunk = self.ring.local(tensor, ring_rank, dim=dim)
        return chunk.split(self.pieces(ring_rank), dim=dim)[ulysses_rank]


def usp_groups(ulysses_degree: int):
    """(Ulysses group, ring group) of this rank: consecutive ranks share a Ulysses group.

    Every rank creates every group, in the same order, as ``torch.distributed.new_group`` asks.

    Args:
        ulysses_degree: U; the world's size must be a multiple.
    """
    size, rank = runtime.world_size(), runtime.rank()
    check_int("Ulysses degree", ulysses_degree, minimum=1)
    if size % ulysses_degree:
        raise UserError(
            f"{size} ranks do not make Ulysses groups of {ulysses_degree}: use a divisor of {size}"
        )
    mine = {}
    for first in range(0, size, ulysses_degree):
        group = dist.new_group(list(range(first, first + ulysses_degree)))
        if rank // ulysses_degree == first // ulysses_degree:
            mine["ulysses"] = group
    for offset in range(ulysses_degree):
        group = dist.new_group(list(range(offset, size, ulysses_degree)))
        if rank % ulysses_degree == offset:
            mine["ring"] = group
    return mine["ulysses"], mine["ring"]


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunks: UspChunks,
    causal: bool = True,
    ulysses_group=None,
    ring_group=None,
) -> torch.Tensor:
    """USP: an all-to-all inside the Ulysses group, ring attention across, and an all-to-all back.

    Args:
        q: this rank's queries, (batch, heads, local tokens, head_dim), as ``layout.local`` cuts them.
        k: this rank's keys, the same shape.
        v: this rank's values, the same shape.
        chunks: the grid's token layout.
        causal: each query sees only the keys at or before its position.
        ulysses_group: this rank's Ulysses group (``usp_groups``).
        ring_group: this rank's ring group (``usp_groups``).
    """
    ring_rank = runtime.rank(group=ring_group)
    if (runtime.world_size(group=ulysses_group), runtime.world_size(group=ring_group)) != (
        chunks.ulysses_degree,
        chunks.ring_degree,
    ):
        raise UserError(
            "the groups do not match the layout's degrees: make them with usp_groups(ulysses_degree)"
        )
    pieces = chunks.pieces(ring_rank)
    check_attention_inputs(q, k, v, chunks=chunks.inside(ring_rank), group=ulysses_group)
    check_heads(q.shape[HEADS_DIM], chunks.ulysses_degree)
    # my ring chunk, for H/U heads, in the ring layout's order
    chunk = heads_to_sequence(torch.stack([q, k, v]), tokens=pieces, group=ulysses_group)
    out = ring_attention(*chunk, chunks=chunks.ring, causal=causal, group=ring_group)
    return sequence_to_heads(out, tokens=pieces, group=ulysses_group)


def usp_bytes_per_rank(chunks: UspChunks, rank: int, *, bytes_per_token: int) -> int:
    """What rank ``rank`` sends in one USP attention, forward and backward: its Ulysses and ring parts.

    Args:
        chunks: the grid's token layout.
        rank: the global rank that sends.
        bytes_per_token: one token's q over every head (batch x heads x head_dim x element size).
    """
    ring_rank, ulysses_rank = chunks.coordinates(rank)
    inside = chunks.inside(ring_rank)
    ulysses = ulysses_bytes_per_rank(inside, ulysses_rank, bytes_per_token=bytes_per_token)
    # the ring carries K and V of H/U heads
    ring = ring_bytes_per_rank(
        chunks.ring, ring_rank, bytes_per_token=2 * bytes_per_token // chunks.ulysses_degree
    )
    return ulysses + ring
