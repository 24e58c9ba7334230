"""The classes a student calls refuse bad arguments on every rank alike, before any collective.

Each case runs on 2 and 3 real processes (``launch`` on gloo). Every rank makes the same bad
call and catches what it raises: the test then sees, per rank, the message, or the fact that the
call went through. Every rank must report the same ``UserError``: had one rank gone on into a
collective, the others would have left it waiting and ``launch`` would time out instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import models
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import ddp, fsdp, mesh, pipeline, tensor, zero


def _odd_model() -> nn.Module:
    # 58 parameters: divides by neither 2 nor 3
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def _stage_of_this_rank() -> dict[int, nn.Module]:
    return {dist.get_rank(): nn.Linear(4, 4)}


CASES = {
    "DataParallel of a tensor": (
        lambda: ddp.DataParallel(torch.zeros(3)),
        "module must be a torch.nn.Module, got Tensor",
    ),
    "DataParallel bucket_mb nan": (
        lambda: ddp.DataParallel(_odd_model(), bucket_mb=float("nan")),
        "bucket_mb (the size of one all-reduce message, in MB) must be a finite number above 0, got nan",
    ),
    "DataParallel bucket_mb 0": (
        lambda: ddp.DataParallel(_odd_model(), bucket_mb=0),
        "must be a finite number above 0, got 0",
    ),
    "DataParallel sync": (
        lambda: ddp.DataParallel(_odd_model(), sync="fast"),
        "unknown sync 'fast': choose one of naive, bucketed, overlapped",
    ),
    "DataParallel group": (
        lambda: ddp.DataParallel(_odd_model(), group="all"),
        "group must be a process group (dist.new_group, or mesh.get_group()), got str",
    ),
    "ZeroDataParallel stage 3": (
        lambda: zero.ZeroDataParallel(_odd_model(), stage=3),
        "ZeroDataParallel does stage 1 or 2, not 3",
    ),
    "ZeroDataParallel of parameters": (
        lambda: zero.ZeroDataParallel(list(_odd_model().parameters())),
        "module must be a torch.nn.Module, got list",
    ),
    "FSDP of a function": (lambda: fsdp.FullyShardedDataParallel(print), "module must be a torch.nn.Module"),
    "FSDP strategy": (
        lambda: fsdp.FullyShardedDataParallel(_odd_model(), sharding_strategy="FULL"),
        "unknown sharding strategy 'FULL'",
    ),
    "FSDP hybrid size 0": (
        lambda: fsdp.FullyShardedDataParallel(
            _odd_model(), sharding_strategy="HYBRID_SHARD", hybrid_shard_size=0
        ),
        "hybrid_shard_size must be a whole number, 1 or more, got 0",
    ),
    "FSDP mixed precision": (
        lambda: fsdp.FullyShardedDataParallel(_odd_model(), mixed_precision="bf16"),
        "mixed_precision must be a fsdp.MixedPrecision(...), got str",
    ),
    "Pipeline no stages": (
        lambda: pipeline.PipelineExecutor({}, 2, "gpipe", 4, models.lm_loss, (2, 4)),
        "stages must be a non-empty dict {stage index: module}",
    ),
    "Pipeline micro-batches": (
        lambda: pipeline.PipelineExecutor(
            _stage_of_this_rank(), dist.get_world_size(), "gpipe", 0, models.lm_loss, (2, 4)
        ),
        "microbatches must be a whole number, 1 or more, got 0",
    ),
    "Pipeline loss": (
        lambda: pipeline.PipelineExecutor(
            _stage_of_this_rank(), dist.get_world_size(), "1f1b", 4, "mse", (2, 4)
        ),
        "loss_fn must be a function (outputs, targets) -> loss, got str",
    ),
    "Pipeline shape": (
        lambda: pipeline.PipelineExecutor(
            _stage_of_this_rank(), dist.get_world_size(), "1f1b", 4, models.lm_loss, (2, 0)
        ),
        "boundary_shape must be positive whole numbers",
    ),
    "Pipeline schedule": (
        lambda: pipeline.PipelineExecutor(
            _stage_of_this_rank(), dist.get_world_size(), "2f2b", 4, models.lm_loss, (2, 4)
        ),
        "unknown schedule '2f2b'",
    ),
    "Column features": (
        lambda: tensor.ColumnParallelLinear(6, 35),
        "output features 35 does not divide by the tensor-parallel degree",
    ),
    "Column zero": (
        lambda: tensor.ColumnParallelLinear(6, 0),
        "output features must be a whole number, 1 or more",
    ),
    "Row features": (lambda: tensor.RowParallelLinear(35, 6), "input features 35 does not divide"),
    "parallel_mlp of a Linear": (
        lambda: tensor.parallel_mlp(nn.Linear(4, 4)),
        "mlp.fc1 must be an nn.Linear",
    ),
    "parallel_attention heads": (
        lambda: tensor.parallel_attention(models.SelfAttention(35, 35), 35),
        "attention heads 35 does not divide",
    ),
    "Mesh product": (lambda: mesh.Mesh(data=2, tensor=2), "data 2 x pipeline 1 x tensor 2 = 4 ranks, but"),
    "Mesh fraction": (lambda: mesh.Mesh(data=1.5), "the data degree must be a whole number, got 1.5"),
    "Mesh device": (
        lambda: mesh.Mesh(data=dist.get_world_size(), device_type="tpu"),
        "unknown device_type 'tpu': choose one of cpu, cuda",
    ),
}


def _every_case() -> dict[str, str | None]:
    """Run each bad call on this rank; what it raised (None: it went through)."""
    seen = {}
    for name, (call, _) in CASES.items():
        try:
            call()
            seen[name] = None
        except UserError as error:
            seen[name] = str(error)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [2, 3])
def test_bad_arguments_raise_the_same_error_on_every_rank(nprocs):
    per_rank = launch(_every_case, nprocs, timeout_s=120)
    for name, (_, message) in CASES.items():
        seen = [ranks_view[name] for ranks_view in per_rank]
        assert all(text is not None and message in text for text in seen), f"{name}: {seen}"
        assert len(set(seen)) == 1, f"{name}: the ranks disagree: {seen}"


def _group_without_the_last_rank() -> str | None:
    group = dist.new_group(list(range(dist.get_world_size() - 1)))  # every rank takes part in creating it
    try:
        ddp.DataParallel(_odd_model(), group=group)
        return None
    except UserError as error:
        return str(error)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_group_that_does_not_hold_this_rank_is_named(nprocs):
    *members, outsider = launch(_group_without_the_last_rank, nprocs, timeout_s=60)
    assert members == [None] * (nprocs - 1)  # the group's own ranks wrap their model
    assert f"group does not contain this rank (global rank {nprocs - 1})" in outsider


def test_wrapping_before_the_processes_meet_says_how_to_start_them():
    with pytest.raises(UserError, match=r"call course_lib.distributed.runtime.init\(\) first"):
        ddp.DataParallel(_odd_model())
