"""Exercise: lab 8: what a transformer block keeps for backward, as a formula you write.

Autograd keeps, for every operation that needs it, what its backward will read: a linear layer
its input, GELU its input, attention its queries, keys, values, output and a log-sum-exp, a
layer norm its input and two statistics per token. Added up per block, that is the activation
memory that decides, for long sequences, whether a model fits. Korthikanti et al. (2022) count
it term by term; here you count it for the course's ``models.Block`` (no dropout, fused
attention), then for one rank of a tensor-parallel group, then under recomputation. Every
function returns elements (multiply by 4 for fp32 bytes), in the units of
``course_lib.plan.activations``, which you should not read before you are done.

Check your work (measured on real processes with ``memory.live_tensor_bytes`` at 1, 2 and 3
ranks, the block converted by the course's own tensor and sequence parallelism):

    python -m course_lib.tools.labs check lab8_activations
"""

from __future__ import annotations


def one_process_terms(*, batch: int, seq: int, d_model: int, heads: int) -> dict[str, float]:
    """Elements one ``models.Block`` keeps on one process, by term: ``norms``, ``projection_inputs``
    (the input that q, k, v share and fc1's input), ``attention`` (q, k, v, output, log-sum-exp),
    ``mlp`` (fc1's output and GELU's output; the MLP is 4·d_model wide)."""
    # TODO: walk the block's forward (models.Block, SelfAttention, MLP) and, for each operation, ask what its backward must read; where you are unsure, measure one operation with memory.saved_tensor_bytes. Write each term with sbh = seq·batch·d_model and sb = seq·batch. Pitfall: a tensor two operations read is kept once
    raise NotImplementedError(
        "TODO: walk the block's forward (models.Block, SelfAttention, MLP) and, for each operation, ask what its backward must read; where you are unsure, measure one operation with memory.saved_tensor_bytes. Write each term with sbh = seq·batch·d_model and sb = seq·batch. Pitfall: a tensor two operations read is kept once"
    )


def tensor_parallel_terms(
    terms: dict[str, float], *, degree: int, sequence_parallel: bool
) -> dict[str, float]:
    """The same terms on one of ``degree`` tensor-parallel ranks. With ``sequence_parallel``, Megatron-LM's
    variant: the norms run on seq/T tokens and the projections keep only their shard of the input."""
    # TODO: tensor parallelism splits what lies between f and g, the heads and the MLP's hidden units, so the attention and MLP terms fall to 1/T; the norms and the projections' inputs are whole on every rank, unless sequence parallelism cuts them along the tokens too. Pitfall: return a new dictionary, and keep every key
    raise NotImplementedError(
        "TODO: tensor parallelism splits what lies between f and g, the heads and the MLP's hidden units, so the attention and MLP terms fall to 1/T; the norms and the projections' inputs are whole on every rank, unless sequence parallelism cuts them along the tokens too. Pitfall: return a new dictionary, and keep every key"
    )


def recomputed_total(
    *, batch: int, seq: int, d_model: int, heads: int, degree: int, sequence_parallel: bool, policy: str
) -> float:
    """All a block keeps on one rank under ``policy``: ``"none"``, ``"full"`` (only the block's
    input, which is seq/T tokens with sequence parallelism) or ``"selective"`` (the input, and the
    results of the block's matmuls and attention kernel: q, k, v, the attention output and
    log-sum-exp, fc1's output, and on one process the outputs of ``out`` and fc2; under tensor
    parallelism those two are partial sums, which the policy recomputes)."""
    # TODO: "none" is the sum of tensor_parallel_terms; under "full" a checkpoint keeps only its region's input; under "selective", read what the policy caches in course_lib/parallel/recompute.py and count it as you counted one process. Pitfall: the input of a sequence-parallel block is already cut to seq/T tokens
    raise NotImplementedError(
        'TODO: "none" is the sum of tensor_parallel_terms; under "full" a checkpoint keeps only its region\'s input; under "selective", read what the policy caches in course_lib/parallel/recompute.py and count it as you counted one process. Pitfall: the input of a sequence-parallel block is already cut to seq/T tokens'
    )
