"""Each axis's communication in one step: seconds exposed and bytes sent per rank.

Each collective from the alpha-beta model (``scaling``), on the link the axis runs on: the tensor
axis innermost, inside a node, the data axis across nodes once the inner axes fill one
(``mesh.AXES``). What is hidden under compute is not paid: DDP's and ZeRO's gradient
reductions under the backward, FSDP's gathers under the forward and backward, ring attention's
passes under the attention; tensor parallelism's all-reduces sit between the matmuls that need
them and are paid whole; the pipeline pays its sends while it fills and drains. What a stack
overlaps beyond that, or does not, is its profile's (``frameworks.Framework``): tensor
parallelism cut into pieces beside the matmuls, ZeRO's parameter gather beside the next forward,
gradient reductions after the backward rather than beside it.

Paper: Narayanan et al. (arXiv:2104.04473) for the layout's axes and their traffic.
"""

from __future__ import annotations

import math

from ..distributed.comm import ring_bytes
from ..parallel.mesh import AXES
from .kernels import GPUS
from .layout import Layout
from .memory_model import stage_parameters
from .memory_phases import NCCL_CHANNELS
from .specs import ClusterSpec, Link, ModelSpec, StepShape


def ring_steps(op: str, group: int) -> int:
    """Messages one rank sends in a ring collective: 2(N-1) for an all-reduce, N-1 for the others."""
    return (2 if op == "all_reduce" else 1) * (group - 1)


def collective_seconds(op: str, message_bytes: float, group: int, link: Link) -> float:
    """The alpha-beta time of one ring collective: a latency per message, ``comm.ring_bytes`` at the
    link's bandwidth.

    Args:
        op: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``.
        message_bytes: the whole tensor's bytes (the all-gather's output, the all-reduce's input).
        group: N, the ranks.
        link: the link the ring runs on.
    """
    return ring_steps(op, group) * link.latency_s + ring_bytes(op, message_bytes, group) / link.bandwidth


TREE_BANDWIDTH = 0.92
"""The share of the ring's bus bandwidth NCCL's tuning model grants its tree all-reduce
(``busBw * .92`` in NVIDIA/nccl's ``src/graph/tuning.cc``, ``ncclTopoTuneModel``)."""


def all_reduce_seconds(
    message_bytes: float, group: int, link: Link, *, nodes: int = 1, inside: Link | None = None
) -> tuple[float, str]:
    """An all-reduce's time and algorithm, as NCCL chooses between its ring and its tree by size.

    The ring sends 2(N-1)/N of the message in 2(N-1) steps, each paying the link's latency. The
    tree (NCCL's double binary tree, pipelined in chunks) reduces up a chain inside each node and a
    tree across the nodes, then broadcasts back down: the latency of 2((N/nodes - 1) hops inside a
    node + log2(nodes) across), and twice the message at ``TREE_BANDWIDTH`` of the bus bandwidth
    (NCCL's ``tuning.cc`` counts both so). Many nodes and a small message: the tree; a large one:
    the ring. Inside one node the tree is a chain, no faster than the ring, and NCCL keeps the ring.

    Args:
        message_bytes: the tensor's bytes.
        group: N, the ranks.
        link: the link between the nodes (or inside the node, for a group within one).
        nodes: the nodes the group spans.
        inside: the link inside a node, whose latency the tree's chains pay (None: ``link``).
    """
    ring = collective_seconds("all_reduce", message_bytes, group, link)
    if nodes <= 1:
        return ring, "ring"
    inside = inside or link
    hops = 2 * ((group // nodes - 1) * inside.latency_s + math.ceil(math.log2(nodes)) * link.latency_s)
    tree = hops + 2 * message_bytes / (TREE_BANDWIDTH * link.bandwidth)
    return (tree, "tree") if tree < ring else (ring, "ring")


# The three all-reduces of ``distributed.hierarchical`` across K nodes of G GPUs, priced per link
# class with the same alpha-beta collectives. ``link_of`` already gives a group with g members on a
# node g NICs: that is the hierarchy's bandwidth, which NCCL reaches with a ring (channel) per NIC.


def flat_ring_seconds(message_bytes: float, *, world: int, across: Link) -> float:
    """One ring over all N ranks, as the course builds it: 2(N-1) steps, each as slow as the node
    boundary it may cross, whose one NIC carries the ring's whole 2(N-1)/N of the message (NCCL's
    flat ring runs a channel through every NIC: ``channel_rings_seconds``).

    Args:
        message_bytes: S.
        world: N, the ranks.
        across: one NIC between two nodes.
    """
    return collective_seconds("all_reduce", message_bytes, world, across)


def channel_rings_seconds(message_bytes: float, *, world: int, gpus_per_node: int, across: Link) -> float:
    """NCCL's flat ring: the message cut over G channels, each a ring over all N ranks whose node
    crossings leave through a different NIC, so every NIC carries 1/G of the ring's bytes. The
    bandwidth of the hierarchy, with the flat ring's 2(N-1) latency steps.

    Args:
        message_bytes: S.
        world: N, the ranks.
        gpus_per_node: G, the NICs of a node (one a GPU), one channel each.
        across: one NIC between two nodes.
    """
    every_nic = Link(across.latency_s, across.bandwidth * gpus_per_node)
    return collective_seconds("all_reduce", message_bytes, world, every_nic)


def hierarchical_seconds(
    message_bytes: float, *, gpus_per_node: int, nodes: int, inside: Link, across: Link
) -> float:
    """Reduce-scatter inside the node, all-reduce of S/G across the nodes (G rings at once, a NIC
    each), all-gather inside the node.

    Args:
        message_bytes: S.
        gpus_per_node: G.
        nodes: K.
        inside: the link inside a node.
        across: one NIC between two nodes.
    """
    g = gpus_per_node
    in_node = collective_seconds("reduce_scatter", message_bytes, g, inside) + collective_seconds(
        "all_gather", message_bytes, g, inside
    )
    return in_node + collective_seconds("all_reduce", message_bytes / g, nodes, across)


def tree_seconds(message_bytes: float, *, world: int, across: Link) -> float:
    """The double binary tree as ``hierarchical.tree_all_reduce`` builds it (unpipelined, the two
    trees one after the other): per tree, floor(log2 N) levels up and down, a parent taking its two
    children's halves one after the other, every level at the slowest link's pace.

    Args:
        message_bytes: S.
        world: N.
        across: the slowest link a level may cross.
    """
    if world <= 1:
        return 0.0
    levels = math.floor(math.log2(world))
    per_message = across.latency_s + message_bytes / 2 / across.bandwidth
    return 2 * 2 * levels * 2 * per_message  # two trees, up and down, two children a level


def _members_per_node(axis: str | tuple[str, ...], layout: Layout, cluster: ClusterSpec) -> tuple[int, int]:
    """(the size of one group of the axis, its members on each node): all of them where the group
    and the axes inside it fit one node."""
    axes = (axis,) if isinstance(axis, str) else axis
    innermost = max(AXES.index(name) for name in axes)
    inside = math.prod(layout.degree(name) for name in AXES[innermost + 1 :])  # between ring neighbours
    group = math.prod(layout.degree(name) for name in axes)
    if inside * group <= cluster.gpus_per_node:
        return group, group
    return group, max(1, min(group, cluster.gpus_per_node // inside))


def nodes_of(axis: str | tuple[str, ...], layout: Layout, cluster: ClusterSpec) -> int:
    """How many nodes one group of an axis spans (1: it fits inside one)."""
    group, members = _members_per_node(axis, layout, cluster)
    return math.ceil(group / members)


def link_of(axis: str | tuple[str, ...], layout: Layout, cluster: ClusterSpec) -> Link:
    """The link an axis's rings run on, as one GPU sees it (``axis``: one of ``AXES``, or adjacent
    ones whose ranks form one group, as FSDP's data x context).

    Inside a node while this axis and those inside it fit one. Across nodes, a ring's bytes leave
    each node through the NICs of the group's members on that node: NCCL runs several rings
    (channels) at once, each crossing the node boundary through another NIC. A group with one
    member per node (the data axis under 8-way tensor parallelism on 8-GPU nodes) has one NIC,
    ``between_nodes``; a group with g members per node has g of them, up to what the link inside
    the node carries. Checked against published bus bandwidths of all-reduces spanning whole
    nodes: 93 GB/s across 4 Alps nodes of 4 GPUs with 25 GB/s each (swiss-ai/lsaie-ss26-gipfelsturm,
    README, "within the theoretical ceiling of 100 GB/s per node"), and 180 GB/s across 4 H100
    nodes with 8 NICs of 25 GB/s (NVIDIA/nccl issue 1031): 0.93 and 0.90 of g NICs.
    """
    group, members = _members_per_node(axis, layout, cluster)
    if members == group:
        return cluster.inside_node
    if members == 1:
        return cluster.between_nodes
    network, node = cluster.between_nodes, cluster.inside_node
    return Link(network.latency_s, min(node.bandwidth, members * network.bandwidth))


# #region axes
def tensor_axis(step: StepShape, matmuls: float = 0.0) -> tuple[float, float]:
    """Seconds exposed and bytes per rank of the tensor group in one step: f and g around every
    block, and the collectives beside the blocks. Nothing hides them (the next matmul needs each
    result) unless the stack cuts each collective and its matmul into T pieces
    (``Framework.tensor_overlap``): then only the first piece waits, the rest runs beside
    ``matmuls`` (the step's matmul seconds)."""
    layout = step.layout
    t = layout.tensor
    # All-reduce-sized passes per block: f and g, forward and backward (4); sequence parallelism's
    # regathered inputs add two all-gathers in backward (one all-reduce's worth); recomputing
    # repeats the forward's g: both under "full", under "selective" the attention's, whose
    # result the second norm needs again (the MLP's goes nowhere in backward).
    passes = 4 + (1 if layout.sequence_parallel and t > 1 else 0)
    passes += {"none": 0, "selective": 1, "full": 2}[layout.recomputation] / layout.recompute_every
    link = link_of("tensor", layout, step.cluster)
    calls = passes * step.layers * step.microbatches
    seconds = calls * collective_seconds("all_reduce", step.activation_bytes, t, link)
    sent = calls * ring_bytes("all_reduce", step.activation_bytes, t)
    if t > 1:
        beside_seconds, beside_sent = _tensor_collectives_beside_the_blocks(
            step.model,
            layout,
            activation_bytes=step.activation_bytes,
            tokens=step.tokens,
            microbatches=step.microbatches,
            layers=step.layers,
            link=link,
        )
        seconds += beside_seconds
        sent += beside_sent
    if step.framework.tensor_overlap and t > 1:
        seconds = seconds / t + max(0.0, seconds * (1 - 1 / t) - matmuls)
    return seconds, sent


def _tensor_collectives_beside_the_blocks(
    model: ModelSpec,
    layout: Layout,
    *,
    activation_bytes: float,
    tokens: float,
    microbatches: int,
    layers: int,
    link: Link,
) -> tuple[float, float]:
    """Seconds and bytes per rank of the tensor group's collectives other than the blocks' f and g.

    Under sequence parallelism, the embedding's output is cut to s/T tokens (its gradient
    all-gathered in backward), and the weights that see only this rank's tokens (the norms, the
    row-parallel biases, and without ``loss_parallel`` the head's projection) have partial
    gradients, summed in one all-reduce a step. With ``loss_parallel`` (``parallel.vocab``), per
    micro-batch: the embedding's partial lookups all-reduced; the head's input all-gathered and
    its gradient reduce-scattered under sequence parallelism, or that gradient all-reduced
    without it; the loss's max and (Σ exp, target logit), three fp32 values per token. The
    embedding is on the first pipeline stage, the head on the last: the busier end counts.

    Args:
        model: the shapes.
        layout: the degrees, ``sequence_parallel`` and ``loss_parallel``.
        activation_bytes: one micro-batch's activations, b·s/C tokens of d values.
        tokens: b·s/C, the tokens of one micro-batch on this GPU.
        microbatches: micro-batches per step.
        layers: the blocks of the fullest pipeline stage.
        link: the tensor group's link.
    """
    first, last = [], []  # (op, bytes, calls a step) only the embedding's stage, or only the head's, makes
    blocks = head = 0.0  # replicated parameters whose gradients are partial
    m = microbatches
    if layout.sequence_parallel:
        first.append(("all_gather", activation_bytes, m))
        blocks = layers * model.replicated_block_parameters()
        head = model._norm_parameters() if layout.loss_parallel else model.head_parameters()
    if layout.loss_parallel:
        first.append(("all_reduce", activation_bytes, m))
        if layout.sequence_parallel:
            last += [("all_gather", activation_bytes, m), ("reduce_scatter", activation_bytes, m)]
        else:
            last.append(("all_reduce", activation_bytes, m))
        last += [("all_reduce", 4 * tokens, m), ("all_reduce", 2 * 4 * tokens, m)]

    def cost(calls):
        calls = [(op, size, count) for op, size, count in calls if size > 0]
        return (
            sum(count * collective_seconds(op, size, layout.tensor, link) for op, size, count in calls),
            sum(count * ring_bytes(op, size, layout.tensor) for op, size, count in calls),
        )

    if layout.pipeline == 1:
        return cost([*first, *last, ("all_reduce", 4 * (blocks + head), 1)])
    return max(
        cost([*first, ("all_reduce", 4 * blocks, 1)]),
        cost([*last, ("all_reduce", 4 * (blocks + head), 1)]),
        key=lambda seconds_and_bytes: seconds_and_bytes[1],
    )


def context_axis(step: StepShape, attention_flops: float) -> tuple[float, float]:
    """Seconds exposed and bytes per rank of the context group: Ulysses' all-to-alls, paid whole,
    or the ring's K/V chunks, hidden under the attention's compute where the cluster overlaps."""
    model, cluster, layout = step.model, step.cluster, step.layout
    c, t, element = layout.context, layout.tensor, layout.element_bytes
    link = link_of("context", layout, cluster)
    blocks = step.layers * step.microbatches
    if c > 1 and layout.context_attention == "ulysses":
        # Ulysses: q, k and v in one all-to-all to the head split, the output in one back; backward
        # the same two again, and recomputation (either policy) the forward's. Nothing to hide them
        # under: attention waits for its heads. With more context ranks than key/value heads, each
        # key/value head travels in context / kv_heads copies (parallel.ulysses.kv_copies).
        q_bytes = element * step.tokens * model.heads * model.head_dim / t
        kv_heads_sent = max(model.kv_heads / t, c)
        calls = (
            ("all_to_all", q_bytes * (1 + 2 * kv_heads_sent / (model.heads / t))),
            ("all_to_all", q_bytes),
        )
        exchanges = 2 + (layout.recomputation != "none") / layout.recompute_every
        each = sum(collective_seconds(op, size, c, link) for op, size in calls)
        return blocks * exchanges * each, blocks * exchanges * sum(
            ring_bytes(op, size, c) for op, size in calls
        )
    kv_bytes = element * 2 * step.tokens * model.kv_heads * model.head_dim / t
    # Forward passes on C-1 K/V chunks; backward the same C-1 again and C of their gradients.
    chunk_sends = 3 * c - 2 if c > 1 else 0
    if c > 1 and layout.recomputation != "none":
        chunk_sends += (c - 1) / layout.recompute_every  # the ring's forward again (both policies)
    ring = chunk_sends * (link.latency_s + kv_bytes / link.bandwidth)
    attention_compute = attention_flops / cluster.achieved_flops / blocks
    if not cluster.overlaps_communication:
        attention_compute = 0.0
    return blocks * max(0.0, ring - attention_compute), blocks * chunk_sends * kv_bytes


def data_axis(step: StepShape, busy: float) -> tuple[float, float]:
    """Seconds exposed and bytes per rank of the data (and context) group's gradient reductions
    and parameter gathers. ``busy``: the step's compute, which hides them where the cluster
    overlaps (DDP's and ZeRO's reductions under the backward, FSDP's gathers under all of it)."""
    return data_collectives(step, busy)[:2]


def contention_seconds(step: StepShape, hidden: float) -> float:
    """What overlapping ``hidden`` seconds of communication costs the compute beside it on a GPU.

    Overlap is not free: while NCCL's kernel runs it holds a multiprocessor a channel (one CUDA
    block each: NCCL's ``NCCL_MIN_CTAS``/``NCCL_MAX_CTAS``), ``memory_phases.NCCL_CHANNELS`` of
    them, so the compute it overlaps runs on the rest, (SMs - channels)/SMs as fast, and the step is
    longer by channels/SMs of the overlapped time (an H100's 132: 12 %; measured far worse where a
    product's last wave no longer fits: 80 % to 47 % of the peak for a 132-tile GEMM beside a
    24-block all-gather, forums.developer.nvidia.com/t/337991). Its memory traffic competes too;
    ``plan calibrate``'s ``contention`` term fits the two together. A CPU's overlap is not modelled
    (its gloo threads take the cores that compute: ``overlaps_communication``)."""
    if not step.cluster.gpu or not step.cluster.overlaps_communication:
        return 0.0
    return hidden * NCCL_CHANNELS / GPUS[step.cluster.gpu].multiprocessors


def data_collectives(step: StepShape, busy: float) -> tuple[float, float, float]:
    """(seconds exposed, bytes sent, seconds of every collective) of the data group's step: what
    ``data_axis`` reports, and the whole, of which all but the exposed seconds ran beside the
    compute (what ``contention_seconds`` charges for)."""
    layout, cluster, framework = step.layout, step.cluster, step.framework
    link, group = link_of(("data", "context"), layout, cluster), layout.data * layout.context
    stage_params = stage_parameters(step.model, layout, equal_blocks=framework.equal_stage_blocks)
    gradient_bytes = framework.gradient_reduce_bytes(layout.precision) * stage_params
    param_bytes = framework.gather_bytes(layout.precision) * stage_params
    reduce_op = "all_reduce" if layout.sharding == "ddp" else "reduce_scatter"
    if reduce_op == "all_reduce":  # NCCL's ring or tree, whichever its model says is faster
        nodes = nodes_of(("data", "context"), layout, cluster)
        gradient_time, _ = all_reduce_seconds(
            gradient_bytes, group, link, nodes=nodes, inside=cluster.inside_node
        )
    else:
        gradient_time = collective_seconds(reduce_op, gradient_bytes, group, link)
    gathers = 0
    if layout.sharding in ("zero1", "zero2"):
        gathers = 1  # the updated parameters, after the step
    elif layout.sharding == "fsdp":  # forward and backward, every micro-batch without PP
        gathers = 2 * (step.microbatches if layout.pipeline == 1 else 1)
    gather_time = gathers * collective_seconds("all_gather", param_bytes, group, link)
    overlaps = cluster.overlaps_communication
    if layout.sharding == "fsdp":  # FSDP gathers and reduces unit by unit, beside the compute
        seconds = max(0.0, gradient_time + gather_time - (busy if overlaps else 0.0))
    else:  # bucket by bucket beside the backward, or after it
        seconds = max(
            0.0, gradient_time - (busy * 2 / 3 if overlaps and framework.grad_reduce_overlap else 0.0)
        )
    if layout.sharding in ("zero1", "zero2"):
        # after the optimizer step: beside the next forward, or nothing left to hide it under
        hidden = busy / 3 if overlaps and framework.param_gather_overlap else 0.0
        seconds += max(0.0, gather_time - hidden)
    sent = ring_bytes(reduce_op, gradient_bytes, group) + gathers * ring_bytes(
        "all_gather", param_bytes, group
    )
    return seconds, sent, gradient_time + gather_time


def pipeline_axis(step: StepShape) -> tuple[float, float]:
    """Seconds exposed and bytes per rank of the pipeline's sends: filling and draining pay them,
    the steady state overlaps them, unless the stack's schedule waits on every micro-batch's
    (``Framework.blocking_pipeline_sends``)."""
    layout = step.layout
    p = layout.pipeline
    if p == 1:
        return 0.0, 0.0
    link = link_of("pipeline", layout, step.cluster)
    # A stage's output: this rank's s/T tokens under sequence parallelism, else every token (each
    # tensor rank holds and sends the whole of it)
    message = step.activation_bytes / (layout.tensor if layout.sequence_parallel else 1)
    send = link.latency_s + message / link.bandwidth
    # a middle stage sends activations on and gradients back; the two ends send one of them
    waits = p - 1 + (step.microbatches if layout.schedule in step.framework.blocking_pipeline_sends else 0)
    return 2 * waits * send, (1 if p == 2 else 2) * step.microbatches * message


def expert_axis(step: StepShape) -> tuple[float, float]:
    """Seconds and bytes per rank of the experts' all-to-alls: dispatch and combine, forward and
    backward, on every block; nothing hides them. The busiest rank's rows: ``expert_imbalance``
    times the mean (every token routed, none dropped)."""
    layout = step.layout
    if layout.expert == 1:
        return 0.0, 0.0
    tokens = step.tokens * step.framework.expert_imbalance
    rows_bytes = layout.element_bytes * tokens * step.model.top_k * step.model.d_model
    each = collective_seconds("all_to_all", rows_bytes, layout.expert, link_of("data", layout, step.cluster))
    calls = 4 * step.layers * step.microbatches
    return calls * each, calls * ring_bytes("all_to_all", rows_bytes, layout.expert)


# #endregion axes
