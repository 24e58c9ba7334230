"""FSDP on one dimension of a mesh, tensor parallelism on the other: the pieces compose.

On a 2 x 2 grid (``Mesh(data=2, tensor=2)``), the course's FSDP shards over the data groups
([0, 2] and [1, 3]) while the course's tensor parallelism splits every block over the tensor groups
([0, 1] and [2, 3]). The transformer must train exactly like one process, and like PyTorch's own
composition of the same two ideas: FSDP2 (``fully_shard``) over the data dimension of the same
DeviceMesh and DTensor's ``parallelize_module`` over its tensor dimension.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import tensor as tp
from course_lib.parallel.fsdp import FullyShardedDataParallel
from course_lib.parallel.mesh import Mesh

STEPS, GLOBAL_BATCH, SEQ = 5, 12, 16
TOLERANCE = dict(rel=2e-5)


def _batch_indices(step: int, size: int) -> torch.Tensor:
    return torch.randperm(size, generator=torch.Generator().manual_seed(step))[:GLOBAL_BATCH]


def _dtensor_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.q": ColwiseParallel(),
        "attention.k": ColwiseParallel(),
        "attention.v": ColwiseParallel(),
        "attention.out": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }


def _train(kind: str, prefetch: bool = True) -> list[float]:
    """The loss of every step, averaged over the data replicas: ``single``, ``course`` or ``torch``."""
    inputs, targets, vocabulary = data.zen_windows(seq_len=SEQ)
    torch.manual_seed(0)
    model = models.TinyTransformer(len(vocabulary), d_model=32, n_heads=4, n_layers=2, max_seq_len=SEQ)
    data_rank, data_group = 0, None
    if kind != "single":
        grid = Mesh(data=2, tensor=2)
        data_rank, data_group = grid.coordinates.data, grid.group("data")
    if kind == "course":
        tp.apply_tensor_parallel(model, grid.group("tensor"))
        model = FullyShardedDataParallel(
            model,
            group=data_group,
            auto_wrap_policy=models.Block,
            forward_prefetch=prefetch,
            backward_prefetch=prefetch,
        )
    elif kind == "torch":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        blocks = [m for m in model if isinstance(m, models.Block)]
        for block in blocks:
            parallelize_module(block, grid.device_mesh["tensor"], _dtensor_plan())
            fully_shard(block, mesh=grid.device_mesh["data"])
        fully_shard(model, mesh=grid.device_mesh["data"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        batch = _batch_indices(step, len(inputs))
        mine = batch if kind == "single" else batch[data_rank::2]  # this replica's half of the global batch
        optimizer.zero_grad()
        loss = models.lm_loss(model(inputs[mine]), targets[mine])
        loss.backward()
        optimizer.step()
        report = loss.detach().reshape(1).clone()
        if data_group is not None:
            comm.all_reduce(report, op="mean", group=data_group)
        losses.append(float(report))
    return losses


@pytest.fixture(scope="module")
def one_process():
    return launch(_train, 1, "single")[0]


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no prefetch"])
def test_course_fsdp_over_data_and_tensor_parallel_over_tensor_train_like_one_process(one_process, prefetch):
    ranks = launch(_train, 4, "course", prefetch)
    for losses in ranks:  # every rank saw the same averaged loss
        assert losses == pytest.approx(ranks[0], rel=1e-6)
    assert ranks[0] == pytest.approx(one_process, **TOLERANCE)
    assert ranks[0][-1] < ranks[0][0]  # and it learns


@pytest.mark.slow
def test_course_composition_equals_fsdp2_with_dtensor_on_the_same_mesh(one_process):
    ours = launch(_train, 4, "course")[0]
    theirs = launch(_train, 4, "torch")[0]
    assert theirs == pytest.approx(one_process, **TOLERANCE)
    assert ours == pytest.approx(theirs, **TOLERANCE)


def _shard_counts() -> tuple[int, int, int]:
    """How many elements of the root unit this rank holds, sharded over the data group only."""
    grid = Mesh(data=2, tensor=2)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(torch.nn.Linear(7, 5), group=grid.group("data"))  # 40 elements, 2 shards
    flat = model.flat_params[0]
    return flat.group_size, flat.shard_numel, runtime.rank(group=grid.group("data"))


def test_fsdp_on_a_group_shards_over_that_group_only():
    for rank, (group_size, shard_numel, data_rank) in enumerate(launch(_shard_counts, 4)):
        assert (group_size, shard_numel) == (2, 20)
        assert data_rank == rank // 2  # data groups are [0, 2] and [1, 3]


def _mistakes() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    grid = Mesh(data=2, tensor=2)
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    found = {}
    cases = {
        "both": dict(group=grid.group("data"), mesh=square),
        "no shard on a group": dict(group=grid.group("data"), sharding_strategy="NO_SHARD"),
        "full shard on a 2-D mesh": dict(mesh=square, sharding_strategy="FULL_SHARD"),
        "the whole grid": dict(mesh=grid.device_mesh),
        "not a mesh": dict(mesh="data"),
    }
    for name, options in cases.items():
        try:
            FullyShardedDataParallel(torch.nn.Linear(3, 3), **options)
            found[name] = "no error"
        except UserError as error:
            found[name] = str(error)
    return found


def test_a_wrong_group_or_mesh_is_refused_with_the_fix():
    for found in launch(_mistakes, 4):
        assert found["both"].startswith("pass either group or mesh")
        assert "needs a 2-D mesh" in found["no shard on a group"]
        assert "a 2-D mesh means HYBRID_SHARD" in found["full shard on a 2-D mesh"]
        # the grid has four dimensions: pipeline, data, context, tensor
        assert "takes a 1-D or 2-D mesh, got 4 dimensions" in found["the whole grid"]
        assert found["not a mesh"] == "mesh must be a torch.distributed.device_mesh.DeviceMesh, got str"
