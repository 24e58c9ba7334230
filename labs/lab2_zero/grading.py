"""The grading suite of lab 2: what ``python -m course_lib.tools.labs check lab2_zero`` checks.

Your ``ShardedOptimizer`` trains a model whose parameters divide by none of 2, 3 and 4 (with a
frozen layer and a weight used twice) at 2, 3 and 4 processes, with AdamW and with SGD with
momentum; the references are the unsharded optimizer on one process and PyTorch's
``ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.parallel import memory
from course_lib.tools.labs import Property, Question, case_seed, in_sandbox, on_ranks

WORLD_SIZES = (2, 3, 4)
GLOBAL_BATCH, STEPS = 60, 3
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD with momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


class LabModel(nn.Module):
    """Odd sizes, a frozen layer and a weight used twice (one parameter, two uses)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(7, 23)
        self.shared = nn.Linear(23, 23)
        self.frozen = nn.Linear(23, 23)
        self.frozen.requires_grad_(False)
        self.last = nn.Linear(23, 5)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.first(x))))))
        return self.last(torch.tanh(self.frozen(h)))


def _model() -> LabModel:
    torch.manual_seed(case_seed(0))  # this grading's own weights: a recording of another cannot match
    return LabModel()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _batch(step: int, *, mine: bool):
    generator = torch.Generator().manual_seed(case_seed(1000 + step))
    inputs, targets = (
        torch.randn(GLOBAL_BATCH, 7, generator=generator),
        torch.randint(0, 5, (GLOBAL_BATCH,), generator=generator),
    )
    if not mine:
        return inputs, targets
    share = GLOBAL_BATCH // runtime.world_size()
    part = slice(runtime.rank() * share, (runtime.rank() + 1) * share)
    return inputs[part], targets[part]


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _one_process(optimizer_name: str) -> torch.Tensor:
    model = _model()
    optimizer_cls, options = OPTIMIZERS[optimizer_name]
    optimizer = optimizer_cls(_trainable(model), **options)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(_batch(step, mine=False)[0]), _batch(step, mine=False)[1]).backward()
        optimizer.step()
    return _weights(model)


def _train(lab, optimizer_name: str, stage: int):
    """STEPS steps under your ShardedOptimizer (``lab``), or under PyTorch's ZeroRedundancyOptimizer
    where ``lab`` is None (a launch of the reference never loads your file): the weights, the state's
    bytes, the bytes sent by each collective, and the parameters still holding a gradient."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    optimizer_cls, options = OPTIMIZERS[optimizer_name]
    if lab is None:
        optimizer = ZeroRedundancyOptimizer(_trainable(model), optimizer_class=optimizer_cls, **options)
    else:
        optimizer = lab.ShardedOptimizer(model.parameters(), optimizer_cls, **options)
    wrapped = DistributedDataParallel(model) if stage == 1 else model  # ZeRO-2 averages by itself
    with comm.CommLog() as log:
        for step in range(STEPS):
            optimizer.zero_grad()
            inputs, targets = _batch(step, mine=True)
            F.cross_entropy(wrapped(inputs), targets).backward()
            optimizer.step() if stage == 1 else optimizer.step_from_local_gradients()
    state = optimizer.state_bytes() if lab is not None else None
    kept = [name for name, param in model.named_parameters() if param.grad is not None]
    return (
        _weights(model),
        state,
        {op: log.bytes_per_rank(op) for op in ("all_reduce", "all_gather", "reduce_scatter")},
        kept,
    )


# -- the properties ---------------------------------------------------------------------------------


def _your_bounds(lab, cases: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Your shard_bounds for every rank of each (numel, world), in one sandbox."""
    return [[tuple(lab.shard_bounds(numel, rank, world)) for rank in range(world)] for numel, world in cases]


def check_shard_bounds(lab) -> None:
    drawn = random.Random(case_seed(2)).randrange(11, 100_000)  # this grading's own length
    cases = [(numel, world) for numel in (35_173, drawn, 10, 7, 1) for world in (1, 2, 3, 4, 5)]
    for (numel, world), bounds in zip(cases, in_sandbox(_your_bounds, lab, cases)):
        size = math.ceil(numel / world)
        wanted = [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(world)]
        assert bounds == wanted, (
            f"shard_bounds({numel}, rank, {world}) for ranks 0..{world - 1} gave {bounds}"
        )


def _check_equals_one_process(lab, stage: int) -> None:
    for optimizer_name in OPTIMIZERS:
        reference = _one_process(optimizer_name)
        for world in WORLD_SIZES:
            for rank, (weights, _, _, _) in enumerate(on_ranks(world, _train, lab, optimizer_name, stage)):
                error = (weights - reference).abs().max().item()
                assert error < 1e-5, (
                    f"ZeRO-{stage} with {optimizer_name} on {world} ranks: rank {rank}'s weights after {STEPS} "
                    f"steps differ from one process's by {error:.2e}"
                )


def check_zero1_equals_one_process(lab) -> None:
    _check_equals_one_process(lab, stage=1)


def check_zero1_equals_zero_redundancy_optimizer(lab) -> None:
    for optimizer_name in OPTIMIZERS:
        yours = on_ranks(3, _train, lab, optimizer_name, 1)[0][0]
        theirs = on_ranks(3, _train, None, optimizer_name, 1)[0][0]
        error = (yours - theirs).abs().max().item()
        assert error < 1e-5, (
            f"with {optimizer_name} on 3 ranks you differ from ZeroRedundancyOptimizer by {error:.2e}"
        )


def check_zero1_state_is_sharded(lab) -> None:
    numel = sum(p.numel() for p in _trainable(_model()))
    for world in WORLD_SIZES:
        states = [state for _, state, _, _ in on_ranks(world, _train, lab, "AdamW", 1)]
        for rank, state in enumerate(states):
            start, end = (min(r * math.ceil(numel / world), numel) for r in (rank, rank + 1))
            wanted = 8 * (end - start)  # AdamW: two fp32 moments per element of the shard
            assert state == wanted, (
                f"on {world} ranks, rank {rank} holds {state} bytes of AdamW state, not {wanted} (two moments "
                "for each element of its shard, and nothing else)"
            )


def check_zero1_traffic(lab) -> None:
    numel = sum(p.numel() for p in _trainable(_model()))
    for world in WORLD_SIZES:
        _, _, sent, _ = on_ranks(world, _train, lab, "SGD with momentum", 1)[0]
        padded = 4 * math.ceil(numel / world) * world
        wanted = STEPS * comm.ring_bytes("all_gather", padded, world)
        assert sent["all_gather"] == wanted, (
            f"on {world} ranks you all-gathered {sent['all_gather']:.0f} bytes per rank in {STEPS} steps, not "
            f"{wanted:.0f}: one all-gather of the padded shards per step"
        )


def check_zero2_equals_one_process(lab) -> None:
    _check_equals_one_process(lab, stage=2)


def check_zero2_sends_a_reduce_scatter_not_an_all_reduce(lab) -> None:
    numel = sum(p.numel() for p in _trainable(_model()))
    for world in WORLD_SIZES:
        _, _, sent, _ = on_ranks(world, _train, lab, "AdamW", 2)[0]
        padded = 4 * math.ceil(numel / world) * world
        assert sent["all_reduce"] == 0, (
            "ZeRO-2 needs no all-reduce: each rank only needs the average of its shard"
        )
        wanted = STEPS * comm.ring_bytes("reduce_scatter", padded, world)
        assert sent["reduce_scatter"] == wanted, (
            f"on {world} ranks you reduce-scattered {sent['reduce_scatter']:.0f} bytes per rank in {STEPS} "
            f"steps, not {wanted:.0f}"
        )


def check_zero2_lets_the_full_gradient_go(lab) -> None:
    for world in WORLD_SIZES:
        kept = on_ranks(world, _train, lab, "AdamW", 2)[0][3]
        assert not kept, (
            f"on {world} ranks, after step_from_local_gradients the model still holds the full-size gradients "
            f"of {kept[:3]}: ZeRO-2 keeps only the average of its shard"
        )


PROPERTIES = [
    Property(
        "shard bounds cover the flat vector in equal, contiguous pieces",
        check_shard_bounds,
        "N ranks, numel elements: every piece has the same length, rounded up so the pieces cover "
        "everything; a range past the end of the vector is clamped to it (math.ceil, min).",
    ),
    Property(
        "ZeRO-1 under DDP equals one process (AdamW, SGD with momentum; 2, 3, 4 ranks)",
        check_zero1_equals_one_process,
        "The real optimizer must hold a tensor of its own (a clone of this rank's slice, as an "
        "nn.Parameter) and see that slice's gradient; after its step every rank needs every slice: an "
        "all-gather wants pieces of equal length, so pad yours, and write the gathered values back into "
        "the model's parameters in their order.",
    ),
    Property(
        "ZeRO-1 equals PyTorch's ZeroRedundancyOptimizer",
        check_zero1_equals_zero_redundancy_optimizer,
        "Both update each element once, from the same averaged gradient: if one process is right and "
        "this is not, look at the hyperparameters you pass on (the kwargs).",
    ),
    Property(
        "each rank holds the optimizer state of its shard only",
        check_zero1_state_is_sharded,
        "The saving is the point: give the real optimizer only this rank's slice, never the whole model.",
    ),
    Property(
        "ZeRO-1 sends one all-gather of the padded shards per step",
        check_zero1_traffic,
        "One all_gather_into_tensor per step, of pieces padded to the common shard length.",
    ),
    Property(
        "ZeRO-2 (each rank averages only its shard) equals one process",
        check_zero2_equals_one_process,
        "Without DDP each rank has only its own gradients. A reduce-scatter with op='mean' hands each "
        "rank the average of its piece: pad the flat gradient to N equal pieces first, then keep only "
        "the real part of yours.",
    ),
    Property(
        "ZeRO-2 sends a reduce-scatter and no all-reduce",
        check_zero2_sends_a_reduce_scatter_not_an_all_reduce,
        "An all-reduce would give every rank the whole averaged gradient, which ZeRO-2 never keeps.",
    ),
    Property(
        "ZeRO-2 lets the full local gradient go",
        check_zero2_lets_the_full_gradient_go,
        "What ZeRO-2 saves is the gradient memory: once your piece is averaged, the full-size local "
        "gradients the model's parameters still point to are of no use to anyone.",
    ),
]


# -- the README's questions ------------------------------------------------------------------------------


def _digits_cnn_parameters() -> int:
    return models.count_parameters(models.build_model("digits_cnn"))


def _fp32_adam(sharding: str, world: int):
    return memory.model_state_bytes(
        _digits_cnn_parameters(), world, sharding, param_bytes=4, grad_bytes=4, optimizer_bytes=8
    )


QUESTIONS = [
    Question(
        "adam_state_bytes_per_rank_zero1_on_3_ranks",
        lambda: _fp32_adam("zero1", 3).optimizer,
        "Adam keeps two fp32 moments per parameter, and ZeRO-1 splits them over the ranks (course_lib/parallel/memory.py)",
    ),
    Question(
        "model_state_bytes_per_rank_zero1_on_3_ranks",
        lambda: _fp32_adam("zero1", 3).total,
        "parameters and gradients whole on every rank, Adam's state split over the ranks",
    ),
    Question(
        "model_state_bytes_per_rank_zero2_on_3_ranks",
        lambda: _fp32_adam("zero2", 3).total,
        "what ZeRO-2 shards beyond ZeRO-1: memory.model_state_bytes gives each part",
    ),
    Question(
        "elements_sent_per_rank_per_step_zero2_on_3_ranks",
        lambda: memory.traffic_elements_per_rank(_digits_cnn_parameters(), 3, "zero2"),
        "a reduce-scatter and an all-gather each send (N-1)/N of the elements: compare with DDP's all-reduce",
    ),
]
