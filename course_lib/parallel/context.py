"""Context parallelism: ring attention, so that one sequence can be longer than one rank can hold.

Tensor and sequence parallelism split a layer; context parallelism splits the *sequence* for
the whole model. Each of C ranks holds a chunk of every sequence: its tokens' activations, and
its queries, keys and values in attention. Everything but attention is per token, so it needs
no communication. Attention needs every key for every query, so the key/value chunks travel:

    for step in 0 .. C-1:
        start sending my current K/V chunk to the next rank, receiving the previous rank's
        attend my queries to the K/V chunk I hold (one block of the attention matrix)
        merge the block's result into my running result
        wait for the message: the next step's chunk

After C steps every query has met every key, and no rank ever held more than two K/V chunks.
The message travels while the block is computed: the ring costs no time if computing a block
takes longer than sending a chunk.

**Merging partial results (online softmax).** A block gives, for each query, the softmax of
its scores over *this block's* keys, ``o_b``, and the log of that softmax's denominator,
``lse_b = log Σ exp(scores)``. Two blocks merge exactly:

    lse = log(exp(lse_1) + exp(lse_2)),    o = exp(lse_1 - lse)·o_1 + exp(lse_2 - lse)·o_2

(the same rule as FlashAttention's tiles). The backward runs the ring again: each block's
gradient needs only the block and the final ``o`` and ``lse``, and the key/value gradients
travel with their keys and values until they are home.

**Causal masking and balance** (``context_chunks``): a block whose keys all come after its
queries is skipped; contiguous chunks leave rank C-1 with C times rank 0's work, the zig-zag
layout (2C chunks, rank r holding r and 2C-1-r) balances it.

Cost per rank: activations and attention inputs of S/C tokens; the attention block of
(S/C)² scores at a time instead of S²; sent per layer: C-1 K/V chunks forward, C-1 K/V chunks
and C K/V-gradient chunks backward, i.e. about 2·(C-1)/C of the layer's keys and values, each way.

PyTorch's twin, ``torch.distributed.tensor.experimental.context_parallel``, shards the buffers
and swaps scaled_dot_product_attention for a ring; it supports only the CUDA attention kernels
(on CPU it stops with "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered"), so on CPU the course compares with one process.

Papers: Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context", 2023 (arXiv:2310.01889); the online softmax, Milakov and Gimelshein, 2018
(arXiv:1805.02867) and Dao et al., "FlashAttention", NeurIPS 2022 (arXiv:2205.14135); the
layouts' sources are in ``context_chunks``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..checks import check_group, check_instance, check_module
from ..distributed import comm, runtime
from ..errors import UserError
from ..models import Embedding, SelfAttention
from .claims import claim_module
from .context_chunks import Segment, SequenceChunks, block_is_needed

# -- one block of attention, forward and backward ----------------------------------------------


def _scores(q, k, query: Segment, key: Segment, causal: bool, scale: float) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) * scale
    if causal and key.end > query.start:  # the diagonal block: hide the keys after each query
        q_pos = torch.arange(query.start, query.end, device=q.device)
        k_pos = torch.arange(key.start, key.end, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores


def _block_forward(q, k, v, query, key, causal, scale):
    """Softmax attention of ``q`` over this block's keys, and the log of its denominator."""
    scores = _scores(q, k, query, key, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


# #region ring-attention
# #region online-softmax
def merge_partial_attention(out, lse, block_out, block_lse):
    """The online-softmax rule: two blocks' results as if one softmax had covered both."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    return (
        torch.exp(lse - merged).unsqueeze(-1) * out + torch.exp(block_lse - merged).unsqueeze(-1) * block_out,
        merged,
    )


# #endregion online-softmax


def _block_backward(q, k, v, out_grad, lse, delta, query, key, causal, scale):
    """FlashAttention's backward for one block, from the final lse and delta = rowsum(dO · O)."""
    probabilities = torch.exp(_scores(q, k, query, key, causal, scale) - lse.unsqueeze(-1))
    v_grad = probabilities.transpose(-1, -2) @ out_grad
    score_grad = probabilities * (out_grad @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return score_grad @ k * scale, score_grad.transpose(-1, -2) @ q * scale, v_grad


def _split(tensor: torch.Tensor, segments: list[Segment], *, dim: int = -2) -> list[torch.Tensor]:
    return list(tensor.split([s.length for s in segments], dim=dim))


class _Ring:
    """The ring's neighbours and the shapes of the chunks that travel on it."""

    def __init__(self, chunks: SequenceChunks, group):
        self.chunks, self.group = chunks, group
        self.rank, self.size = runtime.rank(group=group), runtime.world_size(group=group)
        self.next, self.previous = runtime.ring_neighbours(group=group)

    def owner_at(self, step: int) -> int:
        return (self.rank - step) % self.size

    def pass_on(self, chunk: torch.Tensor, step: int, *, tag: int = 0):
        """Start sending ``chunk`` on; return (handle, buffer) for the chunk of step + 1."""
        incoming_tokens = self.chunks.tokens(self.owner_at(step + 1))
        shape = (*chunk.shape[:-2], incoming_tokens, chunk.shape[-1])
        buffer = torch.empty(shape, dtype=chunk.dtype, device=chunk.device)
        handle = comm.send_recv(
            chunk.contiguous(), self.next, buffer, self.previous, group=self.group, tag=tag
        )
        return handle, buffer


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunks, causal, group):
        ring = _Ring(chunks, group)
        scale = q.shape[-1] ** -0.5
        queries = chunks.segments(ring.rank)
        q_parts = _split(q, queries)
        results = [(None, None)] * len(queries)
        key_values = torch.stack([k, v])
        for step in range(ring.size):
            if step < ring.size - 1:  # send on what we hold while we compute with it
                handle, incoming = ring.pass_on(key_values, step)
            keys = chunks.segments(ring.owner_at(step))
            for k_part, v_part, key in zip(*(_split(t, keys) for t in key_values), keys, strict=True):
                for i, (q_part, query) in enumerate(zip(q_parts, queries, strict=True)):
                    if block_is_needed(query, key, causal=causal):
                        block = _block_forward(q_part, k_part, v_part, query, key, causal, scale)
                        results[i] = merge_partial_attention(*results[i], *block)
            if step < ring.size - 1:
                handle.wait()
                key_values = incoming
        out = torch.cat([o for o, _ in results], dim=-2)
        lse = torch.cat([s for _, s in results], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.causal, ctx.group = chunks, causal, group
        return out

    @staticmethod
    def backward(ctx, out_grad):
        q, k, v, out, lse = ctx.saved_tensors
        chunks, causal, group = ctx.chunks, ctx.causal, ctx.group
        ring = _Ring(chunks, group)
        scale = q.shape[-1] ** -0.5
        queries = chunks.segments(ring.rank)
        out_grad = out_grad.contiguous()
        delta = (out_grad * out).sum(-1)
        q_grad = torch.zeros_like(q)
        q_parts, g_parts, q_grad_parts = (_split(t, queries) for t in (q, out_grad, q_grad))
        lse_parts, delta_parts = (_split(t, queries, dim=-1) for t in (lse, delta))
        key_values = torch.stack([k, v])
        kv_grad_handle = arriving_grad = None
        for step in range(ring.size):
            if step < ring.size - 1:
                handle, incoming = ring.pass_on(key_values, step)
            keys = chunks.segments(ring.owner_at(step))
            kv_grad = torch.zeros_like(key_values)  # the gradient of the chunk we hold, for its owner
            pieces = (_split(t, keys) for t in (*key_values, *kv_grad))  # views: += lands in kv_grad
            for k_part, v_part, k_grad_part, v_grad_part, key in zip(*pieces, keys, strict=True):
                for i, query in enumerate(queries):
                    if block_is_needed(query, key, causal=causal):
                        dq, dk, dv = _block_backward(
                            q_parts[i], k_part, v_part, g_parts[i], lse_parts[i], delta_parts[i],
                            query, key, causal, scale,
                        )  # fmt: skip
                        q_grad_parts[i] += dq
                        k_grad_part += dk
                        v_grad_part += dv
            # The gradients travel behind their chunk: collect what the ring brings, add ours, pass on.
            if step > 0:
                kv_grad_handle.wait()
                kv_grad += arriving_grad
            if ring.size > 1:
                kv_grad_handle, arriving_grad = ring.pass_on(kv_grad, step, tag=1)
            if step < ring.size - 1:
                handle.wait()
                key_values = incoming
        if ring.size > 1:  # after C passes, the gradient of our own chunk is home
            kv_grad_handle.wait()
            kv_grad = arriving_grad
        return q_grad, kv_grad[0], kv_grad[1], None, None, None


# #endregion ring-attention


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunks: SequenceChunks,
    causal: bool = True,
    group=None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, the keys travelling a ring.

    Equal, on every rank's tokens, to ``scaled_dot_product_attention`` on the whole sequence.

    Args:
        q: this rank's queries, (batch, heads, local tokens, head_dim), in ``chunks``'s order.
        k: this rank's keys, the same shape.
        v: this rank's values, the same shape.
        chunks: which positions every rank of the group holds (its degree is the group's size).
        causal: each query sees only the keys at or before its position.
        group: the context-parallel process group (None: every rank).
    """
    check_attention_inputs(q, k, v, chunks=chunks, group=group)
    return _RingAttention.apply(q, k, v, chunks, causal, group)


def check_attention_inputs(q, k, v, *, chunks, group=None, grouped_kv: bool = False) -> None:
    """Refuse, before any message, a layout for another group size or q, k, v not of this rank's tokens.

    Args:
        q: this rank's queries.
        k: this rank's keys.
        v: this rank's values.
        chunks: who holds which positions (its ``degree`` must be the group's size).
        group: the process group the tokens are split over (None: every rank).
        grouped_kv: k and v may have fewer heads than q (grouped-query attention).
    """
    check_group("group", group)
    size, rank = runtime.world_size(group=group), runtime.rank(group=group)
    if chunks.degree != size:
        raise UserError(
            f"the chunks are for {chunks.degree} ranks but the group has {size}: build it with degree={size}"
        )
    same = q.shape == k.shape == v.shape
    if grouped_kv:  # every dimension but the heads
        same = (
            k.shape == v.shape
            and q.dim() == k.dim()
            and q.shape[:-3] + q.shape[-2:] == k.shape[:-3] + k.shape[-2:]
        )
    if not same or q.dim() < 3 or q.shape[-2] != chunks.tokens(rank):
        heads = " (k and v may have fewer heads)" if grouped_kv else ""
        raise UserError(
            f"q, k and v must each be (batch, heads, {chunks.tokens(rank)} tokens, head_dim) on rank {rank}"
            f"{heads}, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}: take the tokens with "
            "layout.local()"
        )


class RingAttention(nn.Module):
    """The attention core of ``models.SelfAttention`` on a chunk of the sequence (causal).

    Args:
        chunks: which positions every rank of the group holds.
        group: the context-parallel process group (None: every rank).
    """

    def __init__(self, chunks: SequenceChunks, *, group=None):
        super().__init__()
        self.chunks, self.group = chunks, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, chunks=self.chunks, causal=True, group=self.group)


class ContextParallelEmbedding(nn.Module):
    """The token and position embedding of this rank's tokens, looked up at their global positions."""

    def __init__(self, embedding: nn.Module, chunks: SequenceChunks, rank: int):
        super().__init__()
        self.embedding, self.chunks, self.rank = embedding, chunks, rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # through the embedding's own call, so that what hooks it still runs (sequence
        # parallelism cuts its output over the tensor ranks)
        return self.embedding(ids, positions=self.chunks.positions(self.rank).to(ids.device))


def apply_context_parallel(model: nn.Module, group=None, *, chunks: SequenceChunks) -> nn.Module:
    """Make a ``models.TinyTransformer`` (or a pipeline stage of one) run on this rank's tokens.

    Every block's attention core becomes ``RingAttention``; the embedding looks positions up from
    the chunks. The rest (norms, MLPs, the head) works token by token and is unchanged; the model
    then takes ``chunks.local(ids)`` and returns the logits of those tokens.

    Args:
        model: the transformer (dense or tensor parallel), changed in place.
        group: the context-parallel process group (None: every rank).
        chunks: which positions every rank of the group holds (a ``SequenceChunks``).
    """
    return split_model_tokens(
        model, chunks, attention_core=lambda: RingAttention(chunks, group=group), group=group
    )


def split_model_tokens(
    model: nn.Module, chunks: SequenceChunks, *, attention_core: Callable[[], nn.Module], group=None
) -> nn.Module:
    """Any split of the tokens over a group: the embedding looks positions up, attention is swapped.

    What ring attention (``apply_context_parallel``) and Ulysses (``ulysses.apply_ulysses_parallel``)
    share: only attention sees other ranks' tokens, so only its core changes.

    Args:
        model: the transformer (dense or tensor parallel), or a stage of one, changed in place.
        chunks: which positions every rank of the group holds.
        attention_core: makes one attention core (``RingAttention``, ``ulysses.UlyssesAttention``)
            for each block.
        group: the process group the tokens are split over (None: every rank).
    """
    check_module("model", model)
    check_instance("chunks", chunks, SequenceChunks)
    check_group("group", group)
    claim_module(model, "context parallelism")
    rank = runtime.rank(group=group)
    for name, child in list(model.named_children()):
        if isinstance(child, Embedding):
            setattr(model, name, ContextParallelEmbedding(child, chunks, rank))
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.attend = attention_core()
    return model


def context_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, *, total_tokens: int) -> torch.Tensor:
    """This rank's share of the whole batch's mean cross-entropy: the ranks' shares add up to it.

    With uneven chunks the ranks hold different numbers of tokens, so each divides its sum by
    the whole count rather than taking its own mean.

    Args:
        logits: (batch, local tokens, vocabulary), the model's output on this rank's tokens.
        targets: (batch, local tokens), their targets (``layout.local(targets, rank)``).
        total_tokens: the tokens of the whole batch, over every rank.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="sum") / total_tokens
