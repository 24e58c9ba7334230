"""What FSDP shards, and over which ranks: units, the sharding strategies, the shard groups.

A *unit* is a group of modules whose parameters are gathered together (``select_units``: one per
module class the policy names, e.g. one per transformer block, and the root for what is left);
each unit's parameters become one flat, padded parameter (``flat_param``) of which every rank
keeps one shard. ``shard_groups`` says over which ranks a shard is cut and over which the
gradients are reduced, for each sharding strategy, on a group or a device mesh:

====================  ============================================================
strategy              parameters kept between uses
====================  ============================================================
``FULL_SHARD``        1/N (ZeRO-3): gathered for forward, freed, gathered for backward
``SHARD_GRAD_OP``     whole after forward until backward (ZeRO-2's memory, fewer gathers)
``HYBRID_SHARD``      1/G inside a node's group of G ranks, replicated across groups
``NO_SHARD``          whole (DDP's memory), the gradients all-reduced
====================  ============================================================

``fsdp.py`` is the wrapper that runs the units: gather before use, free after, reduce the
gradients; this file is what it is built from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_choice, check_int
from ..distributed import runtime
from ..errors import UserError
from .flat_param import FlatParameter

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


OFFLOAD_MODES = ("none", "params", "full")


WrapPolicy = None | int | type | Iterable[type] | Iterable[nn.Module] | Callable[[nn.Module], bool]


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes for computing and gathering (``param_dtype``), reducing gradients, and buffers.

    Args:
        param_dtype: the dtype parameters are gathered and computed in (None: their own, fp32).
        reduce_dtype: the dtype gradients are reduced in (None: ``param_dtype``).
        buffer_dtype: the dtype of buffers such as running statistics (None: unchanged).
        gather_dtype: the dtype the parameters travel in, if narrower than ``param_dtype``:
            ``torch.float8_e4m3fn`` sends one byte an element, scaled by the unit's amax over every
            rank (``flat_param.FlatParameter``), and each rank rebuilds ``param_dtype`` from it.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    gather_dtype: torch.dtype | None = None


@dataclass
class Unit:
    """A module whose parameters are gathered and reduced together."""

    module: nn.Module
    name: str
    flat: FlatParameter
    reshard_after_forward: bool
    holds_units: bool = False  # it contains other units (the root, usually): always gathered around them
    arrived: int = 0  # parameters whose gradient is complete in this backward
    backward_started: bool = False
    hooks: list = field(default_factory=list)


class UnitMemory:
    """What FSDP's units hold, by category, now and at most; and the most units whole at once.

    FSDP's hooks tell it each moment memory may peak (``tell``): a unit made whole
    (``"gathered"``), a gather started ahead (``"gathering"``), a unit's gradients complete
    before it is freed (``"reducing"``), every unit made whole to inspect it (``"inspecting"``).
    The memory lesson and the tests read what it counted; the hooks themselves read nothing of it.

    Args:
        units: the FSDP model's units.
    """

    def __init__(self, units: list[Unit]):
        self.units = units
        self.peak: dict[str, int] = {}
        self.max_units_gathered = 0

    def current(self) -> dict[str, int]:
        """The bytes the units hold now: parameters and gradients, sharded and whole."""

        def size(tensor):
            return 0 if tensor is None else tensor.untyped_storage().nbytes()

        flats = [unit.flat for unit in self.units]
        return {
            "sharded_params": sum(size(f.shard) for f in flats),
            "unsharded_params": sum(size(f.full) for f in flats),
            "sharded_grads": sum(size(f.shard.grad) for f in flats),
            "unsharded_grads": sum(size(s.leaf.grad) for f in flats for s in f.slots),
        }

    def tell(self, moment: str) -> None:
        """A moment of the hooks: the units whole or on their way as training gathers them, and the bytes
        held wherever they are whole (a gather started is counted once it is waited for)."""
        if moment in ("gathered", "gathering"):
            whole = [u for u in self.units if u.flat.is_gathered or u.flat.is_gathering]
            self.max_units_gathered = max(self.max_units_gathered, sum(not u.holds_units for u in whole))
        if moment == "gathering":
            return
        current = self.current()
        current["total"] = sum(current.values())
        for key, value in current.items():
            self.peak[key] = max(self.peak.get(key, 0), value)


def select_units(model: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The submodules that become units, parents before children. ``policy`` is one of:

    - an ``int``: bottom-up, a module becomes a unit when it holds at least that many parameters
      not already in a unit (PyTorch's ``size_based_auto_wrap_policy``);
    - a module class or several: every submodule of those classes;
    - modules: exactly those; or a function ``module -> bool``.
    """
    if policy is None:
        return []
    if isinstance(policy, bool):
        raise UserError(
            "auto_wrap_policy must be a parameter count, module classes, modules or a function, not a bool"
        )
    if isinstance(policy, int):
        if policy < 1:
            raise UserError(f"a size-based wrap policy needs min_num_params >= 1, got {policy}")
        chosen: list[nn.Module] = []

        def unwrapped_count(module: nn.Module) -> int:
            count = sum(p.numel() for p in module.parameters(recurse=False))
            for child in module.children():
                count += unwrapped_count(child)
            if count >= policy and module is not model:
                chosen.append(module)
                return 0
            return count

        unwrapped_count(model)
        ordered = [m for m in model.modules() if any(m is c for c in chosen)]
        return ordered
    if isinstance(policy, type) or (
        isinstance(policy, (tuple, list, set)) and policy and all(isinstance(p, type) for p in policy)
    ):
        classes = (policy,) if isinstance(policy, type) else tuple(policy)
        if isinstance(model, classes):
            raise UserError(
                f"the wrap policy matches the model itself ({type(model).__name__}), so every parameter is "
                "in one unit gathered at once: name the classes of its blocks instead"
            )
        return [m for m in model.modules() if m is not model and isinstance(m, classes)]
    if callable(policy) and not isinstance(policy, nn.Module):
        return [m for m in model.modules() if m is not model and policy(m)]
    modules = list(policy)
    inside = {id(m) for m in model.modules()}
    for module in modules:
        if not isinstance(module, nn.Module) or id(module) not in inside:
            raise UserError(f"wrap policy entry {module!r} is not a submodule of the model")
    wanted = {id(m) for m in modules if m is not model}
    return [m for m in model.modules() if id(m) in wanted]


def describe_policy(policy: WrapPolicy) -> str:
    if isinstance(policy, int):
        return f"min_num_params={policy}"
    if isinstance(policy, type):
        return policy.__name__
    if callable(policy) and not isinstance(policy, nn.Module):
        return f"function {getattr(policy, '__name__', 'policy')}"
    return "[" + ", ".join(p.__name__ if isinstance(p, type) else type(p).__name__ for p in policy) + "]"


def check_units(model: nn.Module, units: list[nn.Module], policy: WrapPolicy) -> None:
    """Refuse a policy that wraps nothing (one unit: no saving) or everything (even submodules like ReLU)."""
    with_params = [u for u in units if any(True for _ in u.parameters())]
    if policy is not None and not with_params:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise UserError(
            f"the wrap policy {describe_policy(policy)} wraps no submodule with parameters, so the whole "
            "model would be one unit, gathered whole at once (no memory saved over SHARD_GRAD_OP): choose "
            f"among the model's classes {classes} or lower the parameter threshold"
        )
    submodules = [m for m in model.modules() if m is not model]
    empty = [type(u).__name__ for u in units if not any(True for _ in u.parameters())]
    if len(submodules) > 1 and len(units) == len(submodules) and empty:
        raise UserError(
            f"the wrap policy {describe_policy(policy)} wraps every one of the {len(submodules)} submodules, "
            f"even {len(empty)} without parameters (such as {empty[0]}): name the classes of the blocks to "
            "shard, e.g. auto_wrap_policy={nn.Linear} or a transformer block class"
        )


def check_options(sharding_strategy: str, cpu_offload: str, mixed_precision: MixedPrecision) -> None:
    check_choice("sharding strategy", sharding_strategy, SHARDING_STRATEGIES)
    check_choice("cpu_offload", cpu_offload, OFFLOAD_MODES)
    for role in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(mixed_precision, role)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise UserError(
                f"MixedPrecision({role}={dtype!r}): use a floating-point torch dtype such as torch.bfloat16"
            )
    if mixed_precision.gather_dtype not in (None, torch.float8_e4m3fn):
        raise UserError(
            f"MixedPrecision(gather_dtype={mixed_precision.gather_dtype!r}): the parameters travel in "
            "param_dtype (None) or as float8 (torch.float8_e4m3fn)"
        )


@dataclass
class ShardGroups:
    """Which ranks hold different shards of a unit, and which hold copies of the same shard."""

    sharding_strategy: str
    state_mesh: object  # a DeviceMesh whose last dimension is the shard group (for DCP's DTensors)
    shard_group: object  # ranks that hold different shards
    replicate_group: object | None  # ranks that hold the same shard (HYBRID_SHARD, NO_SHARD), or None
    # the groups over which the model must start equal (None: the whole world, in one step)
    start_groups: tuple = (None,)


def hybrid_shard_group_size(hybrid_shard_size: int | None, world_size: int, ranks_per_node: int) -> int:
    """The ranks of one HYBRID_SHARD shard group: ``hybrid_shard_size``, by default a node's ranks.

    The groups must cut the ranks evenly: checked here, before any process waits (the training
    command calls this from its configuration check, so ``--dry-run`` refuses it too).

    Args:
        hybrid_shard_size: the size asked for (None: ``ranks_per_node``).
        world_size: all the ranks.
        ranks_per_node: the ranks on one node (LOCAL_WORLD_SIZE).
    """
    shard_size = hybrid_shard_size or ranks_per_node
    if world_size % shard_size:
        sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
        asked = "" if hybrid_shard_size else f" (the ranks of one node, {ranks_per_node}, by default)"
        raise UserError(
            f"HYBRID_SHARD needs a shard group size that divides the {world_size} ranks, got {shard_size}"
            f"{asked}: pass --hybrid-shard-size (hybrid_shard_size) among {sizes}"
        )
    return shard_size


def shard_groups(
    sharding_strategy: str | None, hybrid_shard_size: int | None, group, mesh, device_type: str
) -> ShardGroups:
    """Where the shards live: the whole world, a process group, or a 1-D or 2-D device mesh.

    - no ``group`` and no ``mesh``: every rank. FULL_SHARD and SHARD_GRAD_OP shard over all of
      them, NO_SHARD replicates, HYBRID_SHARD shards inside groups of ``hybrid_shard_size``
      consecutive ranks (default: the ranks of a node) and replicates across the groups.
    - a ``group`` or a 1-D ``mesh`` (e.g. the data dimension of a data x tensor mesh): shard over
      its ranks only, so the other ranks are free for another kind of parallelism.
    - a 2-D ``mesh`` (replicate, shard), as ``init_device_mesh`` builds it: HYBRID_SHARD, like
      FSDP2's ``fully_shard(mesh=...)`` on a 2-D mesh.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is not None and mesh is not None:
        raise UserError("pass either group or mesh to FullyShardedDataParallel, not both")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise UserError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if hybrid_shard_size is not None:
        check_int("hybrid_shard_size", hybrid_shard_size, minimum=1)
    if mesh is not None and mesh.ndim == 2:
        if sharding_strategy not in (None, "HYBRID_SHARD"):
            raise UserError(
                "a 2-D mesh means HYBRID_SHARD (replicate over its first dimension, shard over its second), "
                f"not {sharding_strategy}: pass a 1-D mesh or a group to shard over one dimension"
            )
        if hybrid_shard_size is not None:
            raise UserError("hybrid_shard_size is the size of the 2-D mesh's second dimension: leave it out")
        everyone = mesh.size() == runtime.world_size()
        return ShardGroups(
            "HYBRID_SHARD",
            mesh,
            mesh.get_group(1),
            mesh.get_group(0),
            (None,) if everyone else (mesh.get_group(0), mesh.get_group(1)),
        )
    if mesh is not None and mesh.ndim != 1:
        raise UserError(
            f"FullyShardedDataParallel takes a 1-D or 2-D mesh, got {mesh.ndim} dimensions: pass the "
            "dimension to shard over, e.g. mesh['data']"
        )
    sharding_strategy = sharding_strategy or "FULL_SHARD"
    check_choice("sharding strategy", sharding_strategy, SHARDING_STRATEGIES)
    if sharding_strategy != "HYBRID_SHARD" and hybrid_shard_size is not None:
        raise UserError("hybrid_shard_size only applies to sharding_strategy='HYBRID_SHARD'")
    if mesh is not None:
        group = mesh.get_group()
    if group is not None and runtime.world_size(group=group) != runtime.world_size():
        if sharding_strategy in ("NO_SHARD", "HYBRID_SHARD"):
            raise UserError(
                f"{sharding_strategy} over a group of some ranks needs a 2-D mesh: build it on every rank "
                "with init_device_mesh(device, (replicas, shards)) and pass mesh="
            )
        ranks = dist.get_process_group_ranks(group)
        state_mesh = (
            mesh if mesh is not None else DeviceMesh.from_group(group, device_type, mesh=torch.tensor(ranks))
        )
        return ShardGroups(sharding_strategy, state_mesh, group, None, (group,))
    world = runtime.world_size()
    if sharding_strategy == "HYBRID_SHARD":
        shard_size = hybrid_shard_group_size(
            hybrid_shard_size, world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
        )
    else:
        shard_size = 1 if sharding_strategy == "NO_SHARD" else world
    # Rows are replicas, columns are shards: ranks [0, 1] share one model on a 2x2 mesh.
    state_mesh = init_device_mesh(
        device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )
    return ShardGroups(
        sharding_strategy, state_mesh, state_mesh.get_group("shard"), state_mesh.get_group("replicate")
    )


def device_for_compute(
    module: nn.Module, device: torch.device | str | None, cpu_offload: str
) -> torch.device:
    first = next(module.parameters(), None)
    device = (
        torch.device(device)
        if device is not None
        else (first.device if first is not None else torch.device("cpu"))
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        wanted = (
            f"cpu_offload={cpu_offload!r} keeps shards in CPU memory and computes on the GPU, but"
            if cpu_offload != "none"
            else "the model is meant for a GPU, but"
        )
        raise UserError(
            f"{wanted} this process sees no CUDA device: run it on a GPU node, or compute on the CPU "
            "(device='cpu'), where the parameters already live in CPU memory"
        )
    if first is not None and first.device != device:
        raise UserError(
            f"the model's parameters are on {first.device} but FSDP computes on {device}: move the model "
            f"first (model.to({str(device)!r}))"
        )
    return device
