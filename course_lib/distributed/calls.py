"""How every call goes out: its tensors checked, its record written, the instruments told, its time taken.

Each wrapper in ``comm`` and ``p2p`` hands its ``torch.distributed`` call to ``issue``, which
numbers it on its group (the n-th collective of a group must be the same call on every rank),
writes its ``CommRecord`` into every running ``CommLog``, tells the instruments registered in
``hooks`` (they may skip it, refuse it, or record it), calls it, and times it until it completed:
for an asynchronous call, until its handle's ``wait()`` returned.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import PeerLeft, UserError
from . import hooks, runtime
from .ledger import CommRecord, active_logs, ring_bytes

calls_on: dict[object, int] = {}  # collectives made so far on each process group (None: the world)


POINT_TO_POINT = ("send", "recv", "isend", "irecv", "send_recv")

# torch 2.14 renamed the tensor-to-tensor collectives (the old names still work, with a warning).
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
"""The transport's all-gather into one tensor: ``comm`` issues it, and ``collective_check`` calls it
bare (its fingerprints are no collective of the ledger)."""


def report_failure(call: Call, error: Exception) -> None:
    """Tell the instruments that ``call`` failed; where the transport only says that a peer went
    away, raise what that means instead (the caller re-raises ``error`` otherwise)."""
    for hook in hooks.collective_hooks:
        hook.failed(call, error)
    if isinstance(error, UserError) or not any(sign in str(error) for sign in runtime.PEER_GONE):
        return
    raise PeerLeft(
        f"rank {runtime.rank()} waited in {call.op} for a rank that had gone: it crashed or was killed "
        "(read its output), or it finished without making this collective (every rank must make the "
        "same collectives, in the same order)"
    ) from None  # the transport's words ("a remote worker crashing") would name one cause of two


class SkippedWork:
    """The handle of a call an instrument skipped (a fault on purpose): nothing to wait for."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class LoggedWork:
    """The handle of an asynchronous call: ``wait()`` also finishes the record (and any post-step)."""

    def __init__(self, work, call: Call, started: float, after: Callable[[], None] | None):
        self._work, self._call, self._started, self._after = work, call, started, after
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            try:
                self._work.wait()
            except Exception as error:
                report_failure(self._call, error)
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


def check_tensors(op: str, **named) -> None:
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
            check_device(*value)
        elif not isinstance(value, torch.Tensor):
            raise UserError(
                f"comm.{op}: {name} must be one torch.Tensor, got {type(value).__name__}: stack the values "
                f"into one tensor (torch.stack), or call {op} once per tensor"
            )
        else:
            check_device(value)


def check_device(*tensors: torch.Tensor) -> None:
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


def _left_to_python(function: Callable) -> Callable:
    """``torch.compiler.disable(function)``, made at the first call rather than at import: the
    decorator imports ``torch._dynamo`` (two seconds of CPU), which a process that never makes a
    call (the planner, a command refusing a flag) need not pay for."""
    disabled: list[Callable] = []

    @functools.wraps(function)
    def at_first_call(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(function))
        return disabled[0](*args, **kwargs)

    return at_first_call


# A compiled block runs this eagerly, between two graphs (a graph break): its counters, records and
# hooks are Python state that a graph cannot hold. Traced instead, every call would change a counter
# the graph depends on and force a recompilation, until torch.compile gave up on the frame.
@_left_to_python
def issue(
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
    sequence = -1 if op in POINT_TO_POINT else calls_on.get(group, 0)  # point to point: no order
    if not all(hook.intercept(op, sequence) for hook in hooks.collective_hooks):
        return SkippedWork() if async_op else None  # as if the line that makes it had not run
    if sequence >= 0:
        calls_on[group] = sequence + 1
    size = runtime.world_size(group=group)
    sent = ring_bytes(op, tensor_bytes, size) if sent_bytes is None else sent_bytes
    record = CommRecord(op, tensor_bytes, sent, size, sequence=sequence, issued_s=time.time(), peer=peer)
    if active_logs or hooks.collective_hooks:
        record.group_ranks = (
            tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(size))
        )
    for log in active_logs:
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
        report_failure(described, error)
        raise
    return LoggedWork(work, described, started, after)
