"""The peak of one step, as the card holds it: the bytes live at each phase, and what is reserved.

A step's memory is not one sum. The gradients grow during the backward while the activations it
has used are freed; the loss's gradients are briefly the largest tensors on the card; an autocast
model's bf16 weight copies live from the forward until their backward. So the planner walks a
step's phases and counts what is live at each:

- **forward**: the model states, what the forward keeps for backward, the gathered parameters,
  the loss's forward (the bf16 logits, their fp32 copy and the log-softmax, together for a moment);
- **loss backward**: the same but the loss's two fp32 gradients instead (the one of the
  log-softmax's output, then of its input: 8 bytes a logit beside the 4 of the log-softmax kept);
- **blocks backward**: under recomputation, a block's backward runs its forward again, so what
  the policy dropped of one block is alive once more, beside nearly every gradient;
- **backward end**: every gradient, the activations freed, the last unit's reduction buffers;
- **optimizer step**: the model states and the gradients (a fused AdamW allocates nothing more).

The largest is what ``torch.cuda.max_memory_allocated`` reports, and the prediction names the
phase that sets it. Whether the gradients are live in the forward is the stack's convention
(``Framework.gradients``): kept in a buffer all step (DDP's buckets, Megatron's ``main_grad``: then
the sum of everything *is* the peak), or regrown after ``zero_grad(set_to_none=True)`` (PyTorch's
default: then the peak is the larger of the forward's end and the backward's).

What the card holds is more than what is allocated:

- **reserved**: PyTorch's caching allocator keeps freed blocks for reuse, one pool per stream.
  FSDP2 gathers and reduces on streams of its own, so the gathered parameters, the reduction
  buffers and the gradients (made by the reduce-scatter) stay reserved in those pools while the
  default stream's pool holds the activations: reserved is the default stream's peak plus those
  pools. **Fragmentation**: a freed block is reused only by a request it can hold. At the loss
  the bf16 logits' block is freed (a stack that upcasts keeps the fp32 log-softmax instead), and
  the fp32 gradients that follow are twice its size: it stays reserved, unused, through the
  loss's backward, 2 bytes a logit. (On the H200 runs of ``slides/recorded/gpu/h200-runs.csv``
  reserved minus allocated is that block within 3 GiB on the autocast runs, whose only pool is
  the default stream's; one run, micro-batch 4 with recomputation, reserved one fp32 logit
  buffer more than predicted.)
- **the CUDA context** (``ClusterSpec.context_bytes``, measured by ``gpu_record``) and **NCCL's
  buffers**, allocated by NCCL itself, outside PyTorch's allocator: per communicator, per channel
  and per peer a buffer of ``NCCL_BUFFSIZE`` (4 MiB by default, NCCL's environment variables
  documentation) for its Simple protocol; 16 channels a communicator is an assumption (NCCL
  picks 16 to 32 on NVLink; ``NCCL_MAX_NCHANNELS`` bounds it).

The verdict: a layout fits when reserved, the context and NCCL's buffers fit in the memory the
device reports. Where only the allocated peak does, it still runs: a failed ``cudaMalloc`` makes
the allocator release its cached blocks and retry, at the price of synchronizing (the
allocator's ``num_alloc_retries``); the prediction says so.

Papers and sources: Rajbhandari et al. (arXiv:1910.02054) for the model states; Korthikanti et
al. (arXiv:2205.05198) for the activations; PyTorch's CUDA semantics notes (memory management)
for the caching allocator; NCCL's documentation for its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel import memory
from .layout import Layout
from .memory_model import (
    _activations_per_gpu,
    block_activation_elements,
    head_activation_bytes,
    logit_elements,
    stage_parameters,
)
from .specs import MIB, StepShape

MEMORY_PARTS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "gathered parameters",
    "reduction buffers",
    "allocator fragmentation",
    "CUDA context",
    "NCCL buffers",
)
"""What the card holds, by part, in the order a breakdown stacks them."""

PHASES = ("forward", "loss backward", "blocks backward", "backward end", "optimizer step")
"""The moments of a step whose live bytes the planner counts, in the order they happen."""

NCCL_BUFFER_BYTES = 4 * MIB
"""``NCCL_BUFFSIZE``'s default: the buffer a channel keeps per peer for NCCL's Simple protocol."""

NCCL_CHANNELS = 16
"""Channels a communicator opens (an assumption: NCCL picks 16 to 32 on NVLink)."""

LOSS_GRADIENT_BYTES = 4 + 4
"""Bytes a logit the loss's backward adds: the fp32 gradient of the log-softmax's output (what
``nll_loss`` hands back, dense), then of its input."""

LOG_SOFTMAX_BYTES = 4
"""Bytes a logit the loss keeps from its forward to its backward: the fp32 log-softmax."""


@dataclass
class MemoryPeak:
    """One step's memory on the fullest GPU (bytes).

    Args:
        phases: what is allocated at each of ``PHASES``.
        phase: the phase that sets the allocated peak.
        parts: what the card holds, by part (``total``: their sum): the live parts at the default
            stream's fullest phase, the other streams' pools, fragmentation, the CUDA context and
            NCCL's buffers.
        allocated: the allocated peak (``torch.cuda.max_memory_allocated``).
        reserved: what the caching allocator reserves (``torch.cuda.max_memory_reserved``): at most
            what the device has left beside the context and NCCL where the allocated peak fits
            (the allocator then frees cached blocks rather than fail).
        model_states: the parameters, gradients and optimizer state alone.
        activations_kept: what one step's forwards keep for backward at their fullest, the
            loss's moments aside (what ``memory.live_tensor_bytes`` measures after a forward).
    """

    phases: dict[str, float]
    phase: str
    parts: dict[str, float] = field(default_factory=dict)
    allocated: float = 0.0
    reserved: float = 0.0
    model_states: float = 0.0
    activations_kept: float = 0.0


def nccl_buffer_bytes(layout: Layout) -> float:
    """NCCL's own buffers on one GPU: a communicator per parallel axis of more than one rank, each
    with ``NCCL_CHANNELS`` channels to two peers (a ring's previous and next; a pipeline's stage
    before and after), ``NCCL_BUFFER_BYTES`` each. A world of one opens none."""
    axes = (layout.data, layout.tensor, layout.pipeline, layout.context, layout.expert)
    communicators = sum(degree > 1 for degree in axes)
    return communicators * NCCL_CHANNELS * 2 * NCCL_BUFFER_BYTES


def _units(step: StepShape) -> tuple[float, float]:
    """(a block's parameters on this GPU, the root's: the stage's parameters outside its blocks)."""
    model, layout = step.model, step.layout
    stage = stage_parameters(model, layout, equal_blocks=step.framework.equal_stage_blocks)
    block = model.block_parameters() / layout.tensor
    return block, max(0.0, stage - step.layers * block)


def memory_peak(step: StepShape) -> MemoryPeak:
    """The step's phases counted, the peak and what the card holds (``MemoryPeak``)."""
    live, states, activations, logits = _live_by_phase(step)
    phases = {phase: sum(live[phase].values()) for phase in PHASES}
    peak = max(PHASES, key=phases.__getitem__)
    parts, reserved = _held_by_the_card(step, live, peak, states.grads, logits)
    return MemoryPeak(
        phases, peak, parts, allocated=phases[peak], model_states=states.total, activations_kept=activations,
        reserved=reserved_on_the_card(reserved, allocated=phases[peak], parts=parts, cluster=step.cluster),
    )  # fmt: skip


def reserved_on_the_card(reserved: float, *, allocated: float, parts: dict, cluster) -> float:
    """What the allocator can reserve of ``reserved``: all of it, or where the allocated peak fits
    but that does not, what the device has left beside the CUDA context and NCCL's buffers (the
    allocator frees its cached blocks rather than fail).

    Args:
        reserved: what the allocator would grow to, unhindered.
        allocated: the allocated peak.
        parts: what the card holds (``MEMORY_PARTS``; its context and NCCL's buffers are read).
        cluster: the machine (its GPU's memory).
    """
    room = cluster.gpu_memory_bytes - parts["CUDA context"] - parts["NCCL buffers"]
    return min(reserved, room) if allocated <= room else reserved


def _live_by_phase(step: StepShape):
    """(what is live at each phase, by part; the model states; what the forwards keep; the logits
    of a micro-batch whose loss is a phase of its own: 0 under a pipeline)."""
    model, layout, framework = step.model, step.layout, step.framework
    stage = stage_parameters(model, layout, equal_blocks=framework.equal_stage_blocks)
    states = memory.model_state_bytes(
        stage, layout.data * layout.context, layout.sharding, **framework.state_bytes(layout.precision)
    )
    autocast = framework.autocasts(layout.precision)
    # autocast's bf16 casts of the matmuls' weights (not the embedding's): alive until their backward
    casts = framework.param_bytes * (stage - model.embedding_parameters()) if autocast else 0.0
    params_after = states.params - (framework.param_bytes * stage if autocast else 0.0)
    shape = {"micro_batch": layout.micro_batch, "seq_len": step.seq_len, "selective": framework.selective}
    block = block_activation_elements(model, layout, **shape, fp32_residual=autocast)
    # one stage: the loss's moments are phases of their own; under a pipeline the last stage's
    # in-flight count holds the loss's forward at its fullest
    pipelined = layout.pipeline > 1
    kept_per_logit = framework.logit_bytes(layout.precision) if pipelined else LOG_SOFTMAX_BYTES
    tokens = {"micro_batch": layout.micro_batch, "seq_len": step.seq_len}
    head = head_activation_bytes(model, layout, **tokens, logit_bytes=kept_per_logit)
    activations = _activations_per_gpu(
        model, layout, block * layout.element_bytes, head, step.tokens, step.microbatches, step.seq_len
    )
    logits = 0.0 if pipelined else logit_elements(model, layout, **tokens)
    gathered, kept_gathered, reduce_buffer = _gathered(step)
    states_then = {
        "parameters": params_after + casts,
        "optimizer": states.optimizer,
        "gathered parameters": gathered,
    }
    in_forward = states.grads if framework.gradients == "kept" or step.microbatches > 1 else 0.0
    loss_forward = (framework.logit_bytes(layout.precision) - LOG_SOFTMAX_BYTES) * logits
    # a recomputed block's backward runs its forward again: its dropped activations live once more,
    # beside (nearly) every gradient; without recomputation this phase lies between its neighbours
    full = block_activation_elements(
        model, layout.with_(recomputation="none", recompute_every=1), **shape, fp32_residual=autocast
    )
    recomputed = (full - block) * layout.element_bytes if layout.recomputation != "none" else 0.0
    fsdp = layout.sharding == "fsdp"  # a block's gradients in reduction precision, as it is reduced
    reduce_block = framework.gradient_reduce_bytes(layout.precision) * _units(step)[0] if fsdp else 0.0
    after = {"parameters": params_after, "gradients": states.grads, "optimizer": states.optimizer}
    live = {
        "forward": states_then | {"gradients": in_forward, "activations": activations + loss_forward},
        "loss backward": states_then
        | {"gradients": in_forward, "activations": activations + LOSS_GRADIENT_BYTES * logits},
        "blocks backward": states_then
        | {"gradients": states.grads, "activations": recomputed, "reduction buffers": reduce_block},
        "backward end": after | {"gathered parameters": kept_gathered, "reduction buffers": reduce_buffer},
        "optimizer step": after,
    }
    return live, states, activations, logits


def _held_by_the_card(step: StepShape, live: dict, peak: str, gradients: float, logits: float):
    """(what the card holds by ``MEMORY_PARTS`` and their total, what the allocator reserves): the live
    parts of the fullest phase, or with FSDP2's streams the default stream's fullest phase beside
    the other streams' pools at their largest; the stranded block; the context; NCCL's buffers."""
    layout, framework, cluster = step.layout, step.framework, step.cluster
    if framework.fsdp_side_streams and layout.sharding == "fsdp":
        pooled = ("gradients", "gathered parameters", "reduction buffers")
        default = max(PHASES, key=lambda p: sum(v for k, v in live[p].items() if k not in pooled))
        parts = {k: v for k, v in live[default].items() if k not in pooled}
        pools = {name: max(live[phase].get(name, 0.0) for phase in PHASES) for name in pooled}
        parts |= pools | {"gradients": gradients}
    else:
        parts = dict(live[peak])
    on_gpu = bool(cluster.gpu or cluster.context_bytes)
    # the block the bf16 logits were freed from is too small for the fp32 gradients that follow
    parts["allocator fragmentation"] = (
        layout.element_bytes * logits if framework.logits_upcast and on_gpu else 0.0
    )
    reserved = sum(parts.values())
    parts["CUDA context"] = cluster.context_bytes
    parts["NCCL buffers"] = nccl_buffer_bytes(layout) if on_gpu else 0.0
    parts = {name: parts.get(name, 0.0) for name in MEMORY_PARTS}
    parts["total"] = sum(parts.values())
    return parts, reserved


def _gathered(step: StepShape) -> tuple[float, float, float]:
    """FSDP's gathered parameters: (during forward and backward, at the backward's end, the
    reduction buffer at the backward's end).

    A unit is gathered with the next prefetched (two blocks); FSDP2's root (the embedding, final
    norm and head) stays gathered from its forward to its backward, and is the last unit reduced:
    its gradients in reduction precision are the buffer alive at the backward's end. Under a
    pipeline a stack that keeps the stage gathered holds all of it.
    """
    layout, framework = step.layout, step.framework
    if layout.sharding != "fsdp":
        return 0.0, 0.0, 0.0
    gather = framework.gather_bytes(layout.precision)
    reduce = framework.gradient_reduce_bytes(layout.precision)
    block, root = _units(step)
    if layout.pipeline > 1 and framework.gathered_under_pipeline:
        whole = gather * (step.layers * block + root)
        return whole, whole, reduce * block
    if framework.fsdp_side_streams:
        return gather * (2 * block + root), gather * root, reduce * max(block, root)
    return 2 * gather * block, gather * block, reduce * block
