"""The course's DDP equals PyTorch's DDP and a single process on the whole global batch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel.ddp import DataParallel, make_buckets
from course_lib.tools import bench

from conftest import run_bench, run_ranks

GLOBAL_BATCH, STEPS = 60, 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _global_batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=generator), torch.randint(
        0, 10, (GLOBAL_BATCH,), generator=generator
    )


def _train(kind: str, sync: str = "overlapped", bucket_mb: float = 0.05, accumulate: int = 1):
    """k SGD-with-momentum steps; each rank computes on its interleaved slice of every global batch."""
    n, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    model = models.build_model("digits_cnn")
    if kind == "course":
        model = DataParallel(model, bucket_mb=bucket_mb, sync=sync)
    elif kind == "torch":
        model = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with comm.CommLog() as log:
        for step in range(STEPS):
            inputs, targets = _global_batch(step)
            if kind != "single":
                inputs, targets = inputs[rank::n], targets[rank::n]
            optimizer.zero_grad()
            micro_inputs, micro_targets = inputs.chunk(accumulate), targets.chunk(accumulate)
            for micro in range(accumulate):

                def backward():
                    loss = F.cross_entropy(model(micro_inputs[micro]), micro_targets[micro]) / accumulate
                    loss.backward()

                if micro < accumulate - 1 and kind != "single":
                    with model.no_sync():
                        backward()
                else:
                    backward()
            optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, log.count("all_reduce"), log.bytes_per_rank("all_reduce")


@pytest.fixture(scope="module")
def single():
    return launch(_train, 1, "single")[0][0]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("sync", ["naive", "bucketed", "overlapped"])
def test_course_ddp_equals_torch_ddp_and_a_single_process(world_size, sync, single):
    ours = launch(_train, world_size, "course", sync)
    theirs = launch(_train, world_size, "torch")
    for rank in range(world_size):
        torch.testing.assert_close(ours[rank][0], ours[0][0], rtol=0, atol=0)  # replicas stay identical
    torch.testing.assert_close(ours[0][0], theirs[0][0], **TOLERANCE)
    torch.testing.assert_close(ours[0][0], single, **TOLERANCE)


# 60 / N samples per rank must split into 4 equal micro-batches
@pytest.mark.parametrize("world_size", [1, 3])
def test_no_sync_accumulation_equals_one_step_on_the_whole_batch(world_size, single):
    flat, all_reduces, _ = launch(_train, world_size, "course", "overlapped", 0.05, 4)[0]
    torch.testing.assert_close(flat, single, **TOLERANCE)
    buckets = len(make_buckets(list(models.build_model("digits_cnn").parameters()), 0.05))
    assert all_reduces == STEPS * buckets  # only the last micro-step of each step communicated


def test_bucket_size_changes_only_the_number_of_all_reduces():
    params = list(models.build_model("digits_cnn").parameters())
    results = {}
    for bucket_mb in (0.001, 0.05, 25):
        flat, calls, sent = launch(_train, 2, "course", "overlapped", bucket_mb)[0]
        results[bucket_mb] = (flat, calls, sent)
        assert calls == STEPS * len(make_buckets(params, bucket_mb))
    # 8 tensors, closed into a bucket once it reaches the cap: at 1 KB a weight closes each bucket
    assert [results[b][1] // STEPS for b in (0.001, 0.05, 25)] == [4, 2, 1]
    for bucket_mb in (0.001, 25):
        assert torch.equal(results[bucket_mb][0], results[0.05][0])
        assert results[bucket_mb][2] == results[0.05][2]  # the same bytes, in fewer or more messages
    gradient_bytes = 4 * sum(p.numel() for p in params)
    assert results[25][2] == STEPS * comm.ring_bytes("all_reduce", gradient_bytes, 2)


def test_buckets_follow_reverse_definition_order_and_close_once_they_reach_the_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 300_000, 20, 30, 5)]
    buckets = make_buckets(params, 1.0)  # 1 MB = 262,144 floats
    assert [[p.numel() for p in bucket] for bucket in buckets] == [[5, 30, 20, 300_000], [10]]
    first_small = make_buckets(params, 1.0, first_bucket_mb=1e-4)  # 104 bytes: the first closes at 35 floats
    assert [[p.numel() for p in bucket] for bucket in first_small] == [[5, 30], [20, 300_000], [10]]


def _torch_buckets_reduced(model_name: str, bucket_mb: float | None) -> int:
    torch.manual_seed(0)
    model, batch = _BUCKET_MODELS[model_name]()
    wrapped = (
        DistributedDataParallel(model)
        if bucket_mb is None
        else DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    )
    for _ in range(3):  # the first step reduces one bucket of everything; then PyTorch rebuilds them
        wrapped(batch).float().sum().backward()
    return wrapped._get_ddp_logging_data()["num_buckets_reduced"]


def _course_buckets_reduced(model_name: str, bucket_mb: float | None) -> int:
    torch.manual_seed(0)
    model, batch = _BUCKET_MODELS[model_name]()
    wrapped = DataParallel(model, bucket_mb=bucket_mb)
    with comm.CommLog() as log:
        wrapped(batch).float().sum().backward()
    return log.count("all_reduce")


def _many_small_tensors():
    layers = [
        m for _ in range(40) for m in (nn.Linear(16, 16), nn.LayerNorm(16))
    ]  # 160 tensors of 64 B to 1 KB
    return nn.Sequential(*layers), torch.randn(8, 16)


_BUCKET_MODELS = {
    "bench MLP": lambda: (
        nn.Sequential(*[nn.Linear(bench.MLP_WIDTH, bench.MLP_WIDTH) for _ in range(bench.MLP_LAYERS)]),
        torch.randn(4, bench.MLP_WIDTH),
    ),
    "many small tensors": _many_small_tensors,
    "digits CNN": lambda: (models.build_model("digits_cnn"), torch.randn(6, 1, 8, 8)),
}


@pytest.mark.parametrize(
    "model_name, bucket_mb",
    [
        ("bench MLP", 4.0),
        ("bench MLP", None),  # PyTorch's defaults: a first bucket of 1 MB, then 25 MB
        ("many small tensors", 0.002),
        ("many small tensors", None),
        ("digits CNN", 0.05),
    ],
)
def test_the_course_reduces_as_many_buckets_as_pytorchs_ddp(model_name, bucket_mb):
    theirs = launch(_torch_buckets_reduced, 2, model_name, bucket_mb)[0]
    ours = launch(_course_buckets_reduced, 2, model_name, bucket_mb)[0]
    assert ours == theirs, f"{model_name}, bucket_mb={bucket_mb}: course {ours}, PyTorch {theirs}"


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.skipped = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x) if self.training else self.skipped(x)


def _unused_parameters(kind: str, find_unused: bool):
    torch.manual_seed(0)
    model = _TwoBranches()
    if kind == "course":
        model = DataParallel(model, find_unused_parameters=find_unused)
    else:
        model = DistributedDataParallel(model, find_unused_parameters=find_unused)
    x = torch.randn(5, 4) + runtime.rank()
    try:
        model(x).sum().backward()
    except UserError as error:
        return str(error)
    module = model.module
    return module.used.weight.grad.clone(), module.skipped.weight.grad


def test_unused_parameters_need_the_flag_and_then_match_torch():
    message = launch(_unused_parameters, 2, "course", False)[0]
    assert "['skipped.weight', 'skipped.bias'] received no gradient" in message
    assert "pass find_unused_parameters=True" in message
    ours, theirs = (
        launch(_unused_parameters, 2, "course", True)[0],
        launch(_unused_parameters, 2, "torch", True)[0],
    )
    torch.testing.assert_close(ours[0], theirs[0])
    assert ours[1] is None and theirs[1] is None  # unused on every rank: no gradient at all


class _SometimesSkipped(nn.Module):
    """A branch used in every second step only: its parameters get no gradient in the others."""

    def __init__(self):
        super().__init__()
        self.always, self.sometimes = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x, step: int):
        out = self.always(x)
        return out + self.sometimes(x) if step % 2 == 0 else out


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _skipped_branch_training(kind: str, find_unused: bool, steps: int = 4):
    """SGD with the gradients kept between steps (``zero_grad(set_to_none=False)``), as many
    training loops do: the skipped branch's gradients are zeros, not None."""
    torch.manual_seed(0)
    model = _SometimesSkipped()
    wrapper = DataParallel if kind == "course" else DistributedDataParallel
    ddp = wrapper(model, find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        try:
            ddp(_batch(step, runtime.rank()), step).sum().backward()
        except UserError as error:
            return str(error)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _one_process_reference(world: int = 2, steps: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _SometimesSkipped()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        (sum(model(_batch(step, rank), step).sum() for rank in range(world)) / world).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_branch_skipped_in_some_steps_trains_as_pytorchs_ddp_and_one_process():
    """Kept zero gradients used to hide the skipped branch from the check, and the bucket that
    never filled ended in ``'NoneType' object has no attribute 'wait'``."""
    message = launch(_skipped_branch_training, 2, "course", False)[0]
    assert "['sometimes.weight', 'sometimes.bias'] received no gradient" in message
    assert "pass find_unused_parameters=True" in message
    ours = launch(_skipped_branch_training, 2, "course", True)[0]
    theirs = launch(_skipped_branch_training, 2, "torch", True)[0]
    reference = _one_process_reference()
    for name in reference:
        torch.testing.assert_close(ours[name], theirs[name])
        torch.testing.assert_close(ours[name], reference[name])


def _misuses():
    errors = {}
    model = models.build_model("digits_cnn")
    if runtime.rank() == 1:
        model[3] = nn.Linear(63, 11)  # a different head on one rank
    try:
        DataParallel(model)
    except UserError as error:
        errors["shapes"] = str(error)
    try:
        DataParallel(models.build_model("digits_cnn"), bucket_mb=0)
    except UserError as error:
        errors["bucket"] = str(error)
    ddp = DataParallel(models.build_model("digits_cnn"))
    with ddp.no_sync():
        loss = ddp(torch.randn(2, 1, 8, 8)).sum()
    try:
        loss.backward()  # forward inside no_sync, backward outside
    except UserError as error:
        errors["no_sync"] = str(error)
    comm.barrier()  # every rank got here: nobody hangs
    return errors


def test_misuse_gets_clear_errors_and_no_hang():
    errors = launch(_misuses, 2, timeout_s=60)
    assert errors[0] == errors[1]  # all ranks raise the same error
    assert (
        "parameter '3.weight' has shape (10, 63) float32 on rank 0 but shape (11, 63) float32 on rank 1"
        in errors[0]["shapes"]
    )
    assert "every rank must build the same model" in errors[0]["shapes"]
    assert (
        "bucket_mb (the size of one all-reduce message, in MB) must be a finite number above 0"
        in errors[0]["bucket"]
    )
    assert "keep the forward and the backward of a micro-step inside the same" in errors[0]["no_sync"]


def test_harness_course_impl_gives_the_same_metrics_as_torch(tmp_path, quick_args):
    metrics = {}
    for impl in ("torch", "course"):
        path = tmp_path / f"{impl}.jsonl"
        outcomes = run_ranks(
            [*quick_args, "--sharding", "ddp", "--impl", impl, "--max-steps", "5", "--metrics", str(path)],
            nprocs=2,
        )
        assert [o.returncode for o in outcomes] == [0, 0], outcomes[0].stderr
        metrics[impl] = json.loads(path.read_text().splitlines()[-1])
    assert metrics["course"]["impl"] == "course"
    for key in ("train_loss", "val_loss"):
        assert metrics["course"][key] == pytest.approx(metrics["torch"][key], rel=1e-5)
    assert metrics["course"]["val_acc"] == metrics["torch"]["val_acc"]


@pytest.mark.timing
def test_benchmark_command_prints_the_promised_json():
    result = run_bench(
        "ddp", "--width", "64", "--layers", "3", "--steps", "2", "--warmup", "1", "--world-size", "3"
    )
    for key in (
        "world_size",
        "params",
        "torch_step_ms",
        "course_step_ms",
        "naive_step_ms",
        "bucketed_step_ms",
        "ratio",
        "bytes_per_rank_measured",
        "bytes_per_rank_theory",
    ):
        assert key in result
    assert result["world_size"] == 3 and result["params"] == 3 * 65 * 64
    assert (
        result["bytes_per_rank_measured"]
        == result["bytes_per_rank_theory"]
        == 2 * 2 / 3 * 4 * result["params"]
    )


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("counter", torch.zeros(4))

    def forward(self, x):
        self.counter += runtime.rank() + 1  # drifts differently on every rank
        return self.linear(x)


def _buffers_and_parameters(broadcast_buffers: bool):
    torch.manual_seed(runtime.rank())  # different initial weights on every rank
    model = _WithBuffer()
    model.counter.fill_(10.0 * runtime.rank())
    wrapped = DataParallel(model, broadcast_buffers=broadcast_buffers)
    after_wrap = (model.linear.weight.detach().clone(), model.counter.clone())
    wrapped(torch.randn(2, 3))
    wrapped(torch.randn(2, 3))
    return after_wrap, model.counter.clone()


def test_wrap_broadcasts_rank_zero_state_and_buffers_follow_rank_zero_each_step():
    ranks = launch(_buffers_and_parameters, 3, True)
    for (weight, counter), _ in ranks:
        torch.testing.assert_close(weight, ranks[0][0][0], rtol=0, atol=0)
        assert counter.tolist() == [0.0] * 4
    # each forward first copies rank 0's buffers, then the rank adds its own increment once more
    assert [ranks[r][1].tolist()[0] for r in range(3)] == [2.0, 3.0, 4.0]
    drifting = launch(_buffers_and_parameters, 3, False)
    assert [drifting[r][1].tolist()[0] for r in range(3)] == [2.0, 4.0, 6.0]
