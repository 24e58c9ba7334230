"""When each parallelism is compute-bound: the conditions the cost model's formulas imply.

A parallelism's communication hides under compute when the compute it overlaps takes longer
than its bytes take on their link. Both grow with the work, at different rates, so each axis has
a threshold (the method of the JAX scaling book's GPU chapter, with the course's own formulas and
each cluster's rates). With F the FLOP/s a GPU reaches on the model's products and B the link's
bytes per second a GPU:

- **data (DDP, FSDP)**: every parameter costs 6 FLOPs a token, 4 of them in backward, and
  ``bytes`` x (d-1)/d on the wire a step (DDP: the gradients all-reduced, twice their bytes,
  beside the backward; FSDP: the parameters gathered twice and the gradients reduce-scattered,
  beside forward and backward). Hidden once each GPU computes ``T* = bytes x F / (4 B)`` (DDP)
  or ``bytes x F / (6 B)`` (FSDP) tokens a step, whatever the model's size.
- **tensor**: a block's f and g move 4 x 2(t-1)/t x h values a token (forward and backward)
  while its matmuls do 6 P_block / t FLOPs a token. Compute-bound while
  ``t - 1 < 6 P_block B / (8 h bytes F)``: the degree past which TP's bytes dominate.
- **context (ring attention)**: each step of the ring moves a chunk's keys and values
  (2 kv_width bytes a token) while attending to it (4 width FLOPs a token pair, half of them
  under the causal mask): hidden once a chunk holds ``s/C > kv_width bytes F / (width B)`` tokens.
- **expert**: dispatch and combine, forward and backward, move 4 top_k h bytes a token while the
  experts compute 6 top_k (3 h f) FLOPs a token (a gated MLP): hidden once
  ``f > 4 bytes (E-1)/E F / (18 B)``, on the link the expert group spans.

These are the bounds a careful reader can derive on paper; ``test_rooflines`` holds each against
the planner's own breakdown (the exposed seconds of that axis vanish past the threshold).
"""

from __future__ import annotations

from dataclasses import dataclass

from .compute_model import products
from .frameworks import COURSE_PROFILE, Framework
from .layout import Layout
from .network_model import link_of
from .specs import ClusterSpec, ModelSpec, StepShape


@dataclass(frozen=True)
class Rooflines:
    """One model's thresholds on one cluster.

    Args:
        flops: F, the FLOP/s a GPU reaches on the model's products (the planner's kernels).
        data_tokens_ddp: tokens a GPU must compute a step for DDP's all-reduce to hide, on a data
            axis of ``data_gpus`` GPUs.
        data_tokens_fsdp: the same for FSDP's gathers and reduce-scatter.
        tensor_degree: the largest tensor degree inside a node that stays compute-bound.
        context_chunk_tokens: the tokens a ring-attention chunk needs to hide its keys and values,
            inside a node.
        expert_ffn: the MLP width an expert needs to hide its all-to-alls across nodes.
    """

    flops: float
    data_tokens_ddp: float
    data_tokens_fsdp: float
    tensor_degree: float
    context_chunk_tokens: float
    expert_ffn: float


def achieved_flops(model: ModelSpec, cluster: ClusterSpec, *, seq_len: int = 8192) -> float:
    """F: the FLOP/s one GPU reaches on ``model``'s products, one sequence of ``seq_len``, no split."""
    step = StepShape(model, cluster, Layout(), seq_len, 1)
    work = products(step)
    return model.flops_per_token(seq_len) * seq_len / work.total


def rooflines(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    seq_len: int = 8192,
    data_gpus: int | None = None,
    framework: Framework = COURSE_PROFILE,
) -> Rooflines:
    """Each axis's threshold for ``model`` on ``cluster`` (see the module docstring).

    Args:
        model: the shapes.
        cluster: the machine: F from its GPU, B from its links.
        seq_len: the sequence length F is measured at.
        data_gpus: the data axis's GPUs (None: two nodes'), whose link ``network_model.link_of``
            gives (a ring across whole nodes leaves each through all of its GPUs' NICs).
        framework: the stack (the bytes its gradients and gathers move).
    """
    flops = achieved_flops(model, cluster, seq_len=seq_len)
    data_gpus = data_gpus or 2 * cluster.gpus_per_node
    data = link_of("data", Layout(data=data_gpus), cluster).bandwidth
    across, inside = cluster.between_nodes.bandwidth, cluster.inside_node.bandwidth
    gradient, gathered = framework.gradient_reduce_bytes("bf16"), framework.gather_bytes("bf16")
    ddp_bytes = 2 * gradient  # an all-reduce: reduce-scatter and all-gather of the gradients
    fsdp_bytes = 2 * gathered + gradient  # the parameters gathered twice, the gradients scattered once
    block = model.block_parameters()
    h, kv_width = model.d_model, model.kv_heads * model.head_dim
    return Rooflines(
        flops=flops,
        data_tokens_ddp=ddp_bytes * flops / (4 * data),
        data_tokens_fsdp=fsdp_bytes * flops / (6 * data),
        tensor_degree=1 + 6 * block * inside / (8 * h * 2 * flops),
        context_chunk_tokens=kv_width * 2 * flops / (model.attention_width * inside),
        expert_ffn=4 * 2 * flops / (18 * across),
    )
