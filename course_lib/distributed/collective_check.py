"""Every rank of a group must make the same call: a check before each collective, in one line.

A collective is a meeting: every rank of the group must call the same operation, in the same
order, with tensors of the same shape and dtype. When one rank calls something else (a branch
taken on one rank only, a tensor shaped by a rank-dependent size), the transport does not say
so: gloo aborts the process ("terminate called"), or a broadcast copies part of a tensor and
goes on; NCCL hangs until its timeout. This instrument makes each collective first all-gather a
small fingerprint of the call (operation, dtype, shape) from every rank of its group and
compare them, so the mistake is refused at once, on every rank, with what each rank called:

    comm: the ranks made different calls (rank 0: all_reduce of float32 (3,); rank 1: ...)

Cost: one small all-gather more per collective, and a wait for its answer, the price of a clear
error. ``COURSE_CHECK_COLLECTIVES`` says where it runs: ``1`` on, ``0`` off (``launch`` sets it:
on unless told not to), unset on with gloo (every CPU run: under ``launch``, torchrun, srun or a
notebook) and off with NCCL, where the wait would stall the GPU's stream at every collective
(set ``1`` there to debug a hang, as PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). It never runs
inside ``unchecked()``, which a timing uses.

``comm`` imports this module, and importing it installs it (``course_lib.distributed.hooks``):
a check that guards correctness is on wherever the course's collectives can run, not only where
some import happened to load it.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist

from ..errors import UserError
from . import hooks, runtime
from .calls import Call, all_gather_single

_FINGERPRINT_DIMS = 6
_OPS = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
_unchecked_depth = 0


@contextlib.contextmanager
def unchecked():
    """Collectives inside skip the cross-rank check: for timing them, since the check is a collective too."""
    global _unchecked_depth
    _unchecked_depth += 1
    try:
        yield
    finally:
        _unchecked_depth -= 1


def _checking(group) -> bool:
    if _unchecked_depth:
        return False
    setting = os.environ.get(hooks.CHECK_COLLECTIVES)
    if setting in ("0", "1"):
        return setting == "1"
    return dist.get_backend(group) == "gloo"


def _fingerprint(op: str, dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> list[int]:
    dims = list(shape[:_FINGERPRINT_DIMS]) + [-1] * (_FINGERPRINT_DIMS - len(shape[:_FINGERPRINT_DIMS]))
    dtype_code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + hash(str(dtype)) % 1000
    return [_OPS.index(op), dtype_code, len(shape), numel, *dims]


def _describe(row: list[int]) -> str:
    op, dtype_code, ndim, numel, *dims = row
    dtype = str(_DTYPES[dtype_code]).removeprefix("torch.") if dtype_code < len(_DTYPES) else "another dtype"
    shape = tuple(dims[: min(ndim, _FINGERPRINT_DIMS)])
    return f"{_OPS[op]} of {dtype} {shape if ndim <= _FINGERPRINT_DIMS else f'{shape}... ({numel} elements)'}"


def check_same_call(op: str, tensor: torch.Tensor, group, *, shape: tuple[int, ...] | None = None) -> None:
    """Refuse, in one line on every rank, a call that the group's ranks do not all make alike.

    ``shape``: what must agree, when not the tensor's whole shape (an all-to-all's rows differ).
    """
    size = runtime.world_size(group=group)
    if size == 1 or not _checking(group):
        return
    shape = tuple(tensor.shape) if shape is None else shape
    mine = torch.tensor(_fingerprint(op, tensor.dtype, shape, math.prod(shape)), device=tensor.device)
    everyone = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
    all_gather_single(everyone, mine, group=group)  # the transport's own: not a collective of the ledger
    rows = everyone.view(size, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    calls = "; ".join(f"rank {rank}: {_describe(row)}" for rank, row in zip(ranks, rows))
    raise UserError(
        f"comm: the ranks made different calls ({calls}): every rank of the group must make the "
        "same collectives, in the same order, with tensors of the same shape and dtype"
    )


class CollectiveCheck(hooks.CollectiveHook):
    """Checks each collective's call across its group before it goes out (after it is recorded)."""

    order = 20  # after the flight recorder, which records the call a refusal fails

    def issued(self, call: Call) -> None:
        if call.tensor is not None and call.record.sequence >= 0:  # collectives, not point to point
            check_same_call(call.op, call.tensor, call.group, shape=call.check_shape)


hooks.register(CollectiveCheck())
