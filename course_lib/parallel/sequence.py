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
activations per rank fall from (b, s, h) to (b, s/T, h).

What it does *not* divide by itself: the all-gathered input of q, k, v and fc1. Autograd keeps
it for the weights' gradients, whole (s, not s/T), on every rank; DTensor's ``SequenceParallel``
plan keeps it too. Korthikanti et al.'s "everything divided by T" is Megatron-LM's variant,
``regather_in_backward=True`` here: the layers keep only this rank's shard and all-gather it
again in backward (``_GatherThenProject``), overlapped with the input gradient's matmul. The
trade, per block and rank: 2·sbh·(T-1)/T fewer elements kept, two more all-gathers of the
activation. ``activations.block_activation_elements`` counts both, term by term.

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

from ..checks import check_flag, check_group, check_module
from ..distributed import comm, runtime
from ..errors import UserError
from ..models import Block, Embedding, LMHead, SelfAttention
from .claims import SPLIT_LAYERS, claim_module
from .collective_matmul import OverlappedRowLinear, all_gather_project
from .tensor import SEQUENCE_DIM, ColumnParallelLinear, RowParallelLinear, _split_size, check_sequence_split


def _start_all_gather_sequence(x: torch.Tensor, group, *, async_op: bool = True):
    """All-gather along the sequence: (the work to wait for, or None; the whole sequence once it is done)."""
    size = runtime.world_size(group=group)
    pieces = x.transpose(0, SEQUENCE_DIM).contiguous()  # the sequence first: collectives cut dim 0
    whole = torch.empty((size * pieces.shape[0], *pieces.shape[1:]), dtype=x.dtype, device=x.device)
    work = comm.all_gather_into_tensor(whole, pieces, group=group, async_op=async_op)
    return work, whole.transpose(0, SEQUENCE_DIM)


def _start_reduce_scatter_sequence(x: torch.Tensor, group, *, async_op: bool = True):
    """Reduce-scatter along the sequence: (the work to wait for, or None; this rank's tokens once done)."""
    size = runtime.world_size(group=group)
    whole = x.transpose(0, SEQUENCE_DIM).contiguous()
    mine = torch.empty((whole.shape[0] // size, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    work = comm.reduce_scatter_tensor(mine, whole, op="sum", group=group, async_op=async_op)
    return work, mine.transpose(0, SEQUENCE_DIM)


def _all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    # contiguous (batch, sequence, features): q, k and v then save this one tensor, not a copy each
    return _start_all_gather_sequence(x, group, async_op=False)[1].contiguous()


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _start_reduce_scatter_sequence(x, group, async_op=False)[1]


# #region sequence-parallel
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
# #endregion sequence-parallel


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


# #region keep-the-shard
class _GatherThenProject(torch.autograd.Function):
    """All-gather this rank's tokens, apply column-parallel linears, and keep only the shard for backward.

    Autograd would save the gathered input (T times the shard) for the weights' gradients;
    Megatron-LM saves the shard and all-gathers it once more in backward, while the input's
    gradient is computed, then reduce-scatters that gradient while the weights' are computed.
    """

    @staticmethod
    def forward(ctx, shard, group, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        whole = _all_gather_sequence(shard, group)
        ctx.save_for_backward(shard, *weights)  # the shard, not ``whole``: the point of the variant
        ctx.group, ctx.with_bias = group, [bias is not None for bias in biases]
        return tuple(nn.functional.linear(whole, weight, bias) for weight, bias in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        shard, *weights = ctx.saved_tensors
        gathering, whole = _start_all_gather_sequence(shard, ctx.group)  # in flight...
        grad_whole = sum(grad @ weight for grad, weight in zip(grads, weights))  # ...during this matmul
        gathering.wait()
        scattering, grad_shard = _start_reduce_scatter_sequence(grad_whole, ctx.group)  # in flight...
        rows = whole.reshape(-1, whole.shape[-1])
        grad_params = []
        for grad, with_bias in zip(grads, ctx.with_bias):  # ...during the weights' gradients
            flat = grad.reshape(-1, grad.shape[-1])
            grad_params += [flat.T @ rows, flat.sum(0) if with_bias else None]
        scattering.wait()
        return grad_shard, None, *grad_params


def gather_then_project(shard: torch.Tensor, layers, *, group=None) -> tuple[torch.Tensor, ...]:
    """Megatron-LM's sequence parallelism: every layer applied to the gathered sequence, the shard kept.

    Args:
        shard: (batch, S/T, features), this rank's tokens.
        layers: ``ColumnParallelLinear`` layers that read the same gathered input (q, k and v).
        group: the tensor-parallel process group (None: every rank).
    """
    params = [tensor for layer in layers for tensor in (layer.weight, layer.bias)]
    return _GatherThenProject.apply(shard, group, *params)


class ShardReadingColumnLinear(ColumnParallelLinear):
    """A column-parallel layer that reads this rank's tokens; ``gather_and_project`` brings the others."""

    gather_and_project = staticmethod(gather_then_project)

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        return self.gather_and_project(shard, (self,), group=self.group)[0]


class ShardSavingColumnLinear(ShardReadingColumnLinear):
    """Megatron-LM's variant: it keeps only this rank's tokens for backward and gathers them again."""


class OverlappedColumnLinear(ShardReadingColumnLinear):
    """Collective matmul: it multiplies each chunk of tokens while the next one travels."""

    gather_and_project = staticmethod(all_gather_project)


class ShardReadingAttention(SelfAttention):
    """``SelfAttention`` reading this rank's tokens: one gather feeds q, k and v.

    Args:
        attention: the attention whose layers (already tensor parallel) it takes over.
        group: the tensor-parallel process group (None: every rank).
        gather_and_project: ``gather_then_project`` (only the shard kept for backward) or
            ``collective_matmul.all_gather_project`` (the gather under the matmuls).
    """

    def __init__(self, attention: SelfAttention, *, group=None, gather_and_project=gather_then_project):
        nn.Module.__init__(self)  # not SelfAttention's: the layers exist, cut, in ``attention``
        self.head_dim, self.group, self.gather_and_project = attention.head_dim, group, gather_and_project
        self.q, self.k, self.v = attention.q, attention.k, attention.v
        self.out, self.attend = attention.out, attention.attend

    def project(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gather_and_project(shard, (self.q, self.k, self.v), group=self.group)


# #endregion keep-the-shard


def _gather_input(group):
    return lambda module, args: (gather_sequence(args[0], group=group), *args[1:])


def sequence_parallel_block(
    block: nn.Module, *, group=None, regather_in_backward: bool = False, overlap: bool = False
) -> nn.Module:
    """Convert one dense ``models.Block`` in place: tensor parallel inside, sequence parallel around.

    Args:
        block: a dense ``models.Block``; its weights are cut, not re-initialised.
        group: the tensor-parallel process group (None: every rank).
        regather_in_backward: keep only this rank's tokens of the input of q, k, v and fc1 and
            all-gather them again in backward (Megatron-LM's variant: 2·sbh·(T-1)/T elements less
            per rank, one more all-gather per region). Off: autograd keeps the gathered input
            whole, as DTensor's ``SequenceParallel`` plan does.
        overlap: collective matmul (``collective_matmul``): each all-gather and reduce-scatter cut
            into its ring steps, each step's chunk multiplied while the next one travels. The
            gathered input is kept whole, as without ``regather_in_backward``.
    """
    if overlap and regather_in_backward:
        raise UserError(
            "overlap keeps the gathered tokens that its ring assembles anyway; regather_in_backward is "
            "the plain version's option: choose one of the two"
        )
    attention, mlp = block.attention, block.mlp
    claim_module(attention, "sequence parallelism", family=SPLIT_LAYERS)
    claim_module(mlp, "sequence parallelism", family=SPLIT_LAYERS)
    _split_size(attention.out.out_features // attention.head_dim, group, "attention heads")
    if overlap:
        for name in ("q", "k", "v"):
            dense = getattr(attention, name)
            setattr(attention, name, ColumnParallelLinear.from_dense(dense, group=group, copy_input=False))
        attention.out = OverlappedRowLinear.from_dense(attention.out, group=group)
        block.attention = ShardReadingAttention(attention, group=group, gather_and_project=all_gather_project)
        mlp.fc1 = OverlappedColumnLinear.from_dense(mlp.fc1, group=group, copy_input=False)
        mlp.fc2 = OverlappedRowLinear.from_dense(mlp.fc2, group=group)
        return block
    column = ShardSavingColumnLinear if regather_in_backward else ColumnParallelLinear
    for name in ("q", "k", "v"):
        dense = getattr(attention, name)
        setattr(attention, name, column.from_dense(dense, group=group, copy_input=False))
    attention.out = SequenceParallelRowLinear.from_dense(attention.out, group=group)
    mlp.fc1 = column.from_dense(mlp.fc1, group=group, copy_input=False)
    mlp.fc2 = SequenceParallelRowLinear.from_dense(mlp.fc2, group=group)
    if regather_in_backward:  # the gather happens inside the layers, which keep the shard
        block.attention = ShardReadingAttention(attention, group=group)
    else:  # the gather happens before the layers, and autograd keeps what it gathered
        attention.register_forward_pre_hook(_gather_input(group))
        mlp.register_forward_pre_hook(_gather_input(group))
    return block


def apply_sequence_parallel(
    model: nn.Module, group=None, *, regather_in_backward: bool = False, overlap: bool = False
) -> nn.Module:
    """Make a dense ``models.TinyTransformer``, or a pipeline stage of one, tensor and sequence parallel.

    The embedding still runs whole on every rank (its input is the token ids) and its output is
    cut to this rank's tokens; every block is converted (``sequence_parallel_block``); the head
    then returns the logits of this rank's tokens only: compare them with
    ``targets.chunk(T, dim=1)[rank]`` (``sequence_parallel_loss``). A stage without the
    embedding takes, and every stage but the last returns, this rank's tokens: the activations
    sent between pipeline stages are 1/T of a whole stage's.

    Args:
        model: a dense ``models.TinyTransformer``, or an ``nn.Sequential`` stage of one.
        group: the tensor-parallel process group (None: every rank).
        regather_in_backward: Megatron-LM's variant (see ``sequence_parallel_block``).
        overlap: collective matmul, the communication hidden under the matmuls (see
            ``sequence_parallel_block``).
    """
    check_module("model", model)
    check_flag("regather_in_backward", regather_in_backward)
    check_flag("overlap", overlap)
    check_group("group", group)
    parts = list(model) if isinstance(model, nn.Sequential) else []
    if not any(isinstance(part, Embedding | Block | LMHead) for part in parts):
        raise UserError(
            "apply_sequence_parallel needs a TinyTransformer, or a pipeline stage of one (an nn.Sequential "
            "of its embedding, blocks and head)"
        )
    for block in parts:
        if isinstance(block, Block):
            sequence_parallel_block(
                block, group=group, regather_in_backward=regather_in_backward, overlap=overlap
            )
    if isinstance(parts[0], Embedding):
        parts[0].register_forward_hook(lambda module, args, output: split_sequence(output, group=group))
    return model


def _sequence_parallel_places(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of each replicated parameter that sees only this rank's tokens."""
    places = []
    for module in model.modules():
        if isinstance(module, Block):
            places += [(norm, name) for norm in (module.norm1, module.norm2) for name in ("weight", "bias")]
            places += [(layer, "bias") for layer in (module.attention.out, module.mlp.fc2)]
        elif isinstance(module, LMHead):
            places += [(module.norm, name) for name in ("weight", "bias")]
            if isinstance(module.proj, nn.Linear):  # replicated; split by vocabulary it sees every token
                places += [(module.proj, name) for name in ("weight", "bias")]
    return places


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters that see only this rank's tokens: their gradients are partial sums."""
    found = (getattr(module, name, None) for module, name in _sequence_parallel_places(model))
    return [param for param in found if isinstance(param, nn.Parameter)]


def all_reduce_sequence_parallel_gradients(model: nn.Module, *, group=None) -> None:
    """After backward: add the partial gradients of the token-by-token parameters over the group.

    Under ZeRO or FSDP over another axis (a wrapper with ``flat_params``) the gradients are no
    longer on the parameters but in this rank's shard of each flat vector: the same elements of
    it on every rank of the group, which are added there. Adding over the tensor ranks and
    averaging over the data ranks are both linear, so their order does not matter.

    Args:
        model: the model ``apply_sequence_parallel`` converted, or a ZeRO/FSDP wrapper of it.
        group: the tensor-parallel process group (None: every rank).
    """
    if hasattr(model, "flat_params"):
        places = {(id(module), name) for module, name in _sequence_parallel_places(model)}
        partial = [piece for flat in model.flat_params for piece in flat.shard_gradient_pieces(places)]
    else:
        partial = [param.grad for param in sequence_parallel_parameters(model) if param.grad is not None]
    comm.all_reduce_coalesced(partial, op="sum", group=group)  # small and many: one call


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
