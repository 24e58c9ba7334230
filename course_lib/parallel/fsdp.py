"""FSDP: ZeRO stage 3, where even the parameters are sharded and gathered only while they are used.

ZeRO-1/2 (``zero.py``) still keep a full copy of the parameters on every rank. FSDP drops it:
each rank keeps 1/N of the parameters, gradients and optimizer state, 16Ψ/N bytes with mixed-
precision Adam, and rebuilds a piece of the model only for the moment it computes with it.

Units. The model is cut into *units* (``auto_wrap_policy``: module classes such as a
transformer block, a parameter-count threshold, or an explicit list of modules; the root module
is always a unit, for the parameters left over). Each unit's parameters form one
``FlatParameter``: flattened, padded, sharded. A weight tied between two units (an embedding
reused as the output head) belongs to the innermost unit that holds both, so it stays one
weight, gathered while either use computes. Per unit and step:

1. before its forward: **all-gather** the full parameters (forward pre-hook);
2. after its forward: **free** them (``reshard_after_forward``); only one unit is whole at a time;
3. before its backward: **all-gather** them again (a hook on the unit's output gradients);
4. when every parameter of the unit has its gradient: **reduce-scatter** the flat gradient, keep
   the averaged shard, drop the full gradient, free the parameters.

Traffic: two all-gathers and one reduce-scatter of Ψ elements, 3(N-1)/N Ψ per rank, 1.5 times
DDP. Memory: the shards, plus the largest unit (or two) gathered, plus activations. The unit
size is the trade-off: smaller units hold less at once but send more, smaller messages.

Overlap (section 3.3-3.4 of the FSDP paper). Done one after the other, every all-gather makes
the computation wait. So, while a unit computes, the next one's parameters are already on
their way: *forward prefetch* starts the all-gather of the unit that comes next in forward
(the order is recorded in the first step), *backward prefetch* the one whose backward comes
next; each reduce-scatter starts *asynchronously* when its unit's gradients are complete and
is waited for only when a later one needs room, or at the end of backward, where the optimizer
needs the shards. A rate limit keeps at most ``MAX_UNITS_IN_FLIGHT`` = 2 units (of those without
nested units) gathered or being gathered at once, so prefetching never holds more than two units'
parameters: memory stays bounded while communication hides behind computation. Each can be
switched off (``forward_prefetch``, ``backward_prefetch``) to measure what it buys.

Sharding strategies (``sharding_strategy``), from most to least memory saved:

==============  ============================================================================
FULL_SHARD      as above (ZeRO-3).
SHARD_GRAD_OP   parameters stay gathered from forward to backward (no second all-gather,
                2(N-1)/N Ψ traffic, like ZeRO-2), freed after backward.
HYBRID_SHARD    shard inside groups of ``hybrid_shard_size`` ranks (a node: fast links),
                replicate across groups; gradients are reduce-scattered inside the group and
                all-reduced across groups (only 1/G of the gradient crosses the slow network).
NO_SHARD        every rank keeps everything and gradients are all-reduced: DDP.
==============  ============================================================================

Options. ``cpu_offload``: ``"params"`` keeps parameter shards, their gradients and therefore the
optimizer state and step in CPU memory (ZeRO-Offload), copying a shard to the device only to
gather it; ``"full"`` also moves the activations saved for backward to CPU. Memory is pinned
only when a CUDA driver is present. ``mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``: compute and gather in bf16 (half the traffic), reduce gradients in
fp32, while the shards the optimizer updates stay fp32 master weights.
``activation_checkpointing``: units (without nested units) keep only their inputs for backward
and recompute the rest.

Papers: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020 (arXiv:1910.02054), stage P_os+g+p; Zhao et al., "PyTorch FSDP: Experiences on
Scaling Fully Sharded Data Parallel", VLDB 2023 (arXiv:2304.11277), for units, the sharding
strategies and mixed precision as PyTorch does them; Ren et al., "ZeRO-Offload: Democratizing
Billion-Scale Model Training", USENIX ATC 2021 (arXiv:2101.06840), for ``cpu_offload``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_map

from ..checks import check_flag, check_group, check_module
from ..errors import UserError
from .claims import DATA_PARALLEL_WRAPPER, claim_module
from .ddp import EndOfBackward, start_as_replicas
from .flat_param import FlatParameter, owned_parameters
from .flat_sharded import FlatShardedMixin
from .fsdp_units import (
    MixedPrecision,
    Unit,
    UnitMemory,
    WrapPolicy,
    check_options,
    check_units,
    device_for_compute,
    select_units,
    shard_groups,
)
from .recompute import recomputation_units, recompute_modules

MAX_UNITS_IN_FLIGHT = 2
"""Units (of those without nested units) that may be gathered or being gathered at once: FSDP's
rate limiter (``limit_all_gathers``), so that prefetching bounds the memory it uses."""


REDUCTIONS_IN_FLIGHT = 2
"""Asynchronous reduce-scatters that may be running at once; an older one is finished first."""


def _checked_arguments(
    module, group, mixed_precision, sharding_strategy, cpu_offload, **flags
) -> MixedPrecision:
    """``FullyShardedDataParallel``'s arguments, each refused in one line naming it; the mixed
    precision to use (the default one where none is given)."""
    check_module("module", module)
    for name, flag in flags.items():
        check_flag(name, flag)
    check_group("group", group)
    if not isinstance(mixed_precision, (MixedPrecision, type(None))):
        raise UserError(
            f"mixed_precision must be a fsdp.MixedPrecision(...), got {type(mixed_precision).__name__}"
        )
    mixed_precision = mixed_precision or MixedPrecision()
    check_options(sharding_strategy or "FULL_SHARD", cpu_offload, mixed_precision)
    return mixed_precision


class FullyShardedDataParallel(FlatShardedMixin, nn.Module):
    """Shard ``module`` over a group of ranks; build the optimizer on ``model.parameters()`` (the shards).

    Args:
        module: the model, the same on every rank (the first rank's weights are copied to all).
        group: the process group to shard over (default: every rank). Pass one dimension of a
            mesh to combine FSDP with another parallelism on the other dimension.
        mesh: instead of ``group``, a ``DeviceMesh``: 1-D to shard over it, or 2-D
            (replicate, shard) for HYBRID_SHARD.
        auto_wrap_policy: which submodules become units (see ``select_units``); None: one unit.
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD.
        hybrid_shard_size: ranks per shard group for HYBRID_SHARD without a mesh (default: a node).
        cpu_offload: ``"none"``, ``"params"`` (shards, their gradients and the optimizer state in
            CPU memory) or ``"full"`` (also the activations saved for backward).
        mixed_precision: a ``MixedPrecision`` (compute, reduce and buffer dtypes), or None for fp32.
        activation_checkpointing: units without nested units recompute their activations in backward.
        device: where to compute (default: where the parameters are).
        forward_prefetch: start gathering the next unit's parameters while one computes forward.
        backward_prefetch: likewise, for the unit whose backward comes next.
        reshard_after_forward: free a unit's parameters after its forward (None: what the sharding
            strategy says, True but under SHARD_GRAD_OP); ``set_reshard_after_forward`` sets it
            for one unit, as FSDP2 does per ``fully_shard`` call.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group=None,
        mesh=None,
        auto_wrap_policy: WrapPolicy = None,
        sharding_strategy: str | None = None,
        hybrid_shard_size: int | None = None,
        cpu_offload: str = "none",
        mixed_precision: MixedPrecision | None = None,
        activation_checkpointing: bool = False,
        device: torch.device | str | None = None,
        forward_prefetch: bool = True,
        backward_prefetch: bool = True,
        reshard_after_forward: bool | None = None,
    ):
        super().__init__()
        mixed_precision = _checked_arguments(
            module, group, mixed_precision, sharding_strategy, cpu_offload,
            activation_checkpointing=activation_checkpointing, forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
        )  # fmt: skip
        compute_device = device_for_compute(module, device, cpu_offload)
        groups = shard_groups(sharding_strategy, hybrid_shard_size, group, mesh, compute_device.type)
        unit_modules = select_units(module, auto_wrap_policy)
        check_units(module, unit_modules, auto_wrap_policy)
        claim_module(module, "FullyShardedDataParallel", family=DATA_PARALLEL_WRAPPER)
        for ranks in groups.start_groups:  # every rank starts from the first rank's weights
            start_as_replicas(module, group=ranks)

        self.module = module
        self.sharding_strategy, self.cpu_offload, self.mixed_precision = (
            groups.sharding_strategy,
            cpu_offload,
            mixed_precision,
        )
        self.state_mesh, self.shard_group = groups.state_mesh, groups.shard_group
        replicate_group = groups.replicate_group
        names = {id(m): name for name, m in module.named_modules()}
        shard_device = torch.device("cpu") if cpu_offload != "none" else compute_device

        reshard = (
            groups.sharding_strategy != "SHARD_GRAD_OP"
            if reshard_after_forward is None
            else reshard_after_forward
        )
        self.units = self._make_units(
            [module, *unit_modules],
            names,
            replicate_group=replicate_group,
            compute_device=compute_device,
            shard_device=shard_device,
            reshard_after_forward=reshard,
        )
        self.flat_params = [unit.flat for unit in self.units]
        self.flat_shards = nn.ParameterList([flat.shard for flat in self.flat_params])
        if mixed_precision.buffer_dtype is not None:
            for buffer in module.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(mixed_precision.buffer_dtype)

        self.forward_prefetch, self.backward_prefetch = forward_prefetch, backward_prefetch
        self._forward_order: list[Unit] = []  # units as their forward starts, recorded in the first step
        self._backward_order: list[Unit] = []  # units as their forward ends, reversed: backward's order
        self._order_known = False
        self._reductions: list[tuple[Unit, Callable[[], torch.Tensor]]] = []  # reduce-scatters in flight
        self._sync_this_backward = True
        self._end_of_backward = EndOfBackward(self._finish_backward)
        self.memory = UnitMemory(self.units)  # what the units hold, counted where the hooks tell it
        self._register_hooks()
        if activation_checkpointing:
            self._checkpoint_leaf_units()

    def _make_units(
        self,
        unit_modules: list[nn.Module],
        names: dict[int, str],
        *,
        replicate_group,
        compute_device: torch.device,
        shard_device: torch.device,
        reshard_after_forward: bool,
    ) -> list[Unit]:
        """One unit per module of ``unit_modules`` (the root first) that owns parameters, each with
        its flat parameter; a parameter goes to the innermost unit that holds every place of it."""
        units: list[Unit] = []
        unassigned = owned_parameters(unit_modules[0])
        # Children first, so that a nested unit takes its parameters before its parent does. A
        # parameter belongs to the innermost unit that holds *every* place of it: a weight tied
        # between two units (an embedding and the output head) goes to their common ancestor,
        # which is gathered for as long as either of them computes (FSDP's rule for shared
        # parameters).
        for unit_module in reversed(unit_modules):
            prefix = names[id(unit_module)]
            inside = {id(m) for m in unit_module.modules()}
            params = [o for o in unassigned if all(id(owner) in inside for _, owner, _ in o.places)]
            unassigned = [o for o in unassigned if not any(o is p for p in params)]
            if not params:
                continue
            flat = FlatParameter(
                prefix,
                params,
                self.shard_group,
                replicate_group=replicate_group,
                compute_device=compute_device,
                param_dtype=self.mixed_precision.param_dtype,
                reduce_dtype=self.mixed_precision.reduce_dtype,
                gather_dtype=self.mixed_precision.gather_dtype,
                shard_device=shard_device,
            )
            units.insert(0, Unit(unit_module, prefix, flat, reshard_after_forward=reshard_after_forward))
        for unit in units:
            unit.holds_units = any(
                other is not unit and any(other.module is m for m in unit.module.modules()) for other in units
            )
        return units

    def _register_hooks(self) -> None:
        """Each unit gathers before its forward and frees after; each gradient reports when ready."""
        for unit in self.units:
            unit.hooks.append(
                unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            )
            unit.hooks.append(unit.module.register_forward_hook(functools.partial(self._after_forward, unit)))
            for slot in unit.flat.slots:
                if slot.leaf.requires_grad:
                    slot.leaf.register_post_accumulate_grad_hook(
                        functools.partial(self._gradient_ready, unit)
                    )

    def _checkpoint_leaf_units(self) -> None:
        # Recomputing a unit that contains units would gather and free them mid-backward.
        leaves = [
            unit.module for unit in self.units if unit.module is not self.module and not unit.holds_units
        ]
        recompute_modules(leaves, policy="full")

    def set_reshard_after_forward(self, module: nn.Module, reshard: bool) -> None:
        """Free (True) or keep (False) the unit of ``module``'s parameters between its forward and backward.

        Keeping them saves the backward's all-gather at the price of holding the unit whole
        meanwhile: SHARD_GRAD_OP for one unit (FSDP2: ``fully_shard(module, reshard_after_forward=)``).

        Args:
            module: a module that is a unit (one of ``auto_wrap_policy``'s, or the model).
            reshard: whether its parameters are freed after its forward.
        """
        unit = next((unit for unit in self.units if unit.module is module), None)
        if unit is None:
            raise UserError(
                f"{type(module).__name__} is not one of this model's units: pass a module that is"
            )
        unit.reshard_after_forward = bool(reshard)

    # -- forward --------------------------------------------------------------------------------
    # #region fsdp-hooks
    def forward(self, *args, **kwargs):
        self._sync_this_backward = self.require_gradient_sync
        param_dtype = self.mixed_precision.param_dtype
        if param_dtype is not None:  # inputs in the compute dtype, as the layers expect
            cast = lambda t: t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        offload_activations = self.cpu_offload == "full" and torch.is_grad_enabled()
        saving = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if offload_activations
            else contextlib.nullcontext()
        )
        with saving:
            output = self.module(*args, **kwargs)
        self._order_known = True  # the whole forward ran once: the units' orders are recorded
        return output

    # #region forward-hooks
    def _before_forward(self, unit: Unit, module: nn.Module, args) -> None:
        self._gather(unit)
        if not self._order_known:
            self._forward_order.append(unit)
        elif self.forward_prefetch:  # while this unit computes, the next one's parameters travel
            self._prefetch(self._forward_order, unit)

    def _after_forward(self, unit: Unit, module: nn.Module, args, output) -> None:
        if not self._order_known:
            self._backward_order.insert(0, unit)
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if (
            torch.is_grad_enabled() and outputs
        ):  # a frozen unit too: backward needs its weights to go through it
            for tensor in outputs:  # fires when the gradient reaches this unit's output: its backward begins
                tensor.register_hook(functools.partial(self._before_backward, unit))
            if not unit.reshard_after_forward:
                return
        unit.flat.free()

    # #endregion forward-hooks

    # #region prefetch
    def _gather(self, unit: Unit) -> None:
        """Make ``unit`` whole now: wait for its prefetched all-gather, or gather it if nobody started one."""
        unit.flat.wait_gather()
        self.memory.tell("gathered")

    def _prefetch(self, order: list[Unit], current: Unit) -> None:
        """Start gathering the unit after ``current`` in ``order``, if the rate limit allows it."""
        position = next((i for i, u in enumerate(order) if u is current), None)
        if position is None or position + 1 >= len(order):
            return
        upcoming = order[position + 1]
        if upcoming.flat.is_gathered or upcoming.flat.is_gathering:
            return
        if not upcoming.holds_units and self._leaf_units_in_flight() >= MAX_UNITS_IN_FLIGHT:
            return  # two units are whole or on their way already: the memory bound wins over overlap
        upcoming.flat.start_gather()
        self.memory.tell("gathering")

    def _leaf_units_in_flight(self) -> int:
        return sum(1 for u in self.units if not u.holds_units and (u.flat.is_gathered or u.flat.is_gathering))

    # #endregion prefetch

    # -- backward -------------------------------------------------------------------------------
    def _before_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._end_of_backward.request()
        if not unit.backward_started:
            unit.backward_started = True
            self._gather(unit)
            if self.backward_prefetch:
                self._prefetch(self._backward_order, unit)

    def _gradient_ready(self, unit: Unit, leaf: torch.Tensor) -> None:
        self._end_of_backward.request()
        unit.arrived += 1
        if unit.arrived == sum(slot.leaf.requires_grad for slot in unit.flat.slots):
            self._finish_unit(unit)

    def _finish_unit(self, unit: Unit) -> None:
        """The unit's backward is done: start reducing its gradient to this rank's shard; free the unit."""
        self.memory.tell("reducing")
        if self._sync_this_backward and unit.flat.requires_grad:
            self._reductions.append((unit, unit.flat.start_reduce(unit.flat.flat_gradient())))
            while len(self._reductions) > REDUCTIONS_IN_FLIGHT:  # the flat gradients wait in memory
                self._finish_reduction()
        unit.flat.free()
        unit.arrived, unit.backward_started = 0, False

    def _finish_reduction(self) -> None:
        unit, finish = self._reductions.pop(0)
        unit.flat.accumulate_into_shard(finish())

    def _finish_backward(self) -> None:
        """End of backward: units some of whose parameters got no gradient are finished now (as zeros);
        every reduce-scatter still in flight is waited for (the optimizer needs the shards now); a
        unit prefetched for nothing is freed."""
        for unit in self.units:
            if unit.arrived or unit.backward_started:
                self._finish_unit(unit)
        while self._reductions:
            self._finish_reduction()
        for unit in self.units:
            if unit.flat.is_gathered or unit.flat.is_gathering:
                unit.flat.free()

    # #endregion fsdp-hooks

    # -- inspection -----------------------------------------------------------------------------
    def gather_parameters(self) -> None:
        """Make every unit whole (to inspect or export the weights); ``reshard_parameters()`` undoes it."""
        for unit in self.units:
            unit.flat.gather()
        self.memory.tell("inspecting")

    def reshard_parameters(self) -> None:
        for unit in self.units:
            unit.flat.free()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        self.gather_parameters()
        try:
            yield
        finally:
            self.reshard_parameters()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by category (``memory.measure_model_states`` counts their storage)."""
        flats = self.flat_params
        return {
            "params": [f.shard for f in flats] + [f.full for f in flats],
            "grads": [f.shard.grad for f in flats] + [s.leaf.grad for f in flats for s in f.slots],
        }

    @property
    def max_units_gathered(self) -> int:
        """The most units (without nested units) whole or on their way at once (``UnitMemory``)."""
        return self.memory.max_units_gathered

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, dict[str, int]]:
        """Bytes this rank holds now and at most so far, by category (optimizer state if one is given)."""
        current = self.memory.current()
        if optimizer is not None:
            current["optimizer_state"] = sum(
                v.untyped_storage().nbytes()
                for state in optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
        current["total"] = sum(current.values())
        return {"current": current, "peak": dict(self.memory.peak)}


def apply_fsdp(
    model: nn.Module, group_or_mesh=None, *, units: list[nn.Module] | None = None, **options
) -> FullyShardedDataParallel:
    """``model`` sharded over a group or a mesh, one unit gathered at a time: build the optimizer on it.

    Args:
        model: the model, the same on every rank (the first rank's weights are copied to all).
        group_or_mesh: a process group, or a ``DeviceMesh`` (2-D for HYBRID_SHARD); None: every rank.
        units: the submodules gathered and freed whole (None: a transformer's blocks, else
            ``models.sharding_units``), as torchtitan calls ``fully_shard`` on each block.
        options: the other options of ``FullyShardedDataParallel`` (``sharding_strategy``,
            ``cpu_offload``, ``mixed_precision``...).
    """
    where = {"mesh" if isinstance(group_or_mesh, DeviceMesh) else "group": group_or_mesh}
    if units is None:
        units = recomputation_units(model)
    return FullyShardedDataParallel(model, auto_wrap_policy=units, **where, **options)
