"""Activation recomputation: keep less for backward, and compute part of the forward again.

Backward needs what forward computed: every layer's input and, for the non-linear ones, more
(``activations``). Kept, that is the largest memory of a long-sequence model; dropped, it must be
computed again. ``torch.utils.checkpoint`` does the bookkeeping: inside a checkpointed region
autograd keeps nothing but the region's inputs, and when backward reaches the region it runs
the region's forward once more, this time keeping everything, and backpropagates through it.
Three policies, one region per unit (a transformer ``Block``, or one of ``models.sharding_units``
of a CNN):

===========  ===============================================  ==========================================
policy       kept per block for backward                      paid
===========  ===============================================  ==========================================
none         everything (16·sbh + 4·sb + a·sb elements)        nothing
full         the block's input (sbh), and while one block's   one more forward of every block: about
             backward runs, that block's whole list           +33 % of the step's FLOPs (2 + 4 → 2 + 2 + 4)
selective    the input, and the outputs of the matmuls and    the cheap operations again (norms, GELU,
             attention (``SAVED_BY_SELECTIVE``): 11·sbh + a·sb  residual adds): a few % of the FLOPs;
             on one process; under tensor parallelism not    under tensor parallelism also the ``out``
             the row-parallel partial sums (see below)       projection and its reduction
===========  ===============================================  ==========================================

Selective recomputation keeps what is expensive to compute and cheap to hold, and recomputes
what is cheap to compute and expensive to hold. Korthikanti et al. recompute the attention core
(the s×s scores and softmax: 5·as²b of their 34·sbh + 5·as²b); the course's fused attention
never holds the s×s matrix, so what is cheap and large here is the pointwise work: the norms'
inputs and statistics and the MLP's GELU output (4·sbh, the largest single term). The policy is
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with a list of operations whose
results are cached in forward; everything else is recomputed. Pass your own list to try others.

Under tensor or sequence parallelism one matmul must not be kept: a row-parallel layer's result
(``out``'s, fc2's) is a *partial sum* of the whole activation, s·b·h elements on every rank,
before its group sums it. Kept, the two of them hold 2·sbh that no degree shrinks, and at T = 8
with sequence parallelism a "selective" block would keep more than no recomputation at all. So
the policy recomputes the row-parallel matmuls (and the reduction after them) in backward; what
it keeps shrinks by the same factors as the block
(``activations.block_activation_elements(recomputation=...)`` says exactly how). torchtitan's
op-level policy reaches the same end by keeping the reduce-scatter's output instead, s/T tokens;
the course's collectives write their results in place, which a policy over operations cannot
name, so it recomputes. Under pipeline parallelism each in-flight micro-batch holds the smaller
list: recomputation is what lets 1F1B's first stage keep p micro-batches of a long sequence.

Paper: Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016
(arXiv:1604.06174), for full recomputation; Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023 (arXiv:2205.05198), section 5, for
selective recomputation.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import models
from ..checks import check_choice, check_int
from ..distributed import runtime
from ..errors import UserError
from .tensor import RowParallelLinear

POLICIES = ("none", "full", "selective")

aten = torch.ops.aten
SAVED_BY_SELECTIVE = (
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
"""What selective recomputation keeps: the linear layers' matmuls and the fused attention kernels.

Not ``bmm``: ring attention's blocks are batched matmuls of s/C × s/C scores, the very thing not
to keep; under context parallelism the whole ring (its exchanges included) is recomputed."""


def recomputation_units(model: nn.Module) -> list[nn.Module]:
    """The regions each policy recomputes one at a time: a transformer's blocks, else the FSDP units.

    Args:
        model: a ``TinyTransformer`` (or a stage of one), or one of the lab's CNNs.
    """
    blocks = [module for module in model.modules() if isinstance(module, models.Block)]
    return blocks or models.sharding_units(model)


class _PartialSums:
    """Whether a row-parallel layer of a group larger than one is running now: its matmul's result
    is a partial sum of the whole activation, which the policy recomputes instead of keeping.

    Its hooks run in the forward and again in the recomputation (both call the layers), so the
    policy decides the same way both times, which the cache's order needs."""

    def __init__(self, module: nn.Module):
        self.depth = 0
        for layer in module.modules():
            if isinstance(layer, RowParallelLinear) and runtime.world_size(group=layer.group) > 1:
                layer.register_forward_pre_hook(self.enter)
                layer.register_forward_hook(self.leave)

    def enter(self, layer, args) -> None:
        self.depth += 1

    def leave(self, layer, args, output) -> None:
        self.depth -= 1


def _keep_listed_results(saved_ops: frozenset, partial_sums: _PartialSums):
    def policy(ctx, op, *args, **kwargs):
        if op in saved_ops and not partial_sums.depth:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


# #region recomputation
def recompute_modules(
    modules: Iterable[nn.Module], *, policy: str, saved_ops: Iterable = SAVED_BY_SELECTIVE
) -> None:
    """Make each module's forward a checkpointed region under ``policy`` (in place; weights unchanged).

    The module's ``forward`` is replaced, not the module: its parameters keep their names, hooks
    on it (FSDP's gathers) still run around each call, and whatever ``forward`` is at this moment
    (a tensor- or sequence-parallel one) is what is recomputed: apply it after those, before
    sharding the parameters, as torchtitan does.

    Args:
        modules: the regions, usually ``recomputation_units(model)``.
        policy: ``"none"`` (nothing changes), ``"full"`` or ``"selective"`` (see the table above).
        saved_ops: with ``"selective"``, the operations (``torch.ops.aten.*`` overloads) whose
            results are kept (but not a row-parallel layer's partial sums); everything else is
            recomputed.
    """
    check_choice("recomputation policy", policy, POLICIES)
    if policy == "none":
        return
    saved_ops = frozenset(saved_ops)
    for module in modules:
        if getattr(module, "recomputation", "none") != "none":
            raise UserError(
                f"this {type(module).__name__} already recomputes ({module.recomputation}): "
                "apply a policy once"
            )
        options = {}
        if policy == "selective":  # a row-parallel layer's partial sums are recomputed, not kept
            options["context_fn"] = _keep_listed_results(saved_ops, _PartialSums(module))
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **options)
        module.recomputation = policy


def apply_recomputation(model: nn.Module, *, policy: str, every: int = 1) -> nn.Module:
    """Recompute ``model``'s units (``recomputation_units``) under ``policy``; return the model.

    Args:
        model: a ``TinyTransformer`` (or a stage of one, tensor-, sequence- or context-parallel), or
            one of the lab's CNNs.
        policy: ``"none"``, ``"full"`` or ``"selective"``.
        every: recompute only every ``every``-th unit (the 2nd, 4th, ... for 2), the others keep
            everything: torchtitan's "selective layer" checkpointing, a memory between the policies.
    """
    check_int("every", every, minimum=1)
    units = recomputation_units(model)
    if policy != "none" and not units:
        raise UserError(
            f"recomputation {policy!r} finds nothing to recompute in this {type(model).__name__}: it has no "
            "transformer blocks and no sharding units (models.sharding_units): apply it to a course model"
        )
    recompute_modules(units[every - 1 :: every], policy=policy)
    return model


# #endregion recomputation
