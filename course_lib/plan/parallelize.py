"""A layout applied: the course's transformer cut and wrapped as ``Layout`` says, one verb per technique.

``parallelize(model, mesh, layout)`` applies a layout (``plan.layout.Layout``) to the course's
transformer with one verb per technique, each of the same shape, ``apply_x(model, group, *,
options) -> model`` (as torchtitan's ``apply_tp(model, tp_mesh, ...)``), defined in the
technique's own lesson, in torchtitan's order (``parallelize_llama``):
cut the pipeline stage, then ``tensor.apply_tensor_parallel`` (or
``sequence.apply_sequence_parallel``), ``vocab.apply_vocabulary_parallel``,
``context.apply_context_parallel`` (or ``ulysses.apply_ulysses_parallel``),
``recompute.apply_recomputation`` (recompute what the parallel layers compute) and last
``data_parallel.apply_data_parallel`` (DDP, ZeRO or FSDP, whose hooks must wrap everything else).
Pipelining is the outer verb (``pipeline.apply_pipeline_parallel``): it cuts the model and returns
this rank's stages with the schedule that runs them. ``parallelize`` returns a ``ParallelModel``:
the stages, and the rest of a training step (``layout_loss``, the loss of the split logits;
``finish_gradients``, the gradient reductions no wrapper makes).

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), section 3; torchtitan's ``parallelize_llama``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any

from torch import nn

from ..checks import check_flag, check_instance, check_int
from ..distributed import comm
from ..errors import UserError
from ..llama import Llama
from ..models import Block, Embedding, LMHead, TinyTransformer
from ..parallel import context, pipeline, recompute, sequence, tensor, ulysses, vocab
from ..parallel.data_parallel import apply_data_parallel
from ..parallel.mesh import AXES
from .layout import Layout


# #region compose
def parallelize(
    model: nn.Module,
    mesh,
    layout: Layout,
    *,
    seq_len: int,
    data_parallel: bool = True,
    tensor_overlap: bool = False,
) -> ParallelModel:
    """A dense ``TinyTransformer`` laid out as ``layout`` on ``mesh``: what a training step calls.

    Pipelining is the outer verb (``pipeline.apply_pipeline_parallel``: this rank's stages and the
    schedule that runs them); every other technique is then applied inside each stage, in
    torchtitan's order. The result (``ParallelModel``) holds the stages, the loss of the split
    logits and the gradient reductions no wrapper makes. Every rank must start from the same
    weights (the same seed). Under pipeline parallelism the data axis is averaged after the
    executor's step (``finish_gradients``), so only ``sharding="ddp"`` runs there.

    Args:
        model: the dense transformer, cut and changed in place.
        mesh: a ``parallel.mesh.Mesh`` with the layout's degrees.
        layout: the layout (its ``expert`` degree must be 1: the transformer has no MoE layers).
        seq_len: tokens per sequence (context parallelism cuts it).
        data_parallel: wrap the stage for the data axis; False leaves the data axis to
            ``finish_gradients``, which averages every gradient after the step.
        tensor_overlap: with sequence parallelism, run each all-gather and reduce-scatter of the
            tensor axis as collective matmul (``parallel.collective_matmul``): in ring steps under
            the matmuls, as PyTorch's async TP does (the planner's ``Framework.tensor_overlap``).
    """
    _check_parallelize(
        model, mesh, layout, seq_len, data_parallel=data_parallel, tensor_overlap=tensor_overlap
    )
    d_model, vocab_size = model.d_model, model.vocab_size
    cut = pipeline.apply_pipeline_parallel(
        model, mesh.group("pipeline"), schedule=layout.schedule, virtual_stages=layout.virtual_stages
    )
    tensor_group, sp = mesh.group("tensor"), layout.sequence_parallel
    for index, stage in cut.stages.items():
        if layout.tensor > 1 and any(isinstance(m, Block) for m in stage.modules()):
            if sp:  # Megatron-LM's sequence parallelism: the input's shard regathered in backward,
                # or, overlapped, the gathered input kept (its ring assembles it anyway)
                sequence.apply_sequence_parallel(
                    stage, tensor_group, regather_in_backward=not tensor_overlap, overlap=tensor_overlap
                )
            else:
                tensor.apply_tensor_parallel(stage, tensor_group)
        holds_vocabulary = any(isinstance(m, Embedding | LMHead) for m in stage.modules())
        if layout.tensor > 1 and layout.loss_parallel and holds_vocabulary:
            vocab.apply_vocabulary_parallel(stage, tensor_group, sequence_parallel=sp)
        if layout.context > 1:
            apply_context = (
                ulysses.apply_ulysses_parallel
                if layout.context_attention == "ulysses"
                else context.apply_context_parallel
            )
            apply_context(stage, mesh.group("context"), chunks=layout.sequence_chunks(seq_len))
        recompute.apply_recomputation(stage, policy=layout.recomputation, every=layout.recompute_every)
        if wraps_data_axis(layout, data_parallel=data_parallel):
            cut.stages[index] = apply_data_parallel(stage, mesh.group("data"), sharding=layout.sharding)
    loss_fn = layout_loss(layout, mesh, vocab_size=vocab_size, seq_len=seq_len)
    return ParallelModel(
        cut, mesh, layout, loss_fn, seq_len=seq_len, d_model=d_model, data_parallel=data_parallel
    )


# #endregion compose


def _check_parallelize(model, mesh, layout, seq_len, *, data_parallel, tensor_overlap) -> None:
    """``parallelize``'s arguments and their agreement, each refused in one line naming the fix."""
    check_instance("parallelize's layout", layout, Layout)
    check_int("parallelize's seq_len", seq_len, minimum=1)
    check_flag("parallelize's data_parallel", data_parallel)
    check_flag("parallelize's tensor_overlap", tensor_overlap)
    if tensor_overlap and not (layout.tensor > 1 and layout.sequence_parallel):
        raise UserError(
            "tensor_overlap overlaps sequence parallelism's all-gathers and reduce-scatters with the "
            "matmuls: it needs a tensor degree above 1 and sequence_parallel=True"
        )
    if not isinstance(model, TinyTransformer | Llama):
        raise UserError(
            f"parallelize lays out the course's models.TinyTransformer or llama.Llama, got "
            f"{type(model).__name__}: apply the techniques' own verbs (apply_tensor_parallel, ...) to other "
            "models"
        )
    _check_llama_layout(model, layout)
    _check_positions(model, seq_len)
    for axis in AXES:
        if mesh.degrees[axis] != layout.degree(axis):
            raise UserError(
                f"the mesh's {axis} degree is {mesh.degrees[axis]} but the layout's is "
                f"{layout.degree(axis)}: build the mesh from the layout"
            )
    if layout.expert > 1:
        raise UserError("the course's TinyTransformer has no MoE layers: use expert=1 (see parallel.expert)")
    if data_parallel and layout.pipeline > 1 and layout.sharding != "ddp":
        raise UserError(
            f"sharding {layout.sharding!r} under pipeline parallelism: the pipeline's data axis is averaged "
            "after the executor's step; use sharding='ddp'"
        )


def _check_positions(model: nn.Module, seq_len: int) -> None:
    """A learned position embedding covers so many positions: a longer sequence would index past
    it, deep inside torch; refuse it here, naming the two numbers."""
    embeddings = [module for module in model.modules() if isinstance(module, Embedding)]
    if embeddings and seq_len > embeddings[0].positions.num_embeddings:
        longest = embeddings[0].positions.num_embeddings
        raise UserError(
            f"parallelize's seq_len {seq_len} is longer than the {longest} positions the model embeds: "
            f"build it with max_seq_len={seq_len} or more, or train on sequences of {longest} tokens or fewer"
        )


def _check_llama_layout(model: nn.Module, layout: Layout) -> None:
    """What the Llama module does not run yet, refused before any rank waits: its rotary positions
    are computed for a whole sequence (no context parallelism), and its norms and vocabulary are not
    those sequence parallelism and the split loss cut."""
    if not isinstance(model, Llama):
        return
    if layout.context > 1:
        raise UserError(
            "the Llama module attends over whole sequences: use context=1 (TinyTransformer has it)"
        )
    if layout.tensor > 1 and (layout.sequence_parallel or layout.loss_parallel):
        raise UserError(
            "the Llama module splits its blocks over the tensor ranks, not its sequence or vocabulary: "
            "use sequence_parallel=False and loss_parallel=False (the layout's no-sp no-loss-parallel)"
        )


@dataclass
class ParallelModel:
    """What ``parallelize`` returns: this rank's share of the model and the rest of a training step.

    A step is ``loss = model.forward_backward(x, y, executor)`` (the pipeline's schedule, or the
    lone stage's forward and backward), then ``model.finish_gradients()``, then the optimizer's
    step over ``model.parameters()``.

    Args:
        pipeline: this rank's stages and their schedule (``pipeline.apply_pipeline_parallel``).
        mesh: the mesh the layout was applied on.
        layout: the layout.
        loss_fn: the loss of one micro-batch on this rank (``layout_loss``).
        seq_len: tokens of a whole sequence.
        d_model: the width of the activations the stages send each other.
        data_parallel: whether the stages were wrapped for the data axis.
    """

    pipeline: pipeline.Pipeline
    mesh: Any
    layout: Layout
    loss_fn: Callable
    _: KW_ONLY
    seq_len: int
    d_model: int
    data_parallel: bool = True

    @property
    def stages(self) -> dict[int, nn.Module]:
        """{stage index: module}: the stages this rank holds (index 0 alone without a pipeline)."""
        return self.pipeline.stages

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.pipeline.parameters()

    def executor(self, *, micro_batch: int, microbatches: int, measure_memory: bool = False):
        """The schedule run on this rank's stages, for micro-batches of ``micro_batch`` sequences.

        What one stage sends the next: this rank's tokens (1/C of each sequence under context
        parallelism, 1/T of those again under sequence parallelism) of ``d_model`` values each.

        Args:
            micro_batch: sequences per micro-batch.
            microbatches: m, micro-batches per step.
            measure_memory: count what every forward leaves alive for its backward (slow).
        """
        coordinate = self.mesh.coordinates.context
        tokens = self.layout.sequence_chunks(self.seq_len).tokens(coordinate)
        tokens //= self.layout.tensor if self.layout.sequence_parallel else 1
        return self.pipeline.executor(
            microbatches=microbatches,
            loss_fn=self.loss_fn,
            boundary_shape=(micro_batch, tokens, self.d_model),
            measure_memory=measure_memory,
        )

    def forward_backward(self, inputs, targets, executor=None):
        """One step's forwards and backwards: the schedule (``executor``) under a pipeline, else
        the lone stage's; the loss (on the last stage; None elsewhere)."""
        if executor is not None:
            return executor.step(inputs, targets)
        loss = self.loss_fn(self.stages[0](inputs), targets)
        loss.backward()
        return loss.detach()

    def finish_gradients(self) -> None:
        """The gradient reductions no wrapper made (``finish_gradients``)."""
        finish_gradients(self.stages, self.mesh, self.layout, data_parallel=self.data_parallel)


def wraps_data_axis(layout: Layout, *, data_parallel: bool = True) -> bool:
    """Whether ``parallelize`` wraps the stage for the data axis (its wrapper then reduces the
    gradients): only without a pipeline, whose data axis is averaged after the executor's step."""
    return data_parallel and layout.pipeline == 1 and (layout.data > 1 or layout.sharding != "ddp")


def layout_loss(layout: Layout, mesh, *, vocab_size: int, seq_len: int) -> Callable:
    """The loss of one micro-batch on this rank, as the last stage of ``parallelize``'s model
    gives its logits: this rank's share of the mean over the micro-batch's whole sequences, so
    that the shares of the context ranks (and under sequence parallelism the tensor ranks) add up
    to it.

    Args:
        layout: the layout ``parallelize`` applied.
        mesh: the mesh it applied it on.
        vocab_size: V, the vocabulary (the logits' last dimension, split with ``loss_parallel``).
        seq_len: tokens of a whole sequence (context parallelism cuts it).
    """

    def loss_fn(logits, targets):
        whole = len(targets) * seq_len  # the micro-batch's tokens, over every rank
        if layout.tensor > 1 and layout.loss_parallel:  # this rank's slice of every token's logits
            summed = vocab.vocab_parallel_cross_entropy(
                logits, targets, vocab_size=vocab_size, reduction="sum", group=mesh.group("tensor")
            )
            return summed / whole
        if layout.tensor > 1 and layout.sequence_parallel:  # the logits of this rank's tokens
            targets = targets.chunk(layout.tensor, dim=1)[mesh.coordinates.tensor]
        return context.context_parallel_loss(logits, targets, total_tokens=whole)

    return loss_fn


def finish_gradients(
    stages: dict[int, nn.Module], mesh, layout: Layout, *, data_parallel: bool = True
) -> None:
    """After a step's backward, the gradient reductions no wrapper made, so that every rank holds
    the gradient of the whole batch.

    - sequence parallelism: the weights that saw 1/T of the tokens (the norms) add up their
      partial gradients over the tensor ranks;
    - context parallelism: each chunk of the sequences adds its part of every gradient;
    - the data axis: averaged here when ``parallelize`` wrapped no data-parallel wrapper around
      the stage (under the pipeline, or with ``data_parallel=False``).

    Args:
        stages: the stages ``parallelize`` laid out (``ParallelModel.stages``).
        mesh: the mesh it applied the layout on.
        layout: the layout.
        data_parallel: what was passed to ``parallelize``.
    """
    if layout.tensor > 1 and layout.sequence_parallel:
        for stage in stages.values():
            sequence.all_reduce_sequence_parallel_gradients(stage, group=mesh.group("tensor"))
    grads = [param.grad for stage in stages.values() for param in stage.parameters()]
    if layout.context > 1:
        comm.all_reduce_coalesced(grads, op="sum", group=mesh.group("context"))
    if not wraps_data_axis(layout, data_parallel=data_parallel) and layout.data > 1:
        comm.all_reduce_coalesced(grads, op="mean", group=mesh.group("data"))
