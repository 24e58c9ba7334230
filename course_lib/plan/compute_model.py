"""The fullest GPU's own work in one step: matmuls, memory-bound operations, recomputation, bubble.

- **compute**: the model's FLOPs per token (6·N + 12·L·h·s, as torchtitan and PaLM count them)
  over what one GPU achieves on large matrix products (a measured rate, not the datasheet's);
- **memory-bound work**: what the blocks keep for backward, written once and read twice by the
  norms, activation functions and adds, and the optimizer's bytes per updated parameter, at a
  memory bandwidth (the optimizer's may be measured apart);
- **recomputation**: one more forward of what the policy drops (what "selective" drops is the
  stack's: ``frameworks.SELECTIVE_POLICIES``);
- **the bubble**: the pipeline's schedule simulated (``pipeline.simulate_timeline``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..parallel.pipeline import (
    WHOLE_BACKWARD,
    bubble_fraction,
    bubble_overhead_theory,
    build_schedule,
    simulate_timeline,
)
from . import kernels
from .memory_model import (
    block_activation_elements,
    block_matmuls,
    head_activation_bytes,
    logit_elements,
    stage_parameters,
)
from .specs import OPTIMIZER_BYTES, StepShape


@dataclass
class ComputeSeconds:
    """The fullest GPU's own work in one step, in seconds (``attention_flops``: FLOPs)."""

    matmuls: float
    pointwise_blocks: float  # the blocks' memory-bound operations
    pointwise_head: float  # the head's
    optimizer: float
    recomputation: float
    bubble: float
    attention_flops: float  # the attention's score and value products, which a ring can hide under
    copies: float = 0.0  # the casts and copies mixed precision and FSDP's buffers make

    @property
    def forward_and_backward(self) -> float:
        """The work communication can hide under (the copies into and out of a collective's buffers
        run before and after it, not beside it)."""
        return self.matmuls + self.pointwise_blocks + self.pointwise_head


def compute_seconds(step: StepShape) -> ComputeSeconds:
    """The matmuls and attention (``products``), the memory-bound work (``memory_bound``), the
    recomputation, and the pipeline's bubble (the schedule simulated)."""
    layout, framework = step.layout, step.framework
    work = products(step)
    pointwise_blocks, pointwise_head, optimizer = memory_bound(step)
    ring = layout.context > 1 and layout.context_attention == "ring"
    ring_attention = work.attention_forward if ring else 0.0
    selective = {
        # the pointwise operations' forward again (and under context parallelism the ring's attention)
        # and under tensor parallelism the out projection, whose partial sums are not kept
        "course": pointwise_blocks / 3
        + ring_attention
        + (work.block_forward * output_projection_share(step.model) if layout.tensor > 1 else 0.0),
        # and the forward of every second matmul
        "op_sac": pointwise_blocks / 3 + work.recomputed_matmuls + ring_attention,
        # the attention core's forward: its two products
        "attention_core": work.attention_forward,
    }[framework.selective]
    recompute = {
        "none": 0.0,
        "full": work.block_forward + work.attention_forward + pointwise_blocks / 3,  # one more forward
        "selective": selective,
    }[layout.recomputation] / layout.recompute_every
    parts = ComputeSeconds(
        work.total, pointwise_blocks, pointwise_head, optimizer, recompute, 0.0, work.attention_flops,
        copies=copy_seconds(step),
    )  # fmt: skip
    if layout.pipeline > 1:  # the schedule simulated: a backward twice a forward, three times if recomputed
        backward_over_forward = 2.0 + (layout.recomputation == "full") / layout.recompute_every
        parts.bubble = (parts.forward_and_backward + recompute) * bubble_overhead(
            layout.schedule, layout.pipeline, step.microbatches, layout.virtual_stages, backward_over_forward
        )
    return parts


@dataclass
class Products:
    """Seconds of the fullest GPU's matrix products in one step (``attention_flops``: FLOPs).

    ``block_forward`` and ``block_backward`` are the blocks' matmuls (the backward computes two
    products a matmul: the input's gradient and the weight's); ``recomputed_matmuls`` the forward
    of every second one (what torchtitan's selective policy recomputes).
    """

    block_forward: float
    block_backward: float
    recomputed_matmuls: float
    head: float
    attention_forward: float
    attention_backward: float
    attention_flops: float  # forward and backward as the planner counts them (the whole square)

    @property
    def total(self) -> float:
        return (
            self.block_forward
            + self.block_backward
            + self.head
            + self.attention_forward
            + self.attention_backward
        )


def products(step: StepShape) -> Products:
    """The step's products on the fullest GPU: at the cluster's one achieved rate, or where the
    cluster names its GPU, each matmul by its shape and attention at its rate (``kernels``)."""
    model, cluster, layout = step.model, step.cluster, step.layout
    t, p = layout.tensor, layout.pipeline
    tokens = step.tokens_per_gpu_step
    head_flops = 6 * model.head_parameters() * tokens / (t if layout.loss_parallel else 1)
    block_flops = (model.flops_per_token(step.seq_len) - 6 * model.head_parameters()) * tokens / (t * p)
    attention_flops = 12 * model.attention_width * model.attended_span(step.seq_len) * tokens / (t * p)
    if not cluster.gpu:
        rate = cluster.achieved_flops
        forward = (block_flops - attention_flops) / 3 / rate
        return Products(
            forward, 2 * forward, recomputed_matmul_share(model) * forward, head_flops / rate,
            attention_flops / 3 / rate, 2 * attention_flops / 3 / rate, attention_flops,
        )  # fmt: skip
    gpu = kernels.GPUS[cluster.gpu]
    fit = kernels.kernel_fit(gpu.record)
    blocks = step.layers * step.microbatches
    linear = "fp8" if layout.precision == "fp8" else "bf16"  # the blocks' linear layers; the head stays bf16
    shapes = _block_products(model, layout, step.tokens, imbalance=step.framework.expert_imbalance)
    grouped = step.framework.grouped_experts
    passes = [_matmul_passes(gpu, shape, linear, grouped=grouped) for shape in shapes]
    vocabulary = model.vocab / t if layout.loss_parallel else model.vocab
    head = _matmul_passes(gpu, (step.tokens, vocabulary, model.d_model, 1))
    causal_forward = attention_flops / 2 / 3  # a causal kernel computes half the square
    forward_rate, backward_rate = kernels.attention_fractions(
        fit, **attention_shape(model, layout, step.seq_len)
    )
    return Products(
        block_forward=blocks * sum(forward for forward, _ in passes),
        block_backward=blocks * sum(backward for _, backward in passes),
        recomputed_matmuls=blocks * sum(forward for forward, _ in passes[1::2]),
        head=step.microbatches * sum(head),
        attention_forward=causal_forward / (forward_rate * gpu.peak_flops),
        attention_backward=2 * causal_forward / (backward_rate * gpu.peak_flops),
        attention_flops=attention_flops,
    )


def attention_shape(model, layout, seq_len: int) -> dict:
    """What one GPU's attention kernel sees: its head width, its query heads (a tensor rank's share;
    Ulysses deals them out over the context ranks too) and the tokens a sequence attends over
    (a ring's chunk of s/C)."""
    heads, length = model.heads / layout.tensor, seq_len
    if layout.context > 1 and layout.context_attention == "ulysses":
        heads /= layout.context
    elif layout.context > 1:
        length /= layout.context
    return {"head_dim": model.head_dim, "heads": heads, "seq_len": length}


def _block_products(
    model, layout, tokens: float, *, imbalance: float = 1.0
) -> list[tuple[float, float, float, float]]:
    """(m, n, k, count) of each matmul of one block for one micro-batch of ``tokens`` on this GPU:
    a column-parallel layer's outputs and a row-parallel layer's inputs split over T; an MoE
    layer's MLP as its experts/E local experts, each fed top_k·E/experts of the tokens, times
    ``imbalance`` on the busiest expert rank (``Framework.expert_imbalance``), whose experts the
    step waits for (on one rank every expert's rows are its own, whatever their spread).
    ``count`` is how many such products run (a rank's experts), priced one launch each or, where
    the stack groups them (``Framework.grouped_experts``), as one kernel
    (``kernels.grouped_matmul_seconds``)."""
    t, shapes = layout.tensor, []
    for inputs, outputs, rows, row_parallel in block_matmuls(model):
        m, count = tokens, 1
        if rows > 1:  # an expert's MLP
            count = model.experts / layout.expert
            m = tokens * rows * layout.expert / model.experts * (imbalance if layout.expert > 1 else 1)
        n, k = (outputs, inputs / t) if row_parallel else (outputs / t, inputs)
        shapes.append((m, n, k, count))
    return shapes


def _matmul_passes(gpu, shape, precision: str = "bf16", *, grouped: bool = False) -> tuple[float, float]:
    """Seconds of a layer's forward product and of its backward's two (input and weight gradients):
    ``count`` products one after the other, or (``grouped``, more than one) as one grouped kernel."""
    m, n, k, count = shape

    def seconds(a, b, c):
        if grouped and count > 1:
            return kernels.grouped_matmul_seconds(gpu, a, b, c, count, precision)
        return count * kernels.matmul_seconds(gpu, a, b, c, precision)

    return seconds(m, n, k), seconds(m, k, n) + seconds(k, n, m)


def memory_bound(step: StepShape) -> tuple[float, float, float]:
    """Seconds of the memory-bound work: (the blocks', the head's, the optimizer step's).

    What the blocks keep for backward is written once in forward and read twice in backward by
    the norms, activation functions and adds; the head's too, its logits through the loss's
    kernels; the optimizer step moves each parameter it updates, its gradient and its two
    moments. At the cluster's bandwidths, or where the cluster names its GPU, at the fractions of
    its datasheet bandwidth its record measured (eager or compiled, as the stack runs).
    """
    model, cluster, layout, framework = step.model, step.cluster, step.layout, step.framework
    unrecomputed = layout.with_(recomputation="none", recompute_every=1)
    shape = {"micro_batch": layout.micro_batch, "seq_len": step.seq_len}
    autocast = framework.autocasts(layout.precision)
    block_bytes = layout.element_bytes * block_activation_elements(
        model, unrecomputed, **shape, fp32_residual=autocast
    )
    held = stage_parameters(model, layout, equal_blocks=framework.equal_stage_blocks)
    updated = held / (1 if layout.sharding == "ddp" else layout.data * layout.context)
    optimizer_bytes = OPTIMIZER_BYTES[layout.precision] * updated
    if not cluster.gpu:
        head = head_activation_bytes(
            model, layout, **shape, logit_bytes=framework.logit_bytes(layout.precision)
        )
        blocks = 3 * block_bytes * step.layers * step.microbatches / cluster.memory_bandwidth
        return (
            blocks,
            3 * head * step.microbatches / cluster.memory_bandwidth,
            optimizer_bytes / (cluster.optimizer_bandwidth or cluster.memory_bandwidth),
        )
    gpu = kernels.GPUS[cluster.gpu]
    fit = kernels.kernel_fit(gpu.record)
    pointwise = gpu.memory_bandwidth * (fit.pointwise_compiled if framework.compiled else fit.pointwise_eager)
    # the head's norm and projection input as the blocks' work; its logits through the loss's kernels,
    # at the record's rate for fp32 logits, forward and backward
    head_rest = head_activation_bytes(model, layout, **shape, logit_bytes=0)
    loss = 4 * logit_elements(model, layout, **shape) / (fit.loss * gpu.memory_bandwidth)
    if layout.precision == "fp8":
        # each cast to fp8 reads its bf16 input twice (amax, cast) and writes 1 byte: forward x and
        # W, backward dy and the transposed x and W; written once, not the three passes below
        shapes = _block_products(model, layout, step.tokens, imbalance=framework.expert_imbalance)
        cast = sum(count * (2 * m * k + 2 * k * n + m * n) for m, n, k, count in shapes)
        block_bytes += 5 * cast / 3
    return (
        3 * block_bytes * step.layers * step.microbatches / pointwise,
        (3 * head_rest / pointwise + loss) * step.microbatches,
        optimizer_bytes / (fit.optimizer * gpu.memory_bandwidth),
    )


def copy_bytes(step: StepShape) -> dict[str, float]:
    """Bytes a step's casts and buffer copies move on one GPU (read and written), by cause.

    - ``logits``: a stack that upcasts the logits (``Framework.logits_upcast``) casts them to
      fp32 in forward (2 bytes read, 4 written) and their gradient back (4 + 2): 12 a logit;
    - ``autocast``: every forward casts each matmul's fp32 weight to bf16 (4 + 2), every backward
      its bf16 gradient to fp32 (2 + 4): 12 a parameter a micro-batch;
    - ``fsdp``: each gather copies this rank's shard into the gather's buffer, cast to the
      gathered precision, and the gathered buffer out into the layer's parameters; each reduction
      copies the gradients into its buffer in reduction precision and its output into the
      sharded gradients (FSDP2's ``foreach_all_gather``, ``foreach_reduce``); a unit is gathered
      for the forward and again for the backward of every micro-batch (once a step under a
      pipeline), and reduced once a step, as ``network_model`` counts the collectives. A world of
      one reduces by a copy too.
    """
    model, layout, framework = step.model, step.layout, step.framework
    shape = {"micro_batch": layout.micro_batch, "seq_len": step.seq_len}
    logits = logit_elements(model, layout, **shape) if framework.logits_upcast else 0.0
    stage = stage_parameters(model, layout, equal_blocks=framework.equal_stage_blocks)
    result = {"logits": 12 * logits * step.microbatches}
    if framework.autocasts(layout.precision):
        result["autocast"] = 12 * (stage - model.embedding_parameters()) * step.microbatches
    if layout.sharding == "fsdp":
        shards = layout.data * layout.context
        stored, gather = (
            framework.state_bytes(layout.precision)["param_bytes"],
            framework.gather_bytes(layout.precision),
        )
        reduce = framework.gradient_reduce_bytes(layout.precision)
        # as network_model counts the collectives: two gathers a micro-batch, one a step under a
        # pipeline (the stage stays gathered), one reduction a step
        gathers = 2 * (step.microbatches if layout.pipeline == 1 else 1)
        each_gather = (stored + gather) / shards + 2 * gather
        reduction = (layout.element_bytes + reduce) + 2 * reduce / shards
        result["fsdp"] = (gathers * each_gather + reduction) * stage
    return result


def copy_seconds(step: StepShape) -> float:
    """Seconds of ``copy_bytes`` at the rate the GPU's record measured for a copy (0 where the
    cluster names no GPU: a CPU's calibrated bandwidths already hold its copies)."""
    if not step.cluster.gpu:
        return 0.0
    gpu = kernels.GPUS[step.cluster.gpu]
    rate = kernels.kernel_fit(gpu.record).copy * gpu.memory_bandwidth
    return sum(copy_bytes(step).values()) / rate


def recomputed_matmul_share(model) -> float:
    """The share of a block's matmul FLOPs that torchtitan's op-level selective policy recomputes:
    every second matmul in forward order (wk, wo and the gated MLP's second up-projection)."""
    flops = [inputs * outputs * rows for inputs, outputs, rows, _ in block_matmuls(model)]
    return sum(flops[1::2]) / sum(flops)


def output_projection_share(model) -> float:
    """The share of a block's matmul FLOPs in the attention's output projection: what the course's
    selective policy recomputes under tensor parallelism (its result is a partial sum, not kept;
    fc2's, the other one, is never needed again: the recomputation stops before it)."""
    flops = [inputs * outputs * rows for inputs, outputs, rows, _ in block_matmuls(model)]
    return flops[3] / sum(flops)


SIMULATED_MICROBATCHES = 512
"""Beyond this many micro-batches a step, a schedule with a formula is priced by it: the simulation
equals it (tested up to this count and beyond), and costs seconds per layout at thousands."""


@functools.cache
def bubble_overhead(
    schedule: str, pipeline_size: int, microbatches: int, virtual_stages: int, backward_over_forward: float
) -> float:
    """A rank's idle time over its compute time in one step, from the schedule simulated.

    The schedule built (``pipeline.build_schedule``) and run on a clock (``simulate_timeline``)
    whose backward takes ``backward_over_forward`` forwards; for the schedules with a formula it
    equals (p - 1) / (v m) (``pipeline.bubble_overhead_theory``, tested), and a schedule without
    one is planned the same way.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, micro-batches per step.
        virtual_stages: v, stages per rank.
        backward_over_forward: a micro-batch's backward time over its forward time.
    """
    if microbatches > SIMULATED_MICROBATCHES and schedule in WHOLE_BACKWARD:
        return bubble_overhead_theory(pipeline_size, microbatches, virtual_stages=virtual_stages)
    actions = build_schedule(schedule, pipeline_size, microbatches, virtual_stages=virtual_stages)
    events = simulate_timeline(actions, pipeline_size, forward_time=1.0, backward_time=backward_over_forward)
    idle = bubble_fraction(events)
    return idle / (1 - idle)
