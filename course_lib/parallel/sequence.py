"""Sequence parallelism (Megatron-LM style): what tensor parallelism leaves whole, split along the sequence.

Tensor parallelism splits the matrix multiplications of a block over T ranks, but the rest of
the block (the layer norms, dropout, the residual additions) runs on the whole activation,
(batch, sequence, d_model), on *every* rank: T copies of the same numbers. These regions work
token by token, so they can just as well run on 1/T of the tokens each.

So the activation between the tensor-parallel regions is cut along the sequence: rank t holds
tokens [t·S/T, (t+1)·S/T). Tensor parallelism's f and g change places with two other
collectives, which move exactly the same number of bytes:

=====================================  =================================  =============================
where                                  tensor parallelism                 sequence parallelism
=====================================  =================================  =============================
entering attention / MLP (forward)     f: identity                        all-gather along the sequence
entering (backward)                    f: all-reduce of the gradient      reduce-scatter along the sequence
leaving attention / MLP (forward)      g: all-reduce of the partial sums  reduce-scatter along the sequence
leaving (backward)                     g: identity                        all-gather along the sequence
=====================================  =================================  =============================

An all-reduce *is* a reduce-scatter then an all-gather (``comm``'s table: 2(N-1)/N·S against
(N-1)/N·S twice), so the traffic is the same; what changes is memory: the norms' and residuals'
activations per rank fall from (b, s, h) to (b, s/T, h) (Korthikanti et al.: from 10·sbh to
10·sbh/T of the 34·sbh + 5·a·s²b bytes per layer).

One new duty: a parameter that works token by token (the norms' weights, the biases added
after the reduce-scatter, the head) now sees only this rank's tokens, so its gradient is a
partial sum: ``all_reduce_sequence_parallel_gradients`` adds them over the group after backward.

Paper: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023 (arXiv:2205.05198), section 4.2.2; PyTorch's twin is DTensor's ``SequenceParallel``
style with ``ColwiseParallel`` / ``RowwiseParallel(output_layouts=Shard(1))``.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm, runtime
from ..checks import SPLIT_LAYERS, check_group, check_module, claim_module
from ..errors import UserError
from .tensor import ColumnParallelLinear, RowParallelLinear, _split_size

SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


def _all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    size = runtime.world_size(group=group)
    pieces = x.transpose(0, SEQUENCE_DIM).contiguous()  # the sequence first: collectives cut dim 0
    whole = torch.empty((size * pieces.shape[0], *pieces.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(whole, pieces, group=group)
    return whole.transpose(0, SEQUENCE_DIM)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    size = runtime.world_size(group=group)
    whole = x.transpose(0, SEQUENCE_DIM).contiguous()
    mine = torch.empty((whole.shape[0] // size, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(mine, whole, op="sum", group=group)
    return mine.transpose(0, SEQUENCE_DIM)


# #region gather-and-reduce-scatter
class _GatherSequence(torch.autograd.Function):
    """Entering a TP region: every rank needs every token."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        # partial sums (my heads' share): add them up, keep my tokens
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Leaving it: add the partial sums, keep my tokens."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


# #endregion gather-and-reduce-scatter


class _SplitSequence(torch.autograd.Function):
    """A whole activation that every rank computed (the embedding) cut to this rank's tokens."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, rank = runtime.world_size(group=group), runtime.rank(group=group)
        check_sequence_split(x.shape[SEQUENCE_DIM], size)  # same answer on every rank: all stop here
        return x.chunk(size, dim=SEQUENCE_DIM)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


def gather_sequence(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """All-gather the sequence forward; reduce-scatter the gradient backward (replaces f)."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather the gradient backward (replaces g)."""
    return _ReduceScatterSequence.apply(x, group)


def split_sequence(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Keep this rank's tokens forward; all-gather the gradient backward."""
    return _SplitSequence.apply(x, group)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row-parallel layer whose partial sums are reduce-scattered along the sequence, not all-reduced.

    The bias is added after the reduce-scatter, to this rank's tokens only: its gradient is one
    of the partial sums ``all_reduce_sequence_parallel_gradients`` completes.
    """

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x_slice, self.weight)
        y = reduce_scatter_sequence(partial, group=self.group)
        return y + self.bias if self.bias is not None else y


def _gather_input(group):
    return lambda module, args: (gather_sequence(args[0], group=group), *args[1:])


def sequence_parallel_block(block: nn.Module, *, group=None) -> nn.Module:
    """Convert one dense ``models.Block`` in place: tensor parallel inside, sequence parallel around.

    Args:
        block: a dense ``models.Block``; its weights are cut, not re-initialised.
        group: the tensor-parallel process group (None: every rank).
    """
    attention, mlp = block.attention, block.mlp
    claim_module(attention, "sequence parallelism", family=SPLIT_LAYERS)
    claim_module(mlp, "sequence parallelism", family=SPLIT_LAYERS)
    _split_size(attention.out.out_features // attention.head_dim, group, "attention heads")
    for name in ("q", "k", "v"):
        dense = getattr(attention, name)
        setattr(attention, name, ColumnParallelLinear.from_dense(dense, group=group, copy_input=False))
    attention.out = SequenceParallelRowLinear.from_dense(attention.out, group=group)
    attention.register_forward_pre_hook(_gather_input(group))
    mlp.fc1 = ColumnParallelLinear.from_dense(mlp.fc1, group=group, copy_input=False)
    mlp.fc2 = SequenceParallelRowLinear.from_dense(mlp.fc2, group=group)
    mlp.register_forward_pre_hook(_gather_input(group))
    return block


def check_sequence_split(seq_len: int, degree: int) -> None:
    """Refuse, before any process waits, a sequence that does not cut into ``degree`` equal pieces."""
    if seq_len % degree:
        fits = [d for d in range(1, seq_len + 1) if seq_len % d == 0 and d <= 16]
        raise UserError(
            f"a sequence of {seq_len} tokens does not split over tensor/sequence-parallel degree {degree}: "
            f"use a degree among {fits} or a sequence length that is a multiple of {degree}"
        )


def parallelize_sequence(model: nn.Module, *, group=None) -> nn.Module:
    """Make a dense ``models.TinyTransformer`` tensor and sequence parallel, in place.

    The embedding still runs whole on every rank (its input is the token ids) and its output is
    cut to this rank's tokens; every block is converted (``sequence_parallel_block``); the head
    then returns the logits of this rank's tokens only: compare them with
    ``targets.chunk(T, dim=1)[rank]`` (``sequence_parallel_loss``).

    Args:
        model: a dense ``models.TinyTransformer``.
        group: the tensor-parallel process group (None: every rank).
    """
    from ..models import Block, Embedding

    check_module("model", model)
    check_group("group", group)
    if not isinstance(model[0], Embedding):
        raise UserError("parallelize_sequence needs the whole TinyTransformer, starting with its embedding")
    for block in model:
        if isinstance(block, Block):
            sequence_parallel_block(block, group=group)
    model[0].register_forward_hook(lambda module, args, output: split_sequence(output, group=group))
    return model


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters that see only this rank's tokens: their gradients are partial sums."""
    from ..models import Block, LMHead

    found = []
    for module in model.modules():
        if isinstance(module, Block):
            found += [*module.norm1.parameters(), *module.norm2.parameters()]
            rows = (module.attention.out, module.mlp.fc2)
            found += [layer.bias for layer in rows if layer.bias is not None]
        elif isinstance(module, LMHead):
            found += list(module.parameters())
    return found


def all_reduce_sequence_parallel_gradients(model: nn.Module, *, group=None) -> None:
    """After backward: add the partial gradients of the token-by-token parameters over the group.

    Args:
        model: the model ``parallelize_sequence`` converted.
        group: the tensor-parallel process group (None: every rank).
    """
    for param in sequence_parallel_parameters(model):
        if param.grad is not None:
            comm.all_reduce(param.grad, op="sum", group=group)


def sequence_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, *, group=None) -> torch.Tensor:
    """This rank's share of the whole sequence's mean cross-entropy: the shares add up to it.

    Args:
        logits: (batch, S/T, vocabulary), this rank's tokens.
        targets: (batch, S), the whole sequence's targets (this rank takes its piece).
        group: the tensor-parallel process group (None: every rank).
    """
    size, rank = runtime.world_size(group=group), runtime.rank(group=group)
    mine = targets.chunk(size, dim=SEQUENCE_DIM)[rank]
    flat = logits.reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(flat, mine.reshape(-1), reduction="sum") / targets.numel()
