"""Exercise: lab 3: FSDP's core, a unit that holds 1/N of its parameters between uses.

``ShardedUnit(module)`` keeps, on each rank, one shard of the module's trainable parameters,
flattened and padded so that the flat vector divides by N. Around every use:

1. **forward**: all-gather the full flat vector, compute the module with it, and let it go: after
   forward nothing of the full parameters is kept (``GatheredUnit.forward``);
2. **backward**: all-gather it *again*, recompute the module's forward with autograd on (the
   activations were not kept either: this is activation checkpointing, which FSDP combines with
   sharding), take the gradients of the parameters and of the inputs, and **reduce-scatter** the
   parameter gradient: each rank receives the average of its own shard, the gradient the
   optimizer of its shard needs (``GatheredUnit.backward``).

A model is a chain of units; the optimizer is built on the units' shards. Between two uses a rank
holds Ψ/N parameters, not Ψ: only one unit at a time is ever whole.

Check your work (every property, at 2, 3 and 4 processes):

    python -m course_lib.tools.labs check lab3_fsdp
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call

from course_lib.distributed import comm, runtime


class ShardedUnit(nn.Module):
    """``module`` with its trainable parameters sharded over the ranks: ``self.shard`` is this rank's piece.

    Args:
        module: the unit, built the same on every rank.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.rank, self.world_size = runtime.rank(), runtime.world_size()
        # named_parameters() lists a tied weight once; frozen parameters stay as they are, whole
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.shapes = [p.shape for p in trainable]
        self.numel = sum(p.numel() for p in trainable)
        self.shard_size = math.ceil(self.numel / self.world_size)
        # TODO: flatten the trainable parameters into one vector, pad it with zeros to world_size pieces of shard_size, and keep a copy of piece number rank as an nn.Parameter (the only one the optimizer sees); then empty the module's own trainable tensors (param.data = an empty tensor) so the full model is not kept
        raise NotImplementedError(
            "TODO: flatten the trainable parameters into one vector, pad it with zeros to world_size pieces of shard_size, and keep a copy of piece number rank as an nn.Parameter (the only one the optimizer sees); then empty the module's own trainable tensors (param.data = an empty tensor) so the full model is not kept"
        )

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's shard, all-gathered: the full flat vector, padding removed."""
        # TODO: all_gather_into_tensor fills a tensor world_size times the shard (the input must not be the output); drop the padding at the end
        raise NotImplementedError(
            "TODO: all_gather_into_tensor fills a tensor world_size times the shard (the input must not be the output); drop the padding at the end"
        )

    def as_parameters(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """The full flat vector seen as the module's parameters (views: no copy), by name."""
        views, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            views[name] = full[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return views

    def reduce_gradient(self, full_gradient: torch.Tensor) -> torch.Tensor:
        """The average over the ranks of this rank's piece of the full flat gradient."""
        # TODO: each rank needs only the average of its own piece of the full gradient: one collective gives exactly that. Pitfall: the gradient must be cut where the parameters were cut, padding included
        raise NotImplementedError(
            "TODO: each rank needs only the average of its own piece of the full gradient: one collective gives exactly that. Pitfall: the gradient must be cut where the parameters were cut, padding included"
        )

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return GatheredUnit.apply(self.shard, self, *inputs)


class GatheredUnit(torch.autograd.Function):
    """A unit's forward and backward with its parameters gathered only while it computes."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: ShardedUnit, *inputs: torch.Tensor) -> torch.Tensor:
        # TODO: gather the full parameters, compute the module with them (functional_call with as_parameters' dict; autograd is off in here), keep for backward only the unit and the inputs (ctx.save_for_backward), nothing of the full parameters
        raise NotImplementedError(
            "TODO: gather the full parameters, compute the module with them (functional_call with as_parameters' dict; autograd is off in here), keep for backward only the unit and the inputs (ctx.save_for_backward), nothing of the full parameters"
        )

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # TODO: forward kept no full parameters, so backward must gather them again, and run the unit again with autograd on to get its gradients (this lab pairs FSDP with activation checkpointing, for simplicity: real FSDP keeps the activations and only regathers). Return one gradient per input of forward. Pitfall: the inputs must become leaves of the new graph, or their gradients are lost
        raise NotImplementedError(
            "TODO: forward kept no full parameters, so backward must gather them again, and run the unit again with autograd on to get its gradients (this lab pairs FSDP with activation checkpointing, for simplicity: real FSDP keeps the activations and only regathers). Return one gradient per input of forward. Pitfall: the inputs must become leaves of the new graph, or their gradients are lost"
        )
