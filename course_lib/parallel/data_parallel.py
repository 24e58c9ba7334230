"""The data axis's one verb: replicas that average their gradients, each sharding what it is told.

Data parallelism keeps D replicas of the model, each on 1/D of the batch, and averages their
gradients every step. What each replica keeps whole is the choice of the data axis
(``memory.SHARDINGS``): everything (DDP, ``parallel.ddp``), all but the optimizer state
(ZeRO-1) or the gradients too (ZeRO-2, ``parallel.zero``), or the parameters too (FSDP,
``parallel.fsdp``): each saves memory for more bytes or more messages on the wire
(``parallel.memory`` counts them). ``apply_data_parallel`` is the data axis's verb over the three
lessons (``zero.apply_zero`` and ``fsdp.apply_fsdp`` are the sharded lessons' own), as
torchtitan's ``apply_fsdp`` and ``apply_ddp`` are, applied last: its hooks must wrap every other technique.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020 (arXiv:1910.02054).
"""

from __future__ import annotations

from torch import nn

from ..checks import check_choice
from . import ddp, fsdp, zero
from .memory import SHARDINGS


def apply_data_parallel(
    model: nn.Module,
    group=None,
    *,
    sharding: str = "ddp",
    units: list[nn.Module] | None = None,
    **options,
) -> nn.Module:
    """``model`` wrapped so that the data axis averages its gradients, sharding what ``sharding`` says.

    Args:
        model: the module this rank trains (after every other verb).
        group: the data-parallel process group (None: every rank).
        sharding: ``"ddp"`` (``ddp.DataParallel``), ``"zero1"``/``"zero2"`` (``zero.apply_zero``)
            or ``"fsdp"`` (``fsdp.apply_fsdp``).
        units: FSDP's units, each gathered and freed whole (None: a transformer's blocks).
        options: the chosen wrapper's own options (DDP's ``bucket_mb``, FSDP's
            ``sharding_strategy``, ``cpu_offload``...).
    """
    check_choice("sharding", sharding, SHARDINGS)
    if sharding == "ddp":
        return ddp.DataParallel(model, group=group, **options)
    if sharding in ("zero1", "zero2"):
        return zero.apply_zero(model, group, stage=int(sharding[-1]), **options)
    return fsdp.apply_fsdp(model, group, units=units, **options)
