"""Solution of lab 1: data parallelism by hand, from one process to DDP.

Fill in the three functions marked TODO in exercise.py, then check your work:

    python -m course_lib.tools.labs check lab1_ddp

The check trains the digits CNN for a few steps on 2 CPU processes with your functions and with the
solution's, and compares the losses and the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import comm, data, models, runtime
from course_lib.launch import launch
from course_lib.tools.labs import compare_training

STEPS, GLOBAL_BATCH, LR = 40, 64, 0.05


def my_slice(inputs: torch.Tensor, targets: torch.Tensor, rank: int, world_size: int):
    """This rank's share of a global batch: every world_size-th sample, starting at ``rank``."""
    # BEGIN SOLUTION: return every world_size-th sample starting at rank, for inputs and targets (x[rank::world_size])
    return inputs[rank::world_size], targets[rank::world_size]
    # END SOLUTION


def same_start(model: torch.nn.Module) -> None:
    """Make every replica start from rank 0's weights."""
    # BEGIN SOLUTION: broadcast every parameter from rank 0 (comm.broadcast(param.data, src=0))
    for param in model.parameters():
        comm.broadcast(param.data, src=0)
    # END SOLUTION


def average_gradients(model: torch.nn.Module) -> None:
    """After backward: every rank's gradients become the average over all ranks."""
    # BEGIN SOLUTION: all-reduce each param.grad with comm.all_reduce (a sum), then divide it by the world size
    world_size = runtime.world_size()
    for param in model.parameters():
        comm.all_reduce(param.grad, op="sum")
        param.grad /= world_size
    # END SOLUTION


def train(lab) -> dict:
    """Train with ``lab``'s three functions on this process group; the same on every rank."""
    rank, world_size = runtime.rank(), runtime.world_size()
    torch.manual_seed(100 + rank)  # a different start on every rank, on purpose: same_start must fix it
    model = models.build_model("digits_cnn")
    lab.same_start(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    bundle = data.load_dataset("digits")
    images, labels = bundle.train.tensors
    generator = torch.Generator().manual_seed(0)  # the same global batches on every rank
    losses = []
    for _ in range(STEPS):
        chosen = torch.randint(0, len(images), (GLOBAL_BATCH,), generator=generator)
        inputs, targets = lab.my_slice(images[chosen], labels[chosen], rank, world_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        lab.average_gradients(model)
        optimizer.step()
        everyone = loss.detach().clone()
        comm.all_reduce(everyone, op="mean")
        losses.append(everyone.item())
    val_images, val_labels = bundle.val.tensors
    with torch.no_grad():
        accuracy = (model(val_images).argmax(1) == val_labels).float().mean().item()
    return {
        "losses": losses,
        "accuracy": accuracy,
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def check_run(lab) -> dict:
    """What `python -m course_lib.tools.labs check` runs: ``train`` on 2 processes, rank 0's results."""
    ranks = launch(train, 2, lab, timeout_s=120)
    if not torch.equal(ranks[0]["weights"], ranks[1]["weights"]):
        raise AssertionError(
            "the two ranks ended with different weights: replicas must stay identical (same_start, and "
            "average_gradients on every rank)"
        )
    return ranks[0]


def compare(got: dict, expected: dict) -> list[str]:
    return compare_training(got, expected)


def summary(result: dict) -> str:
    return f"final loss {result['losses'][-1]:.3f}, validation accuracy {result['accuracy']:.1%}"
