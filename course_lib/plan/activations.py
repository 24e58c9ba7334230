"""Activation memory: what autograd keeps for backward in one transformer block, as a formula.

Model states (``memory``) are fixed by the parameter count; activations grow with the batch b,
the sequence s and the width h, and for long sequences they are the largest term. Korthikanti et
al. count them per block, term by term, for fp16 with dropout: 34·sbh + 5·a·s²·b bytes. The
course's ``models.Block`` has no dropout and computes attention with a fused kernel
(``scaled_dot_product_attention``: no s×s matrix is kept, only a log-sum-exp per query and head),
so the same count, in elements, reads:

=============================  ===================  ==================================================
what is kept                   elements             who keeps it
=============================  ===================  ==================================================
norm1's input, mean, 1/std     sbh + 2·sb           the first layer norm
q, k, v's input                sbh                  the three projections (one tensor, shared)
q, k and v                     3·sbh                the attention kernel
attention output, log-sum-exp  sbh + a·sb           the kernel; ``out`` reads the same tensor
norm2's input, mean, 1/std     sbh + 2·sb           the second layer norm (the residual sum)
fc1's input                    sbh                  the first MLP layer
fc1's output, GELU's output    4·sbh + 4·sbh        GELU, then fc2
=============================  ===================  ==================================================

16·sbh + 4·sb + a·sb in all (Korthikanti's 34·sbh + 5·as²b is the same list in fp16, with two
dropout masks and the s×s attention matrices).

Tensor parallelism (degree T) splits what lies between f and g, the heads and the MLP's hidden
units: q, k, v, the attention output and the MLP's 8·sbh fall to 1/T. The norms' inputs and the
projections' inputs stay whole on every rank: 4·sbh + 4·sb, Korthikanti's "10·sbh" without the
dropout masks. Sequence parallelism cuts the norms along the sequence; the projections' inputs
are then all-gathered, and what autograd keeps of them depends on the implementation:

- **kept gathered** (the course's default, and DTensor's ``SequenceParallel`` plan): the
  gathered input of q/k/v and of fc1 is saved whole, 2·sbh per rank whatever T is;
- **regathered** (Megatron-LM, ``regather_in_backward=True``): only this rank's shard is saved and
  all-gathered once more in backward, so the whole block falls to 1/T, Korthikanti's 34·sbh/T,
  for one more all-gather of (T-1)/T·sbh elements per region, overlapped with the input
  gradient's matmul.

Context parallelism (degree C) runs every layer on s/C tokens of each sequence, attention
included: ring attention keeps, for its own tokens, the same q, k, v, output and log-sum-exp as the
fused kernel does for all of them. Every term falls to 1/C (with tensor parallelism, the split
terms to 1/(C·T)), and one term is added: ring attention returns its output as (batch, heads,
tokens, head_dim), so the ``out`` projection's input is a reshaped copy, one more sbh/C that
the fused kernel's layout avoids.

Recomputation (``recompute``) changes what is kept, not what is computed. Under ``"full"`` a
block keeps only its input: sbh/C elements (sbh/(C·T) with sequence parallelism, whose blocks take
a shard). Under ``"selective"`` it keeps its input and the results of its matmuls and attention
kernel: q, k, v (3·sbh/T), fc1's output (4·sbh/T), the attention output and log-sum-exp
((sbh + a·sb)/T, none under context parallelism: the ring is recomputed), and on one process
the outputs of ``out`` and fc2 (2·sbh). Under tensor parallelism those two are partial sums of
the *whole* sbh before the group sums them: kept, they would be 2·sbh that no degree shrinks,
and at T = 8 with sequence parallelism more than the whole block keeps without recomputation. So
the policy recomputes them (``recompute``), and everything it keeps falls with T.

``block_activation_elements`` writes this table as code; the tests hold it to
``memory.saved_tensor_bytes`` and ``memory.live_tensor_bytes`` measured on real processes,
exactly, at every layout and policy.

A mixture-of-experts layer (``parallel.expert.MoE``) in place of the MLP keeps, for T tokens
routed to k of E experts, R kept assignments of this rank's tokens and R' rows computed by this
rank's experts (R' = R on one process; with expert parallelism, what the all-to-all brought):
the router's probabilities (T·E), the rows each expert reads and its fc1 and GELU outputs
(R'·(h + 2·hidden)), the results brought home and their gated copy (2·R·h), the gates, and the
int64 indices that send rows out and bring them back (T·k + 3·R). ``moe_activation_bytes``
counts them; expert parallelism does not shrink R' (a rank computes as many rows as it routes,
when routing is balanced), it spreads the experts' *weights*.

A pipeline stage keeps, per micro-batch, the sum of its layers' terms, and a rank holds as many
micro-batches at once as its schedule lets in before their backward
(``pipeline.peak_activations_theory``: m under GPipe, p - rank under 1F1B):
``pipeline_activation_bytes`` multiplies the two.

Paper: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023 (arXiv:2205.05198), section 4 (equations 1-4) and 4.2.2 (sequence parallelism).
"""

from __future__ import annotations

from ..checks import check_choice
from ..errors import UserError
from ..parallel.pipeline import peak_activations_theory
from ..parallel.recompute import POLICIES as RECOMPUTATION_POLICIES


def block_activation_elements(
    *,
    batch: int,
    seq: int,
    d_model: int,
    heads: int,
    tensor_degree: int = 1,
    sequence_parallel: bool = False,
    regather_in_backward: bool = False,
    context_degree: int = 1,
    recomputation: str = "none",
) -> dict[str, float]:
    """Elements one rank keeps for the backward of one ``models.Block``, term by term (see the table).

    Multiply by the element size (4 in fp32) for bytes. Without recomputation the terms are
    ``norms``, ``projection_inputs``, ``attention`` and ``mlp``; with ``"full"``, ``input``; with
    ``"selective"``, ``input``, ``projections``, ``attention``, ``mlp`` and ``row_outputs``.
    ``total`` is their sum.

    Args:
        batch: b, sequences per step on this rank.
        seq: s, tokens per sequence (the whole sequence, before any split).
        d_model: h, the block's width.
        heads: a, the attention heads.
        tensor_degree: T, the tensor-parallel degree (1: one process).
        sequence_parallel: the norms run on s/T tokens (``parallel.sequence``).
        regather_in_backward: Megatron-LM's variant: the projections keep only the shard.
        context_degree: C, the ranks each sequence is split over (``parallel.context``): this
            rank holds s/C of its tokens.
        recomputation: ``"none"``, ``"full"`` or ``"selective"`` (``recompute``'s policies).
    """
    for name, degree in (("tensor_degree", tensor_degree), ("context_degree", context_degree)):
        if degree < 1:
            raise UserError(f"{name} must be at least 1, got {degree}")
    if regather_in_backward and not sequence_parallel:
        raise UserError(
            "regather_in_backward is a sequence-parallel variant: pass sequence_parallel=True too"
        )
    check_choice("recomputation", recomputation, RECOMPUTATION_POLICIES)
    t = tensor_degree
    tokens = seq / context_degree  # this rank's share of each sequence
    sbh, sb = tokens * batch * d_model, tokens * batch
    block_input = sbh / t if sequence_parallel else sbh
    if recomputation == "full":
        return {"input": block_input, "total": block_input}
    if recomputation == "selective":
        terms = {
            "input": block_input,
            "projections": 3 * sbh / t,  # q, k, v
            "attention": (sbh + heads * sb) / t if context_degree == 1 else 0.0,  # the ring is recomputed
            "mlp": 4 * sbh / t,  # fc1's output; GELU's is recomputed
            # out's and fc2's results; under tensor parallelism partial sums of the whole sbh, recomputed
            "row_outputs": 2 * sbh if t == 1 else 0.0,
        }
        return terms | {"total": sum(terms.values())}
    norms = 2 * (sbh + 2 * sb)
    projection_inputs = 2 * sbh
    terms = {
        "norms": norms / t if sequence_parallel else norms,
        "projection_inputs": projection_inputs / t if regather_in_backward else projection_inputs,
        # q, k, v, the output (and under ring attention its copy for ``out``); the log-sum-exp
        "attention": ((5 if context_degree > 1 else 4) * sbh + heads * sb) / t,
        "mlp": 8 * sbh / t,  # fc1's output and GELU's
    }
    return terms | {"total": sum(terms.values())}


def embedding_activation_bytes(*, batch: int, seq: int) -> int:
    """Bytes ``models.Embedding`` keeps for backward: the token ids and the positions (int64 each).

    Args:
        batch: b, sequences per step on this rank.
        seq: s, tokens per sequence on this rank.
    """
    return 8 * (batch * seq + seq)


def head_activation_bytes(*, batch: int, seq: int, d_model: int, vocab: int, element_bytes: int = 4) -> int:
    """Bytes ``models.LMHead`` and ``models.lm_loss`` keep for backward.

    The final norm keeps its input and a mean and 1/std per token; the projection keeps its input;
    the cross-entropy keeps its log-softmax, one value per token and vocabulary entry (s·b·V, often
    the largest single tensor of a small model), the targets (int64) and one scalar.

    Args:
        batch: b, sequences per step on this rank.
        seq: s, tokens per sequence on this rank.
        d_model: h, the model's width.
        vocab: V, the vocabulary's size.
        element_bytes: bytes per activation element (4 in fp32).
    """
    sb = batch * seq
    floats = 2 * sb * d_model + 2 * sb + sb * vocab
    return element_bytes * floats + 8 * sb + 4


def stage_activation_bytes(
    *,
    batch: int,
    seq: int,
    d_model: int,
    heads: int,
    vocab: int,
    blocks: int,
    first: bool,
    last: bool,
    element_bytes: int = 4,
    **block_layout,
) -> float:
    """Bytes one micro-batch leaves alive on a rank for the backward of a stage of ``TinyTransformer``.

    The embedding if the stage is the first, ``blocks`` blocks, the head and loss if it is the last;
    tensor parallelism splits the blocks only (the embedding and head stay whole on every rank).

    Args:
        batch: b, sequences per micro-batch.
        seq: s, tokens per sequence.
        d_model: h, the model's width.
        heads: a, the attention heads.
        vocab: V, the vocabulary's size.
        blocks: the transformer blocks in the stage.
        first: the stage holds the embedding.
        last: the stage holds the head (and computes the loss).
        element_bytes: bytes per activation element (4 in fp32).
        block_layout: ``tensor_degree``, ``recomputation`` and the other layout arguments of
            ``block_activation_elements``.
    """
    block = block_activation_elements(batch=batch, seq=seq, d_model=d_model, heads=heads, **block_layout)
    total = blocks * element_bytes * block["total"]
    if first:
        total += embedding_activation_bytes(batch=batch, seq=seq)
    if last:
        total += head_activation_bytes(
            batch=batch, seq=seq, d_model=d_model, vocab=vocab, element_bytes=element_bytes
        )
    return total


def pipeline_activation_bytes(
    per_microbatch_bytes: float,
    *,
    schedule: str,
    pipeline_size: int,
    microbatches: int,
    rank: int,
) -> float:
    """The most activation bytes a pipeline rank holds at once: its schedule's in-flight micro-batches.

    Args:
        per_microbatch_bytes: what one micro-batch of this rank's stage keeps (``stage_activation_bytes``).
        schedule: ``"gpipe"`` or ``"1f1b"`` (one stage per rank).
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        rank: the rank's place in the pipeline (the first holds the most under 1F1B).
    """
    if schedule not in ("gpipe", "1f1b"):
        raise UserError(
            f"pipeline_activation_bytes covers gpipe and 1f1b (one stage per rank), not {schedule!r}"
        )
    return peak_activations_theory(schedule, pipeline_size, microbatches, rank) * per_microbatch_bytes


def moe_activation_bytes(
    *,
    tokens: int,
    d_model: int,
    hidden: int,
    num_experts: int,
    top_k: int,
    rows_routed: int,
    rows_computed: int,
) -> int:
    """Bytes one ``parallel.expert.MoE`` layer keeps for backward on a rank (fp32, int64 indices).

    With balanced routing and nothing dropped, ``rows_routed = rows_computed = top_k · tokens``.

    Args:
        tokens: T, the tokens this rank routes (batch x sequence).
        d_model: h, the width of the tokens.
        hidden: each expert's hidden width.
        num_experts: E.
        top_k: k, experts per token.
        rows_routed: R, this rank's assignments kept within capacity (``routing.kept.sum()``).
        rows_computed: R', the rows this rank's experts computed (``MoE.rows_computed``).
    """
    floats = (
        tokens * num_experts  # the router's probabilities (softmax keeps its output)
        + num_experts  # their mean over the tokens (the load-balancing loss)
        + rows_computed * (d_model + 2 * hidden)  # each expert's input rows, fc1's and GELU's outputs
        + 2 * rows_routed * d_model  # the results brought home and the gated results (index_add)
        + rows_routed  # each kept row's gate
    )
    if top_k > 1:  # the k gates renormalised to sum to 1: the gates and their sum
        floats += tokens * top_k + tokens
    indices = tokens * top_k + 3 * rows_routed  # top-k's choices; gather, gate and scatter-back indices
    return 4 * floats + 8 * indices
