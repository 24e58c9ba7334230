"""Are the replicas still one model? A fingerprint of every parameter, compared across ranks.

Data parallelism rests on one promise: after every step, every rank holds the same weights.
Nothing checks it while a run trains: if one rank's gradients miss an all-reduce (a collective
skipped in one branch, a parameter DDP was told is unused), if one rank's optimizer sees a
different learning rate, if a buffer is updated on one rank only, the replicas drift apart and
the run goes on, training several slightly different models and reporting the loss of one. It
shows much later as a loss that stops improving, or as a checkpoint (written by rank 0) that
does not reproduce the other ranks' results.

The check: each rank hashes every parameter's bytes (8 bytes of BLAKE2 per tensor), the ranks
exchange their fingerprints (one small all-gather of Python objects), and the first parameter
whose fingerprints differ is named, with which ranks agree. Bit-for-bit: the replicas of a
correct data-parallel run are equal to the last bit, since every rank applies the same averaged
gradient with the same optimizer.

Cost: reading every parameter once (a fraction of one optimizer step) and one collective; run
it every N steps, not every step (``--check-replicas N`` on the trainer).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import runtime
from ..errors import UserError


class ReplicasDiverged(UserError):
    """The ranks no longer hold the same weights."""


def fingerprints(model: nn.Module) -> dict[str, str]:
    """Every parameter's name and a hash of its bytes (and of its shape and dtype).

    Args:
        model: the replica (a DDP wrapper's ``module`` prefix is dropped from the names).
    """
    result = {}
    for name, param in model.named_parameters():
        tensor = param.detach().to("cpu").contiguous()
        digest = hashlib.blake2b(digest_size=8)
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        result[name.removeprefix("module.")] = digest.hexdigest()
    return result


def check_replicas(model: nn.Module, *, group=None, step: int | None = None) -> None:
    """Raise ``ReplicasDiverged`` naming the first parameter whose value differs between ranks.

    Call it on every rank of ``group`` at the same point (it is a collective).

    Args:
        model: this rank's replica.
        group: the replicas' process group (None: every rank).
        step: the step it is checked after, for the message.
    """
    mine = fingerprints(model)
    gathered: list[dict[str, str] | None] = [None] * runtime.world_size(group=group)
    dist.all_gather_object(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    differing = [name for name in mine if len({g.get(name) for g in gathered}) > 1]
    if not differing:
        return
    first = differing[0]
    holders: dict[str, list[int]] = defaultdict(list)
    for rank, prints in zip(ranks, gathered):
        holders[prints.get(first)].append(rank)
    sides = " and ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in sorted(holders.values())
    )
    when = f" after step {step}" if step is not None else ""
    raise ReplicasDiverged(
        f"the replicas differ{when}: parameter {first!r} has {len(holders)} values ({sides} each hold one)"
        f"; {len(differing)} of {len(mine)} parameters differ. Every rank must apply the same averaged "
        "gradient: look for a gradient all-reduce one rank skipped, a rank with another learning rate or "
        "seed-dependent update, or a NaN on one rank"
    )
