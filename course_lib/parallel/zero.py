"""ZeRO-1 and ZeRO-2: shard the optimizer state, then the gradients, across data-parallel ranks.

The redundancy. Under DDP every one of N ranks holds the same parameters, the same averaged
gradients and the same optimizer state: with Adam the state alone is twice the parameters
(two moments), plus a master copy in mixed precision. Every rank also does the same optimizer
step on all of it. ZeRO's observation: each rank only has to *update* 1/N of the model, as long
as everyone gets the updated parameters back before the next forward.

The flat parameter (``flat_param.py``, also the building block of FSDP in ``fsdp.py``). The
parameters of the model are copied into one flat vector, padded to a multiple of the group size
G and cut into G equal contiguous shards; rank g owns shard g.

One step of ZeRO on N ranks (``ZeroDataParallel``, ``stage=1`` or ``2``):

1. forward and backward run on the full parameters, as in DDP;
2. the flat gradient is **reduce-scattered**: rank g receives the sum of everyone's shard g
   (not the whole sum, as an all-reduce would give), and divides it by N;
3. the optimizer, any element-wise torch optimizer (SGD with momentum, Adam, AdamW...), is built
   on the shard only: it keeps state for 1/N of the parameters and updates only those;
4. before the next forward, the shards are **all-gathered** into the full parameters.

A reduce-scatter plus an all-gather is exactly what a ring all-reduce does internally, so ZeRO-1
and ZeRO-2 send the same 2(N-1)/N Ψ elements per step as DDP: the memory saving is free.

The two stages differ in what happens to the full gradient after step 2:

- **ZeRO-1** keeps it: a full-size gradient buffer stays allocated (only this rank's range of
  it is averaged; the rest is scratch). Memory per rank: 4Ψ params + 4Ψ grads + KΨ/N state (fp32).
- **ZeRO-2** never holds the full gradient. As in DeepSpeed, gradients are grouped into buckets
  during backward (PyTorch DDP's buckets, ``ddp.make_buckets``); as soon as a bucket's gradients
  are all there, they are copied into one buffer and freed, and the buffer is reduce-scattered
  *asynchronously* while backward goes on: each rank receives the sum of the part of the bucket
  that falls in its own shard (pieces of unequal size, some empty), and the buffer is freed once
  the reduction is done. Memory per rank: 4Ψ + (4 + K)Ψ/N, plus the buckets in flight.

Element-wise is the condition: an optimizer whose update of one element depends on others
(LAMB's per-tensor trust ratio, L-BFGS) would see a shard, not the tensor, and compute
something else.

Paper: Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020 (arXiv:1910.02054): stages P_os (ZeRO-1) and P_os+g (ZeRO-2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_group, check_module, check_number
from ..distributed import comm, runtime
from ..errors import UserError
from .claims import DATA_PARALLEL_WRAPPER, claim_module
from .ddp import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, EndOfBackward, make_buckets, start_as_replicas
from .flat_param import FlatParameter, ParamSlot, owned_parameters
from .flat_sharded import FlatShardedMixin

BUCKETS_IN_FLIGHT = 2
"""Buckets whose reduce-scatter may run while backward goes on; an older one is waited for first."""


class GradientBucket:
    """A run of the flat vector, ``[start, end)``, whose gradients are reduce-scattered together.

    Rank g owns elements ``[g S, (g+1) S)`` of the flat vector; its piece of this bucket is the
    overlap of the two ranges, empty when the bucket lies in other ranks' shards.

    Args:
        slots: the parameters whose gradients the bucket holds (consecutive in the flat vector).
        shard_numel: S, the elements of one rank's shard.
        group_size: the ranks the flat vector is sharded over.
    """

    def __init__(self, slots: list[ParamSlot], shard_numel: int, group_size: int):
        self.slots = slots
        self.start = min(slot.offset for slot in slots)
        self.end = max(slot.offset + slot.numel for slot in slots)
        self.pieces = [
            (max(self.start, rank * shard_numel), min(self.end, (rank + 1) * shard_numel))
            for rank in range(group_size)
        ]
        self.ready = 0
        self.buffer: torch.Tensor | None = None  # the bucket's gradients, until they are reduced
        self.work = None  # the reduce-scatter in flight

    def piece_sizes(self) -> list[int]:
        return [max(0, end - start) for start, end in self.pieces]


# #region zero-data-parallel
class ZeroDataParallel(FlatShardedMixin, nn.Module):
    """ZeRO stage 1 or 2 around ``module``: build any element-wise optimizer on ``model.parameters()``.

    ``model.parameters()`` is one flat shard (this rank's 1/N of the model), so the optimizer
    keeps state for, and updates, only that. The full parameters are all-gathered lazily, at the
    next forward after the optimizer changed the shard.

    Args:
        module: the model; every rank must build the same one (rank 0's weights are broadcast).
        stage: 1 shards the optimizer state, 2 also the gradients.
        group: the data-parallel process group to shard over (None: every rank).
        bucket_mb: with stage 2, the size at which a bucket of gradients is reduce-scattered
            during backward (None: PyTorch DDP's defaults, 1 MB first, then 25 MB).
    """

    def __init__(self, module: nn.Module, *, stage: int = 2, group=None, bucket_mb: float | None = None):
        super().__init__()
        check_module("module", module)
        check_group("group", group)
        if stage not in (1, 2):
            raise UserError(
                f"ZeroDataParallel does stage 1 or 2, not {stage!r}: for stage 3 use "
                "course_lib.parallel.fsdp.FullyShardedDataParallel"
            )
        claim_module(module, "ZeroDataParallel", family=DATA_PARALLEL_WRAPPER)
        params = owned_parameters(module)
        if not params:
            raise UserError("the model has no parameters to shard")
        self.module, self.stage, self.group, self.shard_group = module, stage, group, group
        start_as_replicas(module, group=group)
        self.flat = FlatParameter("", params, shard_group=group, shard_is_view=True)
        self.flat_params = [self.flat]
        self.flat_shard = self.flat.shard  # the only nn.Parameter of this module
        self._end_of_backward = EndOfBackward(self._reduce_gradients)
        self._gathered_version = self.flat_shard._version
        # ZeRO-1 keeps a full-size gradient buffer for good; ZeRO-2 allocates one per step and frees it.
        self._gradient_buffer = torch.zeros_like(self.flat.full) if stage == 1 else None
        from torch.distributed.device_mesh import DeviceMesh

        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(runtime.world_size()))
        )
        self.state_mesh = DeviceMesh.from_group(
            group or dist.group.WORLD, self.flat.compute_device.type, mesh=torch.tensor(ranks)
        )
        if bucket_mb is not None:
            check_number("bucket_mb (the size of one reduce-scatter, in MB)", bucket_mb, above=0)
        self.buckets: list[GradientBucket] = []
        if stage == 2:
            slot_of = {id(slot.leaf): slot for slot in self.flat.slots}
            trainable = [slot.leaf for slot in self.flat.slots if slot.leaf.requires_grad]
            for leaves in make_buckets(
                trainable,
                bucket_mb if bucket_mb is not None else DEFAULT_BUCKET_MB,
                first_bucket_mb=None if bucket_mb is not None else DEFAULT_FIRST_BUCKET_MB,
            ):
                slots = [slot_of[id(leaf)] for leaf in leaves]
                self.buckets.append(GradientBucket(slots, self.flat.shard_numel, self.flat.group_size))
        self._bucket_of = {id(slot.leaf): bucket for bucket in self.buckets for slot in bucket.slots}
        self._next_to_launch = 0
        self._in_flight: list[GradientBucket] = []
        self._shard_sum: torch.Tensor | None = None  # this rank's shard of the summed gradient, so far
        for slot in self.flat.slots:
            slot.leaf.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        if (
            self.flat_shard._version != self._gathered_version
        ):  # the optimizer stepped (or a load wrote) the shard
            self.gather_parameters()
        return self.module(*args, **kwargs)

    def gather_parameters(self) -> None:
        """All-gather every rank's shard into the full parameters (done for you before forward)."""
        with torch.no_grad():
            shard = self.flat_shard.detach().clone()  # the input must not alias the output
            comm.all_gather_into_tensor(self.flat.full, shard, group=self.group)
        self._gathered_version = self.flat_shard._version

    def _gradient_ready(self, leaf: torch.Tensor) -> None:
        if not self.require_gradient_sync:
            return  # no_sync(): the gradient accumulates where it is
        self._end_of_backward.request()
        if self.stage == 2:
            self._bucket_of[id(leaf)].ready += 1
            self._launch_ready_buckets()

    # #region zero2-buckets
    def _launch_ready_buckets(self, *, all_of_them: bool = False) -> None:
        """Reduce-scatter every complete bucket, strictly in bucket order (every rank must use one order)."""
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.ready < len(bucket.slots) and not all_of_them:
                return
            flat = torch.zeros(
                bucket.end - bucket.start, dtype=self.flat.reduce_dtype, device=self.flat.compute_device
            )
            for slot in bucket.slots:  # then the parameters' own gradients are let go
                if slot.leaf.grad is not None:
                    at = slot.offset - bucket.start
                    flat[at : at + slot.numel].copy_(slot.leaf.grad.reshape(-1))
                    slot.leaf.grad = None
            sizes = bucket.piece_sizes()  # the ranks' pieces follow one another: they cut the bucket
            bucket.buffer = flat  # kept alive until the reduction is done
            if self._shard_sum is None:  # this rank's piece of each bucket lands in its place at once
                self._shard_sum = torch.zeros(self.flat.shard_numel, dtype=flat.dtype, device=flat.device)
            start, end = bucket.pieces[self.flat.index]
            at = max(0, start - self.flat.index * self.flat.shard_numel)
            bucket.work = comm.reduce_scatter(
                self._shard_sum[at : at + max(0, end - start)],
                list(flat.split(sizes)),
                op="sum",
                group=self.group,
                async_op=True,
            )
            self._next_to_launch += 1
            self._in_flight.append(bucket)
            while len(self._in_flight) > BUCKETS_IN_FLIGHT:  # bound the memory the buckets hold
                self._take_in(self._in_flight.pop(0))

    def _take_in(self, bucket: GradientBucket) -> None:
        """Wait for a bucket's reduce-scatter (its piece is then in this rank's shard), free the bucket."""
        bucket.work.wait()
        bucket.ready, bucket.work, bucket.buffer = 0, None, None

    # #endregion zero2-buckets

    def _reduce_gradients(self) -> None:
        """End of backward: stage 1 reduce-scatters the whole flat gradient and keeps it; stage 2
        waits for its buckets, already in flight, and keeps this rank's shard of the sum."""
        previous = self.flat_shard.grad.clone() if self.flat_shard.grad is not None else None
        if self.stage == 1:  # the averaged shard goes back into its range of the kept buffer
            flat_gradient = self.flat.flat_gradient(self._gradient_buffer)
            reduced = self.flat.reduce_gradient(flat_gradient)
            own = flat_gradient[self.flat.index * self.flat.shard_numel :][: self.flat.shard_numel]
            own.copy_(reduced)
            self.flat_shard.grad = own
        else:
            self._launch_ready_buckets(all_of_them=True)  # a parameter that got no gradient counts as zero
            while self._in_flight:
                self._take_in(self._in_flight.pop(0))
            self._next_to_launch = 0
            self.flat_shard.grad, self._shard_sum = self._shard_sum.div_(self.flat.data_parallel_size), None
        if previous is not None:  # gradients accumulate over optimizer steps if the user did not zero them
            self.flat_shard.grad += previous

    # #endregion zero-data-parallel

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by category (for ``memory.measure_model_states``)."""
        grads = [self.flat_shard.grad, self._gradient_buffer] + [s.leaf.grad for s in self.flat.slots]
        return {"params": [self.flat.full, self.flat_shard], "grads": grads}

    def gradient_bytes_held(self) -> int:
        """The gradient bytes this rank holds now: the parameters' own, the buckets in flight, the
        shard's sum so far (a hook after each gradient reads it to find the backward's peak)."""
        held = [s.leaf.grad for s in self.flat.slots] + [self.flat_shard.grad, self._shard_sum]
        held += [b.buffer for b in self.buckets]
        return sum(t.numel() * t.element_size() for t in held if t is not None)


def apply_zero(
    model: nn.Module, group=None, *, stage: int = 2, bucket_mb: float | None = None
) -> ZeroDataParallel:
    """``model`` under ZeRO stage 1 or 2 over ``group``: build the optimizer on what it returns.

    Args:
        model: the model, the same on every rank (rank 0's weights are broadcast).
        group: the data-parallel process group (None: every rank).
        stage: 1 shards the optimizer state, 2 the gradients too.
        bucket_mb: the gradients' reduce-scatter buckets, in MiB (None: DDP's sizes).
    """
    return ZeroDataParallel(model, stage=stage, group=group, bucket_mb=bucket_mb)
