"""Collectives, and how many bytes each one makes every rank send.

Every parallelism in this course is built from a handful of communication patterns. The
wrappers here have the signatures of ``torch.distributed`` (they call it: the transport is
PyTorch's), and each call is also written into every active ``CommLog``, so a lesson can compare
the traffic it measured with the traffic theory predicts.

One module per idea: the collectives are here and point to point in ``p2p``; ``ledger`` counts
the bytes (``CommLog``, ``ring_bytes``); ``calls`` is how each call goes out (checked, logged,
timed, shown to the instruments of ``hooks``); ``ring`` builds the all-reduce from sends and
receives. ``comm`` is the one door: it offers every wrapper and the ledger, so a lesson imports
``comm`` alone.

``ring.ring_all_reduce`` builds the all-reduce from ``send``/``recv`` to show where the 2(N-1)/N comes
from: N-1 steps of reduce-scatter, then N-1 steps of all-gather, each moving one N-th of the
tensor to the right-hand neighbour.

Papers: the ring all-reduce and why it is bandwidth-optimal, Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009; the per-operation costs
and the latency-bandwidth (alpha-beta) model, Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..checks import check_choice
from ..errors import UserError
from . import collective_check, hooks, runtime  # noqa: F401 (collective_check: installed on import)
from .calls import POINT_TO_POINT, Call, all_gather_single, calls_on, check_tensors, issue
from .ledger import CommLog, CommRecord, bus_bandwidth, nbytes, ring_bytes
from .p2p import irecv, isend, recv, send, send_recv

__all__ = [
    "Call",
    "CommLog",
    "CommRecord",
    "POINT_TO_POINT",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "bus_bandwidth",
    "gather",
    "irecv",
    "isend",
    "nbytes",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "ring_bytes",
    "scatter",
    "send",
    "send_recv",
]

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}
"""Plus "mean", done as a sum divided by N (gloo has no AVG for any dtype, and the division is the lesson)."""


def _reduce_op(op: str):
    if op == "mean":
        return dist.ReduceOp.SUM
    return REDUCE_OPS[check_choice("reduction", op, (*REDUCE_OPS, "mean"))]


def _mean_divider(tensor: torch.Tensor, op: str, group) -> Callable[[], None] | None:
    if op != "mean":
        return None
    if not tensor.is_floating_point():
        raise UserError(
            f"the mean of a {tensor.dtype} tensor is not a {tensor.dtype}: use op='sum' or a float tensor"
        )
    size = runtime.world_size(group=group)
    return lambda: tensor.div_(size)


# torch 2.14 renamed the tensor-to-tensor collectives (the old names still work, with a warning;
# ``calls.all_gather_single`` is the other one).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# #region all-reduce
def all_reduce(tensor: torch.Tensor, *, op: str = "sum", group=None, async_op: bool = False):
    """Every rank ends with the reduction (sum, mean, min, max, product) of all ``tensor``s, in place.

    Args:
        tensor: this rank's contribution, overwritten with the result.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"``.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("all_reduce", tensor=tensor)
    tensor, group = hooks.substituted("all_reduce", calls_on.get(group, 0), tensor, group)
    reduce_op, divide = _reduce_op(op), _mean_divider(tensor, op, group)
    return issue(
        "all_reduce",
        nbytes(tensor),
        group,
        lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op),
        async_op,
        divide,
        tensor=tensor,
    )


# #endregion all-reduce


def all_reduce_coalesced(tensors: list[torch.Tensor], *, op: str = "sum", group=None) -> None:
    """All-reduce many tensors as one: copied into one flat buffer, reduced once, copied back.

    A collective pays its latency once per call however small it is, so a hundred small
    gradients (the norms' weights and biases) cost a hundred latencies one by one and one
    latency together; the copies in and out are cheap beside it. Megatron-LM reduces its
    layer-norm gradients this way, and DDP's buckets are the same idea.

    Args:
        tensors: this rank's contributions, same dtype and device, each overwritten with its result.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"``.
        group: the process group (None: every rank); every member must make the same call.
    """
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, op=op, group=group)
    for tensor, reduced in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(reduced.view_as(tensor))


def broadcast(tensor: torch.Tensor, *, src: int = 0, group=None, async_op: bool = False):
    """Every rank ends with rank ``src``'s ``tensor``.

    Args:
        tensor: the data on ``src``; on the other ranks, overwritten with it.
        src: the global rank that sends.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("broadcast", tensor=tensor)
    return issue(
        "broadcast",
        nbytes(tensor),
        group,
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
        async_op,
        tensor=tensor,
    )


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, *, group=None, async_op: bool = False):
    """``output`` (N times larger along dim 0) gets every rank's ``tensor``, in rank order.

    Args:
        output: where the N pieces are written, one after the other.
        tensor: this rank's piece.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("all_gather_into_tensor", output=output, tensor=tensor)
    return issue(
        "all_gather",
        nbytes(output),
        group,
        lambda: all_gather_single(output, tensor, group=group, async_op=async_op),
        async_op,
        tensor=tensor,
    )


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, *, group=None, async_op: bool = False):
    """``tensor_list[i]`` gets rank i's ``tensor``.

    Args:
        tensor_list: N tensors the pieces are written to.
        tensor: this rank's piece.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("all_gather", tensor_list=tensor_list, tensor=tensor)
    return issue(
        "all_gather",
        sum(nbytes(t) for t in tensor_list),
        group,
        lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op),
        async_op,
        tensor=tensor,
    )


def reduce_scatter_tensor(
    output: torch.Tensor, tensor: torch.Tensor, *, op: str = "sum", group=None, async_op: bool = False
):
    """Reduce everyone's ``tensor`` and give rank i the i-th N-th of the result, in ``output``.

    Args:
        output: this rank's share of the result (1/N of ``tensor`` along dim 0).
        tensor: this rank's full contribution.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"``.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("reduce_scatter_tensor", output=output, tensor=tensor)
    reduce_op, divide = _reduce_op(op), _mean_divider(output, op, group)
    return issue(
        "reduce_scatter",
        nbytes(tensor),
        group,
        lambda: reduce_scatter_single(output, tensor, op=reduce_op, group=group, async_op=async_op),
        async_op,
        divide,
        tensor=tensor,
    )


def reduce_scatter(
    output: torch.Tensor,
    tensor_list: list[torch.Tensor],
    *,
    op: str = "sum",
    group=None,
    async_op: bool = False,
):
    """Rank i gets the reduction of everyone's ``tensor_list[i]`` (the pieces may differ in size).

    Args:
        output: this rank's reduced piece.
        tensor_list: this rank's contribution, cut into N pieces.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"``.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("reduce_scatter", output=output, tensor_list=tensor_list)
    reduce_op, divide = _reduce_op(op), _mean_divider(output, op, group)
    return issue(
        "reduce_scatter",
        sum(nbytes(t) for t in tensor_list),
        group,
        lambda: dist.reduce_scatter(output, tensor_list, op=reduce_op, group=group, async_op=async_op),
        async_op,
        divide,
        tensor=output,
        check_shape=tuple(t.numel() for t in tensor_list),
    )


def reduce(tensor: torch.Tensor, *, dst: int = 0, op: str = "sum", group=None, async_op: bool = False):
    """Rank ``dst`` ends with the reduction of everyone's ``tensor`` (the others' tensors are scratch).

    Args:
        tensor: this rank's contribution; on ``dst``, overwritten with the result.
        dst: the global rank that receives the result.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"``.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("reduce", tensor=tensor)
    reduce_op = _reduce_op(op)
    divide = _mean_divider(tensor, op, group) if runtime.rank() == dst else None
    return issue(
        "reduce",
        nbytes(tensor),
        group,
        lambda: dist.reduce(tensor, dst=dst, op=reduce_op, group=group, async_op=async_op),
        async_op,
        divide,
        tensor=tensor,
    )


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    *,
    dst: int = 0,
    group=None,
    async_op: bool = False,
):
    """Rank ``dst`` gets everyone's ``tensor`` in ``gather_list``.

    Args:
        tensor: this rank's piece.
        gather_list: on ``dst``, N tensors the pieces are written to; None on the other ranks.
        dst: the global rank that receives.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("gather", tensor=tensor, gather_list=gather_list)
    total = nbytes(tensor) * runtime.world_size(group=group)
    return issue(
        "gather",
        total,
        group,
        lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op),
        async_op,
        sent_bytes=0.0
        if runtime.rank() == dst
        else ring_bytes("gather", total, runtime.world_size(group=group)),
        tensor=tensor,
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None,
    *,
    src: int = 0,
    group=None,
    async_op: bool = False,
):
    """Rank i gets ``scatter_list[i]`` of rank ``src`` into ``tensor``.

    Args:
        tensor: where this rank's piece is written.
        scatter_list: on ``src``, the N pieces to hand out; None on the other ranks.
        src: the global rank that sends.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("scatter", tensor=tensor, scatter_list=scatter_list)
    total = nbytes(tensor) * runtime.world_size(group=group)
    return issue(
        "scatter",
        total,
        group,
        lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op),
        async_op,
        sent_bytes=ring_bytes("scatter", total, runtime.world_size(group=group))
        if runtime.rank() == src
        else 0.0,
        tensor=tensor,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
    async_op: bool = False,
):
    """Every rank sends piece j of its ``input`` to rank j, and receives rank j's piece i into ``output``.

    The exchange of expert parallelism: each rank holds tokens for every expert, and each expert
    lives on one rank, so the tokens are dealt out (dispatch) and their results dealt back (combine).

    Args:
        output: where the received pieces land, in rank order.
        input: this rank's pieces, in rank order, cut along dimension 0.
        output_split_sizes: the rows received from each rank (None: equal pieces).
        input_split_sizes: the rows sent to each rank (None: equal pieces).
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    check_tensors("all_to_all_single", output=output, input=input)
    size, rank = runtime.world_size(group=group), runtime.rank(group=group)
    row_bytes = nbytes(input) / max(input.shape[0], 1) if input.dim() else nbytes(input)
    if input_split_sizes is None:
        sent = ring_bytes("all_to_all", nbytes(input), size)
    else:
        if len(input_split_sizes) != size or sum(input_split_sizes) != input.shape[0]:
            raise UserError(
                f"input_split_sizes {input_split_sizes} must give one row count per rank ({size}) summing to "
                f"the input's {input.shape[0]} rows"
            )
        sent = row_bytes * (sum(input_split_sizes) - input_split_sizes[rank])
    return issue(
        "all_to_all",
        nbytes(input),
        group,
        lambda: dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        ),
        async_op,
        sent_bytes=sent,
        tensor=input,
        check_shape=tuple(input.shape[1:]),
    )


def barrier(*, group=None, async_op: bool = False):
    """Wait until every rank of the group has arrived.

    Args:
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    return issue("barrier", 0, group, lambda: dist.barrier(group=group, async_op=async_op), async_op)
