"""3-D and 4-D parallelism: train the transformer with data, pipeline, context and tensor parallelism.

On a ``Mesh`` of D x P x C x T ranks, one training step of ``TinyTransformer``:

1. **Pipeline**: the model (embedding, blocks, head) is cut into P stages; the ranks of one
   pipeline group (same data and tensor coordinates) run them with a schedule (1F1B by default)
   and send activations to each other.
2. **Tensor**: inside each stage, every block's attention and MLP are split over the T ranks of
   a tensor group (``tensor.apply_tensor_parallel``), and the embedding, the output projection
   and the loss over the vocabulary (``vocab``: the logits are never gathered). The T ranks of a
   stage hold the same activations, so each sends its own copy to its counterpart in the next
   stage; with ``sequence_parallel`` (Megatron-LM's sequence parallelism, ``sequence``) each
   holds and sends only its 1/T of the tokens, and the norms run on them.
3. **Context**: with C > 1, each sequence is cut over the C ranks of a context group (zig-zag
   layout); every attention runs as ring attention (``context.apply_context_parallel``). Each rank's
   loss is its tokens' share of the batch mean, and the weights' gradients are summed over the
   context group (each rank's tokens add their part).
4. **Data**: each of the D replicas of this whole arrangement takes 1/D of the global batch;
   after the pipeline's backward, gradients are averaged over the data group, and every rank
   steps its own parameters.

Every rank starts from the same dense model (same seed) and keeps its pieces, so the run
computes what one process would: the test compares the loss curves. The cost per rank: 1/(P·T)
of the weights and 1/C of the activations; activation all-reduces in the tensor group (the most
traffic: keep T inside a node), K/V chunks around the context ring, activation sends between
stages, one gradient all-reduce over the data (and context) group per step.

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473): PTD-P, pipeline x tensor x data parallelism.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import models
from ..checks import MAX_LEARNING_RATE, MAX_SEED, check_fields, check_int, check_number
from ..data import zen_windows
from ..distributed import comm, runtime
from ..errors import UserError
from ..observe import anatomy, profiling
from ..parallel import context_chunks, ulysses
from ..parallel import tensor as tp
from ..parallel.mesh import AXES, Mesh, check_degrees, rank_at
from ..plan.layout import Layout
from ..plan.parallelize import parallelize

ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""The schedules ``train_3d`` runs: one stage a rank (interleaving needs virtual stages it does
not cut)."""
RUN_DEFAULTS = {"sharding": "ddp", "precision": "fp32", "sequence_parallel": False}
"""What a 3-D run's layout is where its name says nothing: the data axis averaged after the
pipeline's step (``finish_gradients``, as DDP averages), fp32 (the one process it is compared with
runs fp32), and tensor parallelism without sequence parallelism (the word ``sp`` turns it on)."""


def run_layout(name: str) -> Layout:
    """The layout of a 3-D run, from its name (``Layout.from_name``; what the name leaves out is
    ``RUN_DEFAULTS``), e.g. ``"d2.p2.t2"``, ``"p2.t2 gpipe sac"``, ``"d2.c2.t2 ulysses sp"``.

    Args:
        name: the grid and the words of ``Layout.from_name``.
    """
    return Layout.from_name(name, **RUN_DEFAULTS)


COUNTS = ("steps", "global_batch", "microbatches", "seq_len", "d_model", "n_heads", "n_layers")
"""``RunShape``'s fields that count something: each at least 1."""


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """A 3-D run's model and training: everything but its layout.

    Args:
        steps: optimizer steps.
        global_batch: windows per step over all replicas; must divide by D x ``microbatches``.
        microbatches: m, the pieces each replica's batch is cut into for the pipeline.
        lr: AdamW's learning rate.
        seq_len: characters per window.
        d_model: the transformer's width (a multiple of 4 x T).
        n_heads: attention heads per block (a multiple of T).
        n_layers: blocks (with the embedding and head, at least P pieces to cut).
        seed: the seed of the weights and of the batches, the same on every rank.
    """

    steps: int = 20
    global_batch: int = 16
    microbatches: int = 2
    lr: float = 3e-3
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    seed: int = 0

    def __post_init__(self):
        check_fields(self, minimum={**dict.fromkeys(COUNTS, 1), "seed": 0}, above={"lr": 0})
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        check_number("lr", self.lr, maximum=MAX_LEARNING_RATE)


def check_run(layout: Layout, shape: RunShape, *, world_size: int) -> None:
    """Everything that can be wrong, checked before any process waits on another.

    Args:
        layout: the run's layout (``run_layout``).
        shape: its model and training.
        world_size: the processes started.
    """
    _check_layout(layout)
    check_degrees(world_size, **{axis: layout.degree(axis) for axis in AXES})
    tensor, context, seq_len = layout.tensor, layout.context, shape.seq_len
    tp.check_tensor_parallel_degree(shape.d_model, shape.n_heads, 4 * shape.d_model, tensor)
    context_chunks.check_context_split(seq_len, context, zigzag=layout.context_attention == "ring")
    if layout.context_attention == "ulysses":  # a tensor rank's heads, traded over the context ranks
        ulysses.check_heads(shape.n_heads // tensor, context)
    if layout.sequence_parallel and tensor > 1:  # each context rank's tokens cut again over the tensor ranks
        chunks = layout.sequence_chunks(seq_len)
        uneven = sorted({chunks.tokens(c) for c in range(context) if chunks.tokens(c) % tensor})
        if uneven:
            raise UserError(
                f"sequence parallelism cuts each context rank's tokens ({uneven[0]} of a sequence of "
                f"{seq_len} over {context} rank(s)) over the {tensor} tensor ranks: choose a sequence "
                f"length whose chunks divide by {tensor}, or leave sequence parallelism off"
            )
    if layout.pipeline > shape.n_layers + 2:
        raise UserError(
            f"cannot cut {shape.n_layers + 2} layers (embedding, {shape.n_layers} blocks, head) into "
            f"{layout.pipeline} stages"
        )
    if shape.global_batch % (layout.data * shape.microbatches):
        raise UserError(
            f"the global batch of {shape.global_batch} must split into {layout.data} data-parallel parts "
            f"of {shape.microbatches} micro-batches each: use a multiple of "
            f"{layout.data * shape.microbatches}"
        )


def _check_layout(layout: Layout) -> None:
    """What of a layout a 3-D run cannot run, refused with the word to write instead."""
    if not isinstance(layout, Layout):
        raise UserError(
            f"train_3d takes a plan.layout.Layout (run_layout('d2.p2.t2')), got {type(layout).__name__}"
        )
    wrong = {
        f"sharding {layout.sharding!r}": layout.sharding != "ddp",  # its data axis: after the pipeline
        f"precision {layout.precision!r}": layout.precision != "fp32",
        f"schedule {layout.schedule!r} x{layout.virtual_stages}": (
            layout.schedule not in ONE_STAGE_SCHEDULES or layout.virtual_stages > 1
        ),
        f"expert degree {layout.expert}": layout.expert > 1,
        f"micro_batch {layout.micro_batch}": layout.micro_batch > 1,
    }
    refused = [what for what, bad in wrong.items() if bad]
    if refused:
        raise UserError(
            f"a 3-D run cannot run {', '.join(refused)} (layout {layout.name()!r}): it trains ddp in fp32 "
            f"with {' or '.join(ONE_STAGE_SCHEDULES)}, no experts, and cuts its batch with "
            "RunShape.microbatches; write its layout with run_layout('d2.p2.t2 ...')"
        )


def train_3d(
    layout: Layout, *, shape: RunShape | None = None, profile: str | None = None
) -> list[float] | None:
    """Train on the current process group laid out as ``layout``; return every step's loss on rank 0.

    With ``run_layout("single")`` it is the one-process reference.

    Args:
        layout: the grid and its techniques (``run_layout``: ``"d2.p2.t2"``, ``"d2.c2.t2 ulysses sp"``,
            ``"p2.t2 gpipe sac"``).
        shape: the model and the training (None: ``RunShape()``'s defaults).
        profile: record the anatomy of 3 steps after 2 (``profiling.LoopProfiler``): each rank's
            trace and ``anatomy.json`` go into this folder.
    """
    shape = RunShape() if shape is None else shape
    check_run(layout, shape, world_size=runtime.world_size())
    mesh = Mesh.from_layout(layout)
    inputs, targets, vocabulary = zen_windows(seq_len=shape.seq_len)
    torch.manual_seed(shape.seed)
    model = models.TinyTransformer(len(vocabulary), d_model=shape.d_model, n_heads=shape.n_heads,
                                   n_layers=shape.n_layers, max_seq_len=shape.seq_len)  # fmt: skip
    model = parallelize(model, mesh, layout, seq_len=shape.seq_len, data_parallel=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr)
    micro_batch = shape.global_batch // layout.data // shape.microbatches
    executor = model.executor(micro_batch=micro_batch, microbatches=shape.microbatches)
    losses = []
    reporter = rank_at(mesh.degrees, pipeline=layout.pipeline - 1)  # a rank of the last stage
    profiler = (
        profiling.LoopProfiler(profile, grid=mesh.degrees, schedule=layout.schedule) if profile else None
    )
    chunks = layout.sequence_chunks(shape.seq_len)
    batches = _local_batches(inputs, targets, mesh, chunks, shape.global_batch, shape.seed)
    for _, (x, y) in zip(range(shape.steps), batches, strict=False):
        with profiler.step() if profiler else contextlib.nullcontext():
            loss = _step(model, executor, optimizer, x, y)
        if profiler is not None and profiler.complete:
            profiler.finish()
        losses.append(_reported_loss(loss, mesh, reporter))
    if profiler is not None:
        profiler.finish()  # fewer steps than it records: what there was
    return losses if runtime.rank() == 0 else None


def _local_batches(inputs, targets, mesh, chunks, global_batch: int, seed: int):
    """This rank's windows, step after step: the same draw of ``global_batch`` windows on every rank,
    this replica's share of them, and of each the chunks this context rank holds (``chunks``)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        batch = torch.randint(0, len(inputs), (global_batch,), generator=generator)
        mine = batch[mesh.coordinates.data :: mesh.degrees["data"]]
        yield tuple(chunks.local(t[mine], mesh.coordinates.context) for t in (inputs, targets))


def _step(model, executor, optimizer, x, y) -> torch.Tensor | None:
    """One optimizer step on this rank's tokens, its phases marked for the anatomy."""
    with anatomy.phase("optimizer"):
        optimizer.zero_grad()
    with anatomy.phase("pipeline"):  # forward and backward of every micro-batch
        loss = executor.step(x, y)
    with anatomy.phase("gradients"):  # sequence, context and data: the gradient of the whole batch
        model.finish_gradients()
    with anatomy.phase("optimizer"):
        optimizer.step()
    return loss


def _reported_loss(loss: torch.Tensor | None, mesh: Mesh, reporter: int) -> float:
    """The step's loss on every rank: it lives on the last stage, summed over the context chunks
    and averaged over the replicas there, then every rank takes it from ``reporter``."""
    report = torch.zeros(1) if loss is None else loss.detach().reshape(1)
    if mesh.coordinates.pipeline == mesh.degrees["pipeline"] - 1:
        if mesh.degrees["context"] > 1:
            comm.all_reduce(report, op="sum", group=mesh.group("context"))
        comm.all_reduce(report, op="mean", group=mesh.group("data"))
    comm.broadcast(report, src=reporter)
    return float(report)
