"""What the planner knows: the models, the machines, and one step's shape on the fullest GPU.

``ModelSpec`` holds a transformer's shapes (Llama 3 8B and 70B, Mixtral 8x7B, the course's own
block, in ``MODELS``); ``ClusterSpec`` a machine's GPUs, memory and links (Alps' GH200 nodes, an
8-H100 node, this laptop, in ``CLUSTERS``), each number with its source or the measurement it was
fitted to; ``StepShape`` what every formula of the cost model reads about one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_choice, check_fields
from ..errors import UserError
from ..models import Block
from .frameworks import COURSE_PROFILE, Framework
from .kernels import GPUS
from .layout import Layout


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
        experts: routed experts per MoE layer (1: a dense MLP).
        top_k: routed experts per token.
        norm: ``"rms"`` (RMSNorm: a weight, one statistic per token) or ``"layer"`` (LayerNorm: a
            weight and a bias, a mean and 1/std per token).
        bias: the linear layers have biases.
        position_embeddings: rows of a learned position embedding (0: none, rotary positions).
        source: where the shapes come from.
        head_dim: features per attention head (0: d_model / heads, as most models have; some,
            such as GPT-OSS, choose it apart, so that heads x head_dim differs from d_model).
        tied_embeddings: the output projection is the token embedding's matrix (one copy kept,
            still one more matmul computed).
        sliding_window: keys a query of a sliding-window layer attends to (0: every layer attends
            to the whole causal prefix).
        sliding_layers: how many of the ``layers`` attend through that window (GPT-OSS and
            Gemma alternate windowed and full layers); the rest attend to the whole prefix.
        shared_experts: experts of an MoE layer that every token goes through beside its routed
            ones, each ``ffn_hidden`` wide (DeepSeek-MoE's; ``parallel.dropless.DroplessMoE``'s):
            one dense MLP of their combined width, replicated over the expert ranks.
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
    head_dim: int = 0
    tied_embeddings: bool = False
    sliding_window: int = 0
    sliding_layers: int = 0
    shared_experts: int = 0

    def __post_init__(self):
        check_fields(
            self,
            minimum={
                **dict.fromkeys(("layers", "d_model", "heads", "kv_heads", "ffn_hidden", "vocab"), 1),
                **dict.fromkeys(("experts", "top_k"), 1),
                **dict.fromkeys(
                    ("position_embeddings", "head_dim", "sliding_window", "sliding_layers", "shared_experts"),
                    0,
                ),
            },
        )
        check_choice("ModelSpec norm", self.norm, ("rms", "layer"))
        if self.top_k > self.experts:
            raise UserError(f"{self.name}: top_k ({self.top_k}) cannot exceed the experts ({self.experts})")
        if self.shared_experts and self.experts == 1:
            raise UserError(
                f"{self.name}: shared experts beside no routed ones: give experts > 1, or none shared"
            )
        if not self.head_dim:  # the usual choice, filled in so that every formula reads one field
            object.__setattr__(self, "head_dim", self.d_model // self.heads)
        if self.sliding_layers > self.layers or (self.sliding_layers > 0) != (self.sliding_window > 0):
            raise UserError(
                f"{self.name}: sliding_layers ({self.sliding_layers}) must be at most the layers "
                f"({self.layers}), and set together with sliding_window ({self.sliding_window})"
            )

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
    def attention_width(self) -> int:
        """heads x head_dim: what q projects to and ``out`` projects from (d_model for most models)."""
        return self.heads * self.head_dim

    def attended_span(self, seq_len: int) -> float:
        """The keys of the whole square a token's attention pays for, summed over the layers: s for a
        full layer (a causal kernel computes half of the s x s square, the usual count charges all of
        it), 2w for a layer whose queries see w keys (their half-square), at most s."""
        windowed = min(seq_len, 2 * self.sliding_window)
        return (self.layers - self.sliding_layers) * seq_len + self.sliding_layers * windowed

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
        """q and out (h x heads·head_dim each), k and v (h x kv_heads·head_dim each), the two norms."""
        h, q, kv = self.d_model, self.attention_width, self.kv_heads * self.head_dim
        biases = (q + h + 2 * kv) if self.bias else 0
        return 2 * h * q + 2 * h * kv + biases + 2 * self._norm_parameters()

    def expert_parameters(self) -> int:
        """One MLP (one expert)."""
        matrices = 3 if self.gated_mlp else 2
        biases = ((matrices - 1) * self.ffn_hidden + self.d_model) if self.bias else 0
        return matrices * self.d_model * self.ffn_hidden + biases

    def block_parameters(self) -> int:
        router = self.d_model * self.experts if self.experts > 1 else 0
        mlps = self.experts + self.shared_experts
        return self.attention_parameters() + mlps * self.expert_parameters() + router

    def embedding_parameters(self) -> int:
        """The token (and position) embeddings: looked up, not multiplied, so they cost no FLOPs."""
        return (self.vocab + self.position_embeddings) * self.d_model

    def head_parameters(self) -> int:
        """The final norm and the output projection (untied from the embedding)."""
        return self._norm_parameters() + self.vocab * self.d_model + (self.vocab if self.bias else 0)

    def parameters(self) -> int:
        """Ψ: the embeddings, the blocks, the final norm and the output projection (counted once
        when it is the embedding's matrix)."""
        shared = self.vocab * self.d_model if self.tied_embeddings else 0
        return (
            self.embedding_parameters()
            + self.layers * self.block_parameters()
            + self.head_parameters()
            - shared
        )

    def active_parameters(self) -> int:
        """The parameters one token meets: ``top_k`` experts per MoE layer instead of all of them."""
        inactive = (
            self.layers * (self.experts - self.top_k) * self.expert_parameters() if self.experts > 1 else 0
        )
        return self.parameters() - inactive

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per active parameter a token is multiplied by (the blocks'
        and the head's, the head once even when tied), plus attention's 12·(heads·head_dim)·s per
        layer (``attended_span``: a sliding window's layers pay for their window instead)."""
        multiplied = self.active_parameters() - self.embedding_parameters()
        if self.tied_embeddings:
            multiplied += self.vocab * self.d_model
        return 6 * multiplied + 12 * self.attention_width * self.attended_span(seq_len)


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
            source=(
                "Mixtral 8x7B (Jiang et al., 2024, table 1; mistralai/Mixtral-8x7B-v0.1 config.json); "
                "routed as Megatron-Bridge's Mixtral recipe does: dropless, softmax top-2, all-to-all, "
                "grouped GEMM (Framework.grouped_experts); its load skew is Framework.expert_imbalance"
            ),
        ),
        ModelSpec(
            "gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, experts=128, top_k=4, bias=True, head_dim=64,
            sliding_window=128, sliding_layers=18,
            source=(
                "GPT-OSS 120B (OpenAI, 2025, gpt-oss model card table 1; openai/gpt-oss-120b config.json): "
                "64 heads of 64 (4096 wide, not d_model), every second layer a 128-token window; its "
                "attention sinks (one learned logit per head) cost no FLOPs worth counting; routed as "
                "Megatron-Bridge's recipe does: dropless, softmax top-4, all-to-all, grouped GEMM"
            ),
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Link:
    """One class of link in the alpha-beta model: ``latency_s`` per message, ``bandwidth`` bytes/s per GPU."""

    latency_s: float
    bandwidth: float

    def __post_init__(self):
        check_fields(self, minimum={"latency_s": 0}, above={"bandwidth": 0})


@dataclass(frozen=True)
class ClusterSpec:
    """What the planner needs to know of a machine.

    Args:
        name: its name on the command line.
        gpus_per_node: GPUs joined by the fast link.
        gpu_memory_bytes: one GPU's memory, in bytes as the device reports it
            (``torch.cuda.mem_get_info()[1]``: what ``gpu_record`` writes as ``memory_bytes``).
        peak_flops: the datasheet's dense bf16 FLOP/s of one GPU (for MFU).
        achieved_flops: what large bf16 matmuls reach on it (for time where ``gpu`` is not named,
            and for the overlap estimates).
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
        gpu: the kind of GPU (``kernels.GPUS``): its products are then timed by their shapes and
            its memory-bound work at its record's rates (``kernels``), and ``achieved_flops`` and
            ``memory_bandwidth`` serve only the overlap estimates; "": at those two rates.
        context_bytes: what a process's CUDA context takes of the GPU's memory before PyTorch
            allocates anything (``gpu_record``'s ``memory_bytes - free_after_context_bytes``;
            NCCL's buffers are counted apart, from the layout: ``memory_phases``).
    """

    name: str
    gpus_per_node: int
    gpu_memory_bytes: float
    peak_flops: float
    achieved_flops: float
    memory_bandwidth: float
    inside_node: Link
    between_nodes: Link
    overlaps_communication: bool = True
    source: str = ""
    optimizer_bandwidth: float | None = None
    host_seconds_per_operation: float = 0.0
    gpu: str = ""
    context_bytes: float = 0.0

    def __post_init__(self):
        positive = (
            "gpu_memory_bytes",
            "peak_flops",
            "achieved_flops",
            "memory_bandwidth",
            "optimizer_bandwidth",
        )
        check_fields(
            self,
            minimum={"gpus_per_node": 1, "context_bytes": 0, "host_seconds_per_operation": 0},
            above=dict.fromkeys(positive, 0),
        )
        if self.gpu:
            check_choice("ClusterSpec gpu", self.gpu, tuple(GPUS))


GB = 1e9
GIB = 2**30
"""A gibibyte: what PyTorch's memory readings and published memory figures count in."""

MIB = 2**20

H100_REPORTED = 85017493504
"""What an H100 80GB reports to PyTorch (``slides/recorded/gpu/nvidia-h100-80gb-hbm3.json``):
81,079 MiB of its 81,920 MiB of HBM3 (five 16 GiB stacks); the driver keeps the rest."""

H200_REPORTED = 150109880320
"""What an H200 reports to PyTorch (``slides/recorded/gpu/nvidia-h200.json``): 143,156 MiB of
its 147,456 MiB of HBM3e (six 24 GiB stacks)."""

CUDA_CONTEXT = 753729536
"""A CUDA context on an H100 and on an H200, measured the same on both by ``gpu_record``
(``memory_bytes - free_after_context_bytes``, PyTorch 2.11, CUDA 13.0): 719 MiB."""


def reported_by_the_device(stacks_gib: float) -> float:
    """What a Hopper or Ampere GPU with ``stacks_gib`` of HBM reports to PyTorch, where no record of
    it exists: that memory times the share the H100's record reports of its 80 GiB (98.97 %; the
    driver keeps the rest), an assumption each cluster using it names."""
    return stacks_gib * GIB * H100_REPORTED / (80 * GIB)


OPTIMIZER_BYTES = {"fp32": 7 * 4, "bf16": 7 * 4 + 2, "fp8": 7 * 4 + 2}
"""Bytes AdamW moves per parameter it updates: reads the weight, gradient and two moments, writes
the weight and moments (fp32), and in mixed precision writes the bf16 copy forward uses."""


CLUSTERS = {
    spec.name: spec
    for spec in (
        ClusterSpec(
            name="alps",
            gpu="gh200",
            gpus_per_node=4,
            gpu_memory_bytes=reported_by_the_device(96),
            context_bytes=CUDA_CONTEXT,
            peak_flops=989.4e12,
            achieved_flops=0.7 * 989.4e12,
            memory_bandwidth=0.8 * 4000 * GB,
            inside_node=Link(10e-6, 150 * GB),
            between_nodes=Link(20e-6, 25 * GB),
            source=(
                "CSCS Alps GH200 nodes (docs.cscs.ch/alps/hardware): 4 GH200 per node, 96 GiB HBM3 each "
                "(reported to PyTorch as the H100's share of its HBM, an assumption; the CUDA context as "
                "measured on an H100), "
                "NVLink all-to-all (6 NVLink-4 links of 25 GB/s per peer and direction), one Slingshot-11 "
                "NIC of 200 Gb/s per GPU; bf16 peak and 4 TB/s HBM3 from NVIDIA's datasheet; products and "
                "memory-bound work timed by plan.kernels (an H100's record); the latencies are assumptions: "
                "measure yours with bench allreduce, or fit them with plan calibrate"
            ),
        ),
        ClusterSpec(
            name="h100-node",
            gpu="h100-sxm",
            gpus_per_node=8,
            gpu_memory_bytes=H100_REPORTED,
            context_bytes=CUDA_CONTEXT,
            peak_flops=989.4e12,
            achieved_flops=0.7 * 989.4e12,
            memory_bandwidth=0.8 * 3350 * GB,
            inside_node=Link(10e-6, 436 * GB),
            between_nodes=Link(20e-6, 50 * GB),
            source=(
                "8 H100 SXM per node with NVSwitch (all-reduce bus bandwidth 436 GB/s measured in the "
                "Ultra-Scale Playbook), one 400 Gb/s InfiniBand NIC per GPU; 3.35 TB/s HBM3; the memory and "
                "the CUDA context as this GPU's record measured them; products and "
                "memory-bound work timed by plan.kernels (this GPU's own record); the latencies are "
                "assumptions"
            ),
        ),
        ClusterSpec(
            name="h100-grand-teton",
            gpu="h100-sxm-500w-hbm2e",
            gpus_per_node=8,
            gpu_memory_bytes=reported_by_the_device(96),
            context_bytes=CUDA_CONTEXT,
            peak_flops=989.4e12,
            achieved_flops=0.7 * 989.4e12,
            memory_bandwidth=0.8 * 2400 * GB,
            inside_node=Link(10e-6, 436 * GB),
            between_nodes=Link(20e-6, 50 * GB),
            source=(
                "Meta's Grand Teton hosts as torchtitan's benchmarks describe them "
                "(pytorch/torchtitan@31a17bf:benchmarks/llama3_h100_202412_torchtitan.md): 8 H100 SXM per "
                "host on NVLink, 96 GiB HBM2e at 2.4 TB/s (reported to PyTorch as the H100's share, an "
                "assumption), a 500 W power limit, 400 Gb/s RDMA per GPU; the "
                "SXM datasheet's bf16 peak as MFU's denominator (the benchmark's own); the NVLink figure of "
                "h100-node; products and memory-bound work timed by plan.kernels at the capped GPU's own "
                "peak (kernels.GPUS, between the SXM's and the NVL's) with a 700 W H100's record's "
                "fractions; the latencies are assumptions"
            ),
        ),
        ClusterSpec(
            name="h200-node",
            gpu="h200",
            gpus_per_node=8,
            gpu_memory_bytes=H200_REPORTED,
            context_bytes=CUDA_CONTEXT,
            peak_flops=989.4e12,
            achieved_flops=0.7 * 989.4e12,
            memory_bandwidth=0.8 * 4800 * GB,
            inside_node=Link(10e-6, 436 * GB),
            between_nodes=Link(20e-6, 50 * GB),
            source=(
                "8 H200 SXM per node (NVIDIA's H200 datasheet: 141 GB HBM3e at 4.8 TB/s, the H100's bf16 "
                "peak; the memory and the CUDA context as this GPU's record measured them; "
                "the same NVLink 4 and NVSwitch, so h100-node's measured bus bandwidth), one 400 Gb/s "
                "NIC per GPU (as torchtitan's H200 benchmark describes its hosts: pytorch/torchtitan@bcdeaa3"
                ":benchmarks/llama3_8b_h200_2025-06_torchtitan.md); products and memory-bound work timed by "
                "plan.kernels (this GPU's own record); the latencies are assumptions"
            ),
        ),
        ClusterSpec(
            name="a100-dgx",
            gpu="a100-sxm",
            gpus_per_node=8,
            gpu_memory_bytes=reported_by_the_device(80),
            context_bytes=CUDA_CONTEXT,
            peak_flops=312e12,
            achieved_flops=0.7 * 312e12,
            memory_bandwidth=0.8 * 2039 * GB,
            inside_node=Link(10e-6, 0.8 * 300 * GB),
            between_nodes=Link(20e-6, 25 * GB),
            source=(
                "DGX A100 nodes as in Selene (Narayanan et al. 2021, section 5): 8 A100 80GB SXM per node "
                "(80 GiB of HBM2e, reported to PyTorch as the H100's share, an assumption), "
                "2.039 TB/s HBM2e and 312 TFLOP/s bf16 (NVIDIA's datasheet), NVLink 3 at 300 GB/s per GPU "
                "and direction through NVSwitch, one 200 Gb/s HDR InfiniBand NIC per GPU; 80 % of NVLink's "
                "rate for NCCL's ring; products and memory-bound work timed by plan.kernels (an H100's "
                "record's fractions); the latencies are assumptions"
            ),
        ),
    )
}


@dataclass(frozen=True)
class StepShape:
    """One training step as every axis's formula reads it: the job, and the fullest GPU's share.

    Args:
        model: the shapes.
        cluster: the machine.
        layout: the layout.
        seq_len: s, tokens per sequence.
        global_batch: sequences per optimizer step, over all replicas.
        framework: what the training stack keeps and overlaps (``frameworks.FRAMEWORKS``).
    """

    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    seq_len: int
    global_batch: int
    framework: Framework = COURSE_PROFILE

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
