"""Collective matmul: sequence parallelism's all-gather and reduce-scatter hidden under their matmuls.

Sequence parallelism (``sequence``) all-gathers the tokens before the column-parallel layers (q,
k, v, fc1) and reduce-scatters the partial sums after the row-parallel ones (out, fc2). In the plain
version each collective runs whole, and the matmul waits for it: nothing hides. But a matmul works
token by token. The rows that are already here can be multiplied while the next ones travel. So
each collective is cut into its T ring steps, and each step's matmul runs on the chunk at hand while
the next chunk is in flight:

all-gather, then matmul (entering a region), on rank t of T:
    step i = 0 .. T-1: rank t holds the tokens of rank c = (t - i) mod T. It passes them to
    rank t + 1 and receives the next chunk from rank t - 1, and meanwhile computes Y[c] = X[c] W.
    After T steps it has every chunk (the gathered X, kept for the weights' gradient) and all of Y.

matmul, then reduce-scatter (leaving a region), on rank t of T:
    step i = 0 .. T-1: rank t computes its partial sum for chunk c = (t - 1 - i) mod T, P = X[c] W,
    while the running sum from rank t - 1 travels. It adds that sum to P and passes it to rank
    t + 1. At the last step c = t: the sum over every rank of its own tokens, which it keeps.

Backward, each is the other's transpose. The input gradient of all-gather-then-matmul is the sum
of every rank's dY W over the group, cut back to this rank's tokens: matmul-then-reduce-scatter.
The input gradient of matmul-then-reduce-scatter gathers dY and multiplies: all-gather-then-matmul.
So forward and backward both overlap.

What it costs: the same bytes as the plain collectives, (T-1)/T of the activation per rank each
way (the ledger counts T-1 sends of one chunk), but in T-1 messages instead of one collective. That
is T-1 latencies, and T matmuls of 1/T the rows, each less efficient on a GPU than one large one. It
pays when a chunk's matmul takes at least as long as the chunk's transfer
(``chunk_compute_to_transfer``). On a GPU the transfer runs on copy engines or NVLink and costs the
streaming multiprocessors little. On this machine's shared cores, gloo's threads compete with the
matmul for the cores, so the overlap moves work more than it removes it.

Papers and twins: Wang et al., "Overlap Communication with Dependent Computation via Decomposition
in Large Deep Learning Models", ASPLOS 2023 (collective matmul); the JAX scaling book's chapter
on tensor parallelism. PyTorch's twin is async tensor parallelism:
``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``. They need CUDA
(symmetric memory between the GPUs of a node) and are reached through ``torch.compile`` in
torchtitan. What they compute is ``torch.distributed._symmetric_memory``'s
``_fused_all_gather_matmul_fallback`` and ``_fused_matmul_reduce_scatter_fallback``, which run on
gloo; the tests hold this file equal to them.
"""

from __future__ import annotations

import torch

from ..distributed import collective_check, comm, runtime
from ..errors import UserError
from .tensor import SEQUENCE_DIM, RowParallelLinear, check_sequence_split


def _neighbours(group) -> tuple[int, int, int, int]:
    """(T, this rank's place in the group, the global rank on its right, the one on its left)."""
    return runtime.world_size(group=group), runtime.rank(group=group), *runtime.ring_neighbours(group=group)


# #region ring-steps
def all_gather_matmul(
    shard: torch.Tensor, matrices: list[torch.Tensor], *, group=None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gathered sequence and ``gathered @ matrix`` for each matrix, each chunk multiplied as it arrives.

    Args:
        shard: (batch, S/T, features), this rank's tokens.
        matrices: (features, n) matrices that read the same gathered input (q, k and v's weights).
        group: the tensor-parallel process group (None: every rank).
    """
    size, rank, right, left = _neighbours(group)
    chunks, products = [None] * size, [[None] * size for _ in matrices]
    here = shard.contiguous()
    # #region gather-ring
    for step in range(size):
        owner = (rank - step) % size  # whose tokens ``here`` holds
        if step < size - 1:  # pass them on, receive the next, while we compute
            arriving = torch.empty_like(here)
            exchange = comm.send_recv(here, right, arriving, left, group=group)
        chunks[owner] = here
        for product, matrix in zip(products, matrices):
            product[owner] = here @ matrix
        if step < size - 1:
            exchange.wait()
            here = arriving
    # #endregion gather-ring
    return torch.cat(chunks, dim=SEQUENCE_DIM), [torch.cat(p, dim=SEQUENCE_DIM) for p in products]


def matmul_reduce_scatter(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, group=None) -> torch.Tensor:
    """This rank's tokens of the sum over the group of ``sum(x @ matrix for x, matrix in pairs)``.

    Each step computes the partial sum of one chunk while the running sum of the previous chunk
    travels, then adds what arrived and passes it on.

    Args:
        pairs: (x, matrix) with x (batch, S, k) whole along the sequence, matrix (k, n): the
            partial sums to add (several when one gradient flows back into q, k and v).
        group: the tensor-parallel process group (None: every rank).
    """
    size, rank, right, left = _neighbours(group)
    check_sequence_split(pairs[0][0].shape[SEQUENCE_DIM], size)
    pieces = [x.chunk(size, dim=SEQUENCE_DIM) for x, _ in pairs]
    travelling = exchange = None
    for step in range(size):
        owner = (rank - 1 - step) % size  # the chunk whose sum passes through this rank now
        partial = sum(piece[owner] @ matrix for piece, (_, matrix) in zip(pieces, pairs))
        if exchange is not None:  # the running sum of the ranks before this one
            exchange.wait()
            partial = partial + travelling
        if step == size - 1:
            return partial  # owner == rank: every rank's contribution to this rank's tokens
        travelling = torch.empty_like(partial)
        exchange = comm.send_recv(partial.contiguous(), right, travelling, left, group=group)
    raise AssertionError("unreachable: the loop returns at its last step")


# #endregion ring-steps


# #region autograd
class _AllGatherProject(torch.autograd.Function):
    """Column-parallel layers on the gathered sequence; backward: their input gradient reduce-scattered."""

    @staticmethod
    def forward(ctx, shard, group, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        whole, products = all_gather_matmul(shard, [w.t() for w in weights], group=group)
        ctx.save_for_backward(whole, *weights)  # the gathered tokens: what the weights' gradients read
        ctx.group, ctx.with_bias = group, [bias is not None for bias in biases]
        return tuple(y + b if b is not None else y for y, b in zip(products, biases))

    @staticmethod
    def backward(ctx, *grads):
        whole, *weights = ctx.saved_tensors
        grad_shard = matmul_reduce_scatter(list(zip(grads, weights)), group=ctx.group)
        rows = whole.reshape(-1, whole.shape[-1])
        grad_params = []
        for grad, with_bias in zip(grads, ctx.with_bias):
            flat = grad.reshape(-1, grad.shape[-1])
            grad_params += [flat.T @ rows, flat.sum(0) if with_bias else None]
        return grad_shard, None, *grad_params


# #region project-reduce-scatter
class _ProjectReduceScatter(torch.autograd.Function):
    """A row-parallel layer, its partial sums reduce-scattered in ring steps;
    backward: its gradient gathered the same way."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return matmul_reduce_scatter([(x, weight.t())], group=group)

    @staticmethod
    def backward(ctx, grad_shard):
        x, weight = ctx.saved_tensors
        gathered = all_gather_matmul(grad_shard, [weight], group=ctx.group)
        grad_whole, (grad_x,) = gathered
        flat = grad_whole.reshape(-1, grad_whole.shape[-1])
        return grad_x, flat.T @ x.reshape(-1, x.shape[-1]), None


# #endregion project-reduce-scatter
# #endregion autograd


def all_gather_project(shard: torch.Tensor, layers, *, group=None) -> tuple[torch.Tensor, ...]:
    """``layer(all_gather(shard))`` for each column-parallel layer, overlapped: one gather feeds them all
    (``sequence.OverlappedColumnLinear`` and ``sequence.ShardReadingAttention`` call it).

    Args:
        shard: (batch, S/T, features), this rank's tokens.
        layers: ``ColumnParallelLinear`` layers that read the same gathered input (q, k and v).
        group: the tensor-parallel process group (None: every rank).
    """
    # the ring passes each shard on as it is: shards of different lengths would abort a rank in the
    # transport, so every rank's is compared first (as the gather it replaces would be)
    collective_check.check_same_call("all_gather", shard, group)
    params = [tensor for layer in layers for tensor in (layer.weight, layer.bias)]
    return _AllGatherProject.apply(shard, group, *params)


class OverlappedRowLinear(RowParallelLinear):
    """A row-parallel layer whose partial sums are reduce-scattered under its matmul.

    The bias is added after the reduce-scatter, to this rank's tokens only, as in
    ``sequence.SequenceParallelRowLinear``.
    """

    def forward(self, x_slice: torch.Tensor) -> torch.Tensor:
        y = _ProjectReduceScatter.apply(x_slice, self.weight, self.group)
        return y + self.bias if self.bias is not None else y


def chunk_compute_to_transfer(
    *, features_per_rank: int, flops_per_s: float, bytes_per_s: float, bytes_per_element: int = 2
) -> float:
    """How many times longer a chunk's matmul takes than the chunk's transfer: the overlap pays above 1.

    All-gather then matmul: a chunk of r tokens of h features travels (r h elements) and meets this
    rank's n = out/T columns of the weight: 2 r h n operations. Matmul then reduce-scatter: the
    running sum of r tokens of the layer's output travels (r x out elements), computed from k = in/T
    features: 2 r k out operations. Either way the ratio is 2 n x ``bytes_per_s`` / (``flops_per_s``
    x ``bytes_per_element``), with n the layer's width on this rank along the split dimension. It
    depends neither on the tokens nor on the other width: only on how wide this rank's slice is
    against the machine's balance of compute and link.

    Args:
        features_per_rank: n, the split dimension's width on this rank (out / T for a column-parallel
            layer, in / T for a row-parallel one).
        flops_per_s: the matmul's rate (the GPU's dense peak times the fraction it reaches).
        bytes_per_s: one direction of the link a ring step crosses.
        bytes_per_element: 2 for bf16, 1 for float8, 4 for fp32.
    """
    if min(features_per_rank, flops_per_s, bytes_per_s, bytes_per_element) <= 0:
        raise UserError("chunk_compute_to_transfer needs positive widths, rates and element sizes")
    return 2 * features_per_rank * bytes_per_s / (flops_per_s * bytes_per_element)
