"""Solution of lab 11: collective matmul, the ring loop that hides tensor parallelism's communication.

Sequence parallelism all-gathers the tokens before a column-parallel layer and reduce-scatters the
partial sums after a row-parallel one. Plain, the matmul waits for the whole collective. Cut into
its T ring steps, each step's matmul runs on the chunk at hand while the next chunk travels:

- ``all_gather_matmul``: at step i you hold the tokens of rank (rank - i) mod T. Post the exchange
  (send them to the right, receive the next chunk from the left) *before* you multiply them, then
  wait. After T steps you hold every chunk and every chunk's product.
- ``matmul_reduce_scatter``: at step i compute your partial sum for chunk (rank - 1 - i) mod T
  while the running sum from the left travels; wait for it, add it, and pass the sum on. At the
  last step the chunk is your own, summed over every rank.

Check your work (every property, at 2, 3 and 4 processes):

    python -m course_lib.tools.labs check lab11_collective_matmul
"""

from __future__ import annotations

import torch

from course_lib.distributed import comm, runtime

SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


def neighbours(group=None) -> tuple[int, int, int, int]:
    """(T, this rank's place in the group, the global rank on its right, the one on its left)."""
    return runtime.world_size(group=group), runtime.rank(group=group), *runtime.ring_neighbours(group=group)


def all_gather_matmul(
    shard: torch.Tensor, matrix: torch.Tensor, *, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gathered sequence, the gathered sequence @ ``matrix``), each chunk multiplied as it arrives.

    Args:
        shard: (batch, S/T, k), this rank's tokens.
        matrix: (k, n), this rank's slice of a column-parallel layer's weight, transposed.
        group: the tensor-parallel process group (None: every rank).
    """
    size, rank, right, left = neighbours(group)
    # BEGIN SOLUTION: every rank starts with its own chunk and must end with all T of them; in T - 1 steps each chunk can move one neighbour further round the ring while you multiply the chunk you already hold. Pitfall: a wait placed before your matmul leaves nothing to overlap; and keep track of whose chunk you hold, which decides where its product goes
    chunks, products = [None] * size, [None] * size
    here = shard.contiguous()
    for step in range(size):
        owner = (rank - step) % size
        if step < size - 1:
            arriving = torch.empty_like(here)
            exchange = comm.send_recv(here, right, arriving, left, group=group)
        chunks[owner], products[owner] = here, here @ matrix
        if step < size - 1:
            exchange.wait()
            here = arriving
    return torch.cat(chunks, dim=SEQUENCE_DIM), torch.cat(products, dim=SEQUENCE_DIM)
    # END SOLUTION


def matmul_reduce_scatter(x: torch.Tensor, matrix: torch.Tensor, *, group=None) -> torch.Tensor:
    """This rank's tokens of the sum over the group of ``x @ matrix``, each chunk summed on its way round.

    Args:
        x: (batch, S, k), the whole sequence (S a multiple of T): this rank's input of a row-parallel
            layer.
        matrix: (k, n), this rank's slice of that layer's weight, transposed.
        group: the tensor-parallel process group (None: every rank).
    """
    size, rank, right, left = neighbours(group)
    pieces = x.chunk(size, dim=SEQUENCE_DIM)
    # BEGIN SOLUTION: the mirror of the gather: a running sum travels round the ring, and every rank adds its partial product for the chunk that sum belongs to, so that after T - 1 hops each sum arrives whole at the rank that owns it. Pitfall: compute your partial product before you wait for the incoming sum, or nothing overlaps; which chunk you start with decides where each sum ends
    travelling = exchange = None
    for step in range(size):
        owner = (rank - 1 - step) % size
        partial = pieces[owner] @ matrix
        if exchange is not None:
            exchange.wait()
            partial = partial + travelling
        if step == size - 1:
            return partial
        travelling = torch.empty_like(partial)
        exchange = comm.send_recv(partial.contiguous(), right, travelling, left, group=group)
    raise AssertionError("unreachable: the loop returns at its last step")
    # END SOLUTION
