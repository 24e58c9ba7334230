"""What a wrapper made of flat parameters (ZeRO, FSDP) offers a training loop, though each rank
holds only shards.

- **Clipping**: the norm of the *whole* gradient, assembled from the shards' (one all-reduce).
- **State dicts**: ``full_state_dict()`` gathers every original parameter, whole, under its
  original name (it loads into a plain model); ``sharded_state_dict()`` keeps each rank's pieces
  as DTensors of each flat parameter, which ``torch.distributed.checkpoint`` writes and reads
  back in place on any number of ranks (save on N, load on M).
- **no_sync**: gradient accumulation without the reduction (``ddp.GradientSyncSwitch``).

Cost: a full state dict gathers every parameter on every rank at once (the whole model, once);
the sharded one moves nothing but what is written. PyTorch's FSDP has the same two kinds
(``StateDictType.FULL_STATE_DICT``, ``SHARDED_STATE_DICT``).
"""

from __future__ import annotations

import math

import torch

from ..distributed import comm
from ..errors import UserError
from .ddp import GradientSyncSwitch
from .flat_param import FlatParameter


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make a lazily initialised optimizer (Adam...) create its state, without changing any parameter.

    Loading a checkpoint writes *into* the optimizer's state tensors, so they must exist first:
    one step on zero gradients, with a learning rate and weight decay of 0, creates them.
    """
    if optimizer.state:
        return
    neutral = {"lr": 0.0, "weight_decay": 0.0}
    saved = [{key: group[key] for key in neutral if key in group} for group in optimizer.param_groups]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_grads = [p.grad for p in params]
    for group, values in zip(optimizer.param_groups, saved):
        group.update({key: neutral[key] for key in values})
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)
    for param, grad in zip(params, saved_grads):
        param.grad = grad


def clip_sharded_grad_norm_(
    flats: list[FlatParameter], group, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale the shards' gradients so that the norm of the *whole* gradient is at most ``max_norm``.

    Each rank only sees its shard, so the norm is assembled: for the 2-norm, every rank sums the
    squares of its elements and an all-reduce adds those sums (the padding is zero and adds
    nothing); for the max-norm, an all-reduce takes the maximum. Returns the total norm before
    clipping, like ``torch.nn.utils.clip_grad_norm_``.
    """
    norm_type = float(norm_type)
    grads = [f.shard.grad for f in flats if f.shard.grad is not None]
    device = flats[0].compute_device
    if math.isinf(norm_type):
        local = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).to(device, torch.float32)
        comm.all_reduce(local, op="max", group=group)
        total = local
    else:
        local = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.tensor(0.0)).to(device)
        comm.all_reduce(local, op="sum", group=group)
        total = local ** (1.0 / norm_type)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.device))
    return total


class FlatShardedMixin(GradientSyncSwitch):
    """State dicts, gradient clipping and ``no_sync`` for wrappers made of flat parameters (ZeRO, FSDP).

    - ``full_state_dict()``: every original parameter, whole, under its original name, on every
      rank (an all-gather per flat parameter). Loads into a plain model with ``load_state_dict``.
    - ``sharded_state_dict()`` / ``sharded_optimizer_state_dict(optimizer)``: each rank's pieces
      only, as DTensors of each flat parameter; ``torch.distributed.checkpoint`` (DCP) writes them
      and reads them back *in place* on any number of ranks (save on N, load on M).
    """

    flat_params: list[FlatParameter]
    state_mesh = None  # the DeviceMesh the shards are spread over
    shard_group = None  # the ranks that hold different shards (None: all)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient of the whole model, of which this rank holds a shard; returns its norm."""
        return clip_sharded_grad_norm_(self.flat_params, self.shard_group, max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for flat in self.flat_params:
            state.update({fqn: t.detach().cpu().clone() for fqn, t in flat.split(flat.full_fp32()).items()})
        for name, buffer in self.module.named_buffers():
            state[name] = buffer.detach().cpu().clone()
        return state

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = {name for flat in self.flat_params for slot in flat.slots for name in slot.names} | {
            name for name, _ in self.module.named_buffers()
        }
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise UserError(
                f"state dict does not fit this model: missing {sorted(missing)[:5]}, unexpected "
                f"{sorted(unexpected)[:5]}: load a state dict of the same model"
            )
        for flat in self.flat_params:
            flat.load_full(state)
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                buffer.copy_(state[name])

    def _flat_key(self, flat: FlatParameter) -> str:
        return f"{flat.name}.flat_param" if flat.name else "flat_param"

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        state = {
            self._flat_key(flat): flat.shard_piece(flat.shard, self.state_mesh) for flat in self.flat_params
        }
        state.update({name: buffer for name, buffer in self.module.named_buffers()})
        return state

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        initialize_optimizer_state(optimizer)
        state = {}
        for flat in self.flat_params:
            for key, value in optimizer.state.get(flat.shard, {}).items():
                name = f"{self._flat_key(flat)}.{key}"
                if isinstance(value, torch.Tensor) and value.shape == flat.shard.shape:
                    # element-wise state: sharded like the weights
                    state[name] = flat.shard_piece(value, self.state_mesh)
                else:
                    state[name] = value  # a step counter: the same on every rank
        return state

    @property
    def state_layout(self) -> str:
        """What a sharded checkpoint of this wrapper holds: only the same layout can load it."""
        return f"{type(self).__name__} flat parameters " + ", ".join(
            self._flat_key(f) for f in self.flat_params
        )
