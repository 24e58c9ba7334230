"""Vocabulary parallelism: the embedding, the output projection and the loss split over the vocabulary.

Tensor parallelism splits the blocks, but a language model's two largest single matrices are
its token embedding and its output projection, V x d each, and its largest activation is the
logits, one value per token and vocabulary entry (b·s·V: for Llama 3, V = 128,256, that is 16
times a block's input). Megatron-LM splits all three over the T tensor ranks by vocabulary rows:

- **embedding**: rank t holds rows [t·V/T, (t+1)·V/T). A token whose id is in its range is
  looked up; the others give zeros. The T partial results add up (one all-reduce: g) to the
  embedding of every token.
- **output projection**: column parallel (``tensor.ColumnParallelLinear``): rank t computes the
  logits of its V/T entries for every token, and never sees the others.
- **cross-entropy**, without gathering the logits: ``loss = log Σ_v exp(z_v) - z_target``.
  1. each rank takes the max of its logits; an all-reduce (max) gives the global max m
     (subtracted so that exp cannot overflow);
  2. each rank sums exp(z - m) over its entries, and picks z_target - m if the target is its
     entry (0 otherwise); one all-reduce (sum) of both gives Σ exp and z_target - m;
  3. every rank now has every token's loss. Backward needs no message: the gradient of the
     logits is softmax - one_hot(target), and each rank has its slice of both.

So each rank keeps b·s·V/T logits and softmax values instead of b·s·V, and the messages are
per token (b·s values, three times), not per logit.

**Padding.** V rarely divides by T (the course's vocabulary has 42 characters; GPT-2's 50,257).
Megatron pads the vocabulary to a multiple of T: every rank holds ceil(V/T) rows, the last
ones padding that no token looks up. Here the padded entries are also left out of the softmax
(set to -inf), so the model computes exactly what one process computes.

Cost per rank: 1/T of the embedding's and projection's weights, gradients and optimizer state;
1/T of the logits and of the loss's saved softmax; sent per step: one all-reduce of the
embedding's output (b·s·d) forward, the projection's input gradient (b·s·d) backward, and three
values per token for the loss.

PyTorch's twin: DTensor's ``loss_parallel()`` context (``torch.distributed.tensor.parallel``)
computes the cross-entropy of logits sharded on the vocabulary dimension.

Paper: Shoeybi et al., "Megatron-LM", 2019 (arXiv:1909.08053), section 3 ("we parallelize the
input embedding weight matrix along the vocabulary dimension ... fuse the output of the parallel
GEMM with the cross entropy loss"); Megatron-LM's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..checks import check_flag, check_group, check_int, check_module
from ..distributed import comm, runtime
from ..errors import UserError
from ..models import Embedding, LMHead
from .claims import claim_module
from .sequence import gather_sequence
from .tensor import copy_to_parallel, reduce_from_parallel


def rows_per_rank(vocab_size: int, degree: int) -> int:
    """ceil(V/T): the rows every rank holds, padding included.

    Args:
        vocab_size: V, the real vocabulary.
        degree: T, the ranks sharing it.
    """
    check_int("vocabulary size", vocab_size, minimum=1)
    check_int("vocabulary-parallel degree", degree, minimum=1)
    return math.ceil(vocab_size / degree)


def vocab_range(vocab_size: int, degree: int, rank: int) -> tuple[int, int]:
    """The real vocabulary entries rank ``rank`` holds: ``(start, stop)`` (empty when all padding).

    Args:
        vocab_size: V.
        degree: T.
        rank: the rank in the group.
    """
    per_rank = rows_per_rank(vocab_size, degree)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def _my_range(vocab_size: int, group) -> tuple[int, int, int]:
    size, rank = runtime.world_size(group=group), runtime.rank(group=group)
    return (*vocab_range(vocab_size, size, rank), rows_per_rank(vocab_size, size))


def _my_rows(dense: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """This rank's rows of a (V, ...) tensor, zero rows appended up to ceil(V/T)."""
    start, stop, per_rank = _my_range(vocab_size, group)
    rows = dense.new_zeros((per_rank, *dense.shape[1:]))
    rows[: stop - start] = dense[start:stop]
    return rows


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(V, d)`` with the rows split over the group; the partial lookups all-reduced.

    Args:
        vocab_size: V, the whole vocabulary (need not divide by the group's size).
        embedding_dim: d, the width of each row.
        group: the tensor-parallel process group (None: every rank).
    """

    def __init__(self, vocab_size: int, embedding_dim: int, *, group=None):
        super().__init__()
        check_group("group", group)
        self.vocab_size, self.group = vocab_size, group
        self.start, self.stop, per_rank = _my_range(vocab_size, group)
        self.weight = nn.Parameter(torch.zeros(per_rank, embedding_dim))

    @classmethod
    def from_dense(cls, dense: nn.Embedding, *, group=None) -> VocabParallelEmbedding:
        """This rank's rows of a dense embedding: the same function, split.

        Args:
            dense: the embedding to cut.
            group: the tensor-parallel process group (None: every rank).
        """
        layer = cls(dense.num_embeddings, dense.embedding_dim, group=group)
        with torch.no_grad():
            layer.weight.copy_(_my_rows(dense.weight, dense.num_embeddings, group))
        return layer.to(dense.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        elsewhere = (ids < self.start) | (ids >= self.stop)  # another rank's rows
        local = (ids - self.start).masked_fill(elsewhere, 0)
        partial = nn.functional.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return reduce_from_parallel(partial, group=self.group)  # each token found on exactly one rank


class VocabParallelLinear(nn.Module):
    """The output projection, ``nn.Linear(d, V)`` split by vocabulary rows: this rank's ceil(V/T) logits.

    Args:
        in_features: d, the width of the input, which every rank holds whole (or, with
            ``sequence_parallel``, its own tokens of it).
        vocab_size: V; the padded entries' logits are 0 and ``vocab_parallel_cross_entropy``
            leaves them out.
        bias: learn a bias (split like the rows).
        group: the tensor-parallel process group (None: every rank).
        sequence_parallel: the input holds this rank's tokens only (Megatron's sequence
            parallelism): all-gather them first, and reduce-scatter the input's gradient.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        bias: bool = True,
        group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        check_flag("bias", bias)
        check_flag("sequence_parallel", sequence_parallel)
        check_group("group", group)
        self.vocab_size, self.group, self.sequence_parallel = vocab_size, group, sequence_parallel
        self.start, self.stop, per_rank = _my_range(vocab_size, group)
        self.weight = nn.Parameter(torch.zeros(per_rank, in_features))
        self.bias = nn.Parameter(torch.zeros(per_rank)) if bias else None

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, *, group=None, sequence_parallel: bool = False
    ) -> VocabParallelLinear:
        """This rank's rows of a dense projection (its output features are the vocabulary).

        Args:
            dense: the projection to cut.
            group: the tensor-parallel process group (None: every rank).
            sequence_parallel: the input holds this rank's tokens only (see the class).
        """
        layer = cls(
            dense.in_features,
            dense.out_features,
            bias=dense.bias is not None,
            group=group,
            sequence_parallel=sequence_parallel,
        )
        with torch.no_grad():
            layer.weight.copy_(_my_rows(dense.weight, dense.out_features, group))
            if dense.bias is not None:
                layer.bias.copy_(_my_rows(dense.bias, dense.out_features, group))
        return layer.to(dense.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # f: each rank's backward gives only its entries' share of the input's gradient
        x = (
            gather_sequence(x, group=self.group)
            if self.sequence_parallel
            else copy_to_parallel(x, group=self.group)
        )
        return nn.functional.linear(x, self.weight, self.bias)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group):
        start, stop, _ = _my_range(vocab_size, group)
        logits = logits.float().masked_fill(  # the padding: no entry of the vocabulary
            torch.arange(logits.shape[-1], device=logits.device) >= stop - start, float("-inf")
        )
        # #region vocab-parallel-loss
        top = logits.max(dim=-1).values
        comm.all_reduce(top, op="max", group=group)  # 1. the largest logit of each token
        shifted = logits - top.unsqueeze(-1)
        mine = (targets >= start) & (targets < stop)
        index = (targets - start).masked_fill(~mine, 0).unsqueeze(-1)
        exponentials = shifted.exp()
        totals = torch.stack(  # 2. Σ exp over my entries, and the target's logit if it is mine
            [exponentials.sum(dim=-1), shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)]
        )
        comm.all_reduce(totals, op="sum", group=group)  # one message for both
        sum_exp, target_logit = totals
        ctx.save_for_backward(exponentials.div_(sum_exp.unsqueeze(-1)), mine, index)  # my slice of softmax
        return sum_exp.log() - target_logit  # 3. every token's loss, on every rank
        # #endregion vocab-parallel-loss

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, index = ctx.saved_tensors
        # d loss / d z = softmax - one_hot(target): my slice of both, no message
        grad_logits = softmax.scatter_add(-1, index, -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None, None


# #region vocab-loss
def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, reduction: str = "mean", group=None
) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary, never gathered: the same value on every rank.

    Args:
        logits: (..., ceil(V/T)) this rank's slice of the logits (``VocabParallelLinear``'s output).
        targets: (...) token ids of the whole vocabulary, the same on every rank.
        vocab_size: V, the real vocabulary (the columns past it are padding).
        reduction: ``"mean"`` or ``"sum"`` over the tokens, or ``"none"`` (one loss per token).
        group: the tensor-parallel process group (None: every rank).
    """
    check_group("group", group)
    size = runtime.world_size(group=group)
    width = rows_per_rank(vocab_size, size)
    if logits.shape[-1] != width or logits.shape[:-1] != targets.shape:
        raise UserError(
            f"logits must be (..., {width}): this rank's slice of {vocab_size} entries "
            f"over {size} ranks, with targets of the same leading shape; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if reduction not in ("mean", "sum", "none"):
        raise UserError(f"unknown reduction {reduction!r}: choose mean, sum or none")
    losses = _VocabParallelCrossEntropy.apply(logits, targets, vocab_size, group)
    return {"mean": losses.mean, "sum": losses.sum, "none": lambda: losses}[reduction]()


# #endregion vocab-loss


def gather_vocab_logits(logits: torch.Tensor, *, vocab_size: int, group=None) -> torch.Tensor:
    """Every rank's logits slices put together, padding dropped: (..., V). For inspection, not training.

    Args:
        logits: (..., ceil(V/T)) this rank's slice.
        vocab_size: V.
        group: the tensor-parallel process group (None: every rank).
    """
    size = runtime.world_size(group=group)
    pieces = [torch.empty_like(logits) for _ in range(size)]
    comm.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)[..., :vocab_size]


def apply_vocabulary_parallel(model: nn.Module, group=None, *, sequence_parallel: bool = False) -> nn.Module:
    """Split the token embedding and the output projection of a ``TinyTransformer`` (or a stage of one).

    The model then returns this rank's ceil(V/T) logits of every token: take the loss with
    ``vocab_parallel_cross_entropy``. A tied embedding and projection stay tied (one split
    parameter in both places).

    Args:
        model: the transformer (or a pipeline stage holding its embedding and/or head), in place.
        group: the tensor-parallel process group (None: every rank).
        sequence_parallel: the head's input holds this rank's tokens (``sequence.apply_sequence_parallel``).
    """
    check_module("model", model)
    check_flag("sequence_parallel", sequence_parallel)
    check_group("group", group)
    parts = [m for m in model.modules() if isinstance(m, Embedding | LMHead)]
    if not parts:
        raise UserError(
            "no Embedding or LMHead found to split over the vocabulary: pass a models.TinyTransformer"
        )
    claim_module(model, "vocabulary parallelism")
    embedding = next((m for m in parts if isinstance(m, Embedding)), None)
    head = next((m for m in parts if isinstance(m, LMHead)), None)
    tied = embedding is not None and head is not None and head.proj.weight is embedding.tokens.weight
    if embedding is not None:
        embedding.tokens = VocabParallelEmbedding.from_dense(embedding.tokens, group=group)
    if head is not None:
        head.proj = VocabParallelLinear.from_dense(
            head.proj, group=group, sequence_parallel=sequence_parallel
        )
        if tied:
            head.proj.weight = embedding.tokens.weight
    return model
