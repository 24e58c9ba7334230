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

import torch

from .. import models
from ..data import zen_windows
from ..distributed import comm, runtime
from ..errors import UserError
from ..observe import anatomy, profiling
from ..parallel import context_chunks, ulysses
from ..parallel import tensor as tp
from ..parallel.mesh import Mesh, check_degrees, rank_at
from ..plan.layout import Layout
from ..plan.parallelize import parallelize

ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""The schedules ``train_3d`` runs: one stage a rank (interleaving needs virtual stages it does
not cut)."""


def local_layout(
    mesh: Mesh,
    *,
    schedule: str = "1f1b",
    recomputation: str = "none",
    sequence_parallel: bool = False,
    context_attention: str = "ring",
) -> Layout:
    """The layout ``train_3d`` runs: the mesh's degrees, the vocabulary split, fp32, and the data
    axis left to ``finish_gradients`` (``parallelize(..., data_parallel=False)``)."""
    degrees = {axis: mesh.degrees[axis] for axis in ("data", "pipeline", "context", "tensor")}
    return Layout(
        **degrees,
        sharding="ddp",
        schedule=schedule,
        recomputation=recomputation,
        precision="fp32",
        sequence_parallel=sequence_parallel,
        loss_parallel=True,
        context_attention=context_attention,
    )


def check_run(
    world_size: int,
    data: int,
    pipeline: int,
    tensor: int,
    global_batch: int,
    microbatches: int,
    n_layers: int,
    d_model: int,
    n_heads: int,
    *,
    context: int = 1,
    seq_len: int = 32,
    sequence_parallel: bool = False,
    context_attention: str = "ring",
) -> None:
    """Everything that can be wrong, checked before any process waits on another."""
    check_degrees(world_size, data=data, pipeline=pipeline, context=context, tensor=tensor)
    tp.check_tensor_parallel_degree(d_model, n_heads, 4 * d_model, tensor)
    context_layout = Layout(context=context, context_attention=context_attention)  # refuses an unknown method
    context_chunks.check_context_split(seq_len, context, zigzag=context_attention == "ring")
    if context_attention == "ulysses":  # a tensor rank's heads, traded over the context ranks
        ulysses.check_heads(n_heads // tensor, context)
    if sequence_parallel:  # each context rank's tokens cut again over the tensor ranks
        chunks = context_layout.sequence_chunks(seq_len)
        uneven = sorted({chunks.tokens(c) for c in range(context) if chunks.tokens(c) % tensor})
        if uneven:
            raise UserError(
                f"sequence parallelism cuts each context rank's tokens ({uneven[0]} of a sequence of "
                f"{seq_len} over {context} rank(s)) over the {tensor} tensor ranks: choose a sequence "
                f"length whose chunks divide by {tensor}, or leave sequence parallelism off"
            )
    if pipeline > n_layers + 2:
        raise UserError(
            f"cannot cut {n_layers + 2} layers (embedding, {n_layers} blocks, head) into {pipeline} stages"
        )
    if global_batch % (data * microbatches):
        raise UserError(
            f"the global batch of {global_batch} must split into {data} data-parallel parts of "
            f"{microbatches} micro-batches each: use a multiple of {data * microbatches}"
        )


def train_3d(
    *,
    data: int = 2,
    pipeline: int = 2,
    tensor: int = 2,
    context: int = 1,
    steps: int = 20,
    global_batch: int = 16,
    microbatches: int = 2,
    schedule: str = "1f1b",
    lr: float = 3e-3,
    seq_len: int = 32,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 4,
    seed: int = 0,
    recomputation: str = "none",
    sequence_parallel: bool = False,
    context_attention: str = "ring",
    profile: str | None = None,
) -> list[float] | None:
    """Train on the current process group laid out as a mesh; return the loss of every step on rank 0.

    With 1 x 1 x 1 it is the single-process reference.

    Args:
        data: D, the replicas that split the global batch.
        pipeline: P, the stages the transformer is cut into.
        tensor: T, the ranks each block's matrices are split over.
        context: C, the ranks each sequence is split over (ring attention, zig-zag layout).
        steps: optimizer steps.
        global_batch: windows per step over all replicas; must divide by D x ``microbatches``.
        microbatches: m, the pieces each replica's batch is cut into for the pipeline.
        schedule: the pipeline schedule, ``"gpipe"`` or ``"1f1b"``.
        lr: AdamW's learning rate.
        seq_len: characters per window.
        d_model: the transformer's width (a multiple of 4 x T).
        n_heads: attention heads per block (a multiple of T).
        n_layers: blocks (with the embedding and head, at least P pieces to cut).
        seed: the seed of the weights and of the batches, the same on every rank.
        recomputation: what each block keeps for backward: ``"none"``, ``"full"`` or ``"selective"``
            (``course_lib.parallel.recompute``).
        sequence_parallel: with T > 1, Megatron-LM's sequence parallelism: the norms run on
            1/T of the tokens, and the stages send each other 1/T of the activations.
        context_attention: with C > 1, ``"ring"`` (zig-zag chunks) or ``"ulysses"`` (contiguous
            chunks; all-to-alls trade them for 1/C of each tensor rank's heads).
        profile: record the anatomy of 3 steps after 2 (``profiling.LoopProfiler``): each rank's
            trace and ``anatomy.json`` go into this folder.
    """
    world = runtime.world_size()
    check_run(
        world, data, pipeline, tensor, global_batch, microbatches, n_layers, d_model, n_heads,
        context=context, seq_len=seq_len, sequence_parallel=sequence_parallel,
        context_attention=context_attention,
    )  # fmt: skip
    mesh = Mesh(data=data, pipeline=pipeline, context=context, tensor=tensor)
    plan = local_layout(mesh, schedule=schedule, recomputation=recomputation,
                        sequence_parallel=sequence_parallel, context_attention=context_attention)  # fmt: skip
    inputs, targets, vocabulary = zen_windows(seq_len=seq_len)
    torch.manual_seed(seed)
    model = models.TinyTransformer(len(vocabulary), d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                                   max_seq_len=seq_len)  # fmt: skip
    model = parallelize(model, mesh, plan, seq_len=seq_len, data_parallel=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    executor = model.executor(micro_batch=global_batch // data // microbatches, microbatches=microbatches)
    losses = []
    reporter = rank_at(mesh.degrees, pipeline=pipeline - 1)  # a rank of the last stage
    profiler = profiling.LoopProfiler(profile, grid=mesh.degrees, schedule=schedule) if profile else None
    batches = _local_batches(inputs, targets, mesh, plan.sequence_chunks(seq_len), global_batch, seed)
    for _, (x, y) in zip(range(steps), batches, strict=False):
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
