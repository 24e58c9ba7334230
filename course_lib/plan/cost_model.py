"""Predict a layout before launching it: memory per GPU, bytes sent, step time, MFU.

Every term is a formula the course has already measured on real processes; this lesson adds
them up for a model and a cluster too large for a laptop:

- **model states**: ``memory.model_state_bytes`` of the parameters a GPU holds (its pipeline
  stage's layers, 1/T of each matrix, 1/E of the experts), sharded over the data (and context)
  ranks by the ZeRO stage;
- **activations**: the per-block count of ``activations`` (Korthikanti et al.), written here for
  a Llama-style block (RMSNorm, grouped-query attention, a gated MLP, flash attention), times the
  micro-batches the pipeline schedule keeps in flight (``pipeline.peak_activations_theory``);
- **compute**: the model's FLOPs per token (6·N + 12·L·h·s, as torchtitan and PaLM count them)
  over what one GPU achieves on large matrix products (a measured rate, not the datasheet's);
- **communication**: each axis's collectives from the alpha-beta model (``scaling``), on the
  link the axis runs on: the tensor axis innermost, inside a node, the data axis across nodes
  once the inner axes fill one (``layout.AXES``). What is hidden under compute is not paid:
  DDP's and ZeRO's gradient reductions under the backward, FSDP's gathers under the forward and
  backward, ring attention's passes under the attention; tensor parallelism's all-reduces sit
  between the matmuls that need them and are paid whole; the pipeline pays its bubble.

- **memory-bound work**: what the blocks keep for backward, written once and read twice by the
  norms, activation functions and adds, and the optimizer's bytes per updated parameter, at a
  memory bandwidth (the optimizer's may be measured apart);
- **the host**: where the core that dispatches is the one that computes (a CPU), each operation
  a step dispatches costs the host a few microseconds; the count comes from the implementation
  (``predict``'s ``operations``), the cost per operation from calibration. A GPU's host queues
  its kernels ahead and the term is 0.

The step time is matmuls + memory-bound work + recomputation + bubble + the exposed
communication of every axis + the host's dispatching, the same parts as ``anatomy``'s budget.
``tools.plan`` ranks every layout of a job by it, and ``tools.plan --validate`` holds the same
formulas against measurement on this machine.

What it leaves out (say so when you compare with a published figure): kernel efficiency that
changes with shapes (one achieved rate for all matmuls), a GPU host that cannot keep ahead of
small kernels (the launches a small step is made of), and communication that contends with
compute for the GPU's memory bandwidth.

Papers: Korthikanti et al. (arXiv:2205.05198) for activations; Narayanan et al. (arXiv:2104.04473)
for the layout's axes and their traffic; Rajbhandari et al. (arXiv:1910.02054) for model states.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

from ..distributed.comm import ring_bytes
from ..errors import UserError
from ..models import Block
from ..parallel import memory
from ..parallel.pipeline import bubble_fraction, build_schedule, peak_activations_theory, simulate_timeline
from .layout import AXES, CONTEXT_ATTENTION, Layout


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a decoder-only transformer, Llama-style.

    Args:
        name: its name on the command line.
        layers: L, transformer blocks.
        d_model: h, the width.
        heads: a, query heads.
        kv_heads: key/value heads (grouped-query attention; = heads for multi-head attention).
        ffn_hidden: the MLP's hidden width (per expert for a mixture of experts).
        vocab: V, the vocabulary.
        gated_mlp: SwiGLU (three matrices) rather than two.
        experts: experts per MoE layer (1: a dense MLP).
        top_k: experts per token.
        norm: ``"rms"`` (RMSNorm: a weight, one statistic per token) or ``"layer"`` (LayerNorm: a
            weight and a bias, a mean and 1/std per token).
        bias: the linear layers have biases.
        position_embeddings: rows of a learned position embedding (0: none, rotary positions).
        source: where the shapes come from.
    """

    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    gated_mlp: bool = True
    experts: int = 1
    top_k: int = 1
    norm: str = "rms"
    bias: bool = False
    position_embeddings: int = 0
    source: str = ""

    @classmethod
    def of(cls, model, *, name: str = "course-transformer") -> ModelSpec:
        """The spec of one of the course's ``models.TinyTransformer`` (LayerNorm, biases, GELU MLP)."""
        blocks = [m for m in model if isinstance(m, Block)]
        return cls(
            name, len(blocks), model.d_model, model.n_heads, model.n_heads, blocks[0].mlp.fc1.out_features,
            model.vocab_size, gated_mlp=False, norm="layer", bias=True,
            position_embeddings=model[0].positions.num_embeddings,
            source="the course's models.TinyTransformer",
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def norm_statistics(self) -> int:
        """Values a norm keeps per token for backward: LayerNorm's mean and 1/std, RMSNorm's 1/rms."""
        return 2 if self.norm == "layer" else 1

    def _norm_parameters(self) -> int:
        return (2 if self.norm == "layer" else 1) * self.d_model

    def replicated_block_parameters(self) -> int:
        """What tensor parallelism leaves whole on every rank of a block: the two norms, and the
        biases of ``out`` and fc2 (added once, after the partial sums)."""
        return 2 * self._norm_parameters() + (2 * self.d_model if self.bias else 0)

    def attention_parameters(self) -> int:
        """q and out (h x h each), k and v (h x kv_heads·head_dim each), the block's two norms."""
        h, kv = self.d_model, self.kv_heads * self.head_dim
        biases = (2 * h + 2 * kv) if self.bias else 0
        return 2 * h * h + 2 * h * kv + biases + 2 * self._norm_parameters()

    def expert_parameters(self) -> int:
        """One MLP (one expert)."""
        matrices = 3 if self.gated_mlp else 2
        biases = ((matrices - 1) * self.ffn_hidden + self.d_model) if self.bias else 0
        return matrices * self.d_model * self.ffn_hidden + biases

    def block_parameters(self) -> int:
        router = self.d_model * self.experts if self.experts > 1 else 0
        return self.attention_parameters() + self.experts * self.expert_parameters() + router

    def embedding_parameters(self) -> int:
        """The token (and position) embeddings: looked up, not multiplied, so they cost no FLOPs."""
        return (self.vocab + self.position_embeddings) * self.d_model

    def head_parameters(self) -> int:
        """The final norm and the output projection (untied from the embedding)."""
        return self._norm_parameters() + self.vocab * self.d_model + (self.vocab if self.bias else 0)

    def parameters(self) -> int:
        """Ψ: the embeddings, the blocks, the final norm and the output projection."""
        return self.embedding_parameters() + self.layers * self.block_parameters() + self.head_parameters()

    def active_parameters(self) -> int:
        """The parameters one token meets: ``top_k`` experts per MoE layer instead of all of them."""
        inactive = (
            self.layers * (self.experts - self.top_k) * self.expert_parameters() if self.experts > 1 else 0
        )
        return self.parameters() - inactive

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per active non-embedding parameter, plus attention's 12·L·h·s."""
        return (
            6 * (self.active_parameters() - self.embedding_parameters())
            + 12 * self.layers * self.d_model * seq_len
        )


MODELS = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "llama3-8b", 32, 4096, 32, 8, 14336, 128256,
            source="Llama 3 8B (Grattafiori et al., 2024, table 3; meta-llama/Meta-Llama-3-8B config.json)",
        ),
        ModelSpec(
            "llama3-70b", 80, 8192, 64, 8, 28672, 128256,
            source="Llama 3 70B (Grattafiori et al., 2024, table 3; meta-llama/Meta-Llama-3-70B config.json)",
        ),
        ModelSpec(
            "mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2,
            source="Mixtral 8x7B (Jiang et al., 2024, table 1; mistralai/Mixtral-8x7B-v0.1 config.json)",
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Link:
    """One class of link in the alpha-beta model: ``latency_s`` per message, ``bandwidth`` bytes/s per GPU."""

    latency_s: float
    bandwidth: float


@dataclass(frozen=True)
class ClusterSpec:
    """What the planner needs to know of a machine.

    Args:
        name: its name on the command line.
        gpus_per_node: GPUs joined by the fast link.
        gpu_memory_bytes: one GPU's memory.
        reserved_bytes: what the job cannot use of it (CUDA context, NCCL buffers, allocator
            fragmentation): an assumption, named in every breakdown.
        peak_flops: the datasheet's dense bf16 FLOP/s of one GPU (for MFU).
        achieved_flops: what large bf16 matmuls reach on it (for time).
        memory_bandwidth: bytes/s its memory-bound operations reach (norms, activation
            functions, the optimizer step).
        inside_node: the link between GPUs of one node.
        between_nodes: each GPU's share of the network.
        overlaps_communication: collectives run beside the compute (a GPU's copy engines and
            spare SMs); False on CPUs, where gloo's threads need the cores that compute.
        source: where the figures come from.
        optimizer_bandwidth: bytes/s the optimizer step reaches, when it differs from
            ``memory_bandwidth`` (None: the same). AdamW streams its 28 bytes a parameter with
            little arithmetic; a CPU core's activation functions (GELU's erf, softmax's exp) are
            slower than their bytes say, and on a CPU the two rates are measured apart.
        host_seconds_per_operation: what the host spends dispatching one operation (Python, the
            dispatcher, autograd's bookkeeping) when that time is on the step's path: on a CPU,
            where the core that dispatches is the one that computes. A GPU's host queues
            kernels ahead of the device and the time hides behind large kernels: 0.
    """

    name: str
    gpus_per_node: int
    gpu_memory_bytes: float
    reserved_bytes: float
    peak_flops: float
    achieved_flops: float
    memory_bandwidth: float
    inside_node: Link
    between_nodes: Link
    overlaps_communication: bool = True
    source: str = ""
    optimizer_bandwidth: float | None = None
    host_seconds_per_operation: float = 0.0


GB = 1e9
OPTIMIZER_BYTES = {"fp32": 7 * 4, "bf16": 7 * 4 + 2}
"""Bytes AdamW moves per parameter it updates: reads the weight, gradient and two moments, writes
the weight and moments (fp32), and in mixed precision writes the bf16 copy forward uses."""

CLUSTERS = {
    spec.name: spec
    for spec in (
        ClusterSpec(
            name="alps",
            gpus_per_node=4,
            gpu_memory_bytes=96 * GB,
            reserved_bytes=6 * GB,
            peak_flops=989.4e12,
            achieved_flops=0.7 * 989.4e12,
            memory_bandwidth=0.8 * 4000 * GB,
            inside_node=Link(10e-6, 150 * GB),
            between_nodes=Link(20e-6, 25 * GB),
            source=(
                "CSCS Alps GH200 nodes (docs.cscs.ch/alps/hardware): 4 GH200 per node, 96 GB HBM3 each, "
                "NVLink all-to-all (6 NVLink-4 links of 25 GB/s per peer and direction), one Slingshot-11 "
                "NIC of 200 Gb/s per GPU; bf16 peak and 4 TB/s HBM3 from NVIDIA's datasheet; 70 % of the "
                "peak and 80 % of the bandwidth achieved and the latencies are assumptions: measure yours "
                "with bench allreduce and flops"
            ),
        ),
        ClusterSpec(
            name="h100-node",
            gpus_per_node=8,
            gpu_memory_bytes=80 * GB,
            reserved_bytes=6 * GB,
            peak_flops=989.4e12,
            achieved_flops=0.7 * 989.4e12,
            memory_bandwidth=0.8 * 3350 * GB,
            inside_node=Link(10e-6, 436 * GB),
            between_nodes=Link(20e-6, 50 * GB),
            source=(
                "8 H100 SXM per node with NVSwitch (all-reduce bus bandwidth 436 GB/s measured in the "
                "Ultra-Scale Playbook), one 400 Gb/s InfiniBand NIC per GPU; 3.35 TB/s HBM3; 70 % of the "
                "bf16 peak and 80 % of the bandwidth achieved and the latencies are assumptions"
            ),
        ),
    )
}


@dataclass
class Prediction:
    """What ``predict`` says of one layout: bytes per GPU (the fullest one), seconds per step.

    ``memory`` and ``time`` are breakdowns whose ``total`` is the sum of the other entries;
    ``traffic`` is the bytes one GPU sends per step, by axis. ``problem`` is the one reason the
    layout cannot run (None: it can).
    """

    layout: Layout
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    traffic: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    problem: str | None = None

    @property
    def fits(self) -> bool:
        return self.problem is None


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


def link_of(axis: str, layout: Layout, cluster: ClusterSpec) -> Link:
    """The link an axis's rings run on: inside a node while this axis and those inside it fit one."""
    inner = 1
    for name in reversed(AXES):
        inner *= layout.degree(name)
        if name == axis:
            break
    return cluster.inside_node if inner <= cluster.gpus_per_node else cluster.between_nodes


def block_activation_elements(model: ModelSpec, layout: Layout, *, micro_batch: int, seq_len: int) -> float:
    """Elements one Llama-style block keeps for backward per micro-batch on one GPU (bf16 elements).

    The course's ``activations.block_activation_elements`` term by term, for RMSNorm (input and
    one statistic per token) or LayerNorm (two), grouped-query attention (k and v are
    kv_heads/heads of q), flash attention (an fp32 log-sum-exp per head and token: 2 bf16
    elements), a gated MLP (gate, up, SiLU and product: 4·ffn per token) or a plain one (2·ffn),
    and with ``layout.sequence_parallel`` Megatron-LM's sequence parallelism (the norms and the
    projections' inputs on s/T tokens). For the course's block in fp32 it is
    ``activations.block_activation_elements`` exactly (the tests hold the two equal).

    Args:
        model: the shapes.
        layout: tensor, context degrees and recomputation.
        micro_batch: b, sequences per micro-batch.
        seq_len: s, tokens per sequence.
    """
    t = layout.tensor
    sp = t if layout.sequence_parallel else 1  # what the norms and the projections' inputs are cut by
    tokens = micro_batch * seq_len / layout.context  # this GPU's tokens of the micro-batch
    h, a = model.d_model, model.heads
    sbh = tokens * h
    kv = model.kv_heads / model.heads
    rows = model.top_k if model.experts > 1 else 1  # an MoE layer computes k rows per token
    mlp_hidden = tokens * rows * model.ffn_hidden
    lse = a * tokens * 4 / layout.element_bytes  # one fp32 log-sum-exp per head and token
    block_input = sbh / sp
    if layout.recomputation == "full":
        return block_input
    q_k_v = (1 + 2 * kv) * sbh / t
    attention = (sbh + lse) / t  # the output and the log-sum-exp
    if layout.recomputation == "selective":
        # the ring's blocks are batched matmuls, recomputed; Ulysses' attention is the fused kernel, kept
        ring_recomputed = layout.context > 1 and layout.context_attention == "ring"
        gate_up = 2 * mlp_hidden / t if model.gated_mlp else mlp_hidden / t
        return block_input + q_k_v + (0 if ring_recomputed else attention) + gate_up + 2 * sbh
    norms = 2 * (sbh + model.norm_statistics * tokens) / sp
    projection_inputs = 2 * sbh / sp
    # the attention's output, reshaped from the ring's (or Ulysses' all-to-all's) layout: one copy
    ring_output_copy = sbh / t if layout.context > 1 else 0
    mlp = (4 if model.gated_mlp else 2) * mlp_hidden / t
    router = tokens * model.experts if model.experts > 1 else 0
    return norms + projection_inputs + q_k_v + attention + ring_output_copy + mlp + router


def _activations_per_gpu(
    model: ModelSpec,
    layout: Layout,
    block_bytes: float,
    head: float,
    tokens: float,
    microbatches: int,
    seq_len: int,
) -> float:
    """What a step's forwards leave alive at the worst moment on the fullest GPU.

    Per micro-batch, a stage keeps its blocks' terms; the first stage also the positions it looked
    up, the last the head's terms and the loss. A block's terms count its input, which on a later
    stage is the message received (made before the step's forward), and a stage keeps its output
    until that micro-batch's backward (the message sent). The token ids and targets are the batch's.
    """
    p, v = layout.pipeline, layout.virtual_stages
    layers = math.ceil(model.layers / p)
    boundary = (
        layout.element_bytes * tokens * model.d_model / (layout.tensor if layout.sequence_parallel else 1)
    )
    positions = 8 * seq_len / layout.context if model.position_embeddings else 0
    loss = 4 + 4  # the loss, and the one scalar the cross-entropy keeps for backward
    if layout.loss_parallel and layout.tensor > 1:
        # split over the vocabulary, the embedding keeps which ids are this rank's (bool) and their
        # rows (int64); the loss, which targets are (bool) and their columns (int64)
        positions += 9 * tokens
        loss += 9 * tokens
    if p == 1:
        return positions + layers * block_bytes + head + loss
    first = positions + layers * block_bytes + boundary
    last = layers * block_bytes - boundary + head + loss
    # counted per virtual stage; a virtual stage holds 1/v of the rank's layers
    in_flight_first = peak_activations_theory(layout.schedule, p, microbatches, 0, virtual_stages=v) / v
    in_flight_last = peak_activations_theory(layout.schedule, p, microbatches, p - 1, virtual_stages=v) / v
    return max(in_flight_first * first, in_flight_last * last)


def head_activation_bytes(model: ModelSpec, layout: Layout, *, micro_batch: int, seq_len: int) -> float:
    """Bytes the final norm, the output projection and the loss keep per micro-batch on one GPU.

    The norm's input and statistics, the projection's input, the loss's fp32 log-softmax (one
    value per token and vocabulary entry: split over the tensor ranks with ``loss_parallel``) and
    nothing for the targets (the batch's): ``activations.head_activation_bytes`` for the course's
    head in fp32, less the targets and the loss.

    Args:
        model: the shapes.
        layout: tensor and context degrees, ``loss_parallel``, precision.
        micro_batch: b, sequences per micro-batch.
        seq_len: s, tokens per sequence.
    """
    tokens = micro_batch * seq_len / layout.context
    sp = layout.tensor if layout.sequence_parallel else 1  # the final norm runs on s/T tokens
    norm = layout.element_bytes * tokens / sp * model.d_model + 4 * model.norm_statistics * tokens / sp
    if layout.loss_parallel:  # the norm's output gathered; every token's logits, 1/T of the vocabulary each
        projected, rows, columns = tokens, tokens, vocabulary_rows(model, layout)
    else:  # this rank's tokens (s/T with sequence parallelism), the whole vocabulary
        projected, rows, columns = tokens / sp, tokens / sp, model.vocab
    return norm + layout.element_bytes * projected * model.d_model + 4 * rows * columns


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
    first, last = [], []  # the calls only the embedding's stage, or only the head's, makes
    blocks = head = 0.0  # replicated parameters whose gradients are partial
    if layout.sequence_parallel:
        first += [("all_gather", activation_bytes)] * microbatches
        blocks = layers * model.replicated_block_parameters()
        head = model._norm_parameters() if layout.loss_parallel else model.head_parameters()
    if layout.loss_parallel:
        first += [("all_reduce", activation_bytes)] * microbatches
        if layout.sequence_parallel:
            last += [("all_gather", activation_bytes), ("reduce_scatter", activation_bytes)] * microbatches
        else:
            last += [("all_reduce", activation_bytes)] * microbatches
        last += [("all_reduce", 4 * tokens), ("all_reduce", 2 * 4 * tokens)] * microbatches

    def cost(calls):
        calls = [(op, size) for op, size in calls if size > 0]
        return (
            sum(collective_seconds(op, size, layout.tensor, link) for op, size in calls),
            sum(ring_bytes(op, size, layout.tensor) for op, size in calls),
        )

    if layout.pipeline == 1:
        return cost([*first, *last, ("all_reduce", 4 * (blocks + head))])
    return max(
        cost([*first, ("all_reduce", 4 * blocks)]),
        cost([*last, ("all_reduce", 4 * (blocks + head))]),
        key=lambda seconds_and_bytes: seconds_and_bytes[1],
    )


def vocabulary_rows(model: ModelSpec, layout: Layout) -> int:
    """The embedding's and projection's rows on one GPU: ceil(V/T) with ``loss_parallel`` (the
    vocabulary padded to a multiple of T, as ``parallel.vocab`` and Megatron-LM pad it), else V.

    Args:
        model: the vocabulary.
        layout: the tensor degree and ``loss_parallel``.
    """
    return math.ceil(model.vocab / layout.tensor) if layout.loss_parallel else model.vocab


def block_parameters_per_gpu(model: ModelSpec, layout: Layout) -> float:
    """One block's parameters on one GPU: the matrices and their column biases split over T (the
    experts also over E); the norms and the row-parallel layers' biases whole on every tensor rank."""
    t, replicated = layout.tensor, model.replicated_block_parameters()
    experts = model.experts * model.expert_parameters() if model.experts > 1 else 0
    split = model.block_parameters() - replicated - experts
    return split / t + replicated + experts / (t * layout.expert)


def stage_parameters(model: ModelSpec, layout: Layout) -> float:
    """Parameters on the fullest GPU: its pipeline stages' entries, each cut as ``parallelize`` cuts it.

    The model is the list [embedding, L blocks, head] shared out evenly over P·v stages (earlier
    stages take one more when it does not divide, as ``pipeline.split_model`` does); the embedding
    and head are split over the tensor ranks only with ``loss_parallel``.

    Args:
        model: the shapes.
        layout: the degrees.
    """
    rows = vocabulary_rows(model, layout)
    embedding = rows * model.d_model + model.position_embeddings * model.d_model
    head = model._norm_parameters() + rows * model.d_model + (rows if model.bias else 0)
    block = block_parameters_per_gpu(model, layout)
    entries = [embedding, *([block] * model.layers), head]
    stages = layout.pipeline * layout.virtual_stages
    base, extra = divmod(len(entries), stages)
    sizes = [base + (1 if s < extra else 0) for s in range(stages)]
    bounds = [sum(sizes[:s]) for s in range(stages + 1)]
    per_stage = [sum(entries[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    per_rank = [sum(per_stage[r :: layout.pipeline]) for r in range(layout.pipeline)]
    return max(per_rank)


def check(model: ModelSpec, layout: Layout, *, gpus: int, seq_len: int, global_batch: int) -> str | None:
    """The one reason ``layout`` cannot run ``model`` (None: it can), in the order a launch would meet it."""
    if layout.gpus != gpus:
        return f"takes {layout.gpus} GPUs, not {gpus}"
    if model.kv_heads % layout.tensor:
        return f"{model.kv_heads} key/value heads do not split over tensor degree {layout.tensor}"
    if model.ffn_hidden % layout.tensor:
        return f"the MLP's {model.ffn_hidden} hidden units do not split over tensor degree {layout.tensor}"
    if model.layers < layout.pipeline * layout.virtual_stages:
        return f"{model.layers} layers cannot fill {layout.pipeline * layout.virtual_stages} stages"
    ulysses = layout.context > 1 and layout.context_attention == "ulysses"
    if ulysses and model.kv_heads % (layout.tensor * layout.context):
        return (
            f"{model.kv_heads} key/value heads do not split over tensor x context = "
            f"{layout.tensor * layout.context} (Ulysses splits the heads)"
        )
    if ulysses and seq_len % layout.context:
        return f"a sequence of {seq_len} does not cut into {layout.context} chunks"
    if layout.context > 1 and not ulysses and seq_len % (2 * layout.context):
        return f"a sequence of {seq_len} does not cut into {2 * layout.context} zig-zag chunks"
    if model.experts > 1 and model.experts % layout.expert:
        return f"{model.experts} experts do not split over expert degree {layout.expert}"
    if model.experts == 1 and layout.expert > 1:
        return "expert parallelism needs a mixture-of-experts model"
    if global_batch % (layout.data * layout.micro_batch):
        return (
            f"a global batch of {global_batch} sequences does not split into {layout.data} replicas of "
            f"micro-batches of {layout.micro_batch}"
        )
    microbatches = global_batch // (layout.data * layout.micro_batch)
    if layout.schedule == "interleaved_1f1b" and microbatches % layout.pipeline:
        return (
            f"the interleaved schedule needs micro-batches ({microbatches}) to be a multiple of "
            f"P = {layout.pipeline}"
        )
    return None


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


@dataclass(frozen=True)
class StepShape:
    """One training step as every axis's formula reads it: the job, and the fullest GPU's share.

    Args:
        model: the shapes.
        cluster: the machine.
        layout: the layout.
        seq_len: s, tokens per sequence.
        global_batch: sequences per optimizer step, over all replicas.
    """

    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    seq_len: int
    global_batch: int

    @property
    def microbatches(self) -> int:
        """Micro-batches per replica and step, run one after the other."""
        return self.global_batch // (self.layout.data * self.layout.micro_batch)

    @property
    def layers(self) -> int:
        """The blocks of the fullest pipeline stage."""
        return math.ceil(self.model.layers / self.layout.pipeline)

    @property
    def tokens(self) -> float:
        """This GPU's tokens of one micro-batch: b·s/C."""
        return self.layout.micro_batch * self.seq_len / self.layout.context

    @property
    def activation_bytes(self) -> float:
        """One micro-batch's activations on this GPU: b·s/C tokens of d values."""
        return self.layout.element_bytes * self.tokens * self.model.d_model

    @property
    def tokens_per_gpu_step(self) -> float:
        """Every micro-batch of this GPU's replica and context chunk."""
        return self.global_batch * self.seq_len / (self.layout.data * self.layout.context)


def memory_per_gpu(step: StepShape) -> tuple[dict[str, float], float]:
    """Bytes the fullest GPU holds, by part, and its model states alone.

    Model states: the stage's parameters sharded by the ZeRO stage over data x context;
    activations at the worst moment of the schedule; FSDP's gathered layer and the next
    (prefetched); what the allocator and the libraries reserve.
    """
    model, layout = step.model, step.layout
    element = layout.element_bytes
    stage = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "zero3"}[layout.sharding]
    per_param = memory.MIXED_PRECISION_ADAM if layout.precision == "bf16" else memory.FP32_ADAM
    states = memory.model_state_bytes(
        stage_parameters(model, layout), layout.data * layout.context, stage, **per_param
    )
    block = block_activation_elements(model, layout, micro_batch=layout.micro_batch, seq_len=step.seq_len)
    head = head_activation_bytes(model, layout, micro_batch=layout.micro_batch, seq_len=step.seq_len)
    activations = _activations_per_gpu(
        model, layout, block * element, head, step.tokens, step.microbatches, step.seq_len
    )
    layer_bytes = element * model.block_parameters() / layout.tensor
    gathered = 2 * layer_bytes if layout.sharding == "fsdp" else 0  # this layer and the prefetched next
    parts = {
        "parameters": states.params,
        "gradients": states.grads,
        "optimizer": states.optimizer,
        "activations": activations,
        "gathered parameters": gathered,
        "reserved (assumed)": step.cluster.reserved_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts, states.total


@dataclass
class ComputeSeconds:
    """The fullest GPU's own work in one step, in seconds (``attention_flops``: FLOPs)."""

    matmuls: float
    pointwise_blocks: float  # the blocks' memory-bound operations
    pointwise_head: float  # the head's
    optimizer: float
    recompute: float
    bubble: float
    attention_flops: float  # the attention's score and value products, which a ring can hide under

    @property
    def forward_and_backward(self) -> float:
        return self.matmuls + self.pointwise_blocks + self.pointwise_head


def compute_seconds(step: StepShape) -> ComputeSeconds:
    """The matmuls at the achieved rate, the memory-bound work at the memory's bandwidth, the
    recomputation, and the pipeline's bubble (the schedule simulated)."""
    model, cluster, layout = step.model, step.cluster, step.layout
    t, p, c = layout.tensor, layout.pipeline, layout.context
    # The fullest GPU holds a stage's blocks and, on the last stage, the head.
    tokens = step.tokens_per_gpu_step
    head_flops = 6 * model.head_parameters() * tokens / (t if layout.loss_parallel else 1)
    block_flops = (model.flops_per_token(step.seq_len) - 6 * model.head_parameters()) * tokens / (t * p)
    matmuls = (block_flops + head_flops) / cluster.achieved_flops
    attention_flops = 12 * model.layers * model.d_model * step.seq_len * tokens / (t * p)
    # Memory-bound work: what the blocks keep for backward is written once in forward and read
    # twice in backward by the norms, activation functions and adds; the optimizer step moves
    # each parameter it updates, its gradient and its two moments.
    unrecomputed = layout.with_(recomputation="none")
    block_bytes = layout.element_bytes * block_activation_elements(
        model, unrecomputed, micro_batch=layout.micro_batch, seq_len=step.seq_len
    )
    head = head_activation_bytes(model, layout, micro_batch=layout.micro_batch, seq_len=step.seq_len)
    pointwise_blocks = 3 * block_bytes * step.layers * step.microbatches / cluster.memory_bandwidth
    pointwise_head = 3 * head * step.microbatches / cluster.memory_bandwidth
    updated = stage_parameters(model, layout) / (1 if layout.sharding == "ddp" else layout.data * c)
    optimizer = (
        OPTIMIZER_BYTES[layout.precision]
        * updated
        / (cluster.optimizer_bandwidth or cluster.memory_bandwidth)
    )
    recompute = {
        "none": 0.0,
        "full": (block_flops / cluster.achieved_flops + pointwise_blocks) / 3,  # one more forward
        # the pointwise operations' forward again (and under context parallelism the ring's attention)
        "selective": pointwise_blocks / 3
        + (
            attention_flops / 3 / cluster.achieved_flops
            if c > 1 and layout.context_attention == "ring"
            else 0.0
        ),
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


def tensor_axis(step: StepShape) -> tuple[float, float]:
    """Seconds and bytes per rank of the tensor group in one step: f and g around every block,
    and the collectives beside the blocks. Nothing hides them: the next matmul needs each result."""
    layout = step.layout
    t = layout.tensor
    # All-reduce-sized passes per block: f and g, forward and backward (4); sequence parallelism's
    # regathered inputs add two all-gathers in backward (one all-reduce's worth); recomputing
    # repeats the forward's g: both under "full", under "selective" the attention's, whose
    # result the second norm needs again (the MLP's goes nowhere in backward).
    passes = 4 + (1 if layout.sequence_parallel and t > 1 else 0)
    passes += {"none": 0, "selective": 1, "full": 2}[layout.recomputation]
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
    return seconds, sent


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
        # under: attention waits for its heads.
        q_bytes = element * step.tokens * model.heads * model.head_dim / t
        calls = (("all_to_all", q_bytes * (1 + 2 * model.kv_heads / model.heads)), ("all_to_all", q_bytes))
        exchanges = 2 + (layout.recomputation != "none")
        each = sum(collective_seconds(op, size, c, link) for op, size in calls)
        return blocks * exchanges * each, blocks * exchanges * sum(
            ring_bytes(op, size, c) for op, size in calls
        )
    kv_bytes = element * 2 * step.tokens * model.kv_heads * model.head_dim / t
    # Forward passes on C-1 K/V chunks; backward the same C-1 again and C of their gradients.
    chunk_sends = 3 * c - 2 if c > 1 else 0
    if c > 1 and layout.recomputation != "none":
        chunk_sends += c - 1  # the ring's forward again (recomputed under both policies)
    ring = chunk_sends * (link.latency_s + kv_bytes / link.bandwidth)
    attention_compute = attention_flops / cluster.achieved_flops / blocks
    if not cluster.overlaps_communication:
        attention_compute = 0.0
    return blocks * max(0.0, ring - attention_compute), blocks * chunk_sends * kv_bytes


def data_axis(step: StepShape, busy: float) -> tuple[float, float]:
    """Seconds exposed and bytes per rank of the data (and context) group's gradient reductions
    and parameter gathers. ``busy``: the step's compute, which hides them where the cluster
    overlaps (DDP's and ZeRO's reductions under the backward, FSDP's gathers under all of it)."""
    layout, cluster = step.layout, step.cluster
    link, group = link_of("data", layout, cluster), layout.data * layout.context
    stage_params = stage_parameters(step.model, layout)
    gradient_bytes, param_bytes = 4 * stage_params, layout.element_bytes * stage_params
    reduce_op = "all_reduce" if layout.sharding == "ddp" else "reduce_scatter"
    gradient_time = collective_seconds(reduce_op, gradient_bytes, group, link)
    gathers = 0
    if layout.sharding in ("zero1", "zero2"):
        gathers = 1  # the updated parameters, after the step
    elif layout.sharding == "fsdp":  # forward and backward, every micro-batch without PP
        gathers = 2 * (step.microbatches if layout.pipeline == 1 else 1)
    gather_time = gathers * collective_seconds("all_gather", param_bytes, group, link)
    hidden = busy * 2 / 3 if layout.sharding != "fsdp" else busy
    if not cluster.overlaps_communication:
        hidden = 0.0
    seconds = max(0.0, gradient_time + (gather_time if layout.sharding == "fsdp" else 0) - hidden)
    if layout.sharding in ("zero1", "zero2"):
        seconds += gather_time  # after the optimizer step: nothing left to hide it under
    sent = ring_bytes(reduce_op, gradient_bytes, group) + gathers * ring_bytes(
        "all_gather", param_bytes, group
    )
    return seconds, sent


def pipeline_axis(step: StepShape) -> tuple[float, float]:
    """Seconds exposed and bytes per rank of the pipeline's sends: filling and draining pay them,
    the steady state overlaps them."""
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
    return 2 * (p - 1) * send, (1 if p == 2 else 2) * step.microbatches * message


def expert_axis(step: StepShape) -> tuple[float, float]:
    """Seconds and bytes per rank of the experts' all-to-alls: dispatch and combine, forward and
    backward, on every block; nothing hides them."""
    layout = step.layout
    if layout.expert == 1:
        return 0.0, 0.0
    rows_bytes = layout.element_bytes * step.tokens * step.model.top_k * step.model.d_model
    each = collective_seconds("all_to_all", rows_bytes, layout.expert, link_of("data", layout, step.cluster))
    calls = 4 * step.layers * step.microbatches
    return calls * each, calls * ring_bytes("all_to_all", rows_bytes, layout.expert)


def predict(
    model: ModelSpec,
    cluster: ClusterSpec,
    layout: Layout,
    *,
    seq_len: int,
    global_batch: int,
    operations: int = 0,
) -> Prediction:
    """Memory per GPU, traffic and step time of one training step of ``model`` laid out as ``layout``.

    The sum of the parts above: the memory, the GPU's own work, then each axis's seconds exposed
    and bytes sent, and the host's dispatching.

    Args:
        model: the shapes (``MODELS``).
        cluster: the machine (``CLUSTERS``).
        layout: the layout; its GPUs are the job's.
        seq_len: s, tokens per sequence.
        global_batch: sequences per optimizer step, over all replicas.
        operations: the operations one step's forward and backward dispatch on the busiest GPU,
            counted (an implementation's count, not a formula: ``plan_validation``'s
            ``OperationCounter``); they cost ``cluster.host_seconds_per_operation`` each. 0: no
            host term.
    """
    result = Prediction(layout)
    problem = check(model, layout, gpus=layout.gpus, seq_len=seq_len, global_batch=global_batch)
    if problem:
        result.problem = problem
        return result
    step = StepShape(model, cluster, layout, seq_len, global_batch)
    result.memory, model_states = memory_per_gpu(step)
    work = compute_seconds(step)
    axes = {
        "tensor": tensor_axis(step),
        "context": context_axis(step, work.attention_flops),
        "data": data_axis(step, work.forward_and_backward + work.recompute),
        "pipeline": pipeline_axis(step),
        "expert": expert_axis(step),
    }
    result.time = {
        "compute": work.matmuls,
        "memory-bound operations": work.pointwise_blocks + work.pointwise_head,
        "optimizer step": work.optimizer,
        "recomputation": work.recompute,
        "pipeline bubble": work.bubble,
        "tensor (exposed)": axes["tensor"][0],
        "context (exposed)": axes["context"][0],
        "data (exposed)": axes["data"][0],
        "pipeline sends (exposed)": axes["pipeline"][0],
        "expert (exposed)": axes["expert"][0],
        "host (dispatching operations)": operations * cluster.host_seconds_per_operation,
    }
    result.time["total"] = sum(result.time.values())
    result.traffic = {axis: sent for axis, (_, sent) in axes.items()}
    result.tokens_per_s = global_batch * seq_len / result.time["total"]
    result.mfu = model.flops_per_token(seq_len) * result.tokens_per_s / (layout.gpus * cluster.peak_flops)
    usable, needed = cluster.gpu_memory_bytes, result.memory["total"]
    if needed > usable:
        result.problem = (
            f"needs {needed / GB:.0f} GB per GPU of {usable / GB:.0f} "
            f"(activations {result.memory['activations'] / GB:.0f} GB, model states {model_states / GB:.0f} GB)"
        )
    return result


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    gpus: int,
    template: Layout | None = None,
    context_attention: tuple[str, ...] = CONTEXT_ATTENTION,
) -> list[Layout]:
    """Every layout the planner considers for ``gpus`` GPUs: the product of the axes' choices.

    Tensor degree up to two nodes' worth (to show why it stops at one), pipeline and context
    degrees that are powers of two, with a context degree ring attention and Ulysses, three
    shardings, three recomputation policies, 1F1B and interleaved 1F1B (v = 2), micro-batches of
    1 and 2 sequences; with a mixture of experts, the experts spread over as many data x context
    ranks as divide them. Everything else (precision, sequence and loss parallelism) is
    ``template``'s.

    Args:
        model: the shapes (the experts).
        cluster: the machine (GPUs per node).
        gpus: the GPUs of the job.
        template: the choices every candidate shares.
        context_attention: the methods tried where the context degree is above 1.
    """
    layouts, template = [], template or Layout()
    for t in [k for k in divisors(gpus) if k <= 2 * cluster.gpus_per_node]:
        for p in [k for k in divisors(gpus // t) if k & (k - 1) == 0]:
            for c in [k for k in divisors(gpus // (t * p)) if k & (k - 1) == 0 and k <= 8]:
                d = gpus // (t * p * c)
                experts = [1]
                if model.experts > 1:
                    experts += [e for e in divisors(d * c) if e > 1 and model.experts % e == 0]
                schedules = [("1f1b", 1)] + ([("interleaved_1f1b", 2)] if p > 1 else [])
                methods = context_attention if c > 1 else (template.context_attention,)
                for e, attention in itertools.product(experts, methods):
                    for sharding in ("ddp", "zero1", "fsdp"):
                        for recomputation in ("none", "selective", "full"):
                            for schedule, v in schedules:
                                for micro_batch in (1, 2):
                                    layouts.append(
                                        template.with_(
                                            data=d, pipeline=p, context=c, tensor=t, expert=e,
                                            sharding=sharding, recomputation=recomputation,
                                            schedule=schedule, virtual_stages=v, micro_batch=micro_batch,
                                            context_attention=attention,
                                        )
                                    )  # fmt: skip
    return layouts


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    template: Layout | None = None,
    context_attention: tuple[str, ...] = CONTEXT_ATTENTION,
) -> tuple[list[Prediction], list[Prediction]]:
    """Every candidate layout predicted: (those that fit, fastest first; those that do not).

    Args:
        model: the shapes (``MODELS``).
        cluster: the machine (``CLUSTERS``).
        gpus: the GPUs of the job.
        seq_len: s, tokens per sequence.
        global_batch: sequences per optimizer step.
        template: the choices every candidate shares (precision, sequence and loss parallelism).
        context_attention: the methods tried where the context degree is above 1 (ring, Ulysses).
    """
    if gpus < 1:
        raise UserError(f"the job needs at least one GPU, got {gpus}")
    candidates = candidate_layouts(
        model, cluster, gpus=gpus, template=template, context_attention=context_attention
    )
    predictions = [
        predict(model, cluster, layout, seq_len=seq_len, global_batch=global_batch) for layout in candidates
    ]
    fitting = sorted((p for p in predictions if p.fits), key=lambda p: (-p.tokens_per_s, p.memory["total"]))
    return fitting, [p for p in predictions if not p.fits]
