"""A grid of ranks for 3-D parallelism: data x pipeline x tensor.

With D-way data, P-way pipeline and T-way tensor parallelism, the world of D·P·T ranks is a
grid and every rank has three coordinates. Each kind of parallelism talks along one axis only:

- **tensor** groups (T ranks: the same layer's shards) all-reduce activations in every block,
  forward and backward: the most traffic, so their ranks are **contiguous** (ranks [0, 1]): on
  a cluster, consecutive ranks share a node and its fast links (NVLink).
- **pipeline** groups (P ranks: one per stage) send activations point to point, once per
  micro-batch and stage boundary: little traffic, fine across nodes.
- **data** groups (D ranks holding the same shard of the same stage) all-reduce gradients once
  per step: **strided** (ranks [0, 2, 4, 6] for T = 2, P = 1 on 8 ranks).

The layout (Megatron-LM's): tensor fastest, then data, then pipeline,

    rank = (pipeline · D + data) · T + tensor.

``grid_groups`` computes every group as lists of ranks (pure: it can be printed and tested
without processes); ``Mesh`` creates them as process groups, through PyTorch's ``DeviceMesh``
with the same layout, and tells each rank its coordinates.

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), section 3: why tensor parallelism stays inside a node
and how the three degrees combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .. import runtime
from ..checks import check_choice, check_group
from ..errors import UserError

AXES = ("pipeline", "data", "tensor")  # slowest to fastest


def check_degrees(world_size: int, *, data: int = 1, pipeline: int = 1, tensor: int = 1) -> None:
    for name, degree in (("data", data), ("pipeline", pipeline), ("tensor", tensor)):
        if isinstance(degree, bool) or not isinstance(degree, int):
            raise UserError(f"the {name} degree must be a whole number, got {degree!r}")
        if degree < 1:
            raise UserError(f"the {name} degree must be at least 1, got {degree}")
    if data * pipeline * tensor != world_size:
        raise UserError(
            f"data {data} x pipeline {pipeline} x tensor {tensor} = {data * pipeline * tensor} ranks, but "
            f"{world_size} were started: start {data * pipeline * tensor} processes, or choose degrees whose "
            f"product is {world_size}"
        )


def rank_at(pipeline: int, data: int, tensor: int, degrees: dict[str, int]) -> int:
    return (pipeline * degrees["data"] + data) * degrees["tensor"] + tensor


def grid_groups(
    world_size: int, *, data: int = 1, pipeline: int = 1, tensor: int = 1
) -> dict[str, list[list[int]]]:
    """Every group of ranks along each axis, e.g. {"tensor": [[0, 1], [2, 3]], ...}.

    Args:
        world_size: the number of ranks; must equal ``data * pipeline * tensor``.
        data: D, the replicas that split the batch.
        pipeline: P, the stages the layers are cut into.
        tensor: T, the ranks each layer's matrices are split over.
    """
    check_degrees(world_size, data=data, pipeline=pipeline, tensor=tensor)
    degrees = {"data": data, "pipeline": pipeline, "tensor": tensor}
    coordinates = [(p, d, t) for p in range(pipeline) for d in range(data) for t in range(tensor)]
    groups = {}
    for axis_index, axis in enumerate(AXES):
        found: dict[tuple, list[int]] = {}
        for coordinate in coordinates:
            others = tuple(c for i, c in enumerate(coordinate) if i != axis_index)
            found.setdefault(others, []).append(rank_at(*coordinate, degrees))
        groups[axis] = list(found.values())
    return groups


def describe_grid(world_size: int, *, data: int = 1, pipeline: int = 1, tensor: int = 1) -> str:
    """A printout of the layout: each rank's coordinates and every group.

    Args:
        world_size: the number of ranks; must equal ``data * pipeline * tensor``.
        data: D, the replicas that split the batch.
        pipeline: P, the stages the layers are cut into.
        tensor: T, the ranks each layer's matrices are split over.
    """
    groups = grid_groups(world_size, data=data, pipeline=pipeline, tensor=tensor)
    lines = [
        f"{world_size} ranks = data {data} x pipeline {pipeline} x tensor {tensor}",
        "rank  pipeline  data  tensor",
    ]
    degrees = {"data": data, "pipeline": pipeline, "tensor": tensor}
    for p in range(pipeline):
        for d in range(data):
            for t in range(tensor):
                lines.append(f"{rank_at(p, d, t, degrees):>4}  {p:>8}  {d:>4}  {t:>6}")
    for axis in ("tensor", "data", "pipeline"):
        lines.append(f"{axis + ' groups:':<17}" + " ".join(str(group) for group in groups[axis]))
    return "\n".join(lines)


@dataclass(frozen=True)
class Coordinates:
    pipeline: int
    data: int
    tensor: int


class Mesh:
    """This rank's place on the grid, and the process groups along each axis.

    Every rank must create the same Mesh (creating groups is collective); the degrees are checked
    against the world size first, so a mistake is an error on every rank, before anyone waits.

    Args:
        data: D, the replicas that split the batch.
        pipeline: P, the stages the layers are cut into.
        tensor: T, the ranks each layer's matrices are split over.
        device_type: ``"cpu"`` or ``"cuda"`` (default: ``"cuda"`` under NCCL, else ``"cpu"``).
    """

    def __init__(self, *, data: int = 1, pipeline: int = 1, tensor: int = 1, device_type: str | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        check_group("Mesh", None)
        if device_type is not None:
            check_choice("device_type", device_type, ("cpu", "cuda"))
        world = runtime.world_size()
        check_degrees(world, data=data, pipeline=pipeline, tensor=tensor)
        self.degrees = {"data": data, "pipeline": pipeline, "tensor": tensor}
        device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        # DeviceMesh lays ranks out row-major over (pipeline, data, tensor): the layout above.
        self.device_mesh = init_device_mesh(device_type, (pipeline, data, tensor), mesh_dim_names=AXES)
        self.coordinates = Coordinates(*(self.device_mesh.get_local_rank(axis) for axis in AXES))
        self.groups = {axis: self.device_mesh.get_group(axis) for axis in AXES}

    def group(self, axis: str):
        return self.groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``."""
        return dist.get_process_group_ranks(self.groups[axis])

    def describe(self) -> str:
        return describe_grid(runtime.world_size(), **self.degrees)
