"""Solution of lab 3: sharding the model states by hand (ZeRO-3 / FSDP with one unit).

Every rank keeps 1/N of the model's parameters, flattened into one vector and padded so that it
divides by N. Each step it all-gathers the full vector for forward and backward, reduce-scatters
the gradient so that it keeps only the average of its own shard, and updates only that shard.
Fill in the three functions marked TODO in exercise.py, then check your work:

    python -m course_lib.tools.labs check lab3_fsdp
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from course_lib import comm, data, models, runtime
from course_lib.launch import launch
from course_lib.tools.labs import compare_training

STEPS, GLOBAL_BATCH, LR = 40, 64, 0.05


def my_shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Pad ``flat`` with zeros to a multiple of world_size and return a copy of this rank's piece."""
    # BEGIN SOLUTION: shard size = ceil(numel / world_size); pad with zeros to size * world_size; clone piece number rank
    size = math.ceil(flat.numel() / world_size)
    padded = torch.zeros(size * world_size, dtype=flat.dtype)
    padded[: flat.numel()] = flat
    return padded[rank * size : (rank + 1) * size].clone()
    # END SOLUTION


def gather_full(shard: torch.Tensor, numel: int) -> torch.Tensor:
    """Every rank's shard, concatenated in rank order, without the padding (``numel`` elements)."""
    # BEGIN SOLUTION: comm.all_gather_into_tensor into a tensor world_size times the shard, then keep the first numel
    full = torch.empty(shard.numel() * runtime.world_size(), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard)
    return full[:numel]
    # END SOLUTION


def reduce_my_gradient(flat_grad: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The average over all ranks of this rank's piece of the (padded) flat gradient."""
    # BEGIN SOLUTION: pad like my_shard, comm.reduce_scatter_tensor(out, padded, op="mean") into a shard-sized out
    size = math.ceil(flat_grad.numel() / world_size)
    padded = torch.zeros(size * world_size, dtype=flat_grad.dtype)
    padded[: flat_grad.numel()] = flat_grad
    out = torch.empty(size, dtype=flat_grad.dtype)
    comm.reduce_scatter_tensor(out, padded, op="mean")
    return out
    # END SOLUTION


def train(lab) -> dict:
    rank, world_size = runtime.rank(), runtime.world_size()
    torch.manual_seed(0)
    model = models.build_model("digits_cnn")
    numel = sum(p.numel() for p in model.parameters())
    shard = lab.my_shard(parameters_to_vector(model.parameters()).detach(), rank, world_size)
    velocity = torch.zeros_like(shard)  # SGD momentum: optimizer state for this rank's shard only
    bundle = data.load_dataset("digits")
    images, labels = bundle.train.tensors
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        chosen = torch.randint(0, len(images), (GLOBAL_BATCH,), generator=generator)
        inputs, targets = images[chosen][rank::world_size], labels[chosen][rank::world_size]
        with torch.no_grad():
            vector_to_parameters(lab.gather_full(shard, numel), model.parameters())
        model.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        grad_shard = lab.reduce_my_gradient(
            parameters_to_vector(p.grad for p in model.parameters()), rank, world_size
        )
        velocity.mul_(0.9).add_(grad_shard)
        shard -= LR * velocity
        everyone = loss.detach().clone()
        comm.all_reduce(everyone, op="mean")
        losses.append(everyone.item())
    full = lab.gather_full(shard, numel)
    with torch.no_grad():
        vector_to_parameters(full, model.parameters())
        val_images, val_labels = bundle.val.tensors
        accuracy = (model(val_images).argmax(1) == val_labels).float().mean().item()
    return {
        "losses": losses,
        "accuracy": accuracy,
        "weights": full.clone(),
        "shard_numel": shard.numel(),
        "model_numel": numel,
    }


def check_run(lab) -> dict:
    """``train`` on 3 processes (35,173 parameters do not divide by 3: the padding matters)."""
    ranks = launch(train, 3, lab, timeout_s=120)
    if any(
        r["shard_numel"] * 3 < r["model_numel"] or r["shard_numel"] > r["model_numel"] // 3 + 1 for r in ranks
    ):
        raise AssertionError("each shard must hold ceil(parameters / world size) elements")
    return ranks[0]


def compare(got: dict, expected: dict) -> list[str]:
    return compare_training(got, expected)


def summary(result: dict) -> str:
    return (
        f"final loss {result['losses'][-1]:.3f}, validation accuracy {result['accuracy']:.1%}, "
        f"{result['shard_numel']:,} of {result['model_numel']:,} parameters per rank"
    )
