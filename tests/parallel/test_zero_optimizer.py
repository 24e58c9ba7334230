"""ZeRO-1 as an optimizer: equal to the unsharded optimizer and to PyTorch's ZeroRedundancyOptimizer.

A model whose parameters divide by none of 2, 3 and 4, with a frozen parameter and two parameter
groups, trained under DDP for a few steps on 1 to 4 processes: the sharded optimizer, PyTorch's
``ZeroRedundancyOptimizer`` and the plain optimizer end with the same weights as one process on
the whole batch; each rank holds about 1/N of the optimizer state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel.zero_optimizer import ShardedOptimizer, partition_parameters

GLOBAL_BATCH, STEPS = 60, 3
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 31), nn.Tanh(), nn.Linear(31, 13), nn.Tanh(), nn.Linear(13, 7))
    model[2].bias.requires_grad_(False)  # a frozen parameter: no gradient, never updated
    return model


def _groups(model: nn.Module) -> list[dict]:
    """Two parameter groups: the weights decay, the biases do not (and run at half the rate)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def _batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 17, generator=generator), torch.randint(
        0, 7, (GLOBAL_BATCH,), generator=generator
    )


def _train(kind: str, optimizer_name: str):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world = runtime.rank(), runtime.world_size()
    model = _model()
    optimizer_cls, options = OPTIMIZERS[optimizer_name]
    if kind == "course":
        optimizer = ShardedOptimizer(_groups(model), optimizer_cls, **options)
    elif kind == "torch":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_cls, **options)
    else:
        optimizer = optimizer_cls(_groups(model), **options)
    wrapped = DistributedDataParallel(model) if world > 1 else model
    share = GLOBAL_BATCH // world
    with comm.CommLog() as log:
        for step in range(STEPS):
            inputs, targets = _batch(step)
            inputs, targets = (
                inputs[rank * share : (rank + 1) * share],
                targets[rank * share : (rank + 1) * share],
            )
            optimizer.zero_grad()
            F.cross_entropy(wrapped(inputs), targets).backward()
            optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = optimizer.state_bytes() if kind == "course" else None
    return weights, state, log.bytes_per_rank("all_gather")


@pytest.fixture(scope="module")
def single():
    return {name: launch(_train, 1, "plain", name)[0][0] for name in OPTIMIZERS}


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_sharded_optimizer_equals_one_process_with_groups_and_a_frozen_parameter(
    single, world_size, optimizer_name
):
    ours = launch(_train, world_size, "course", optimizer_name)
    reference = single[optimizer_name]
    torch.testing.assert_close(ours[0][0], reference, rtol=1e-5, atol=1e-6)
    for weights, _, _ in ours:  # every rank ends with the same parameters
        assert torch.equal(weights, ours[0][0])
    # each rank holds about 1/N of the state: whole parameters, so the largest share is a little over
    states = [state for _, state, _ in ours]
    unsharded = launch(_state_of_the_plain_optimizer, 1, optimizer_name)[0]
    assert sum(states) == unsharded
    assert max(states) <= unsharded / world_size + 4 * 31 * 17 * 2 + 64  # one weight matrix of slack
    # the all-gather of the updated parameters: (N-1)/N of the padded shares per rank per step
    if world_size > 1:
        sizes = [p.numel() for p in _model().parameters()]
        largest = max(sum(sizes[i] for i in share) for share in partition_parameters(sizes, world_size))
        assert ours[0][2] == STEPS * comm.ring_bytes("all_gather", 4 * largest * world_size, world_size)


def _state_of_the_plain_optimizer(optimizer_name: str) -> int:
    weights, _, _ = _train("plain", optimizer_name)
    optimizer_cls, options = OPTIMIZERS[optimizer_name]
    model = _model()
    optimizer = optimizer_cls(_groups(model), **options)
    F.cross_entropy(model(_batch(0)[0]), _batch(0)[1]).backward()
    optimizer.step()
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def _train_plain_groups(kind: str):
    """Both ZeRO optimizers on plain parameters (ZeroRedundancyOptimizer's form)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world = runtime.rank(), runtime.world_size()
    model = _model()
    if kind == "course":
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1
        )
    wrapped = DistributedDataParallel(model)
    share = GLOBAL_BATCH // world
    for step in range(STEPS):
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(
            wrapped(inputs[rank * share : (rank + 1) * share]), targets[rank * share : (rank + 1) * share]
        ).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_sharded_optimizer_equals_pytorchs_zero_redundancy_optimizer(world_size):
    ours = launch(_train_plain_groups, world_size, "course")[0]
    theirs = launch(_train_plain_groups, world_size, "torch")[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_the_greedy_partition_balances_whole_parameters():
    assert partition_parameters([10, 10, 10, 10], 2) == [[0, 2], [1, 3]]
    assert partition_parameters([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert partition_parameters([5], 3) == [[0], [], []]  # a rank may own nothing


def _mistakes():
    model = _model()
    found = {}
    for name, make in {
        "not a class": lambda: ShardedOptimizer(model.parameters(), torch.optim.AdamW(model.parameters())),
        "coupled": lambda: ShardedOptimizer(model.parameters(), torch.optim.LBFGS),
        "no params": lambda: ShardedOptimizer([], torch.optim.SGD, lr=0.1),
        "bad kwargs": lambda: ShardedOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.1, betas=(0.9, 0.99)
        ),
    }.items():
        try:
            make()
        except (UserError, ValueError) as error:
            found[name] = str(error)
    return found


def test_mistakes_are_refused_with_the_fix():
    found = launch(_mistakes, 2)[0]
    assert (
        "optimizer_cls must be a torch.optim.Optimizer class such as torch.optim.AdamW"
        in found["not a class"]
    )
    assert "LBFGS couples all the parameters" in found["coupled"]
    assert "empty parameter list" in found["no params"] or "got no parameters" in found["no params"]
    assert "SGD refused the arguments" in found["bad kwargs"]
