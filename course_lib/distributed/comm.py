"""Collectives, and how many bytes each one makes every rank send.

Every parallelism in this course is built from a handful of communication patterns. The
wrappers here have the signatures of ``torch.distributed`` (they call it: the transport is
PyTorch's), and each call is also written into every active ``CommLog``, so a lesson can compare
the traffic it measured with the traffic theory predicts.

Bytes per rank. For a tensor of S bytes and a group of N ranks, the classic bandwidth-optimal
(ring) algorithms make each rank send:

==================  ===================  ====================================================
operation           bytes sent per rank  why
==================  ===================  ====================================================
all_reduce          2 (N-1)/N · S        a reduce-scatter, then an all-gather
reduce_scatter      (N-1)/N · S          S is the full input; each rank keeps 1/N of the sum
all_gather          (N-1)/N · S          S is the full output; each rank contributes 1/N
broadcast, reduce   S                    every rank but the last forwards the tensor once
gather              S/N; the root: 0     each rank sends its share; the root receives (N-1)/N · S
scatter             (N-1)/N · S at root  the root sends each other rank its share; the others send 0
all_to_all          (N-1)/N · S          S is this rank's input: it keeps 1/N, each other rank
                                         gets another 1/N (expert parallelism's exchange)
send / recv         S / 0                point to point
barrier             0
==================  ===================  ====================================================

(This is NCCL's "bus bandwidth" accounting; with N = 1 nothing is sent.) A benchmark that
all-reduces S bytes in T seconds reports two rates: the *algorithm bandwidth* S/T, which
depends on N, and the *bus bandwidth* S/T x 2(N-1)/N (``bus_bandwidth``), the rate each rank's
link really carried, which can be compared with the link's speed at any N. Note the 2 in
all-reduce: data parallelism sends about twice the model's gradient bytes per step, *whatever
N is*. Adding ranks adds no bytes per rank: data parallelism scales in bandwidth. It does not
scale for free in time: the ring's 2(N-1) messages each pay a latency (a term 2(N-1)·alpha that
grows with N), and under strong scaling the compute that could hide the communication shrinks
as 1/N (``scaling.strong_scaling_seconds``).

``ring.ring_all_reduce`` builds the all-reduce from ``send``/``recv`` to show where the 2(N-1)/N comes
from: N-1 steps of reduce-scatter, then N-1 steps of all-gather, each moving one N-th of the
tensor to the right-hand neighbour.

Papers: the ring all-reduce and why it is bandwidth-optimal, Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009; the per-operation costs
and the latency-bandwidth (alpha-beta) model, Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import UserError
from . import hooks, runtime

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}
"""Plus "mean", done as a sum divided by N (gloo has no AVG for integers, and the division is the lesson)."""


# -- the ledger -----------------------------------------------------------------------------


@dataclass
class CommRecord:
    op: str
    tensor_bytes: int  # S: the full tensor (the output of all_gather, the input of reduce_scatter)
    bytes_per_rank: float  # what the ring algorithm makes each rank send
    group_size: int
    seconds: float | None = None  # launch to completion (async: until wait() returned)
    group_ranks: tuple[int, ...] = ()  # the global ranks of the group
    sequence: int = 0  # this collective's number on its group, from 0, the same on every rank (-1: p2p)
    issued_s: float = 0.0  # when this rank called it (time.time(): one clock for the ranks of a machine)


def ring_bytes(op: str, tensor_bytes: int, group_size: int) -> float:
    """Bytes each rank sends for ``op`` on a tensor of ``tensor_bytes`` (see the module's table).

    Args:
        op: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``, ``"broadcast"``, ``"reduce"``,
            ``"gather"``, ``"scatter"``, ``"send"``, ``"recv"`` or ``"barrier"``.
        tensor_bytes: S, the full tensor (the output of an all-gather, the input of a reduce-scatter).
        group_size: N, the ranks taking part.
    """
    n = group_size
    if n <= 1 or op == "barrier" or op == "recv":
        return 0.0
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "gather": 1 / n,  # a rank that is not the root; the root sends nothing
        "all_to_all": (n - 1) / n,
        "scatter": (n - 1) / n,  # the root; the others send nothing
        "broadcast": 1.0,
        "reduce": 1.0,
        "send": 1.0,
    }[op]
    return factor * tensor_bytes


def bus_bandwidth(op: str, algorithm_bandwidth: float, group_size: int) -> float:
    """The rate a rank's link carried: the algorithm bandwidth S/T times ``ring_bytes``' factor.

    This is how ``nccl-tests`` report "busbw": for an all-reduce, algbw x 2(N-1)/N. A ring that
    runs at the link's speed shows a bus bandwidth equal to that speed, whatever N is.

    Args:
        op: the collective, as in ``ring_bytes`` (``"all_reduce"``, ``"all_gather"``...).
        algorithm_bandwidth: S / T, the tensor's bytes over the operation's seconds.
        group_size: N, the ranks taking part.
    """
    return ring_bytes(op, 1, group_size) * algorithm_bandwidth


_active_logs: list[CommLog] = []
_calls_on: dict[object, int] = {}  # collectives made so far on each process group (None: the world)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "send_recv")


class CommLog:
    """Record every collective made through this module while the ``with`` block runs.

    >>> with CommLog() as log:
    ...     all_reduce(grad)
    >>> print(log.summary())
    """

    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommLog:
        _active_logs.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_logs.remove(self)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def bytes_per_rank(self, op: str | None = None) -> float:
        return sum(r.bytes_per_rank for r in self.records if op is None or r.op == op)

    def totals(self) -> dict[str, dict[str, float]]:
        table: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "tensor_bytes": 0, "bytes_per_rank": 0.0, "seconds": 0.0}
        )
        for record in self.records:
            row = table[record.op]
            row["calls"] += 1
            row["tensor_bytes"] += record.tensor_bytes
            row["bytes_per_rank"] += record.bytes_per_rank
            row["seconds"] += record.seconds or 0.0
        return dict(table)

    def summary(self) -> str:
        lines = [f"{'operation':<16}{'calls':>7}{'tensor MB':>12}{'sent/rank MB':>14}{'seconds':>10}"]
        for op, row in sorted(self.totals().items()):
            lines.append(
                f"{op:<16}{row['calls']:>7}{row['tensor_bytes'] / 1e6:>12.3f}"
                f"{row['bytes_per_rank'] / 1e6:>14.3f}{row['seconds']:>10.4f}"
            )
        lines.append(f"{'total':<16}{self.count():>7}{'':>12}{self.bytes_per_rank() / 1e6:>14.3f}")
        return "\n".join(lines)


class _SkippedWork:
    """The handle of a call an instrument skipped (a fault on purpose): nothing to wait for."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _LoggedWork:
    """The handle of an asynchronous call: ``wait()`` also finishes the record (and any post-step)."""

    def __init__(self, work, call: Call, started: float, after: Callable[[], None] | None):
        self._work, self._call, self._started, self._after = work, call, started, after
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            try:
                self._work.wait()
            except Exception as error:
                for hook in hooks.collective_hooks:
                    hook.failed(self._call, error)
                raise
            if self._after is not None:
                self._after()
            self._call.record.seconds = time.perf_counter() - self._started
            for hook in hooks.collective_hooks:
                hook.completed(self._call)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()


# -- what every call checks ----------------------------------------------------------------


def _check_tensors(op: str, **named) -> None:
    """Each argument is what ``op`` takes (a tensor, or a list of tensors) on a device the backend uses."""
    for name, value in named.items():
        if name.endswith("_list"):
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
                raise UserError(
                    f"comm.{op}: {name} must be a list of tensors, one per rank of the group, got "
                    f"{type(value).__name__}"
                )
            _check_device(*value)
        elif not isinstance(value, torch.Tensor):
            raise UserError(
                f"comm.{op}: {name} must be one torch.Tensor, got {type(value).__name__}: stack the values "
                f"into one tensor (torch.stack), or call {op} once per tensor"
            )
        else:
            _check_device(value)


def _check_device(*tensors: torch.Tensor) -> None:
    backend = dist.get_backend()
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.device.type == "meta" or (backend == "nccl" and tensor.device.type != "cuda"):
            wanted = "cuda" if backend == "nccl" else "cpu (or cuda)"
            raise UserError(
                f"a {tuple(tensor.shape)} tensor on {tensor.device} was passed to a {backend} collective, "
                f"which needs {wanted} tensors: move it with "
                "tensor.to(course_lib.distributed.runtime.process_info().device)"
            )


@dataclass
class Call:
    """One collective as it goes out, for the ledger and for the hooks (``hooks.CollectiveHook``)."""

    op: str
    record: CommRecord
    group: object
    tensor: torch.Tensor | None = None  # the one the ranks' calls must agree on, if any
    check_shape: tuple[int, ...] | None = None  # what of its shape must agree, when not all of it
    peer: int | None = None  # the other rank of a send or a receive
    notes: dict = field(default_factory=dict)  # what a hook keeps between issued and completed


def _run(
    op: str,
    tensor_bytes: int,
    group,
    call: Callable[[], object],
    async_op: bool,
    after: Callable[[], None] | None = None,
    sent_bytes: float | None = None,
    *,
    tensor: torch.Tensor | None = None,
    peer: int | None = None,
    check_shape: tuple[int, ...] | None = None,
):
    """Call ``call()`` (a torch.distributed operation), log it, and finish with ``after`` when complete.

    ``sent_bytes``: what this rank sends, when the formula of ``ring_bytes`` does not say it (an
    all-to-all with uneven pieces). ``tensor``: the one the ranks' calls must agree on and the
    instruments describe; ``check_shape``: what of its shape must agree, when not all of it;
    ``peer``: the other rank of a send or receive. The instruments (``hooks.collective_hooks``)
    see the call before it goes out, and when it completed or failed.
    """
    sequence = -1 if op in POINT_TO_POINT else _calls_on.get(group, 0)  # point to point: no order
    if not all(hook.intercept(op, sequence) for hook in hooks.collective_hooks):
        return _SkippedWork() if async_op else None  # as if the line that makes it had not run
    if sequence >= 0:
        _calls_on[group] = sequence + 1
    size = runtime.world_size(group=group)
    sent = ring_bytes(op, tensor_bytes, size) if sent_bytes is None else sent_bytes
    record = CommRecord(op, tensor_bytes, sent, size, sequence=sequence, issued_s=time.time())
    if _active_logs or hooks.collective_hooks:
        record.group_ranks = (
            tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(size))
        )
    for log in _active_logs:
        log.records.append(record)
    described = Call(op, record, group, tensor=tensor, check_shape=check_shape, peer=peer)
    started = time.perf_counter()  # a check, when one runs, is where a rank waits for the others
    try:
        for hook in hooks.collective_hooks:
            hook.issued(described)
        work = call()
        if not async_op:
            if after is not None:
                after()
            record.seconds = time.perf_counter() - started
            for hook in hooks.collective_hooks:
                hook.completed(described)
            return None
    except Exception as error:
        for hook in hooks.collective_hooks:
            hook.failed(described, error)
        raise
    return _LoggedWork(work, described, started, after)


def _reduce_op(op: str):
    if op == "mean":
        return dist.ReduceOp.SUM
    if op not in REDUCE_OPS:
        raise UserError(f"unknown reduction {op!r}: choose one of sum, mean, min, max, product")
    return REDUCE_OPS[op]


def _mean_divider(tensor: torch.Tensor, op: str, group) -> Callable[[], None] | None:
    if op != "mean":
        return None
    if not tensor.is_floating_point():
        raise UserError(
            f"the mean of a {tensor.dtype} tensor is not a {tensor.dtype}: use op='sum' or a float tensor"
        )
    size = runtime.world_size(group=group)
    return lambda: tensor.div_(size)


# -- the collectives ------------------------------------------------------------------------

# torch 2.14 renamed the tensor-to-tensor collectives (the old names still work, with a warning).
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements.

    Args:
        tensor: any tensor.
    """
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, *, op: str = "sum", group=None, async_op: bool = False):
    """Every rank ends with the reduction (sum, mean, min, max, product) of all ``tensor``s, in place.

    Args:
        tensor: this rank's contribution, overwritten with the result.
        op: ``"sum"``, ``"mean"``, ``"min"``, ``"max"`` or ``"product"``.
        group: the process group (None: every rank); every member must make the same call.
        async_op: return a work handle at once (``handle.wait()`` before using the result)
            instead of blocking until the collective is done.
    """
    _check_tensors("all_reduce", tensor=tensor)
    for hook in hooks.collective_hooks:  # an instrument may change them (a fault on purpose)
        tensor, group = hook.substitute("all_reduce", _calls_on.get(group, 0), tensor, group)
    reduce_op, divide = _reduce_op(op), _mean_divider(tensor, op, group)
    return _run(
        "all_reduce",
        nbytes(tensor),
        group,
        lambda: dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op),
        async_op,
        divide,
        tensor=tensor,
    )


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
    _check_tensors("broadcast", tensor=tensor)
    return _run(
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
    _check_tensors("all_gather_into_tensor", output=output, tensor=tensor)
    return _run(
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
    _check_tensors("all_gather", tensor_list=tensor_list, tensor=tensor)
    return _run(
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
    _check_tensors("reduce_scatter_tensor", output=output, tensor=tensor)
    reduce_op, divide = _reduce_op(op), _mean_divider(output, op, group)
    return _run(
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
    _check_tensors("reduce_scatter", output=output, tensor_list=tensor_list)
    reduce_op, divide = _reduce_op(op), _mean_divider(output, op, group)
    return _run(
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
    _check_tensors("reduce", tensor=tensor)
    reduce_op = _reduce_op(op)
    divide = _mean_divider(tensor, op, group) if runtime.rank() == dst else None
    return _run(
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
    _check_tensors("gather", tensor=tensor, gather_list=gather_list)
    total = nbytes(tensor) * runtime.world_size(group=group)
    return _run(
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
    _check_tensors("scatter", tensor=tensor, scatter_list=scatter_list)
    total = nbytes(tensor) * runtime.world_size(group=group)
    return _run(
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
    _check_tensors("all_to_all_single", output=output, input=input)
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
    return _run(
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
    return _run("barrier", 0, group, lambda: dist.barrier(group=group, async_op=async_op), async_op)


def send(tensor: torch.Tensor, dst: int, *, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to one rank and wait until it is handed over.

    Args:
        tensor: what to send.
        dst: the global rank that receives (it must call ``recv``).
        group: the process group ``dst`` is counted in (None: every rank).
        tag: tells apart messages between the same two ranks.
    """
    _check_tensors("send", tensor=tensor)
    _run(
        "send",
        nbytes(tensor),
        group,
        lambda: dist.send(tensor, dst=dst, group=group, tag=tag),
        False,
        tensor=tensor,
        peer=dst,
    )


def recv(tensor: torch.Tensor, src: int, *, group=None, tag: int = 0) -> None:
    """Receive into ``tensor`` what rank ``src`` sends; blocks until it has arrived.

    Args:
        tensor: where the message is written (the sender's shape and dtype).
        src: the global rank that sends.
        group: the process group (None: every rank).
        tag: the sender's tag.
    """
    _check_tensors("recv", tensor=tensor)
    _run(
        "recv",
        nbytes(tensor),
        group,
        lambda: dist.recv(tensor, src=src, group=group, tag=tag),
        False,
        tensor=tensor,
        peer=src,
    )


def isend(tensor: torch.Tensor, dst: int, *, group=None, tag: int = 0):
    """``send`` without waiting: returns a work handle; keep ``tensor`` unchanged until ``wait()``.

    Args:
        tensor: what to send.
        dst: the global rank that receives.
        group: the process group (None: every rank).
        tag: tells apart messages between the same two ranks.
    """
    _check_tensors("isend", tensor=tensor)
    return _run(
        "send",
        nbytes(tensor),
        group,
        lambda: dist.isend(tensor, dst=dst, group=group, tag=tag),
        True,
        tensor=tensor,
        peer=dst,
    )


def irecv(tensor: torch.Tensor, src: int, *, group=None, tag: int = 0):
    """``recv`` without waiting: returns a work handle; ``tensor`` holds the message after ``wait()``.

    Args:
        tensor: where the message is written.
        src: the global rank that sends.
        group: the process group (None: every rank).
        tag: the sender's tag.
    """
    _check_tensors("irecv", tensor=tensor)
    return _run(
        "recv",
        nbytes(tensor),
        group,
        lambda: dist.irecv(tensor, src=src, group=group, tag=tag),
        True,
        tensor=tensor,
        peer=src,
    )


class _AllWork:
    """Several handles waited on as one."""

    def __init__(self, works):
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def send_recv(
    send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int, *, group=None, tag: int = 0
):
    """Send to one rank and receive from another, posted together; returns a handle to ``wait()`` on.

    The step of every ring (ring attention passes keys and values on this way): each rank sends
    to its right-hand neighbour while it receives from its left-hand one. Posting both at once
    (``batch_isend_irecv``) is what keeps NCCL from deadlocking when two ranks are each other's
    neighbours, and lets the caller compute while the message travels.

    Args:
        send_tensor: what to send; keep it unchanged until ``wait()``.
        dst: the global rank that receives it.
        recv_tensor: where the message from ``src`` is written (after ``wait()``).
        src: the global rank that sends to this one.
        group: the process group the ranks are in (None: every rank).
        tag: tells apart two exchanges in flight between the same ranks.
    """
    _check_tensors("send_recv", send_tensor=send_tensor, recv_tensor=recv_tensor)
    operations = [
        dist.P2POp(dist.isend, send_tensor, dst, group, tag),
        dist.P2POp(dist.irecv, recv_tensor, src, group, tag),
    ]
    received = CommRecord("recv", nbytes(recv_tensor), 0.0, runtime.world_size(group=group), sequence=-1)
    for log in _active_logs:
        log.records.append(received)
    return _run(
        "send",
        nbytes(send_tensor),
        group,
        lambda: _AllWork(dist.batch_isend_irecv(operations)),
        True,
        tensor=send_tensor,
        peer=dst,
    )
