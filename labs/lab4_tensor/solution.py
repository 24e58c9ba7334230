"""Solution of lab 4: tensor parallelism, Megatron's way: split layers and the f and g functions.

A linear layer ``y = x Wᵀ + b`` can be cut over T ranks two ways:

- **column parallel**: rank t keeps rows t of W (and of b): it computes its slice of the output
  features from the whole input;
- **row parallel**: rank t keeps columns t of W: from its slice of the input features it computes
  a *partial sum* of the whole output; an all-reduce adds the T partial sums (the bias once).

A column layer then a row layer (an MLP: fc1, GELU, fc2) needs no communication in between. The
two collectives are autograd functions that are each other's mirror (Megatron's f and g):
f is the identity forward and all-reduces the gradient backward (where the whole input enters
the column layer); g all-reduces forward and is the identity backward (after the row layer).

Check your work (every property, at 2, 3 and 4 processes):

    python -m course_lib.tools.labs check lab4_tensor
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.distributed import comm, runtime


class CopyToParallel(torch.autograd.Function):
    """f: the identity in forward; in backward, the sum over the ranks of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION: going forward every rank already holds the whole input: nothing to send. Pitfall: a Function that returns the very tensor object it was given leaves autograd unsure which node produced it; return a new tensor object that costs no copy
        return x.view_as(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION: each rank's gradient only holds its own slice's contribution to d(loss)/dx; the true gradient is their sum: all-reduce a contiguous copy (never the tensor autograd handed you)
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, op="sum")
        return grad
        # END SOLUTION


class ReduceFromParallel(torch.autograd.Function):
    """g: the sum over the ranks in forward; the identity in backward."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION: add up the ranks' partial sums in a copy (an all-reduce works in place, and the input belongs to autograd)
        total = partial.clone()
        comm.all_reduce(total, op="sum")
        return total
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION: every partial sum contributed with weight one: each rank passes the gradient on unchanged
        return grad
        # END SOLUTION


class ColumnParallelLinear(nn.Module):
    """This rank's rows (output features) of a dense ``nn.Linear``; its output is this rank's slice."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.rank, self.per_rank = runtime.rank(), dense.out_features // runtime.world_size()
        # BEGIN SOLUTION: keep copies of this rank's block of per_rank rows of the weight and of the bias, as nn.Parameters (blocks in rank order)
        rows = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        self.weight = nn.Parameter(dense.weight.detach()[rows].clone())
        self.bias = nn.Parameter(dense.bias.detach()[rows].clone())
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION: the whole input enters the split region here, and your rows produce only part of its gradient in backward: which of the two communication functions makes that gradient whole, and must it act before or after your linear?
        return nn.functional.linear(CopyToParallel.apply(x), self.weight, self.bias)
        # END SOLUTION


class RowParallelLinear(nn.Module):
    """This rank's columns (input features) of a dense ``nn.Linear``; its output is the whole output."""

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.rank, self.per_rank = runtime.rank(), dense.in_features // runtime.world_size()
        # BEGIN SOLUTION: keep a copy of this rank's block of per_rank columns of the weight; the bias is whole on every rank (it must be added once, after the sum)
        columns = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        self.weight = nn.Parameter(dense.weight.detach()[:, columns].clone())
        self.bias = nn.Parameter(dense.bias.detach().clone())
        # END SOLUTION

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION: your columns of the weight see only your slice of the input, so what you compute is one term of the output's sum, and the terms must meet. Pitfall: the bias belongs to the sum, not to each term: added on every rank before the sum, it would count T times
        return ReduceFromParallel.apply(nn.functional.linear(x_slice, self.weight)) + self.bias
        # END SOLUTION


class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with fc1 column parallel and fc2 row parallel: one all-reduce each way."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1, self.fc2 = ColumnParallelLinear(fc1), RowParallelLinear(fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))
