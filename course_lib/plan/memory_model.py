"""What the fullest GPU holds in one step: model states, activations, gathered parameters.

- **model states**: ``memory.model_state_bytes`` of the parameters a GPU holds (its pipeline
  stage's layers, 1/T of each matrix, 1/E of the experts), sharded over the data (and context)
  ranks by the ZeRO stage;
- **activations**: the per-block count of ``activations`` (Korthikanti et al.), written here for
  a Llama-style block (RMSNorm, grouped-query attention, a gated MLP, flash attention), times the
  micro-batches the pipeline schedule keeps in flight (``pipeline.peak_activations_theory``).

Papers: Korthikanti et al. (arXiv:2205.05198) for activations; Rajbhandari et al.
(arXiv:1910.02054) for model states.
"""

from __future__ import annotations

import math

from ..parallel.pipeline import peak_activations_theory
from .layout import Layout
from .specs import ModelSpec


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


def stage_parameters(model: ModelSpec, layout: Layout, *, equal_blocks: bool = False) -> float:
    """Parameters on the fullest GPU: its pipeline stages' entries, each cut as ``parallelize`` cuts it.

    The model is the list [embedding, L blocks, head] shared out evenly over P·v stages (earlier
    stages take one more when it does not divide, as ``pipeline.split_model`` does), or with
    ``equal_blocks`` L/(P·v) blocks on every stage and the embedding and head added to the first
    and last (Megatron-LM's cut); the embedding and head are split over the tensor ranks only
    with ``loss_parallel``.

    Args:
        model: the shapes.
        layout: the degrees.
        equal_blocks: Megatron-LM's cut (``Framework.equal_stage_blocks``).
    """
    rows = vocabulary_rows(model, layout)
    stages = layout.pipeline * layout.virtual_stages
    embedding = rows * model.d_model + model.position_embeddings * model.d_model
    # a tied projection is the embedding's matrix: one copy where both sit on one stage, a copy
    # on each end of a pipeline (Megatron-LM's, whose gradients the two ends sum)
    projection = 0 if model.tied_embeddings and stages == 1 else rows * model.d_model
    head = model._norm_parameters() + projection + (rows if model.bias else 0)
    block = block_parameters_per_gpu(model, layout)
    if equal_blocks:
        per_stage = [math.ceil(model.layers / stages) * block] * stages
        per_stage[0] += embedding
        per_stage[-1] += head
    else:
        entries = [embedding, *([block] * model.layers), head]
        base, extra = divmod(len(entries), stages)
        sizes = [base + (1 if s < extra else 0) for s in range(stages)]
        bounds = [sum(sizes[:s]) for s in range(stages + 1)]
        per_stage = [sum(entries[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    per_rank = [sum(per_stage[r :: layout.pipeline]) for r in range(layout.pipeline)]
    return max(per_rank)


def block_activation_elements(
    model: ModelSpec,
    layout: Layout,
    *,
    micro_batch: int,
    seq_len: int,
    selective: str = "course",
    fp32_residual: bool = False,
) -> float:
    """Elements one Llama-style block keeps for backward per micro-batch on one GPU (bf16 elements).

    The course's ``activations.block_activation_elements`` term by term, for RMSNorm (input and
    one statistic per token) or LayerNorm (two), grouped-query attention (k and v are
    kv_heads/heads of q), flash attention (an fp32 log-sum-exp per head and token: 2 bf16
    elements), a gated MLP (gate, up, SiLU and product: 4·ffn per token) or a plain one (2·ffn),
    and with ``layout.sequence_parallel`` Megatron-LM's sequence parallelism (the norms and the
    projections' inputs on s/T tokens). For the course's block in fp32 it is
    ``activations.block_activation_elements`` exactly (the tests hold the two equal).

    Under ``"selective"`` recomputation, what is kept depends on the stack (``selective``): the
    course's policy keeps the block's input, every matmul's and the attention's result;
    torchtitan's op-level policy the same but for every second matmul (``_saved_matmuls``);
    Megatron-LM's everything but the attention core (its output and log-sum-exp).

    Args:
        model: the shapes.
        layout: tensor, context degrees and recomputation.
        micro_batch: b, sequences per micro-batch.
        seq_len: s, tokens per sequence.
        selective: ``frameworks.SELECTIVE_POLICIES``: what ``"selective"`` keeps.
        fp32_residual: the residual stream is fp32 (``Framework.autocast``): the block's input
            takes two bf16 elements a value, and each norm keeps its fp32 input and its fp32
            normalized output (an unfused RMSNorm multiplies that by its weight), four.
    """
    if layout.recomputation != "none" and layout.recompute_every > 1:  # on average over k blocks
        every, shape = (
            layout.recompute_every,
            {"micro_batch": micro_batch, "seq_len": seq_len, "selective": selective,
             "fp32_residual": fp32_residual},
        )  # fmt: skip
        plain = block_activation_elements(
            model, layout.with_(recomputation="none", recompute_every=1), **shape
        )
        recomputed = block_activation_elements(model, layout.with_(recompute_every=1), **shape)
        return ((every - 1) * plain + recomputed) / every
    t = layout.tensor
    sp = t if layout.sequence_parallel else 1  # what the norms and the projections' inputs are cut by
    tokens = micro_batch * seq_len / layout.context  # this GPU's tokens of the micro-batch
    h, a = model.d_model, model.heads
    sbh = tokens * h
    heads_out = tokens * model.attention_width  # q, and the attention's output (sbh for most models)
    kv = tokens * model.kv_heads * model.head_dim  # k, and v
    rows = model.top_k if model.experts > 1 else 1  # an MoE layer computes k rows per token
    mlp_hidden = tokens * (rows + model.shared_experts) * model.ffn_hidden  # and each shared expert's
    lse = a * tokens * 4 / layout.element_bytes  # one fp32 log-sum-exp per head and token
    residual = 2 if fp32_residual else 1  # bf16 elements a value of the residual stream takes
    block_input = residual * sbh / sp
    if layout.recomputation == "full":
        return block_input
    q_k_v = (heads_out + 2 * kv) / t
    attention = (heads_out + lse) / t  # the output and the log-sum-exp
    # the ring's blocks are batched matmuls, recomputed; Ulysses' attention is the fused kernel, kept
    ring_recomputed = layout.context > 1 and layout.context_attention == "ring"
    kept_attention = 0 if ring_recomputed else attention
    if layout.recomputation == "selective" and selective == "course":
        gate_up = 2 * mlp_hidden / t if model.gated_mlp else mlp_hidden / t
        row_outputs = 2 * sbh if t == 1 else 0  # under tensor parallelism partial sums, recomputed
        return block_input + q_k_v + kept_attention + gate_up + row_outputs
    if layout.recomputation == "selective" and selective == "op_sac":
        return block_input + kept_attention + _saved_matmuls(model, layout, tokens=tokens)
    norms = 2 * (2 * residual if fp32_residual else 1) * sbh / sp + 2 * model.norm_statistics * tokens / sp
    projection_inputs = 2 * sbh / sp
    # the attention's output, reshaped from the ring's (or Ulysses' all-to-all's) layout: one copy
    ring_output_copy = heads_out / t if layout.context > 1 else 0
    mlp = (4 if model.gated_mlp else 2) * mlp_hidden / t
    router = tokens * model.experts if model.experts > 1 else 0
    if layout.recomputation == "selective":  # Megatron-LM's: the attention core is recomputed
        attention = 0.0
    return norms + projection_inputs + q_k_v + attention + ring_output_copy + mlp + router


def block_matmuls(model: ModelSpec) -> list[tuple[float, float, float, bool]]:
    """A block's matmuls in the order its forward runs them (wq, wk, wv, wo, then the MLP's up,
    gate and down, then the shared experts'): (input features, output features, rows per token,
    row-parallel). Rows per
    token: an MoE layer's MLP runs top-k rows a token; row-parallel: under tensor parallelism the
    output is a full-width partial sum, not 1/T of the features."""
    h, q, kv, f = model.d_model, model.attention_width, model.kv_heads * model.head_dim, model.ffn_hidden
    k = model.top_k if model.experts > 1 else 1
    up = [(h, f, k, False)] * (2 if model.gated_mlp else 1)
    shared = []
    if model.shared_experts:  # one dense MLP of their combined width, every token through it
        width = model.shared_experts * f
        shared = [*[(h, width, 1, False)] * (2 if model.gated_mlp else 1), (width, h, 1, True)]
    attention = [(h, q, 1, False), (h, kv, 1, False), (h, kv, 1, False), (q, h, 1, True)]
    return [*attention, *up, (f, h, k, True), *shared]


def _saved_matmuls(model: ModelSpec, layout: Layout, *, tokens: float) -> float:
    """Elements torchtitan's op-level selective policy keeps of a block's matmuls: the outputs of
    the 1st, 3rd, 5th... matmul in forward order (every second one is recomputed), a column-parallel
    one's split over T, a row-parallel one's whole (the partial sum before its reduction)."""
    saved = block_matmuls(model)[::2]
    return sum(
        tokens * rows * out / (1 if row_parallel else layout.tensor) for _, out, rows, row_parallel in saved
    )


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
    last = layers * block_bytes - boundary
    # counted per virtual stage; a virtual stage holds 1/v of the rank's layers
    in_flight_first = peak_activations_theory(layout.schedule, p, microbatches, 0, virtual_stages=v) / v
    in_flight_last = peak_activations_theory(layout.schedule, p, microbatches, p - 1, virtual_stages=v) / v
    # the head is the last stage's alone, whose backward follows each forward in the 1F1B schedules
    # (interleaved too: the last rank's earlier virtual stages are what it holds in flight)
    head_in_flight = microbatches if layout.schedule == "gpipe" else 1
    return max(in_flight_first * first, in_flight_last * last + head_in_flight * (head + loss))


def head_activation_bytes(
    model: ModelSpec, layout: Layout, *, micro_batch: int, seq_len: int, logit_bytes: float = 4
) -> float:
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
        logit_bytes: bytes per logit alive at the loss (4: the fp32 log-softmax alone; a stack that
            upcasts bf16 logits holds 2 + 4 + 4 there: ``Framework.logit_bytes``).
    """
    tokens = micro_batch * seq_len / layout.context
    sp = layout.tensor if layout.sequence_parallel else 1  # the final norm runs on s/T tokens
    norm = layout.element_bytes * tokens / sp * model.d_model + 4 * model.norm_statistics * tokens / sp
    # with loss_parallel the norm's output is gathered; else this rank's tokens (s/T with SP)
    projected = tokens if layout.loss_parallel else tokens / sp
    logits = logit_elements(model, layout, micro_batch=micro_batch, seq_len=seq_len)
    return norm + layout.element_bytes * projected * model.d_model + logit_bytes * logits


def logit_elements(model: ModelSpec, layout: Layout, *, micro_batch: int, seq_len: int) -> float:
    """The logits one GPU computes per micro-batch: every token's, 1/T of the vocabulary each with
    ``loss_parallel``, else this rank's tokens (s/T with sequence parallelism), the whole vocabulary.

    Args:
        model: the vocabulary.
        layout: tensor and context degrees, ``sequence_parallel`` and ``loss_parallel``.
        micro_batch: b, sequences per micro-batch.
        seq_len: s, tokens per sequence.
    """
    tokens = micro_batch * seq_len / layout.context
    if layout.loss_parallel:
        return tokens * vocabulary_rows(model, layout)
    return tokens / (layout.tensor if layout.sequence_parallel else 1) * model.vocab
