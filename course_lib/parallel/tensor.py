"""Tensor parallelism (Megatron-LM style): one layer's matrix multiplications split over T ranks.

Data parallelism copies the model; tensor parallelism cuts each big weight matrix. For a linear
layer ``y = x Aᵀ`` (A is out x in):

- **column parallel**: cut A by output rows, ``A = [A_1; ...; A_T]``. Rank t computes
  ``y_t = x A_tᵀ``, its slice of the output features. The input x must be on every rank.
- **row parallel**: cut A by input columns, ``A = [A_1, ..., A_T]``, and the input features the
  same way. Rank t computes ``x_t A_tᵀ``, a *partial sum* of the whole output: an all-reduce adds
  the T partial sums.

A column-parallel layer followed by a row-parallel one needs no communication in between: the
column layer's output slice is exactly the row layer's input slice, and the element-wise GELU
between them works on slices. So a transformer MLP (fc1 column, fc2 row) and attention (q, k, v
column, i.e. whole heads per rank; ``out`` row) each cost **one all-reduce of the activation in
forward and one in backward**. Per block: 2 forward + 2 backward all-reduces of
batch x seq x d_model values. That is why TP stays inside a node, on the fastest links.

The communication is written as two conjugate autograd functions (Megatron's f and g):

==========================  =========================  ==========================
function                    forward                    backward
==========================  =========================  ==========================
``copy_to_parallel`` (f)    identity                   all-reduce the gradient
``reduce_from_parallel``    all-reduce                 identity
(g)
``gather_from_parallel``    all-gather the last dim    keep this rank's slice
==========================  =========================  ==========================

f sits where a replicated activation enters a column-parallel layer: each rank's backward only
produces the gradient of *its* slice's contribution, and the input's true gradient is their sum.

Memory: each rank holds 1/T of the split weights (and their gradients and optimizer state);
norms, embeddings and biases of row-parallel layers stay replicated.

Paper: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", 2019 (arXiv:1909.08053), section 3: the f and g operators, the MLP and
attention splits.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_flag, check_group, check_int, check_module
from ..distributed import comm, runtime
from ..errors import UserError
from ..models import Block
from .claims import SPLIT_LAYERS, check_not_converted, claim_module


# #region tensor-parallel
# #region f-and-g
class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, op="sum", group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        comm.all_reduce(x, op="sum", group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# #endregion f-and-g


# #region gather-from-parallel
class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = runtime.world_size(group=group)
        pieces = [torch.empty_like(x) for _ in range(size)]
        comm.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size = runtime.world_size(group=ctx.group)
        rank = runtime.rank(group=ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


# #endregion gather-from-parallel


def copy_to_parallel(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce backward (where a replicated input enters the parallel region)."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """g: all-reduce forward, identity backward (where partial sums leave the parallel region)."""
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """All-gather slices of the last dimension forward; backward keeps this rank's slice of the gradient."""
    return _GatherFromParallel.apply(x, group)


def _split_size(total: int, group, what: str) -> int:
    check_int(what, total, minimum=1)
    check_group("group", group)
    size = runtime.world_size(group=group)
    if total % size:
        divisors = [d for d in range(1, total + 1) if total % d == 0 and d <= 64]
        raise UserError(
            f"{what} {total} does not divide by the tensor-parallel degree {size}: use a degree among "
            f"{divisors}, or change the layer size"
        )
    return total // size


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in, out)`` whose output features are split over the group (this rank: out / T of them).

    Args:
        in_features: the width of the input, which every rank holds whole.
        out_features: the width of the whole output; must divide by the group's size T.
        bias: learn a bias (split like the output features).
        gather_output: all-gather the T slices so every rank gets the whole output; leave it off
            when a row-parallel layer follows, which wants exactly this rank's slice.
        group: the tensor-parallel process group (None: every rank).
        copy_input: apply f (identity forward, all-reduce of the gradient backward) to the input;
            off when the caller applied it once for several layers that read the same input.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        group=None,
        copy_input: bool = True,
    ):
        super().__init__()
        for name, flag in (("bias", bias), ("gather_output", gather_output), ("copy_input", copy_input)):
            check_flag(name, flag)
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        self.out_per_rank = _split_size(out_features, group, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, *, gather_output: bool = False, group=None, copy_input: bool = True
    ) -> ColumnParallelLinear:
        """This rank's rows of a dense layer's weight (and bias): the same function, split."""
        layer = cls(
            dense.in_features,
            dense.out_features,
            bias=dense.bias is not None,
            gather_output=gather_output,
            group=group,
            copy_input=copy_input,
        )
        rank = runtime.rank(group=group)
        rows = slice(rank * layer.out_per_rank, (rank + 1) * layer.out_per_rank)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[rows])
            if dense.bias is not None:
                layer.bias.copy_(dense.bias[rows])
        return layer.to(dense.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(
            copy_to_parallel(x, group=self.group) if self.copy_input else x, self.weight, self.bias
        )
        return gather_from_parallel(y, group=self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``nn.Linear(in, out)`` whose input features are split over the group; the outputs are summed.

    Args:
        in_features: the width of the whole input; must divide by the group's size T (each rank
            reads in / T of them, the slice a column-parallel layer produced).
        out_features: the width of the output, which every rank gets whole after the all-reduce.
        bias: learn a bias, added once after the sum (replicated on every rank).
        group: the tensor-parallel process group (None: every rank).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None):
        super().__init__()
        check_flag("bias", bias)
        self.group = group
        self.in_per_rank = _split_size(in_features, group, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # added once, after the sum
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_dense(cls, dense: nn.Linear, *, group=None) -> RowParallelLinear:
        layer = cls(dense.in_features, dense.out_features, bias=dense.bias is not None, group=group)
        rank = runtime.rank(group=group)
        columns = slice(rank * layer.in_per_rank, (rank + 1) * layer.in_per_rank)
        with torch.no_grad():
            layer.weight.copy_(dense.weight[:, columns])
            if dense.bias is not None:
                layer.bias.copy_(dense.bias)
        return layer.to(dense.weight.device)

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        """``x_slice``: this rank's in / T input features (the output of a column-parallel layer)."""
        partial = nn.functional.linear(x_slice, self.weight)
        y = reduce_from_parallel(partial, group=self.group)
        return y + self.bias if self.bias is not None else y


def _copy_input_once(module: nn.Module, group) -> None:
    """f on ``module``'s input, once, for the column-parallel layers inside that all read it (a
    forward pre-hook): their input gradients add up before the one backward all-reduce."""
    module.register_forward_pre_hook(lambda _, args: (copy_to_parallel(args[0], group=group), *args[1:]))


def parallel_mlp(mlp: nn.Module, *, group=None) -> nn.Module:
    """A ``models.MLP`` (fc1, act, fc2) made tensor parallel in place: fc1 column, fc2 row; a gated
    one (``llama.GatedMLP``) has its ``up`` column parallel too.

    One all-reduce forward (in fc2), one backward (in fc1's f): the hidden activation, 4x wider
    than the model, never travels.

    Args:
        mlp: a dense ``models.MLP``; its weights are cut, not re-initialised.
        group: the tensor-parallel process group (None: every rank).
    """
    check_module("mlp", mlp)
    claim_module(mlp, "tensor parallelism", family=SPLIT_LAYERS)
    gated = isinstance(getattr(mlp, "up", None), nn.Linear)  # SwiGLU's second up-projection
    for name in ("fc1", "fc2"):
        if not isinstance(getattr(mlp, name, None), nn.Linear):
            raise UserError(
                f"mlp.{name} must be an nn.Linear (a models.MLP has fc1, act, fc2), got "
                f"{type(getattr(mlp, name, None)).__name__}"
            )
    # a gated MLP's two up-projections read one input: f once, on it, as for q, k and v
    mlp.fc1 = ColumnParallelLinear.from_dense(mlp.fc1, group=group, copy_input=not gated)
    if gated:
        mlp.up = ColumnParallelLinear.from_dense(mlp.up, group=group, copy_input=False)
        _copy_input_once(mlp, group)
    mlp.fc2 = RowParallelLinear.from_dense(mlp.fc2, group=group)
    return mlp


# #endregion tensor-parallel


def parallel_attention(attention: nn.Module, n_heads: int, *, group=None) -> nn.Module:
    """A ``models.SelfAttention`` made tensor parallel in place: each rank computes n_heads / T whole heads.

    q, k and v are column parallel with whole heads per rank (rows of a head are contiguous), so
    attention itself needs no communication; ``out`` is row parallel and sums the heads' parts.
    q, k and v read the same input, so f is applied once, to it (a forward pre-hook): the three
    gradients add up before the single backward all-reduce, as with Megatron's fused QKV layer.

    Args:
        attention: a dense ``models.SelfAttention``; its weights are cut, not re-initialised.
        n_heads: its number of heads; must divide by the group's size T.
        group: the tensor-parallel process group (None: every rank).
    """
    check_module("attention", attention)
    _split_size(n_heads, group, "attention heads")
    if hasattr(attention, "kv_heads"):  # grouped-query attention: whole key/value heads a rank too
        _split_size(attention.kv_heads, group, "key/value heads")
    claim_module(attention, "tensor parallelism", family=SPLIT_LAYERS)
    for name in ("q", "k", "v"):
        setattr(
            attention,
            name,
            ColumnParallelLinear.from_dense(getattr(attention, name), group=group, copy_input=False),
        )
    attention.out = RowParallelLinear.from_dense(attention.out, group=group)
    _copy_input_once(attention, group)
    return attention


def apply_tensor_parallel(model: nn.Module, group=None) -> nn.Module:
    """Convert every block of a dense ``models.TinyTransformer`` (or a slice of one) in place.

    The dense weights are cut, not re-initialised: the converted model computes the same function.

    Args:
        model: a ``models.TinyTransformer``, a pipeline stage of one, or any module holding its
            ``Block``s.
        group: the tensor-parallel process group (None: every rank).
    """
    check_module("model", model)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise UserError(
            "no transformer Block found to parallelize: pass a models.TinyTransformer or its blocks"
        )
    for block in blocks:  # read below as dense layers: refuse ones already split first
        check_not_converted(block, "tensor parallelism", family=SPLIT_LAYERS)
    for block in blocks:
        parallel_attention(
            block.attention, block.attention.out.in_features // block.attention.head_dim, group=group
        )
        parallel_mlp(block.mlp, group=group)
    return model


def check_tensor_parallel_degree(d_model: int, n_heads: int, mlp_hidden: int, degree: int) -> None:
    """Before any process waits: does this model split ``degree`` ways?"""
    for what, total in (
        ("attention heads", n_heads),
        ("hidden size d_model", d_model),
        ("MLP hidden size", mlp_hidden),
    ):
        if total % degree:
            raise UserError(
                f"tensor-parallel degree {degree} does not divide the {what} ({total}): use a degree that "
                f"divides {n_heads} heads and {d_model} features"
            )


SEQUENCE_DIM = 1  # activations are (batch, sequence, features): sequence parallelism cuts this one


def check_sequence_split(seq_len: int, degree: int) -> None:
    """Refuse, before any process waits, a sequence that does not cut into ``degree`` equal pieces."""
    if seq_len % degree:
        fits = [d for d in range(1, seq_len + 1) if seq_len % d == 0 and d <= 16]
        raise UserError(
            f"a sequence of {seq_len} tokens does not split over tensor/sequence-parallel degree {degree}: "
            f"use a degree among {fits} or a sequence length that is a multiple of {degree}"
        )
