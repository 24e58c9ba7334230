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

from ..parallel.pipeline import bubble_fraction, build_schedule, simulate_timeline
from .memory_model import block_activation_elements, block_matmuls, head_activation_bytes, stage_parameters
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

    @property
    def forward_and_backward(self) -> float:
        return self.matmuls + self.pointwise_blocks + self.pointwise_head


def compute_seconds(step: StepShape) -> ComputeSeconds:
    """The matmuls at the achieved rate, the memory-bound work at the memory's bandwidth, the
    recomputation, and the pipeline's bubble (the schedule simulated)."""
    model, cluster, layout, framework = step.model, step.cluster, step.layout, step.framework
    t, p, c = layout.tensor, layout.pipeline, layout.context
    # The fullest GPU holds a stage's blocks and, on the last stage, the head.
    tokens = step.tokens_per_gpu_step
    head_flops = 6 * model.head_parameters() * tokens / (t if layout.loss_parallel else 1)
    block_flops = (model.flops_per_token(step.seq_len) - 6 * model.head_parameters()) * tokens / (t * p)
    matmuls = (block_flops + head_flops) / cluster.achieved_flops
    attention_flops = 12 * model.layers * model.attention_width * step.seq_len * tokens / (t * p)
    # Memory-bound work: what the blocks keep for backward is written once in forward and read
    # twice in backward by the norms, activation functions and adds; the optimizer step moves
    # each parameter it updates, its gradient and its two moments.
    unrecomputed = layout.with_(recomputation="none")
    block_bytes = layout.element_bytes * block_activation_elements(
        model, unrecomputed, micro_batch=layout.micro_batch, seq_len=step.seq_len
    )
    head = head_activation_bytes(
        model,
        layout,
        micro_batch=layout.micro_batch,
        seq_len=step.seq_len,
        logit_bytes=framework.logit_bytes(layout.precision),
    )
    pointwise_blocks = 3 * block_bytes * step.layers * step.microbatches / cluster.memory_bandwidth
    pointwise_head = 3 * head * step.microbatches / cluster.memory_bandwidth
    held = stage_parameters(model, layout, equal_blocks=framework.equal_stage_blocks)
    updated = held / (1 if layout.sharding == "ddp" else layout.data * c)
    optimizer = (
        OPTIMIZER_BYTES[layout.precision]
        * updated
        / (cluster.optimizer_bandwidth or cluster.memory_bandwidth)
    )
    ring = c > 1 and layout.context_attention == "ring"
    selective = {
        # the pointwise operations' forward again (and under context parallelism the ring's attention)
        "course": pointwise_blocks / 3 + (attention_flops / 3 / cluster.achieved_flops if ring else 0.0),
        # and the forward of every second matmul
        "op_sac": pointwise_blocks / 3
        + (
            recomputed_matmul_share(model) * (block_flops - attention_flops) / 3
            + (attention_flops / 3 if ring else 0.0)
        )
        / cluster.achieved_flops,
        # the attention core's forward: its two products
        "attention_core": attention_flops / 3 / cluster.achieved_flops,
    }[framework.selective]
    recompute = {
        "none": 0.0,
        "full": (block_flops / cluster.achieved_flops + pointwise_blocks) / 3,  # one more forward
        "selective": selective,
    }[layout.recomputation]
    parts = ComputeSeconds(
        matmuls, pointwise_blocks, pointwise_head, optimizer, recompute, 0.0, attention_flops
    )
    if p > 1:  # the schedule itself, simulated: a backward twice a forward, three times if recomputed
        backward_over_forward = 2.0 + (layout.recomputation == "full")
        parts.bubble = (parts.forward_and_backward + recompute) * bubble_overhead(
            layout.schedule, p, step.microbatches, layout.virtual_stages, backward_over_forward
        )
    return parts


def recomputed_matmul_share(model) -> float:
    """The share of a block's matmul FLOPs that torchtitan's op-level selective policy recomputes:
    every second matmul in forward order (wk, wo and the gated MLP's second up-projection)."""
    flops = [inputs * outputs * rows for inputs, outputs, rows, _ in block_matmuls(model)]
    return sum(flops[1::2]) / sum(flops)


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
    actions = build_schedule(schedule, pipeline_size, microbatches, virtual_stages=virtual_stages)
    events = simulate_timeline(actions, pipeline_size, forward_time=1.0, backward_time=backward_over_forward)
    idle = bubble_fraction(events)
    return idle / (1 - idle)
