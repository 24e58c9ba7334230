"""The flat parameter: a module's parameters as one padded vector, cut into equal shards.

Sharding tensor by tensor would leave ranks with uneven pieces and one collective per tensor.
Instead the parameters of a module (a whole model for ZeRO-1/2, one unit for FSDP) are copied
into one flat vector, padded with zeros to a multiple of the group size G and cut into G equal
contiguous shards; rank g owns shard g. The module's own parameters become *views* into the
flat vector, so the module computes exactly as before, and one all-gather (of the shards into
the vector) or one reduce-scatter (of the flat gradient into the shards) moves a whole module.

Cost: the padding (at most G - 1 elements per module) and, for ZeRO-3, the full vector while it
is gathered. This is PyTorch FSDP1's ``FlatParameter`` (Zhao et al., "PyTorch FSDP: Experiences
on Scaling Fully Sharded Data Parallel", VLDB 2023); FSDP2 shards each tensor on dim 0 instead.

What every wrapper made of flat parameters offers a training loop (the norm of a gradient spread
over shards, state dicts) is ``flat_sharded``. ``zero.py`` (ZeRO-1/2) and ``fsdp.py`` (ZeRO-3)
are built on both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import comm, runtime
from ..errors import UserError
from .float8 import to_float8

Place = tuple[str, nn.Module, str]
"""Where a parameter sits: (its name in the model, the module holding it, that module's attribute)."""


class _HeldInPlaces:
    """The names of a parameter held in ``self.places`` (more than one if it is tied)."""

    places: list[Place]

    @property
    def fqn(self) -> str:
        """Its name: the first place's, as ``named_parameters`` gives it."""
        return self.places[0][0]

    @property
    def names(self) -> list[str]:
        """Every name it has, as ``state_dict`` lists it."""
        return [name for name, _, _ in self.places]


@dataclass
class OwnedParameter(_HeldInPlaces):
    """One parameter of a model and every place that holds it.

    A tied weight (a language model's token embedding reused as its output projection, set by
    ``head.weight = embedding.weight``) is *one* parameter in two places. It must stay one: one
    slot in the flat vector, one leaf that both places compute with, so that autograd adds the
    two gradients into one ``.grad``, and one update. Flattened once per place, it would become
    two parameters trained apart: a different model, with no error anywhere.
    """

    param: nn.Parameter
    places: list[Place]  # the first one names it (as ``named_parameters`` does)


@dataclass
class ParamSlot(_HeldInPlaces):
    """Where one of the module's original parameters lives inside the flat parameter."""

    places: list[Place]  # every (name, module, attribute) that holds it: more than one if tied
    shape: torch.Size
    offset: int  # first element in the flat vector
    leaf: torch.Tensor  # what the modules now use: a view into the unsharded flat vector

    @property
    def numel(self) -> int:
        return self.shape.numel()


def check_same_dtype(named_params: list[tuple[str, nn.Parameter]], unit: str) -> torch.dtype:
    """One flat vector has one dtype and one requires_grad: refuse a unit that mixes them."""
    first_name, first = named_params[0]
    for name, param in named_params[1:]:
        if param.dtype != first.dtype or param.requires_grad != first.requires_grad:
            raise UserError(
                f"unit {unit or '<root>'} mixes {first_name} ({first.dtype}, "
                f"requires_grad={first.requires_grad}) and {name} ({param.dtype}, "
                f"requires_grad={param.requires_grad}), which cannot share one flat parameter: convert the "
                "model to one dtype (model.float()) and freeze whole units, or wrap the differing "
                "parameters in a unit of their own"
            )
    if not first.dtype.is_floating_point:
        raise UserError(
            f"parameter {first_name} is {first.dtype}: only floating-point parameters can be trained"
        )
    return first.dtype


class FlatParameter:
    """The parameters of one module: flattened, padded to a multiple of G, sharded G ways.

    ``shard`` (an ``nn.Parameter`` of ceil(Ψ/G) elements, fp32 master weights) is what the
    optimizer sees. ``full`` (G shards, in the compute dtype) is what forward and backward use: each
    original parameter is replaced on its module by a view into it. With ``shard_is_view`` the
    shard is simply this rank's range of ``full`` (ZeRO-1/2, nothing to duplicate); otherwise
    ``full`` can be freed between uses (``free()``) and rebuilt by an all-gather (``gather()``):
    ZeRO-3.

    Args:
        name: the module's name in the model (a prefix of its parameters' names).
        owned: every parameter to flatten with the places that hold it, as ``owned_parameters``
            lists them (a tied parameter once); one dtype, all trainable or all frozen.
        shard_group: the G ranks the vector is sharded over (None: every rank).
        replicate_group: the ranks holding the same shard, whose gradients are also averaged
            (HYBRID_SHARD across nodes); None when the shard group is the whole data group.
        compute_device: where ``full`` lives and forward runs (default: the parameters' device).
        param_dtype: the dtype of ``full``, gathered and computed in (default: the parameters').
        reduce_dtype: the dtype gradients are reduced in (default: ``param_dtype``).
        gather_dtype: ``torch.float8_e4m3fn`` to send the parameters as float8 (one byte an element):
            every rank scales its shard by the unit's amax over all ranks (one all-reduce of one
            number), so the gathered vector is exactly the float8 cast of the whole one; each rank
            rebuilds ``param_dtype`` from it. None: they travel in ``param_dtype``.
        shard_device: where the fp32 shard and its optimizer state live (``cpu`` to offload).
        shard_is_view: make the shard a view of ``full`` (ZeRO-1/2) instead of its own copy.
    """

    def __init__(
        self,
        name: str,
        owned: list[OwnedParameter],
        shard_group,
        *,
        replicate_group=None,
        compute_device: torch.device | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        gather_dtype: torch.dtype | None = None,
        shard_device: torch.device | None = None,
        shard_is_view: bool = False,
    ):
        self.name = name
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.group_size = runtime.world_size(group=shard_group)
        self.index = runtime.rank(group=shard_group)
        self.data_parallel_size = self.group_size * (
            runtime.world_size(group=replicate_group) if replicate_group else 1
        )
        dtype = check_same_dtype([(o.fqn, o.param) for o in owned], name)
        self.requires_grad = owned[0].param.requires_grad
        self.compute_device = compute_device or owned[0].param.device
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.gather_dtype = gather_dtype
        shard_device = shard_device or self.compute_device

        self.total = sum(o.param.numel() for o in owned)
        self.shard_numel = math.ceil(self.total / self.group_size)
        self.padded = self.shard_numel * self.group_size
        start = self.index * self.shard_numel
        # real elements in this shard; the rest is padding
        self.valid = max(0, min(self.shard_numel, self.total - start))

        flat = torch.zeros(self.padded, dtype=dtype, device=self.compute_device)
        with torch.no_grad():
            torch.cat([o.param.detach().reshape(-1) for o in owned], out=flat[: self.total])
        self.full = (
            flat
            if shard_is_view
            else torch.empty(self.padded, dtype=self.param_dtype, device=self.compute_device)
        )
        own = flat[start : start + self.shard_numel]
        if shard_is_view:
            self.shard = nn.Parameter(own, requires_grad=self.requires_grad)
        else:
            # pinned memory needs a CUDA driver
            pin = shard_device.type == "cpu" and torch.cuda.is_available()
            copy = own.detach().to(shard_device, torch.float32, copy=True)
            self.shard = nn.Parameter(copy.pin_memory() if pin else copy, requires_grad=self.requires_grad)

        self.slots: list[ParamSlot] = []
        offset = 0
        for entry in owned:
            param = entry.param
            # A plain tensor (not a Parameter) that autograd treats as a leaf: its .grad is where
            # backward puts the gradient. ``.data =`` makes it a view of ``full`` while keeping its
            # own version counter, so refilling ``full`` later does not upset autograd.
            leaf = torch.empty(
                0, dtype=self.param_dtype, device=self.compute_device, requires_grad=self.requires_grad
            )
            leaf.data = self.full[offset : offset + param.numel()].view(param.shape)
            for _, module, attr in entry.places:  # every place of a tied weight uses the same leaf
                del module._parameters[attr]
                setattr(module, attr, leaf)
            self.slots.append(ParamSlot(list(entry.places), param.shape, offset, leaf))
            offset += param.numel()
        self.is_gathered = True
        self._gathering = None  # (work, local shard) while an all-gather runs
        if not shard_is_view:
            self.free()

    # -- parameters: gather and free ----------------------------------------------------------
    # #region flat-parameter
    def gather(self) -> None:
        """Rebuild the full parameters from every rank's shard (one all-gather of the compute dtype)."""
        self.start_gather()
        self.wait_gather()

    def wait_gather(self) -> None:
        """Wait for ``start_gather``'s all-gather (start it first if nobody did)."""
        if self._gathering is None and not self.is_gathered:
            self.start_gather()
        if self._gathering is not None:
            work, _, rebuild = self._gathering
            work.wait()
            if rebuild is not None:
                rebuild()
            self._gathering = None
            self.is_gathered = True

    @property
    def is_gathering(self) -> bool:
        return self._gathering is not None

    # #region gather-free
    def start_gather(self) -> None:
        """Start the all-gather; ``wait_gather()`` before use (meanwhile other units compute: prefetch)."""
        if self.is_gathered or self._gathering is not None:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        with torch.no_grad():
            local = self.shard.detach().to(self.compute_device, self.param_dtype, non_blocking=True)
            if self.gather_dtype is not None:
                self._start_float8_gather(local)
            elif self.group_size == 1:
                self.full.copy_(local)
                self.is_gathered = True
            else:  # ``local`` must live until the all-gather is done
                work = comm.all_gather_into_tensor(self.full, local, group=self.shard_group, async_op=True)
                self._gathering = (work, local, None)

    def free(self) -> None:
        """Release the full parameters' memory; the views keep their shapes, their storage is empty."""
        if self._gathering is not None:  # an all-gather still writes into it: let it finish first
            self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.is_gathered = False

    # #endregion gather-free

    # -- gradients ------------------------------------------------------------------------------
    def flat_gradient(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The leaves' gradients in one padded vector (of the reduce dtype); the leaves' grads are dropped."""
        if out is None:
            out = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.compute_device)
        else:
            out.zero_()
        for slot in self.slots:
            if slot.leaf.grad is not None:
                out[slot.offset : slot.offset + slot.numel].copy_(slot.leaf.grad.reshape(-1))
                slot.leaf.grad = None
        return out

    def reduce_gradient(self, flat_gradient: torch.Tensor) -> torch.Tensor:
        """Average ``flat_gradient`` over all data-parallel ranks, keeping only this rank's shard of it."""
        return self.start_reduce(flat_gradient)()

    def start_reduce(self, flat_gradient: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``reduce_gradient`` without waiting: the reduce-scatter starts now; call what is returned
        (at the latest moment that still needs the result) to wait for it and get this rank's shard."""
        own = flat_gradient[self.index * self.shard_numel : (self.index + 1) * self.shard_numel]
        work = None
        if self.group_size == 1:
            reduced = own
        else:
            reduced = torch.empty(self.shard_numel, dtype=flat_gradient.dtype, device=flat_gradient.device)
            work = comm.reduce_scatter_tensor(
                reduced, flat_gradient, op="sum", group=self.shard_group, async_op=True
            )

        def finish(_input: torch.Tensor = flat_gradient) -> torch.Tensor:  # the input lives until then
            if work is not None:
                work.wait()
            if self.replicate_group is not None and runtime.world_size(group=self.replicate_group) > 1:
                # HYBRID_SHARD: the same shard lives on one rank of every replica; average across them.
                comm.all_reduce(reduced, op="sum", group=self.replicate_group)
            return reduced.div_(self.data_parallel_size)

        return finish

    def accumulate_into_shard(self, reduced: torch.Tensor) -> None:
        grad = reduced.to(self.shard.device, torch.float32)  # a fresh tensor: reduce_gradient made it
        if self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad += grad

    # #endregion flat-parameter

    def shard_gradient_pieces(self, places: set[tuple[int, str]]) -> list[torch.Tensor]:
        """Views of this rank's shard gradient where it holds the parameters at ``places`` (each
        ``(id(module), attribute)``): every rank of another axis with the same model structure
        holds the same elements there, so that axis can reduce them in place."""
        if self.shard.grad is None:
            return []
        start, end = self.index * self.shard_numel, (self.index + 1) * self.shard_numel
        pieces = []
        for slot in self.slots:
            if any((id(module), attribute) in places for _, module, attribute in slot.places):
                low, high = max(slot.offset, start), min(slot.offset + slot.numel, end)
                if low < high:
                    pieces.append(self.shard.grad[low - start : high - start])
        return pieces

    def _start_float8_gather(self, local: torch.Tensor) -> None:
        """The all-gather in float8: one scale for the whole unit, then one byte an element."""
        amax = local.abs().amax().float().reshape(1)
        if self.group_size > 1:  # the unit's amax over every rank: every shard scaled alike
            comm.all_reduce(amax, op="max", group=self.shard_group)
        data, scale = to_float8(local, self.gather_dtype, amax=amax)
        packed = data.view(torch.uint8)  # the collectives move bytes: float8 is one an element
        gathered = torch.empty(self.padded, dtype=torch.uint8, device=self.compute_device)

        def rebuild() -> None:
            self.full.copy_(gathered.view(self.gather_dtype).float() * scale)

        if self.group_size == 1:
            gathered.copy_(packed)
            rebuild()
            self.is_gathered = True
            return
        work = comm.all_gather_into_tensor(gathered, packed, group=self.shard_group, async_op=True)
        self._gathering = (work, packed, rebuild)

    # -- state --------------------------------------------------------------------------------
    def full_fp32(self) -> torch.Tensor:
        """All elements (no padding) in fp32 on every rank of the shard group: for full state dicts."""
        local = self.shard.detach().to(self.compute_device, torch.float32)
        if self.group_size == 1:
            return local[: self.total].clone()
        flat = torch.empty(self.padded, dtype=torch.float32, device=self.compute_device)
        comm.all_gather_into_tensor(flat, local, group=self.shard_group)
        return flat[: self.total]

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat vector back as the original named tensors (a tied one under each of its names)."""
        return {
            name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for slot in self.slots
            for name in slot.names
        }

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take this rank's shard out of full tensors named like the original parameters."""
        flat = torch.cat(
            [tensors[slot.fqn].detach().reshape(-1).to(torch.float32).cpu() for slot in self.slots]
        )
        start = self.index * self.shard_numel
        with torch.no_grad():
            self.shard[: self.valid].copy_(flat[start : start + self.valid])

    def shard_piece(self, tensor: torch.Tensor, mesh) -> torch.Tensor:
        """This rank's real elements of a shard-shaped tensor, as a DTensor of the whole unit (for DCP).

        Rank g holds elements [g·S, g·S + valid) of a vector of ``total`` elements: exactly how
        DTensor cuts a dimension (``torch.chunk``: pieces of ceil(total/G), the last ones shorter
        or empty), so DCP can write the pieces and read them back cut for any other G.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
        return DTensor.from_local(
            tensor.detach()[: self.valid],
            mesh,
            placements,
            run_check=False,
            shape=torch.Size([self.total]),
            stride=(1,),
        )


def owned_parameters(module: nn.Module) -> list[OwnedParameter]:
    """Every parameter of ``module`` once, in the model's order, with every place that holds it."""
    found: dict[int, OwnedParameter] = {}
    for module_name, owner in module.named_modules():
        for attr, param in owner._parameters.items():
            if param is not None:
                place = (f"{module_name}.{attr}" if module_name else attr, owner, attr)
                found.setdefault(id(param), OwnedParameter(param, [])).places.append(place)
    return list(found.values())
