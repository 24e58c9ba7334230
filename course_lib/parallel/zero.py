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
- **ZeRO-2** frees it and keeps only this rank's gradient shard: 4Ψ + (4 + K)Ψ/N. (Here the full
  gradient still exists briefly at the end of backward; DeepSpeed reduces it in buckets *during*
  backward so that it never exists at once. The steady state is the same.)

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

from .. import comm, runtime
from ..checks import DATA_PARALLEL_WRAPPER, check_group, check_module, claim_module
from ..errors import UserError
from .ddp import EndOfBackward, start_as_replicas
from .flat_param import FlatParameter, FlatShardedMixin, owned_parameters


class ZeroDataParallel(FlatShardedMixin, nn.Module):
    """ZeRO stage 1 or 2 around ``module``: build any element-wise optimizer on ``model.parameters()``.

    ``model.parameters()`` is one flat shard (this rank's 1/N of the model), so the optimizer
    keeps state for, and updates, only that. The full parameters are all-gathered lazily, at the
    next forward after the optimizer changed the shard.

    Args:
        module: the model; every rank must build the same one (rank 0's weights are broadcast).
        stage: 1 shards the optimizer state, 2 also the gradients.
        group: the data-parallel process group to shard over (None: every rank).
    """

    def __init__(self, module: nn.Module, *, stage: int = 2, group=None):
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

    def _gradient_ready(self, _leaf: torch.Tensor) -> None:
        if self.require_gradient_sync:
            self._end_of_backward.request()

    def _reduce_gradients(self) -> None:
        """End of backward: reduce-scatter the flat gradient; keep it whole (stage 1) or only the shard."""
        previous = self.flat_shard.grad.clone() if self.flat_shard.grad is not None else None
        flat_gradient = self.flat.flat_gradient(self._gradient_buffer)
        reduced = self.flat.reduce_gradient(flat_gradient)
        if self.stage == 1:  # the averaged shard goes back into its range of the kept buffer
            own = flat_gradient[self.flat.index * self.flat.shard_numel :][: self.flat.shard_numel]
            own.copy_(reduced)
            self.flat_shard.grad = own
        else:
            self.flat_shard.grad = reduced
        if previous is not None:  # gradients accumulate over optimizer steps if the user did not zero them
            self.flat_shard.grad += previous

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by category (for ``memory.measure_model_states``)."""
        grads = [self.flat_shard.grad, self._gradient_buffer] + [s.leaf.grad for s in self.flat.slots]
        return {"params": [self.flat.full, self.flat_shard], "grads": grads}
