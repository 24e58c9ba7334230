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
from course_lib.tools.labs import Property, Question, on_ranks

WORLD_SIZES = (2, 3, 4)
IN, HIDDEN, OUT, BATCH, STEPS = 7, 36, 5, 12, 3


def _dense() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)


def _inputs(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=generator), torch.randint(0, OUT, (BATCH,), generator=generator)


def _dense_mlp(fc1, fc2, x):
    return fc2(F.gelu(fc1(x)))


def _rows() -> slice:
    per = HIDDEN // runtime.world_size()
    return slice(runtime.rank() * per, (runtime.rank() + 1) * per)


# -- what each rank runs ------------------------------------------------------------------------------


def _f_and_g(lab):
    rank, world = runtime.rank(), runtime.world_size()
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    y = lab.CopyToParallel.apply(x)
    (y * (rank + 1)).sum().backward()
    f = (
        torch.equal(y.detach(), x.detach()),
        torch.equal(x.grad, torch.full_like(x, world * (world + 1) / 2)),
    )
    partial = (torch.ones(2, 3) * (rank + 1)).requires_grad_()
    total = lab.ReduceFromParallel.apply(partial)
    (total * (rank + 1)).sum().backward()
    g = (
        torch.equal(total.detach(), torch.full((2, 3), world * (world + 1) / 2)),
        torch.equal(partial.grad, torch.full((2, 3), float(rank + 1))),
        torch.equal(partial.detach(), torch.ones(2, 3) * (rank + 1)),  # the input was not overwritten
    )
    return f, g


def _layers(lab):
    fc1, fc2 = _dense()
    x = _inputs()[0]
    column, row = lab.ColumnParallelLinear(fc1), lab.RowParallelLinear(fc2)
    hidden = fc1(x).detach()
    return {
        "column_weight": torch.equal(column.weight.detach(), fc1.weight.detach()[_rows()]),
        "column_output": (column(x).detach() - hidden[:, _rows()]).abs().max().item(),
        "row_weight": torch.equal(row.weight.detach(), fc2.weight.detach()[:, _rows()]),
        "row_output": (row(hidden[:, _rows()]).detach() - fc2(hidden).detach()).abs().max().item(),
    }


def _mlp_step(lab):
    fc1, fc2 = _dense()
    mlp = lab.ParallelMLP(fc1, fc2)
    x, targets = _inputs()
    x_dense, x_parallel = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.cross_entropy(_dense_mlp(fc1, fc2, x_dense), targets).backward()
    with comm.CommLog() as log:
        output = mlp(x_parallel)
        forward_calls = log.count("all_reduce")
        F.cross_entropy(output, targets).backward()
    rows = _rows()
    errors = {
        "output": (output.detach() - _dense_mlp(fc1, fc2, x).detach()).abs().max().item(),
        "input gradient": (x_parallel.grad - x_dense.grad).abs().max().item(),
        "fc1.weight gradient": (mlp.fc1.weight.grad - fc1.weight.grad[rows]).abs().max().item(),
        "fc2.weight gradient": (mlp.fc2.weight.grad - fc2.weight.grad[:, rows]).abs().max().item(),
        "fc2.bias gradient": (mlp.fc2.bias.grad - fc2.bias.grad).abs().max().item(),
    }
    return errors, forward_calls, log.count("all_reduce"), log.bytes_per_rank("all_reduce")


def _train(lab, optimizer_name: str, kind: str):
    fc1, fc2 = _dense()
    if kind == "yours":
        model = lab.ParallelMLP(fc1, fc2)
    elif kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = nn.Sequential(fc1, nn.GELU(), fc2)
        mesh = init_device_mesh("cpu", (runtime.world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        model = nn.Sequential(fc1, nn.GELU(), fc2)
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if optimizer_name == "AdamW"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    for step in range(STEPS):
        optimizer.zero_grad()
        x, targets = _inputs(step)
        F.cross_entropy(model(x), targets).backward()
        optimizer.step()
    if kind == "yours":
        return model.fc1.weight.detach().clone(), model.fc2.weight.detach().clone()
    if kind == "dtensor":
        return model[0].weight.to_local().detach().clone(), model[2].weight.to_local().detach().clone()
    return model[0].weight.detach()[_rows()].clone(), model[2].weight.detach()[:, _rows()].clone()


# -- the properties -----------------------------------------------------------------------------------


def check_f_and_g(lab) -> None:
    for world in WORLD_SIZES:
        for rank, (f, g) in enumerate(on_ranks(world, _f_and_g, lab)):
            assert f[0], f"on {world} ranks, f changed its input in forward (it is the identity there)"
            assert f[1], (
                f"on {world} ranks, rank {rank}'s gradient through f is not the sum of the ranks' gradients"
            )
            assert g[2], f"on {world} ranks, g overwrote its input: all-reduce a copy"
            assert g[0], f"on {world} ranks, g's output is not the sum of the ranks' inputs"
            assert g[1], f"on {world} ranks, rank {rank}'s gradient through g is not the gradient it received"


def check_split_layers(lab) -> None:
    for world in WORLD_SIZES:
        for rank, result in enumerate(on_ranks(world, _layers, lab)):
            assert result["column_weight"], (
                f"on {world} ranks, rank {rank}'s column layer does not hold rows {rank} of fc1"
            )
            assert result["column_output"] < 1e-6, (
                f"on {world} ranks, rank {rank}'s column layer output is not its slice of the dense output"
            )
            assert result["row_weight"], (
                f"on {world} ranks, rank {rank}'s row layer does not hold columns {rank} of fc2"
            )
            assert result["row_output"] < 1e-6, (
                f"on {world} ranks, the row layer's output differs from the dense layer's by {result['row_output']:.2e}"
            )


def check_mlp_forward_and_backward(lab) -> None:
    for world in WORLD_SIZES:
        for rank, (errors, _, _, _) in enumerate(on_ranks(world, _mlp_step, lab)):
            for what, error in errors.items():
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


def _train_against_dense(lab) -> dict[str, float]:
    """Both optimizers, yours against the dense MLP, in one run of the ranks: the largest difference."""
    differences = {}
    for optimizer_name in ("AdamW", "SGD with momentum"):
        yours, dense = _train(lab, optimizer_name, "yours"), _train(lab, optimizer_name, "dense")
        differences[optimizer_name] = max((a - b).abs().max().item() for a, b in zip(yours, dense))
    return differences


def check_trains_like_dense_and_dtensor(lab) -> None:
    for world in WORLD_SIZES:
        for rank, differences in enumerate(on_ranks(world, _train_against_dense, lab)):
            for optimizer_name, error in differences.items():
                assert error < 1e-5, (
                    f"after {STEPS} steps of {optimizer_name} on {world} ranks, rank {rank}'s slices differ from "
                    f"the dense MLP's by {error:.2e}"
                )
    yours = on_ranks(2, _train, lab, "AdamW", "yours")[0]
    theirs = on_ranks(2, _train, lab, "AdamW", "dtensor")[0]
    error = max((a - b).abs().max().item() for a, b in zip(yours, theirs))
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
