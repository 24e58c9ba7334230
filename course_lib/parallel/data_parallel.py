"""The data axis's one verb: replicas that average their gradients, each sharding what it is told.

Data parallelism keeps D replicas of the model, each on 1/D of the batch, and averages their
gradients every step. What each replica keeps whole is the choice of the data axis
(``memory.SHARDINGS``): everything (DDP, ``parallel.ddp``), all but the optimizer state
(ZeRO-1) or the gradients too (ZeRO-2, ``parallel.zero``), or the parameters too (FSDP,
``parallel.fsdp``): each saves memory for more bytes or more messages on the wire (``parallel.memory``
counts them). ``apply_data_parallel`` is the one verb over the three lessons, as torchtitan's
``apply_fsdp`` and ``apply_ddp`` are, applied last: its hooks must wrap every other technique.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020 (arXiv:1910.02054).
"""

from __future__ import annotations

from torch import nn

from ..checks import check_choice
from . import ddp, fsdp, recompute, zero
from .memory import SHARDINGS


def apply_data_parallel(
    model: nn.Module,
    group=None,
    *,
    sharding: str = "ddp",
    units: list[nn.Module] | None = None,
    **fsdp_options,
) -> nn.Module:
    """``model`` wrapped so that the data axis averages its gradients, sharding what ``sharding`` says.

    Args:
        model: the module this rank trains (after every other verb).
        group: the data-parallel process group (None: every rank).
        sharding: ``"ddp"`` (``parallel.ddp``), ``"zero1"``/``"zero2"`` (``parallel.zero``) or
            ``"fsdp"`` (``parallel.fsdp``).
        units: FSDP's units, each gathered and freed whole (None: one per recomputation unit,
            a transformer's blocks).
        fsdp_options: for ``"fsdp"``, the course FSDP's own options (``sharding_strategy``,
            ``hybrid_shard_size``, ``cpu_offload``: ``parallel.fsdp``).
    """
    check_choice("sharding", sharding, SHARDINGS)
    if sharding == "ddp":
        return ddp.DataParallel(model, group=group)
    if sharding in ("zero1", "zero2"):
        return zero.ZeroDataParallel(model, stage=int(sharding[-1]), group=group)
    if units is None:
        units = recompute.recomputation_units(model)
    return fsdp.FullyShardedDataParallel(model, group=group, auto_wrap_policy=units, **fsdp_options)
