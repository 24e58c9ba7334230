"""The trainer's wrappers: the model on one process, replicated (DDP), or sharded (ZeRO, FSDP).

``--sharding`` chooses:

==========  =================================  ===============================================
sharding    each rank holds                    communication per step (Ψ = parameters)
==========  =================================  ===============================================
single      everything, one process            none
ddp         a full replica + its gradients     all-reduce of the gradients: ~2Ψ values sent
zero1       a replica, 1/N of optimizer state  reduce-scatter grads, all-gather params: ~2Ψ
zero2       ... and 1/N of the gradients       the same ~2Ψ
fsdp        1/N of parameters, grads, state    all-gather params (forward and backward) and
                                               reduce-scatter grads: ~3Ψ values sent
==========  =================================  ===============================================

The names after ``single`` are ``parallel.memory.SHARDINGS``, the words a ``Layout``, the
planner and the labs use for the same thing. ``zero1`` and ``zero2`` are the course's own
(``parallel.zero``: ``--impl course``). With ``--impl course``, fsdp also takes PyTorch FSDP's
``--sharding-strategy`` (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD``, ``NO_SHARD``),
``--hybrid-shard-size`` and ``--cpu-offload`` (see ``course_lib.parallel.fsdp``).

``ddp`` and ``fsdp`` have two implementations behind the same flags: ``torch`` (PyTorch's own
``DistributedDataParallel`` and FSDP2 ``fully_shard``, the production path and the default)
and ``course`` (the readable versions in ``course_lib.parallel``, applied by the same verb that
lays out a transformer's data axis, ``parallel.data_parallel.apply_data_parallel``: this CNN has
no other axis). The trainer only ever calls ``wrap_model`` and ``gradient_sync_skipped``, so both
are held to the same numbers.

Gradient accumulation. With ``--grad-accum K`` a rank runs K micro-batches before one
optimizer step. Synchronising gradients after each micro-batch would send K times the bytes for
nothing: only the sum matters. So the first K - 1 backward passes run inside
``gradient_sync_skipped`` (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``)
and only the last one communicates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..checks import check_choice
from ..distributed.runtime import ProcessInfo
from ..errors import UserError
from ..models import sharding_units
from ..parallel.data_parallel import apply_data_parallel
from ..parallel.ddp import DataParallel
from ..parallel.memory import SHARDINGS

TRAINER_SHARDINGS = ("single", *SHARDINGS)
"""What ``--sharding`` takes: one process, or a data axis's sharding (``memory.SHARDINGS``)."""
IMPLEMENTATIONS = ("torch", "course")
COURSE_ONLY = ("zero1", "zero2")
"""Shardings only the course implements here (PyTorch's nearest: ``ZeroRedundancyOptimizer``,
FSDP's ``SHARD_GRAD_OP``)."""


def check_sharding(sharding: str, impl: str, world_size: int) -> None:
    """Reject impossible combinations before any process waits for another."""
    check_choice("sharding", sharding, TRAINER_SHARDINGS)
    check_choice("implementation", impl, IMPLEMENTATIONS)
    if sharding == "single" and world_size > 1:
        raise UserError(
            f"sharding single runs one process, but {world_size} were started: use --sharding "
            f"{', '.join(SHARDINGS)}, or run without torchrun/srun"
        )
    if sharding in COURSE_ONLY and impl != "course":
        raise UserError(
            f"--sharding {sharding} runs the course's ZeroDataParallel: add --impl course (PyTorch's "
            "nearest are ZeroRedundancyOptimizer and FSDP's SHARD_GRAD_OP)"
        )


def wrap_model(
    model: nn.Module,
    *,
    sharding: str,
    impl: str,
    process: ProcessInfo,
    sharding_strategy: str = "FULL_SHARD",
    hybrid_shard_size: int | None = None,
    cpu_offload: str = "none",
) -> nn.Module:
    """Return the model wrapped for this sharding (the optimizer must be built *after* this).

    Args:
        model: the model, on ``process.device``, the same on every rank.
        sharding: one of ``TRAINER_SHARDINGS``: ``single``, or what the ranks shard (``ddp``, ``zero1``,
            ``zero2``, ``fsdp``).
        impl: ``torch`` (PyTorch's DDP or FSDP2) or ``course`` (``course_lib.parallel``).
        process: this process's ``runtime.ProcessInfo`` (its device and world size).
        sharding_strategy: the course FSDP's (PyTorch FSDP's names: ``FULL_SHARD``,
            ``SHARD_GRAD_OP``, ``HYBRID_SHARD``, ``NO_SHARD``).
        hybrid_shard_size: ranks per shard group under ``HYBRID_SHARD``.
        cpu_offload: the course FSDP's offload mode: ``none``, ``params`` or ``full``.
    """
    check_sharding(sharding, impl, process.world_size)
    if sharding == "single":
        return model
    if impl == "course":  # the data axis's one verb, as plan.parallelize applies it to a transformer
        options = {}
        if sharding == "fsdp":
            options = {"sharding_strategy": sharding_strategy, "hybrid_shard_size": hybrid_shard_size,
                       "cpu_offload": cpu_offload}  # fmt: skip
        return apply_data_parallel(model, sharding=sharding, units=sharding_units(model), **options)
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [process.device.index] if process.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    # Shard each block first, then the root (which picks up the parameters left over).
    for unit in sharding_units(model):
        fully_shard(unit)
    return fully_shard(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (torch's or the course's); sharded models stay as they are.

    A DDP replica is a complete model, so saving or reading its weights needs no wrapper, and its
    parameter names then match those of a single process or of FSDP.
    """
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, (DistributedDataParallel, DataParallel)) else model


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradient of the whole model to 2-norm ``max_norm``, whichever way it is spread over ranks.

    A sharded wrapper must assemble the norm from every rank's shard (the course's wrappers have
    their own method); torch's function already does that for FSDP2's DTensor gradients.
    """
    if hasattr(model, "clip_grad_norm_"):
        return model.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@contextlib.contextmanager
def gradient_sync_skipped(model: nn.Module) -> Iterator[None]:
    """Run backward passes whose gradients are accumulated locally, not yet communicated."""
    if hasattr(model, "no_sync"):  # DDP, torch's and the course's
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:  # a single process has nothing to synchronise
        yield
