"""A layout: how one training job spreads a model over its GPUs, as one object.

Every parallelism of the course is one axis of a mesh of D x P x C x T x E ranks (``parallel.mesh``):
data (replicas, each with 1/D of the batch), pipeline (stages of layers), context (pieces of each
sequence), tensor (pieces of each matrix) and expert (experts of each MoE layer, over the data
and context ranks as in torchtitan, so E divides D·C and adds no GPUs). On the data axis the
model states are kept whole (DDP), or sharded by ZeRO stage 1, 2 or 3 (FSDP). Along them go the
choices that change memory and time but not the result: recomputation, the pipeline schedule and
its micro-batches, and the precision.

``parallelize(model, mesh, layout)`` applies a layout to the course's transformer with one verb
per technique, each of the same shape, ``apply_x(model, *, group, options)``, defined in the
technique's own lesson, in torchtitan's order (``parallelize_llama``): cut the pipeline stage,
then ``tensor.apply_tensor_parallel`` (or ``sequence.apply_sequence_parallel``),
``vocab.apply_vocabulary_parallel``, ``context.apply_context_parallel`` (or
``ulysses.apply_ulysses``), ``recompute.apply_recomputation`` (recompute what the parallel layers
compute) and last the data axis's wrapper (DDP, ZeRO or FSDP, whose hooks must wrap everything
else). Pipelining is the outer verb (``pipeline.apply_pipeline_parallel``): it cuts the model and
returns this rank's stages with the schedule that runs them. ``parallelize`` returns a
``ParallelModel``: the stages, and the rest of a training step (``layout_loss``, the loss of the
split logits; ``finish_gradients``, the gradient reductions no wrapper makes).

The planner (``cost_model``) predicts a layout's memory, traffic and step time; the mesh's order
puts the tensor axis innermost, on the fastest links, then context, data and pipeline outermost:
the chattiest axis gets the NVLink of one node, the quietest crosses the network.

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), section 3: how the axes interact and in which order to
place them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, fields, replace
from typing import Any

from torch import nn

from ..checks import check_choice, check_fields, check_flag, check_instance, check_int
from ..distributed import comm
from ..errors import UserError
from ..llama import Llama
from ..models import Block, Embedding, LMHead, TinyTransformer
from ..parallel import context, ddp, fsdp, memory, pipeline, recompute, sequence, tensor, ulysses, vocab, zero
from ..parallel.context_chunks import SequenceLayout
from ..parallel.mesh import AXES

SHARDINGS = memory.SHARDINGS
"""What the data axis shards: ``parallel.memory.SHARDINGS`` (ddp, zero1, zero2, fsdp)."""
SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
"""The pipeline schedules the planner lays out (of ``pipeline.SCHEDULES``)."""
PRECISIONS = ("bf16", "fp32", "fp8")
"""``bf16``: mixed precision (bf16 products and activations, fp32 master weights); ``fp32``;
``fp8``: as bf16, with the blocks' linear layers' products in fp8 with tensorwise scaling
(torchao's Float8Linear, Transformer Engine): attention, the head and the activations stay bf16."""
CONTEXT_ATTENTION = ("ring", "ulysses")
LETTERS = {"d": "data", "p": "pipeline", "c": "context", "t": "tensor", "e": "expert"}
"""The letter of each axis in a layout's name."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a job lays a model over ``data x pipeline x context x tensor`` GPUs.

    Args:
        data: D, the replicas (each takes 1/D of the global batch).
        pipeline: P, the stages the layers are cut into.
        context: C, the pieces each sequence is cut into (ring attention, or Ulysses: see
            ``context_attention``).
        tensor: T, the pieces each block's matrices are cut into (with sequence parallelism).
        expert: the ranks each MoE layer's experts are spread over (must divide D x C).
        sharding: what the data axis shards: ``"ddp"`` (nothing), ``"zero1"`` (optimizer
            state), ``"zero2"`` (and gradients), ``"fsdp"`` (and parameters).
        recomputation: ``"none"``, ``"full"`` or ``"selective"`` (``recompute``).
        recompute_every: apply ``recomputation`` to every k-th block only, the others keeping
            everything (1: every block; torchtitan's "selective layer" checkpointing is full on
            every 2nd).
        schedule: the pipeline schedule, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"gpipe"``.
        virtual_stages: stages per pipeline rank (the interleaved schedule's v).
        micro_batch: sequences per micro-batch.
        precision: ``"bf16"`` (mixed precision, fp32 master weights) or ``"fp32"``.
        sequence_parallel: with T > 1, the norms run on s/T tokens and the projections keep
            only their shard of the input (Megatron-LM's sequence parallelism); off: plain tensor
            parallelism (the course's ``parallel.tensor``).
        loss_parallel: with T > 1, the embedding, the output projection and the loss are split
            over the vocabulary (``parallel.vocab``; Megatron-LM's, DTensor's ``loss_parallel``):
            the model returns this rank's slice of the logits. Off: every tensor rank computes
            the whole head.
        context_attention: with C > 1, how attention sees the other ranks' tokens: ``"ring"``
            (``parallel.context``: K/V chunks passed around a ring, zig-zag chunks) or
            ``"ulysses"`` (``parallel.ulysses``: all-to-alls that trade the sequence split for a
            head split, contiguous chunks; the heads on a tensor rank must divide by C).
    """

    data: int = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    expert: int = 1
    sharding: str = "fsdp"
    recomputation: str = "none"
    recompute_every: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1
    precision: str = "bf16"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    context_attention: str = "ring"

    def __post_init__(self):
        whole = ("data", "pipeline", "context", "tensor", "expert", "virtual_stages", "micro_batch")
        check_fields(self, minimum=dict.fromkeys((*whole, "recompute_every"), 1))
        if self.tensor == 1:  # both split the tensor axis: without one they are moot, and read as on,
            object.__setattr__(self, "sequence_parallel", True)  # so that layouts that run alike are one
            object.__setattr__(self, "loss_parallel", True)
        if self.schedule in pipeline.SCHEDULES and self.schedule not in SCHEDULES:
            raise UserError(
                f"the planner does not lay out {self.schedule!r} yet: its bubble and memory are taught "
                "in parallel.pipeline (notebook 08), but the cost model prices only "
                f"{', '.join(SCHEDULES)}: choose one of them"
            )
        for name, choices in (
            ("sharding", SHARDINGS),
            ("recomputation", recompute.POLICIES),
            ("schedule", SCHEDULES),
            ("precision", PRECISIONS),
            ("context_attention", CONTEXT_ATTENTION),
        ):
            check_choice(f"Layout {name}", getattr(self, name), choices)
        if (self.data * self.context) % self.expert:
            raise UserError(
                f"expert degree {self.expert} must divide data x context = {self.data * self.context}: "
                "the experts are spread over the data and context ranks"
            )
        if self.recompute_every > 1 and self.recomputation == "none":
            raise UserError(
                f"recompute_every {self.recompute_every} recomputes nothing with recomputation='none': "
                "choose recomputation='full' or 'selective', or leave recompute_every at 1"
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise UserError(
                f"virtual_stages {self.virtual_stages} needs schedule='interleaved_1f1b' (the others hold "
                "one stage per rank)"
            )

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element: 4 in fp32, else 2 (fp8 keeps its activations in bf16)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def gpus(self) -> int:
        """D x P x C x T: the GPUs the layout takes."""
        return self.data * self.pipeline * self.context * self.tensor

    def degree(self, axis: str) -> int:
        """The degree of one of ``AXES``."""
        return getattr(self, axis)

    def name(self) -> str:
        """A short label, e.g. ``d8.p2.t4 fsdp sac``: the degrees above 1, the sharding, and every
        other field that differs from its default, so that ``from_name`` reads back the same
        layout (a name that dropped the precision would price an fp32 run as bf16)."""
        parts = [
            f"{a[0]}{self.degree(a)}" for a in ("data", "pipeline", "context", "tensor") if self.degree(a) > 1
        ]
        if self.expert > 1:
            parts.append(f"e{self.expert}")
        label = ".".join(parts) or "single"
        extras = [self.sharding]
        if self.recomputation != "none":
            every = f"/{self.recompute_every}" if self.recompute_every > 1 else ""
            extras.append({"full": "ac", "selective": "sac"}[self.recomputation] + every)
        if self.pipeline > 1 or self.schedule != "1f1b" or self.virtual_stages > 1:
            extras.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.micro_batch > 1:
            extras.append(f"mb{self.micro_batch}")
        if self.context_attention != "ring":
            extras.append(self.context_attention)
        if self.precision != "bf16":
            extras.append(self.precision)
        if not self.sequence_parallel:
            extras.append("no-sp")
        if not self.loss_parallel:
            extras.append("no-loss-parallel")
        return f"{label} {' '.join(extras)}"

    @classmethod
    def from_name(cls, text: str) -> Layout:
        """The layout a ``name()`` describes, read back (``plan predict`` takes its layouts so).

        A grid, then words in any order; what a name leaves out is the default::

            grid    single | AXIS N[.AXIS N]...      AXIS: d data, p pipeline, c context, t tensor,
                                                     e expert
            words   ddp | zero1 | zero2 | fsdp       the data axis's sharding (default fsdp)
                    ac | sac                         full or selective recomputation (default none);
                    ac/2 | sac/2                     ... of every 2nd block only
                    1f1b | gpipe | interleaved_1f1bxV  the pipeline schedule, V stages a rank
                    mbN                              N sequences a micro-batch (default 1)
                    ring | ulysses                   the context axis's attention (default ring)
                    bf16 | fp32 | fp8                the matmuls' precision (default bf16)
                    no-sp | no-loss-parallel         sequence or loss parallelism off (default on)

        Args:
            text: a layout's name, e.g. ``"d8.p2.c4 fsdp sac interleaved_1f1bx2 mb2"``.
        """
        if not text.split():
            raise UserError("an empty layout: write one as the planner prints it, e.g. 'd8.t8 fsdp sac'")
        grid, *words = text.split()
        given: dict[str, Any] = {}

        def give(part: str, **values):
            for key, value in values.items():
                if key in given:
                    raise UserError(f"layout {text!r}: {part!r} sets the {key} a second time")
                given[key] = value

        for part in grid.split(".") if grid != "single" else []:
            axis = re.fullmatch(r"([dpcte])([1-9]\d*)", part)
            if axis is None:
                raise UserError(
                    f"layout {text!r}: {part!r} is not an axis and its degree (d8, p2, c4, t8, e8, or "
                    "'single'): see Layout.from_name"
                )
            give(part, **{LETTERS[axis[1]]: int(axis[2])})
        for word in words:
            schedule = re.fullmatch(r"(1f1b|gpipe|interleaved_1f1b)(?:x([1-9]\d*))?", word)
            micro_batch = re.fullmatch(r"mb([1-9]\d*)", word)
            if word in SHARDINGS:
                give(word, sharding=word)
            elif recomputed := re.fullmatch(r"(s?ac)(?:/([1-9]\d*))?", word):
                policy = "full" if recomputed[1] == "ac" else "selective"
                give(word, recomputation=policy, recompute_every=int(recomputed[2] or 1))
            elif schedule:
                give(word, schedule=schedule[1], virtual_stages=int(schedule[2] or 1))
            elif micro_batch:
                give(word, micro_batch=int(micro_batch[1]))
            elif word in CONTEXT_ATTENTION:
                give(word, context_attention=word)
            elif word in PRECISIONS:
                give(word, precision=word)
            elif word in ("no-sp", "no-loss-parallel"):
                give(word, **{"sequence_parallel" if word == "no-sp" else "loss_parallel": False})
            else:
                raise UserError(
                    f"layout {text!r}: {word!r} is none of a sharding ({', '.join(SHARDINGS)}), ac or sac, "
                    "a schedule (1f1b, gpipe, interleaved_1f1bx2), mbN, ring or ulysses, bf16, fp32 or fp8, "
                    "no-sp or no-loss-parallel: see Layout.from_name"
                )
        return cls(**given)

    def sequence_layout(self, seq_len: int):
        """Which tokens of a ``seq_len`` sequence each context rank holds (``context_chunks.SequenceLayout``):
        zig-zag chunks for the ring (each rank's causal work even), contiguous ones for Ulysses."""
        return SequenceLayout(seq_len, self.context, zigzag=self.context_attention == "ring")

    def with_(self, **changes) -> Layout:
        """A copy with some fields changed (checked again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise UserError(f"Layout has no field {', '.join(sorted(unknown))}")
        return replace(self, **changes)


# -- one verb per technique ---------------------------------------------------------------------


def data_parallel_wrapper(
    model: nn.Module, *, sharding: str, group=None, units: list[nn.Module] | None = None, **fsdp_options
) -> nn.Module:
    """Wrap ``model`` so that the data axis averages its gradients, sharding what ``sharding`` says.

    Args:
        model: the module this rank trains (after every other verb).
        sharding: ``"ddp"`` (``parallel.ddp``), ``"zero1"``/``"zero2"`` (``parallel.zero``) or
            ``"fsdp"`` (``parallel.fsdp``).
        group: the data-parallel process group (None: every rank).
        units: FSDP's units, each gathered and freed whole (None: one per recomputation unit,
            a transformer's blocks).
        fsdp_options: for ``"fsdp"``, the course FSDP's own options (``sharding_strategy``,
            ``hybrid_shard_size``, ``cpu_offload``: ``parallel.fsdp``).
    """
    check_choice("sharding", sharding, SHARDINGS)
    if sharding == "ddp":
        return ddp.DataParallel(model, group=group)
    if sharding in ("zero1", "zero2"):
        return zero.ZeroDataParallel(model, stage=int(sharding[-1]), group=group)
    if units is None:
        units = recompute.recomputation_units(model)
    return fsdp.FullyShardedDataParallel(model, group=group, auto_wrap_policy=units, **fsdp_options)


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
    d_model, vocab_size = model.d_model, model.vocab_size
    cut = pipeline.apply_pipeline_parallel(
        model, schedule=layout.schedule, virtual_stages=layout.virtual_stages, group=mesh.group("pipeline")
    )
    tensor_group, sp = mesh.group("tensor"), layout.sequence_parallel
    for index, stage in cut.stages.items():
        if layout.tensor > 1 and any(isinstance(m, Block) for m in stage.modules()):
            if sp:  # Megatron-LM's sequence parallelism: the input's shard regathered in backward,
                # or, overlapped, the gathered input kept (its ring assembles it anyway)
                sequence.apply_sequence_parallel(
                    stage, group=tensor_group, regather_in_backward=not tensor_overlap, overlap=tensor_overlap
                )
            else:
                tensor.apply_tensor_parallel(stage, group=tensor_group)
        holds_vocabulary = any(isinstance(m, Embedding | LMHead) for m in stage.modules())
        if layout.tensor > 1 and layout.loss_parallel and holds_vocabulary:
            vocab.apply_vocabulary_parallel(stage, group=tensor_group, sequence_parallel=sp)
        if layout.context > 1:
            apply_context = (
                ulysses.apply_ulysses
                if layout.context_attention == "ulysses"
                else context.apply_context_parallel
            )
            apply_context(stage, chunks=layout.sequence_layout(seq_len), group=mesh.group("context"))
        recompute.apply_recomputation(stage, policy=layout.recomputation, every=layout.recompute_every)
        if wraps_data_axis(layout, data_parallel=data_parallel):
            cut.stages[index] = data_parallel_wrapper(
                stage, sharding=layout.sharding, group=mesh.group("data")
            )
    loss_fn = layout_loss(layout, mesh, vocab_size=vocab_size, seq_len=seq_len)
    return ParallelModel(
        cut, mesh, layout, loss_fn, seq_len=seq_len, d_model=d_model, data_parallel=data_parallel
    )


# #endregion compose


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
        tokens = self.layout.sequence_layout(self.seq_len).tokens(coordinate)
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
