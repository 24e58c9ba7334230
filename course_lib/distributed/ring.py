"""The ring all-reduce, built by hand from sends and receives: where 2(N-1)/N comes from.

An all-reduce of S bytes over N ranks can be done as a ring: cut the tensor into N chunks, and
pass chunks to the right-hand neighbour. N-1 steps of reduce-scatter leave each rank with one
chunk summed over everyone; N-1 steps of all-gather pass the finished chunks round. Every rank
sent 2(N-1) chunks of S/N bytes, 2(N-1)/N · S, whatever N is: the bytes per rank do not grow
with the ranks, only the number of steps (each paying a latency) does. NCCL and gloo run this
algorithm (among others) inside ``all_reduce``; here it is written with ``comm.isend`` and
``comm.recv``, and the tests hold it equal to ``all_reduce``.

Paper: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009.
"""

from __future__ import annotations

import torch

from . import runtime
from .p2p import isend, recv


def ring_all_reduce_counts(n: int) -> list[list[list[int]]]:
    """What a ring all-reduce does, counted: after each step, how many ranks' values each chunk holds.

    ``frames[step][rank][chunk]``: in reduce-scatter step k, rank r sends chunk (r - k) mod n to
    rank r + 1, which adds it to its own; after n - 1 steps rank r holds the complete chunk
    (r + 1) mod n. In the n - 1 all-gather steps the complete chunks travel on round the ring.

    Args:
        n: the ranks in the ring (and chunks of the tensor).
    """
    counts = [[1] * n for _ in range(n)]
    frames = [[row[:] for row in counts]]
    for step in range(n - 1):
        sent = [(r, (r - step) % n, counts[r][(r - step) % n]) for r in range(n)]
        for r, chunk, value in sent:
            counts[(r + 1) % n][chunk] += value
        frames.append([row[:] for row in counts])
    for step in range(n - 1):
        sent = [(r, (r + 1 - step) % n, counts[r][(r + 1 - step) % n]) for r in range(n)]
        for r, chunk, value in sent:
            counts[(r + 1) % n][chunk] = value
        frames.append([row[:] for row in counts])
    return frames


# #region ring
def ring_all_reduce(tensor: torch.Tensor, *, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group in place, with the ring algorithm, from send/recv only.

    The tensor is cut into N chunks (``tensor_split``: lengths may differ by one). Ranks form a
    ring; each step every rank sends one chunk to its right neighbour and receives one from its
    left neighbour.

    1. Reduce-scatter, N-1 steps: at step s rank r sends chunk (r - s) mod N and adds the chunk
       (r - s - 1) mod N it receives. Afterwards rank r holds the complete sum of chunk (r + 1) mod N.
    2. All-gather, N-1 steps: each rank passes the finished chunks around the ring, so at step s
       rank r sends chunk (r + 1 - s) mod N and stores the chunk (r - s) mod N it receives.

    Each rank sent 2(N-1) chunks of S/N bytes: 2(N-1)/N · S, whatever N is.

    Args:
        tensor: this rank's contribution, overwritten with the sum.
        group: the ranks of the ring (None: every rank), in their order in the group.
    """
    n, rank = runtime.world_size(group=group), runtime.rank(group=group)
    if n == 1:
        return tensor
    right, left = runtime.ring_neighbours(group=group)
    work = tensor.contiguous().view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(torch.tensor_split(work, n))

    def exchange(send_index: int, receive_index: int) -> torch.Tensor:
        incoming = torch.empty_like(chunks[receive_index])
        # clone: we modify chunks while it flies
        outgoing = isend(chunks[send_index].clone(), right, group=group)
        recv(incoming, left, group=group)
        outgoing.wait()
        return incoming

    # #region ring-steps
    for step in range(n - 1):
        received = exchange((rank - step) % n, (rank - step - 1) % n)
        chunks[(rank - step - 1) % n] += received
    for step in range(n - 1):
        received = exchange((rank + 1 - step) % n, (rank - step) % n)
        chunks[(rank - step) % n].copy_(received)
    # #endregion ring-steps
    if work.data_ptr() != tensor.data_ptr():
        tensor.copy_(work.view_as(tensor))
    return tensor


# #endregion ring
