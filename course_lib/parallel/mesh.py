"""A grid of ranks for 4-D parallelism: data x pipeline x context x tensor.

With D-way data, P-way pipeline, C-way context and T-way tensor parallelism, the world of D·P·C·T
ranks is a grid and every rank has four coordinates. Each kind of parallelism talks along one
axis only:

- **tensor** groups (T ranks: the same layer's shards) all-reduce activations in every block,
  forward and backward: the most traffic, so their ranks are **contiguous** (ranks [0, 1]): on
  a cluster, consecutive ranks share a node and its fast links (NVLink).
- **context** groups (C ranks: the chunks of the same sequences) pass keys and values around
  a ring in every attention layer, overlapped with the attention's compute: next to tensor.
- **pipeline** groups (P ranks: one per stage) send activations point to point, once per
  micro-batch and stage boundary: little traffic, fine across nodes.
- **data** groups (D ranks holding the same shard of the same stage) all-reduce gradients once
  per step: **strided** (ranks [0, 2, 4, 6] for T = 2, P = 1 on 8 ranks). Expert parallelism
  spreads the experts of a mixture-of-experts layer over these same ranks (``group("expert")``):
  they hold different tokens, which the all-to-all deals out to the experts.

The layout (Megatron-LM's): tensor fastest, then context, then data, then pipeline,

    rank = ((pipeline · D + data) · C + context) · T + tensor.

``grid_groups`` computes every group as lists of ranks (pure: it can be printed and tested
without processes); ``Mesh`` creates them as process groups, through PyTorch's ``DeviceMesh``
with the same layout, and tells each rank its coordinates.

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), section 3: why tensor parallelism stays inside a node
and how the three degrees combine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

from ..checks import check_choice, check_group
from ..distributed import runtime
from ..errors import UserError

AXES = ("pipeline", "data", "context", "tensor")  # slowest to fastest


def check_degrees(
    world_size: int, *, data: int = 1, pipeline: int = 1, context: int = 1, tensor: int = 1
) -> None:
    degrees = {"data": data, "pipeline": pipeline, "context": context, "tensor": tensor}
    for name, degree in degrees.items():
        if isinstance(degree, bool) or not isinstance(degree, int):
            raise UserError(f"the {name} degree must be a whole number, got {degree!r}")
        if degree < 1:
            raise UserError(f"the {name} degree must be at least 1, got {degree}")
    product = data * pipeline * context * tensor
    if product != world_size:
        shown = " x ".join(
            f"{name} {degree}" for name, degree in degrees.items() if degree > 1 or name != "context"
        )
        raise UserError(
            f"{shown} = {product} ranks, but {world_size} were started: start {product} processes, or choose "
            f"degrees whose product is {world_size}"
        )


def rank_at(
    degrees: dict[str, int], *, pipeline: int = 0, data: int = 0, context: int = 0, tensor: int = 0
) -> int:
    """The rank at these coordinates of a grid of ``degrees`` (``{"data": D, "pipeline": P, ...}``)."""
    full = {"data": 1, "context": 1, "tensor": 1} | degrees
    return ((pipeline * full["data"] + data) * full["context"] + context) * full["tensor"] + tensor


def _coordinates(degrees: dict[str, int]) -> list[dict[str, int]]:
    ranges = [range(degrees[axis]) for axis in AXES]
    return [dict(zip(AXES, point, strict=True)) for point in itertools.product(*ranges)]


def grid_groups(
    world_size: int, *, data: int = 1, pipeline: int = 1, context: int = 1, tensor: int = 1
) -> dict[str, list[list[int]]]:
    """Every group of ranks along each axis, e.g. {"tensor": [[0, 1], [2, 3]], ...}.

    Args:
        world_size: the number of ranks; must equal ``data * pipeline * context * tensor``.
        data: D, the replicas that split the batch (and share the experts).
        pipeline: P, the stages the layers are cut into.
        context: C, the ranks each sequence is split over (ring attention).
        tensor: T, the ranks each layer's matrices are split over.
    """
    check_degrees(world_size, data=data, pipeline=pipeline, context=context, tensor=tensor)
    degrees = {"data": data, "pipeline": pipeline, "context": context, "tensor": tensor}
    groups = {}
    for axis in AXES:
        found: dict[tuple, list[int]] = {}
        for point in _coordinates(degrees):
            others = tuple(value for name, value in point.items() if name != axis)
            found.setdefault(others, []).append(rank_at(degrees, **point))
        groups[axis] = list(found.values())
    return groups


def describe_grid(
    world_size: int, *, data: int = 1, pipeline: int = 1, context: int = 1, tensor: int = 1
) -> str:
    """A printout of the layout: each rank's coordinates and every group (context only if C > 1).

    Args:
        world_size: the number of ranks; must equal ``data * pipeline * context * tensor``.
        data: D, the replicas that split the batch.
        pipeline: P, the stages the layers are cut into.
        context: C, the ranks each sequence is split over.
        tensor: T, the ranks each layer's matrices are split over.
    """
    degrees = {"data": data, "pipeline": pipeline, "context": context, "tensor": tensor}
    groups = grid_groups(world_size, **degrees)
    shown = [axis for axis in AXES if axis != "context" or context > 1]
    lines = [
        f"{world_size} ranks = "
        + " x ".join(
            f"{axis} {degrees[axis]}" for axis in ("data", "pipeline", "context", "tensor") if axis in shown
        ),
        "rank  " + "  ".join(shown),
    ]
    for point in _coordinates(degrees):
        cells = [f"{point[axis]:>{len(axis)}}" for axis in shown]
        lines.append(f"{rank_at(degrees, **point):>4}  " + "  ".join(cells))
    for axis in ("tensor", "context", "data", "pipeline"):
        if axis in shown:
            lines.append(f"{axis + ' groups:':<17}" + " ".join(str(group) for group in groups[axis]))
    return "\n".join(lines)


@dataclass(frozen=True)
class Coordinates:
    pipeline: int
    data: int
    context: int
    tensor: int


class Mesh:
    """This rank's place on the grid, and the process groups along each axis.

    Every rank must create the same Mesh (creating groups is collective); the degrees are checked
    against the world size first, so a mistake is an error on every rank, before anyone waits.

    Args:
        data: D, the replicas that split the batch (the expert-parallel group too).
        pipeline: P, the stages the layers are cut into.
        context: C, the ranks each sequence is split over.
        tensor: T, the ranks each layer's matrices are split over.
        device_type: ``"cpu"`` or ``"cuda"`` (default: ``"cuda"`` under NCCL, else ``"cpu"``).
    """

    def __init__(
        self,
        *,
        data: int = 1,
        pipeline: int = 1,
        context: int = 1,
        tensor: int = 1,
        device_type: str | None = None,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        check_group("Mesh", None)
        if device_type is not None:
            check_choice("device_type", device_type, ("cpu", "cuda"))
        world = runtime.world_size()
        check_degrees(world, data=data, pipeline=pipeline, context=context, tensor=tensor)
        self.degrees = {"data": data, "pipeline": pipeline, "context": context, "tensor": tensor}
        device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        # DeviceMesh lays ranks out row-major over (pipeline, data, context, tensor): the layout above.
        shape = tuple(self.degrees[axis] for axis in AXES)
        self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        self.coordinates = Coordinates(*(self.device_mesh.get_local_rank(axis) for axis in AXES))
        self.groups = {axis: self.device_mesh.get_group(axis) for axis in AXES}
        self.groups["expert"] = self.groups["data"]  # experts are spread over the data replicas

    @classmethod
    def from_layout(cls, layout, *, device_type: str | None = None) -> Mesh:
        """The mesh of a layout's degrees (a ``plan.layout.Layout``: anything with ``degree(axis)``).

        Args:
            layout: the layout whose data, pipeline, context and tensor degrees the mesh takes.
            device_type: ``"cpu"`` or ``"cuda"`` (default: ``"cuda"`` under NCCL, else ``"cpu"``).
        """
        return cls(**{axis: layout.degree(axis) for axis in AXES}, device_type=device_type)

    def group(self, axis: str):
        """The process group along ``axis``: ``"data"``, ``"pipeline"``, ``"context"``, ``"tensor"`` or
        ``"expert"`` (the data group)."""
        check_choice("axis", axis, (*AXES, "expert"))
        return self.groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``."""
        return dist.get_process_group_ranks(self.group(axis))

    def describe(self) -> str:
        return describe_grid(runtime.world_size(), **self.degrees)
