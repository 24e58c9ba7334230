"""Point to point: one rank sends, one receives, with no group-wide meeting.

A pipeline's stages pass activations forward and gradients back this way; a ring (the ring
all-reduce, ring attention) passes chunks to its right-hand neighbour. A send's bytes are counted
on the sender (``ring_bytes("send", S, N) = S``), a receive sends nothing. Unlike a collective,
point-to-point messages take no sequence number: each pair of ranks has its own order, and a
``tag`` tells apart two messages in flight between the same ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import runtime
from .calls import check_tensors, issue
from .ledger import CommRecord, active_logs, nbytes


def send(tensor: torch.Tensor, dst: int, *, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to one rank and wait until it is handed over.

    Args:
        tensor: what to send.
        dst: the global rank that receives (it must call ``recv``).
        group: the process group ``dst`` is counted in (None: every rank).
        tag: tells apart messages between the same two ranks.
    """
    check_tensors("send", tensor=tensor)
    issue(
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
    check_tensors("recv", tensor=tensor)
    issue(
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
    check_tensors("isend", tensor=tensor)
    return issue(
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
    check_tensors("irecv", tensor=tensor)
    return issue(
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
    check_tensors("send_recv", send_tensor=send_tensor, recv_tensor=recv_tensor)
    operations = [
        dist.P2POp(dist.isend, send_tensor, dst, group, tag),
        dist.P2POp(dist.irecv, recv_tensor, src, group, tag),
    ]
    received = CommRecord("recv", nbytes(recv_tensor), 0.0, runtime.world_size(group=group), sequence=-1)
    for log in active_logs:
        log.records.append(received)
    return issue(
        "send",
        nbytes(send_tensor),
        group,
        lambda: _AllWork(dist.batch_isend_irecv(operations)),
        True,
        tensor=send_tensor,
        peer=dst,
    )
