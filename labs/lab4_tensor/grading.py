"""The grading suite of lab 4: what ``python -m course_lib.tools.labs check lab4_tensor`` checks.

Your f, g, split layers and parallel MLP at 2, 3 and 4 processes (a hidden width of 36 divides by
all three; the 473 parameters divide by none), against the dense MLP on one process and against
DTensor's ``ColwiseParallel`` / ``RowwiseParallel``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import comm, runtime
from course_lib.tools.labs import Property, Question, case_seed, on_ranks

WORLD_SIZES = (2, 3, 4)
IN, HIDDEN, OUT, BATCH, STEPS = 7, 36, 5, 12, 3


def _dense() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(case_seed(0))  # this grading's own weights: a recording of another cannot match
    return nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)


def _inputs(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case_seed(1000 + step))
    return torch.randn(BATCH, IN, generator=generator), torch.randint(0, OUT, (BATCH,), generator=generator)


def _dense_mlp(fc1, fc2, x):
    return fc2(F.gelu(fc1(x)))


def _rows(rank: int, world: int) -> slice:
    per = HIDDEN // world
    return slice(rank * per, (rank + 1) * per)


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- what each rank runs: your code, and what it gives back (the judge compares) ------------------------


def _f_and_g(lab) -> dict[str, torch.Tensor]:
    rank = runtime.rank()
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    y = lab.CopyToParallel.apply(x)
    (y * (rank + 1)).sum().backward()
    partial = (torch.ones(2, 3) * (rank + 1)).requires_grad_()
    total = lab.ReduceFromParallel.apply(partial)
    (total * (rank + 1)).sum().backward()
    return {
        "f_output": y.detach(),
        "f_gradient": x.grad,
        "g_output": total.detach(),
        "g_gradient": partial.grad,
        "g_input_after": partial.detach(),
    }


def _layers(lab) -> dict[str, torch.Tensor]:
    fc1, fc2 = _dense()
    x = _inputs()[0]
    column, row = lab.ColumnParallelLinear(fc1), lab.RowParallelLinear(fc2)
    hidden = fc1(x).detach()[:, _rows(runtime.rank(), runtime.world_size())]
    return {
        "column_weight": column.weight.detach(),
        "column_output": column(x).detach(),
        "row_weight": row.weight.detach(),
        "row_output": row(hidden).detach(),
    }


def _mlp_step(lab):
    fc1, fc2 = _dense()
    mlp = lab.ParallelMLP(fc1, fc2)
    x, targets = _inputs()
    x = x.clone().requires_grad_()
    with comm.CommLog() as log:
        output = mlp(x)
        forward_calls = log.count("all_reduce")
        F.cross_entropy(output, targets).backward()
    values = {
        "output": output.detach(),
        "input gradient": x.grad,
        "fc1.weight gradient": mlp.fc1.weight.grad,
        "fc2.weight gradient": mlp.fc2.weight.grad,
        "fc2.bias gradient": mlp.fc2.bias.grad,
    }
    return values, forward_calls, log.count("all_reduce"), log.bytes_per_rank("all_reduce")


def _dense_step() -> dict[str, torch.Tensor]:
    """The dense MLP's output and gradients on the same batch, in the judge."""
    fc1, fc2 = _dense()
    x, targets = _inputs()
    x = x.clone().requires_grad_()
    output = _dense_mlp(fc1, fc2, x)
    F.cross_entropy(output, targets).backward()
    return {
        "output": output.detach(),
        "input gradient": x.grad,
        "fc1.weight gradient": fc1.weight.grad,
        "fc2.weight gradient": fc2.weight.grad,
        "fc2.bias gradient": fc2.bias.grad,
    }


def _fit(model: nn.Module, optimizer_name: str) -> None:
    """STEPS steps of the named optimizer on the same batches, whatever the model's layout."""
    if optimizer_name == "AdamW":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, targets = _inputs(step)
        F.cross_entropy(model(x), targets).backward()
        optimizer.step()


def _train(lab, optimizer_name: str):
    """STEPS steps under your ParallelMLP (``lab``), or under DTensor's ColwiseParallel and
    RowwiseParallel where ``lab`` is None (a launch of the reference never loads your file)."""
    fc1, fc2 = _dense()
    if lab is not None:
        model = lab.ParallelMLP(fc1, fc2)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = nn.Sequential(fc1, nn.GELU(), fc2)
        mesh = init_device_mesh("cpu", (runtime.world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _fit(model, optimizer_name)
    if lab is not None:
        return model.fc1.weight.detach().clone(), model.fc2.weight.detach().clone()
    return model[0].weight.to_local().detach().clone(), model[2].weight.to_local().detach().clone()


def _train_dense(optimizer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense MLP after STEPS steps, in the judge: both whole weights."""
    fc1, fc2 = _dense()
    _fit(nn.Sequential(fc1, nn.GELU(), fc2), optimizer_name)
    return fc1.weight.detach(), fc2.weight.detach()


def _train_both(lab) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Both optimizers under your ParallelMLP, in one run of the ranks."""
    return {optimizer_name: _train(lab, optimizer_name) for optimizer_name in ("AdamW", "SGD with momentum")}


# -- the properties: computed here, in the judge, from what the ranks sent ---------------------------------


def check_f_and_g(lab) -> None:
    for world in WORLD_SIZES:
        summed = torch.full((2, 3), world * (world + 1) / 2)
        for rank, got in enumerate(on_ranks(world, _f_and_g, lab)):
            x = torch.arange(6.0).reshape(2, 3)
            assert torch.equal(got["f_output"], x), (
                f"on {world} ranks, f changed its input in forward (it is the identity there)"
            )
            assert got["f_gradient"] is not None and torch.equal(got["f_gradient"], summed), (
                f"on {world} ranks, rank {rank}'s gradient through f is not the sum of the ranks' gradients"
            )
            assert torch.equal(got["g_input_after"], torch.full((2, 3), float(rank + 1))), (
                f"on {world} ranks, g overwrote its input: all-reduce a copy"
            )
            assert torch.equal(got["g_output"], summed), (
                f"on {world} ranks, g's output is not the sum of the ranks' inputs"
            )
            assert got["g_gradient"] is not None and torch.equal(
                got["g_gradient"], torch.full((2, 3), float(rank + 1))
            ), f"on {world} ranks, rank {rank}'s gradient through g is not the gradient it received"


def check_split_layers(lab) -> None:
    fc1, fc2 = _dense()
    x = _inputs()[0]
    with torch.no_grad():
        hidden = fc1(x)
        output = fc2(hidden)
    for world in WORLD_SIZES:
        for rank, got in enumerate(on_ranks(world, _layers, lab)):
            rows = _rows(rank, world)
            assert torch.equal(got["column_weight"], fc1.weight.detach()[rows]), (
                f"on {world} ranks, rank {rank}'s column layer does not hold rows {rank} of fc1"
            )
            assert _difference(got["column_output"], hidden[:, rows]) < 1e-6, (
                f"on {world} ranks, rank {rank}'s column layer output is not its slice of the dense output"
            )
            assert torch.equal(got["row_weight"], fc2.weight.detach()[:, rows]), (
                f"on {world} ranks, rank {rank}'s row layer does not hold columns {rank} of fc2"
            )
            error = _difference(got["row_output"], output)
            assert error < 1e-6, (
                f"on {world} ranks, the row layer's output differs from the dense layer's by {error:.2e}"
            )


def check_mlp_forward_and_backward(lab) -> None:
    dense = _dense_step()
    for world in WORLD_SIZES:
        for rank, (got, _, _, _) in enumerate(on_ranks(world, _mlp_step, lab)):
            rows = _rows(rank, world)
            wanted = dict(dense)
            wanted["fc1.weight gradient"] = dense["fc1.weight gradient"][rows]
            wanted["fc2.weight gradient"] = dense["fc2.weight gradient"][:, rows]
            for what, value in wanted.items():
                assert got[what] is not None and got[what].shape == value.shape, (
                    f"on {world} ranks, rank {rank} has no {what} of shape {tuple(value.shape)}"
                )
                error = _difference(got[what], value)
                assert error < 1e-5, (
                    f"on {world} ranks, rank {rank}'s {what} differs from the dense MLP's by {error:.2e}"
                )


def check_mlp_traffic(lab) -> None:
    for world in WORLD_SIZES:
        _, forward_calls, calls, sent = on_ranks(world, _mlp_step, lab)[0]
        assert (forward_calls, calls) == (1, 2), (
            f"the parallel MLP made {forward_calls} all-reduce(s) in forward and {calls - forward_calls} in "
            "backward, not 1 and 1"
        )
        wanted = comm.ring_bytes("all_reduce", 4 * BATCH * OUT, world) + comm.ring_bytes(
            "all_reduce", 4 * BATCH * IN, world
        )
        assert sent == wanted, f"on {world} ranks a step sent {sent:.0f} bytes per rank, not {wanted:.0f}"


def _slices_differ(yours, whole, rank: int, world: int) -> float:
    rows = _rows(rank, world)
    wanted = (whole[0][rows], whole[1][:, rows])
    if any(a.shape != b.shape for a, b in zip(yours, wanted)):
        return float("inf")
    return max(_difference(a, b) for a, b in zip(yours, wanted))


def check_trains_like_dense_and_dtensor(lab) -> None:
    dense = {name: _train_dense(name) for name in ("AdamW", "SGD with momentum")}
    for world in WORLD_SIZES:
        for rank, trained in enumerate(on_ranks(world, _train_both, lab)):
            for optimizer_name, yours in trained.items():
                error = _slices_differ(yours, dense[optimizer_name], rank, world)
                assert error < 1e-5, (
                    f"after {STEPS} steps of {optimizer_name} on {world} ranks, rank {rank}'s slices differ from "
                    f"the dense MLP's by {error:.2e}"
                )
    yours = on_ranks(2, _train, lab, "AdamW")[0]
    theirs = on_ranks(2, _train, None, "AdamW")[0]
    error = max(_difference(a, b) for a, b in zip(yours, theirs))
    assert error < 1e-5, f"your slices differ from DTensor's ColwiseParallel/RowwiseParallel by {error:.2e}"


PROPERTIES = [
    Property(
        "f is the identity forward and sums the gradient backward; g the reverse",
        check_f_and_g,
        "A torch.autograd.Function has a forward and a backward you write. The all-reduce works in "
        "place: give it a copy of what autograd handed you (clone), and make that copy contiguous.",
    ),
    Property(
        "the column layer keeps its rows, the row layer its columns, and both compute their part",
        check_split_layers,
        "Rows of nn.Linear's weight are output features, columns are input features. The row layer's "
        "bias must be added once, after the partial sums are added up.",
    ),
    Property(
        "the parallel MLP's output and gradients equal the dense MLP's (2, 3, 4 ranks)",
        check_mlp_forward_and_backward,
        "Where the whole input enters the column layer, f makes backward add up the ranks' "
        "contributions to the input's gradient; without it each rank would see only its slice's part.",
    ),
    Property(
        "one all-reduce in forward and one in backward, of the activations",
        check_mlp_traffic,
        "GELU works element by element, so the column layer's slice goes straight into the row layer: "
        "no communication between them.",
    ),
    Property(
        "training equals the dense MLP and DTensor's ColwiseParallel/RowwiseParallel",
        check_trains_like_dense_and_dtensor,
        "If one step is right, check that every rank keeps its own copy of the slices (clone), so the "
        "optimizer updates parameters that belong to your layers.",
    ),
]


# -- the README's questions -------------------------------------------------------------------------------

D_MODEL, MLP_HIDDEN, TOKENS, DEGREE = 1024, 4096, 8 * 512, 4

QUESTIONS = [
    Question(
        "mlp_weight_elements_per_rank_d1024_h4096_tp4",
        lambda: 2 * D_MODEL * MLP_HIDDEN / DEGREE,
        "fc1 and fc2 are each d_model x hidden; each rank keeps 1/T of both",
    ),
    Question(
        "all_reduce_bytes_per_rank_forward_tokens4096_d1024_tp4_fp32",
        lambda: comm.ring_bytes("all_reduce", 4 * TOKENS * D_MODEL, DEGREE),
        "g all-reduces the MLP's output (tokens x d_model, fp32) once: 2(T-1)/T of it per rank (course_lib/distributed/comm.py)",
    ),
    Question(
        "bytes_per_rank_to_gather_the_hidden_activation_tp4_fp32",
        lambda: comm.ring_bytes("all_gather", 4 * TOKENS * MLP_HIDDEN, DEGREE),
        "an all-gather of the hidden activation (tokens x hidden): (T-1)/T of it per rank; why is the "
        "column-then-row split better?",
    ),
]
