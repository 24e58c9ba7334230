"""Exercise: lab 6: three training scripts that broke, fixed.

Each function is what every rank of a data-parallel job runs (``launch`` starts it on N local
processes; ``torchrun`` would start it the same way). ``broken.py`` beside this file holds them as
they were first written, each with one mistake that every rank's log hides: run one there, read
what the ranks' flight records say (``python -m course_lib.tools.diagnose``), and fix it here. The
grader runs your fixed scripts on 2 and 3 ranks: each must train exactly like one process on all
the data, and leave records in which the diagnosis finds no problem.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from course_lib import data
from course_lib.distributed import comm, runtime

THRESHOLD = 20.0
"""The loss above which ``train_and_report`` prints the mean loss."""
SEED = 0
"""The run's seed: the weights' and the data order's (the grader sets its own for each grading)."""
TRUE_WEIGHTS = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def regression_rows(world_size: int, rows_per_rank: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """All the data of a small regression problem; rank r's share is rows r, r + N, r + 2N, ...

    The rows of even index are scaled up, so that rank 0's share has a larger loss than rank 1's.
    """
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows_per_rank * world_size, 4, generator=generator)
    x[0::2] *= 2.0
    y = x @ TRUE_WEIGHTS + 0.1 * torch.randn(len(x), 1, generator=generator)
    return x, y


def labelled_rows(world_size: int, rows_per_rank: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """All the data of a small classification problem; the last class appears in row 0 only."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(rows_per_rank * world_size, 4, generator=generator)
    labels = torch.arange(len(x)) % 4
    labels[0] = 4
    return x, labels


def _average_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        comm.all_reduce(param.grad, op="mean")


def _weights(model: nn.Module) -> list[float]:
    return [value for param in model.parameters() for value in param.detach().flatten().tolist()]


def report_high_loss(loss: torch.Tensor, step: int) -> None:
    """Print the mean loss over every rank (rank 0 prints) when it is above THRESHOLD.

    Every rank calls it at every step, with its own loss.
    """
    # TODO: read the records of train_and_report: at the collective where the ranks differ, what did each rank decide, and from which of its numbers? Pitfall: a decision that changes which collectives run must come out the same on every rank
    raise NotImplementedError(
        "TODO: read the records of train_and_report: at the collective where the ranks differ, what did each rank decide, and from which of its numbers? Pitfall: a decision that changes which collectives run must come out the same on every rank"
    )


def train_and_report(steps: int = 4) -> list[float]:
    """Fit a linear layer to this rank's rows, reporting a high loss."""
    rank, world_size = runtime.rank(), runtime.world_size()
    x, y = regression_rows(world_size)
    x, y = x[rank::world_size], y[rank::world_size]
    torch.manual_seed(SEED)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        _average_gradients(model)
        report_high_loss(loss, step)
        optimizer.step()
    return _weights(model)


def number_of_classes(labels: torch.Tensor) -> int:
    """How many outputs the classifier needs, given this rank's share of the labels."""
    # TODO: read the classifier's shapes in each rank's record: where does each rank's count come from, and what is it a count of? Pitfall: a property of the whole data set cannot be read off one rank's share of it
    raise NotImplementedError(
        "TODO: read the classifier's shapes in each rank's record: where does each rank's count come from, and what is it a count of? Pitfall: a property of the whole data set cannot be read off one rank's share of it"
    )


def train_classifier(steps: int = 4) -> list[float]:
    """A linear classifier with one output per class, trained on this rank's rows."""
    rank, world_size = runtime.rank(), runtime.world_size()
    x, labels = labelled_rows(world_size)
    x, labels = x[rank::world_size], labels[rank::world_size]
    torch.manual_seed(SEED)
    model = nn.Linear(4, number_of_classes(labels))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), labels).backward()
        _average_gradients(model)
        optimizer.step()
    return _weights(model)


def make_sampler(dataset: TensorDataset, rank: int, world_size: int) -> DistributedSampler:
    """This rank's sampler of ``dataset``: its share of a shuffled order."""
    # TODO: read which samples each rank drew in epoch 0: do the ranks' shares overlap? Pitfall: DistributedSampler cuts one permutation into shares; its documentation says what must hold on every rank for the shares to be disjoint
    raise NotImplementedError(
        "TODO: read which samples each rank drew in epoch 0: do the ranks' shares overlap? Pitfall: DistributedSampler cuts one permutation into shares; its documentation says what must hold on every rank for the shares to be disjoint"
    )


def start_epoch(sampler: DistributedSampler, epoch: int) -> None:
    """What the sampler needs before each epoch."""
    # TODO: compare epoch 0's order with epoch 1's on one rank. Pitfall: a sampler cannot know by itself that a new epoch began; its documentation says what it needs from the loop
    raise NotImplementedError(
        "TODO: compare epoch 0's order with epoch 1's on one rank. Pitfall: a sampler cannot know by itself that a new epoch began; its documentation says what it needs from the loop"
    )


def train_epochs(epochs: int = 3, batch: int = 2) -> list[float]:
    """Mini-batches drawn by a DistributedSampler, a new order every epoch."""
    rank, world_size = runtime.rank(), runtime.world_size()
    dataset = TensorDataset(*regression_rows(world_size))
    sampler = make_sampler(dataset, rank, world_size)
    torch.manual_seed(SEED)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    share = None
    for epoch in range(epochs):
        start_epoch(sampler, epoch)
        share = data.check_epoch_order(sampler, epoch=epoch, previous=share)
        for start in range(0, len(share), batch):
            x, y = dataset[share[start : start + batch]]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            _average_gradients(model)
            optimizer.step()
    return _weights(model)
