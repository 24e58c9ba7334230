"""The grading suite of lab 3: what ``python -m course_lib.tools.labs check lab3_fsdp`` checks.

A chain of three units (odd sizes; the middle one has a weight used twice and a frozen layer)
wrapped in your ``ShardedUnit``, at 2, 3 and 4 processes; the references are the same model whole
on one process and PyTorch's FSDP2 (``fully_shard``) on the same units.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.parallel import memory
from course_lib.tools.labs import Property, Question, case_seed, on_ranks

WORLD_SIZES = (2, 3, 4)
GLOBAL_BATCH, STEPS = 60, 3


class TiedBlock(nn.Module):
    """A weight used twice (one parameter, two uses) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(23, 23)
        self.frozen = nn.Linear(23, 23)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.frozen(torch.tanh(self.shared(torch.tanh(self.shared(x))))))


def _units() -> list[nn.Module]:
    torch.manual_seed(case_seed(0))  # this grading's own weights: a recording of another cannot match
    return [nn.Sequential(nn.Linear(7, 23), nn.Tanh()), TiedBlock(), nn.Linear(23, 5)]


def _flat(unit: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in unit.parameters() if p.requires_grad])


def _piece(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Piece ``rank`` of ``flat`` padded with zeros to ``world`` equal pieces."""
    size = math.ceil(flat.numel() / world)
    return torch.cat([flat, torch.zeros(size * world - flat.numel())])[rank * size : (rank + 1) * size]


def _batch(step: int, *, mine: bool, rank: int = 0, world: int = 1):
    generator = torch.Generator().manual_seed(case_seed(1000 + step))
    inputs = torch.randn(GLOBAL_BATCH, 7, generator=generator)
    targets = torch.randint(0, 5, (GLOBAL_BATCH,), generator=generator)
    if not mine:
        return inputs, targets
    share = GLOBAL_BATCH // world
    part = slice(rank * share, (rank + 1) * share)
    return inputs[part], targets[part]


def _my_batch(step: int):
    return _batch(step, mine=True, rank=runtime.rank(), world=runtime.world_size())


def _sharded(lab) -> nn.Sequential:
    return nn.Sequential(*[lab.ShardedUnit(unit) for unit in _units()])


# -- what each rank runs: your code, and what it gives back (the judge compares) ------------------------


def _layout(lab) -> list[dict]:
    model = _sharded(lab)
    return [
        {
            "shard": unit.shard.detach(),
            "gathered": unit.gather_full(unit.shard).detach(),
            "kept": [name for name, p in unit.module.named_parameters() if p.numel() and p.requires_grad],
        }
        for unit in model
    ]


def _forward_and_backward(lab):
    model = _sharded(lab)
    inputs, targets = _my_batch(0)
    saved_sizes = []
    shards = {unit.shard.data_ptr() for unit in model}

    def pack(tensor):
        if tensor.data_ptr() not in shards:  # a shard may be as long as another unit's full vector
            saved_sizes.append(tensor.numel())
        return tensor

    with comm.CommLog() as log:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(inputs)
        stored_sizes = [
            value.numel() for unit in model for value in vars(unit).values() if torch.is_tensor(value)
        ]
        forward_gathers = log.count("all_gather")
        F.cross_entropy(output, targets).backward()
    return {
        "output": output.detach(),
        "saved_sizes": saved_sizes,
        "stored_sizes": stored_sizes,
        "forward_gathers": forward_gathers,
        "shard_gradients": [unit.shard.grad for unit in model],
        "shard_sizes": [unit.shard_size for unit in model],
        "traffic": {
            op: (log.count(op), log.bytes_per_rank(op))
            for op in ("all_gather", "reduce_scatter", "all_reduce")
        },
    }


def _train(lab, optimizer_name: str):
    """STEPS steps under your ShardedUnit (``lab``), or under PyTorch's FSDP2 on the same units where
    ``lab`` is None (a launch of the reference never loads your file): the full trained weights."""
    if lab is not None:
        model = _sharded(lab)
        params = [unit.shard for unit in model]
    else:  # PyTorch's FSDP2 on the same units
        from torch.distributed.fsdp import fully_shard

        model = nn.Sequential(*_units())
        for unit in model:
            fully_shard(unit)
        fully_shard(model)
        params = [p for p in model.parameters() if p.requires_grad]
    _fit(model, params, optimizer_name, mine=True)
    if lab is not None:
        return torch.cat([unit.gather_full(unit.shard) for unit in model])
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters() if p.requires_grad])


def _fit(model: nn.Module, params: list, optimizer_name: str, *, mine: bool) -> None:
    """STEPS steps of the named optimizer on this rank's share of each batch (or the whole batch)."""
    optimizer = (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if optimizer_name == "AdamW"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, targets = _my_batch(step) if mine else _batch(step, mine=False)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def _one_process(optimizer_name: str) -> torch.Tensor:
    model = nn.Sequential(*_units())
    _fit(model, [p for p in model.parameters() if p.requires_grad], optimizer_name, mine=False)
    return torch.cat([_flat(unit) for unit in model])


# -- the properties: computed here, in the judge, from what the ranks sent ---------------------------------


def check_layout(lab) -> None:
    flats = [_flat(unit) for unit in _units()]
    for world in WORLD_SIZES:
        for rank, units in enumerate(on_ranks(world, _layout, lab)):
            for index, (got, flat) in enumerate(zip(units, flats)):
                piece = _piece(flat, rank, world)
                assert got["shard"].shape == piece.shape and torch.equal(got["shard"], piece), (
                    f"on {world} ranks, unit {index}: rank {rank}'s shard is not piece {rank} of the padded flat "
                    "parameters"
                )
                assert got["gathered"].shape == flat.shape and torch.equal(got["gathered"], flat), (
                    f"on {world} ranks, unit {index}: gather_full did not give back the full flat parameters"
                )
                assert not got["kept"], (
                    f"on {world} ranks, unit {index}: the module still holds its trainable parameters {got['kept']}"
                )


def _step_results(lab):
    return {world: on_ranks(world, _forward_and_backward, lab) for world in WORLD_SIZES}


def check_forward(lab) -> None:
    whole = nn.Sequential(*_units())
    for world, ranks in _step_results(lab).items():
        for rank, result in enumerate(ranks):
            with torch.no_grad():
                wanted = whole(_batch(0, mine=True, rank=rank, world=world)[0])
            error = (result["output"] - wanted).abs().max().item()
            assert result["output"].shape == wanted.shape and error < 1e-6, (
                f"on {world} ranks, rank {rank}'s output differs from the whole model's by {error:.2e}"
            )


def check_nothing_whole_is_kept(lab) -> None:
    full_sizes = {_flat(unit).numel() for unit in _units()}
    for world, ranks in _step_results(lab).items():
        result = ranks[0]
        kept_whole = full_sizes & {*result["saved_sizes"], *result["stored_sizes"]}
        assert not kept_whole, (
            f"on {world} ranks, a tensor the size of a unit's full parameters was kept after forward (saved for "
            "backward, or stored on the unit): only the shard may outlive the unit's computation"
        )
        assert result["forward_gathers"] == 3, (
            f"forward made {result['forward_gathers']} all-gathers, not 3 (one per unit)"
        )


def check_gradients(lab) -> None:
    whole = nn.Sequential(*_units())
    inputs, targets = _batch(0, mine=False)
    F.cross_entropy(whole(inputs), targets).backward()
    gradients = [
        torch.cat([p.grad.reshape(-1) for p in unit.parameters() if p.requires_grad]) for unit in whole
    ]
    for world, ranks in _step_results(lab).items():
        for rank, result in enumerate(ranks):
            for got, gradient in zip(result["shard_gradients"], gradients):
                wanted = _piece(gradient, rank, world)
                assert got is not None and got.shape == wanted.shape, (
                    f"on {world} ranks, rank {rank}'s shard has no gradient of its shape {tuple(wanted.shape)}"
                )
                error = (got - wanted).abs().max().item()
                assert error < 1e-6, (
                    f"on {world} ranks, rank {rank}'s shard gradient differs from its piece of the whole batch's "
                    f"average gradient by {error:.2e}"
                )


def check_traffic(lab) -> None:
    numels = [_flat(unit).numel() for unit in _units()]
    for world, ranks in _step_results(lab).items():
        traffic = ranks[0]["traffic"]
        padded = sum(4 * math.ceil(numel / world) * world for numel in numels)
        assert traffic["all_reduce"][0] == 0, (
            "FSDP needs no all-reduce: a reduce-scatter gives each rank its piece"
        )
        assert traffic["all_gather"][0] == 6 and traffic["reduce_scatter"][0] == 3, (
            f"a step made {traffic['all_gather'][0]} all-gathers and {traffic['reduce_scatter'][0]} reduce-scatters, "
            "not 6 and 3 (each unit: one gather in forward, one in backward, one reduce-scatter)"
        )
        sent = traffic["all_gather"][1] + traffic["reduce_scatter"][1]
        wanted = 3 * comm.ring_bytes("all_gather", padded, world)
        assert sent == wanted, (
            f"on {world} ranks a step sent {sent:.0f} bytes per rank, not 3(N-1)/N x padded = {wanted:.0f}"
        )


def check_trains_like_one_process_and_fsdp2(lab) -> None:
    for optimizer_name in ("AdamW", "SGD with momentum"):
        reference = _one_process(optimizer_name)
        for world in WORLD_SIZES:
            weights = on_ranks(world, _train, lab, optimizer_name)[0]
            error = (weights - reference).abs().max().item()
            assert error < 1e-5, (
                f"after {STEPS} steps of {optimizer_name} on {world} ranks your weights differ from one "
                f"process's by {error:.2e}"
            )
    theirs = on_ranks(2, _train, None, "AdamW")[0]
    yours = on_ranks(2, _train, lab, "AdamW")[0]
    assert (yours - theirs).abs().max().item() < 1e-5, (
        "your weights differ from FSDP2's (fully_shard) after 3 steps"
    )


PROPERTIES = [
    Property(
        "each rank keeps one padded piece of each unit's parameters, and gathers give them back",
        check_layout,
        "Each rank keeps one N-th of the unit's parameters and nothing more. The pitfalls: a module "
        "that still holds its full tensors saves no memory at all, and the collectives want N pieces "
        "of one length.",
    ),
    Property(
        "forward with gathered parameters equals the whole model's (2, 3, 4 ranks)",
        check_forward,
        "torch.func.functional_call(module, {name: tensor}, inputs) runs a module with parameters you "
        "pass in: the full flat vector seen as views (as_parameters).",
    ),
    Property(
        "after forward only the shards remain: one all-gather per unit, nothing whole kept",
        check_nothing_whole_is_kept,
        "ctx.save_for_backward what backward needs to gather again (the shard) and to recompute (the "
        "inputs); a full vector saved or stored on the unit is exactly what FSDP avoids.",
    ),
    Property(
        "each rank's shard gradient is its piece of the whole batch's average gradient",
        check_gradients,
        "Backward needs the full parameters, which forward let go: get them back the way forward did."
        " What a rank keeps of the gradient is the average over the ranks of its own piece, which one"
        " collective gives directly; mind the padding.",
    ),
    Property(
        "a step sends 3(N-1)/N of the padded parameters: two all-gathers and a reduce-scatter per unit",
        check_traffic,
        "No all-reduce anywhere: forward gathers, backward gathers and reduce-scatters.",
    ),
    Property(
        "training equals one process (AdamW, SGD with momentum) and FSDP2",
        check_trains_like_one_process_and_fsdp2,
        "Return one gradient per input of forward: the shard's, None for the unit, then the inputs'.",
    ),
]


# -- the README's questions -------------------------------------------------------------------------------


def _digits_cnn_parameters() -> int:
    return models.count_parameters(models.build_model("digits_cnn"))


QUESTIONS = [
    Question(
        "shard_elements_per_rank_digits_cnn_on_3_ranks",
        lambda: math.ceil(_digits_cnn_parameters() / 3),
        "the flat vector padded to a multiple of 3, cut in 3 (one unit for the whole model)",
    ),
    Question(
        "model_state_bytes_per_rank_fsdp_on_3_ranks",
        lambda: (
            memory.model_state_bytes(
                _digits_cnn_parameters(), 3, "fsdp", param_bytes=4, grad_bytes=4, optimizer_bytes=8
            ).total
        ),
        "fp32 parameters, gradients and Adam's two moments, all sharded (course_lib/parallel/memory.py)",
    ),
    Question(
        "elements_sent_per_rank_per_step_fsdp_on_3_ranks",
        lambda: memory.traffic_elements_per_rank(_digits_cnn_parameters(), 3, "fsdp"),
        "two all-gathers and a reduce-scatter, each (N-1)/N of the parameters",
    ),
]
