"""Solution of lab 2: optimizer-state sharding (ZeRO-1), then gradient sharding (ZeRO-2).

``ShardedOptimizer(params, torch.optim.AdamW, lr=...)`` wraps any element-wise torch optimizer.
The parameters are seen as one flat vector, cut into N contiguous shards (the last ones may be
shorter: the vector does not divide by N); rank r keeps a copy of shard r as the only parameter
of the real optimizer, so the optimizer state exists once in the job, not N times.

- ZeRO-1 (``step``): gradients were averaged by DDP; each rank copies its shard of the flat
  gradient, steps, and an all-gather gives every rank every updated shard.
- ZeRO-2 (``step_from_local_gradients``): no DDP. Each rank reduce-scatters its own gradients,
  receiving the average of its shard only: the full averaged gradient never exists anywhere.

Check your work (every property, at 2, 3 and 4 processes):

    python -m course_lib.tools.labs check lab2_zero
"""

from __future__ import annotations

import math

import torch
from torch import nn

from course_lib.distributed import comm, runtime


def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [start, end) of rank ``rank``'s shard of a flat vector of ``numel`` elements.

    Shards are ceil(numel / world_size) long; the last ones stop at ``numel`` (and may be empty).
    """
    # BEGIN SOLUTION: every shard has the same length, the number of elements divided by the ranks and rounded up (so that the shards cover everything); clamp both ends to the vector's length, so a rank past the end gets an empty range
    size = math.ceil(numel / world_size)
    return min(rank * size, numel), min((rank + 1) * size, numel)
    # END SOLUTION


class ShardedOptimizer:
    """``optimizer_cls(**kwargs)`` over this rank's shard of ``params``; every rank calls each method.

    Args:
        params: the parameters to optimize (those with ``requires_grad``), the same on every rank.
        optimizer_cls: an element-wise torch optimizer class (SGD, Adam, AdamW...).
        kwargs: its arguments.
    """

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = runtime.rank(), runtime.world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = shard_bounds(self.numel, self.rank, self.world_size)
        self.shard_size = math.ceil(self.numel / self.world_size)
        # BEGIN SOLUTION: the optimizer must own a tensor of its own: a copy of this rank's slice of the flattened parameters, made a leaf that requires grad (nn.Parameter), given to optimizer_cls with the kwargs
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = nn.Parameter(flat[self.start : self.end].clone())
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        # END SOLUTION

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def _flat_gradient(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def _gather_and_write_back(self) -> None:
        """Every rank's updated shard, all-gathered, back into the model's parameters."""
        # BEGIN SOLUTION: each rank updated only its shard, and every rank needs every shard back in its parameters. The collective that hands everyone everyone's piece wants pieces of one size, but when the count does not divide, the last shard is shorter: decide what the short rank sends and what becomes of the extra. Pitfall: the parameters are tensors autograd tracks, and the new values must land in them without being recorded
        piece = torch.zeros(self.shard_size, dtype=self.shard.dtype)
        piece[: self.end - self.start] = self.shard.detach()
        everyone = torch.empty(self.shard_size * self.world_size, dtype=self.shard.dtype)
        comm.all_gather_into_tensor(everyone, piece)
        offset = 0
        with torch.no_grad():
            for param in self.params:
                param.copy_(everyone[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
        # END SOLUTION

    def step(self) -> None:
        """ZeRO-1: the gradients are already averaged (DDP); update this rank's shard, share it."""
        # BEGIN SOLUTION: the shard's gradient is this rank's slice of the flattened (averaged) gradients; step the real optimizer, then share the result
        self.shard.grad = self._flat_gradient()[self.start : self.end].clone()
        self.optimizer.step()
        self._gather_and_write_back()
        # END SOLUTION

    def step_from_local_gradients(self) -> None:
        """ZeRO-2: each rank has only its own gradients (no DDP); average just this rank's shard.

        Then the whole local gradient is let go: what a rank keeps is its shard's average only.
        (The course's ``ZeroDataParallel`` goes further: it reduces bucket by bucket during
        backward, so the whole gradient never exists even before the step.)
        """
        # BEGIN SOLUTION: a reduce-scatter hands each rank the reduction of its piece only, so its input must cut into world_size equal pieces; keep the real part of yours; the full-size local gradients are then garbage: holding on to them (param.grad) keeps exactly the memory ZeRO-2 exists to save; then step and share as in ZeRO-1
        padded = torch.zeros(self.shard_size * self.world_size, dtype=self.shard.dtype)
        padded[: self.numel] = self._flat_gradient()
        self.zero_grad()
        mine = torch.empty(self.shard_size, dtype=self.shard.dtype)
        comm.reduce_scatter_tensor(mine, padded, op="mean")
        self.shard.grad = mine[: self.end - self.start].clone()
        self.optimizer.step()
        self._gather_and_write_back()
        # END SOLUTION

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0
        )
