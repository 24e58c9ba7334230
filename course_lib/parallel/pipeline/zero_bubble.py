"""The backward pass split in two: B, the gradient of the input, and W, the gradients of the weights.

A layer y = x Wᵀ has two gradients: the input's, dx = dy W, which the previous pipeline stage is
waiting for, and the weight's, dW = dyᵀ x, which nobody needs until the optimizer step. An
ordinary backward computes both at once. The zero-bubble schedules (below: ZB-H1, ZB-V,
DualPipeV) run them as two actions: B first, so that the gradient goes back to the previous rank
as early as possible, and W later, in what would have been the bubble. B and W cost about the
same (one matmul each for a linear layer), so a third of the backward becomes movable work.

What each keeps alive. B needs everything the forward saved (every layer's saved tensors along
the chain back to the stage's input). W needs much less: for each layer with weights, its input
and the gradient of its output. This file splits a stage exactly there. Each layer that holds
parameters runs on a *detached* copy of its input, so its little graph (input, weights, output)
stands apart from the stage's graph, and a custom autograd function stitches the two back
together: when B's backward reaches the stitch it keeps the output gradient and asks the layer's
own graph for the input gradient only, keeping that graph for W. After B the stage's graph is
freed (activations, attention probabilities, everything between the layers); each layer's own
graph, its saved input and its output gradient stay until W asks it for the weights' gradients.

Cost: nothing is computed twice; one Python call per layer and per action. What it cannot do:
a layer that holds parameters and also sub-layers is refused (its parameters would be mixed up
with its children's): every parameter must sit in a layer without sub-layers, as ``nn.Linear``,
``nn.LayerNorm`` and ``nn.Embedding`` do. With activation checkpointing, every backward pass
that unpacks a checkpointed block's saved tensors recomputes the block's forward. PyTorch's split
makes two passes per stage (B, then W), so it recomputes twice: the interaction that made its
zero-bubble schedules far slower than 1F1B with activation checkpointing on
(pytorch/torchtitan#773). This file's split makes one pass for the stage and one per layer in
each of B and W, so a block with k layers with weights recomputes 2k + 1 times. ``bench
pipeline`` counts them (a block of 2 linear layers: 6 forwards per micro-batch here, 3 in
PyTorch's, 2 under 1F1B): with recomputation, prefer 1F1B or a split without it.

Paper: Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv:2401.10241),
section 2; PyTorch's version is ``torch.distributed.pipelining``'s ``stage_backward_input`` and
``stage_backward_weight``, which find the same cut in the autograd graph instead of at layers.

The schedules. Each is a function of (rank, p, m) giving that rank's F, B and W in order
(``v``, the chunks per rank, is fixed by the schedule: 1 for ZB-H1, 2 for the V's); they come
first, the split backward that runs them after.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ...errors import UserError
from .actions import Action


# #region zb-h1
def zb_h1_order(rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, section 3.1): 1F1B with each backward split into B and W, rank r
    putting off its first r W's. B alone goes back to the previous rank sooner than a whole
    backward would, so the warm-up and drain bubbles shrink by T_W each step; the W's put off
    fill the drain, where 1F1B's later ranks sat idle. At most p micro-batches wait for their W
    on any rank: 1F1B's peak on rank 0."""
    warmup = min(p - rank - 1, m)
    actions = [Action("F", rank, i) for i in range(warmup)]
    put_off: list[int] = []  # micro-batches whose B ran and whose W has not

    def backward(i: int) -> None:
        actions.append(Action("B", rank, i))
        put_off.append(i)
        if len(put_off) > rank:
            actions.append(Action("W", rank, put_off.pop(0)))

    for i in range(m - warmup):
        actions.append(Action("F", rank, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    actions += [Action("W", rank, i) for i in put_off]
    return actions


# #endregion zb-h1


def zb_v_order(rank: int, p: int, m: int, v: int = 2) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V, rank r holding stage r (going
    down) and stage 2p - 1 - r (coming back). Warm up with the first chunk's forwards, then alternate
    F, B and W of both chunks; the drain runs the B's first and the W's after, so the W's fill what
    would be the bubble. With T_F = T_B = T_W the bubble is almost gone, at 1F1B's peak activation
    memory. Written as PyTorch's ``ScheduleZBVZeroBubble`` builds it: for m < 2p - 1 it plans
    2p - 1 micro-batches and leaves the missing ones out."""
    down, up = rank, 2 * p - 1 - rank
    planned = max(2 * p - 1, m)
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}
    actions: list[Action] = []

    def forward(stage: int) -> None:
        actions.append(Action("F", stage, forwards[stage]))
        forwards[stage] += 1

    def backward(stage: int, *, then_weights: bool) -> None:
        actions.append(Action("B", stage, backwards[stage]))
        if then_weights:
            actions.append(Action("W", stage, backwards[stage]))
        backwards[stage] += 1

    for _ in range(2 * (p - rank) - 1):
        forward(down)
    for _ in range(rank):
        forward(up)
        forward(down)
    for _ in range(p - rank):
        forward(up)
        backward(up, then_weights=True)
    while forwards[up] < forwards[down] or forwards[down] < planned:
        if forwards[down] < planned:
            forward(down)
        backward(down, then_weights=True)
        forward(up)
        backward(up, then_weights=True)
    weights = dict(backwards)  # the drain: B's now, their W's after
    for _ in range(rank):
        backward(down, then_weights=False)
        backward(up, then_weights=False)
    for _ in range(p - rank):
        backward(down, then_weights=False)
        actions.append(Action("W", down, weights[down]))
        weights[down] += 1
    actions += [Action("W", up, i) for i in range(weights[up], backwards[up])]
    actions += [Action("W", down, i) for i in range(weights[down], backwards[down])]
    return [a for a in actions if a.microbatch < m]


def dualpipe_v_order(rank: int, p: int, m: int, v: int = 2) -> list[Action]:
    """DualPipeV (DeepSeek-V3, 2024; the V-shaped half of DualPipe, as PyTorch's
    ``ScheduleDualPipeV`` builds it): the V placement of ZB-V, but in the steady state each rank
    pairs the forward of one chunk with the whole backward of the other (``F`` then ``B`` and ``W``
    here). On a GPU the pair overlaps: one computes while the other's messages (an MoE layer's
    all-to-all) travel. On one CPU core they run one after the other, so what this course measures
    is the schedule's bubble, not that overlap. Only the warm-up and the drain split B from W."""
    down, up = rank, 2 * p - 1 - rank
    done = defaultdict(int)  # (kind, stage) -> micro-batches done
    put_off: list[tuple[int, int]] = []  # (stage, micro-batch) whose B ran and whose W has not
    actions: list[Action] = []

    def forward(stage: int) -> None:
        actions.append(Action("F", stage, done["F", stage]))
        done["F", stage] += 1

    def backward(stage: int, *, split: bool) -> None:
        i = done["B", stage]
        done["B", stage] += 1
        actions.append(Action("B", stage, i))
        if split:
            put_off.append((stage, i))
        else:  # the whole backward at once
            actions.append(Action("W", stage, i))

    def weights() -> None:
        if put_off:
            stage, i = put_off.pop(0)
            actions.append(Action("W", stage, i))

    for _ in range(2 * (p - rank - 1)):
        forward(down)
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    for _ in range(p - rank - 1):
        backward(up, split=True)
        weights()
        forward(up)
    for _ in range(m - 2 * p + rank + 1):  # the steady state: pairs of one chunk's F and the other's B
        forward(down)
        backward(up, split=False)
        forward(up)
        backward(down, split=False)
    for _ in range(p - rank - 1):
        backward(up, split=False)
        forward(up)
        backward(down, split=False)
    split = False
    for i in range(rank + 1):  # the drain: the second half of its B's leave their W for later
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(up, split=split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(down, split=split)
    for _ in range(p - rank - 1):
        weights()
        backward(down, split=split)
    while put_off:
        weights()
    return actions


# -- the backward split in two -----------------------------------------------------------------


@dataclass
class LayerRecord:
    """One call of a layer with weights, in one micro-batch's forward: what its W will need.

    Args:
        layer: the module.
        output: where its output's gradient enters its own small graph (back to its weights and its
            input's copy). An edge, not the output itself: W needs the graph, not the output's values.
        inputs: the detached copies of its tensor inputs that its graph starts from (until B).
    """

    layer: nn.Module
    output: GradientEdge
    inputs: list[torch.Tensor]
    grad_output: torch.Tensor | None = None  # kept by B for W


@dataclass
class MicroBatchRecord:
    """The layers one micro-batch's forward went through, for its B and its W."""

    anchor: torch.Tensor  # every stitch hangs from it, so one B reaches every layer
    layers: list[LayerRecord] = field(default_factory=list)


class _Stitch(torch.autograd.Function):
    """The layer's output, joined back to the stage's graph; its backward is the layer's B."""

    @staticmethod
    def forward(
        ctx, record: LayerRecord, output: torch.Tensor, anchor: torch.Tensor, *inputs: torch.Tensor
    ) -> torch.Tensor:
        # ``output`` arrives detached (autograd does not see it as an input): the same values, no edge
        ctx.record = record
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        record: LayerRecord = ctx.record
        record.grad_output = grad_output  # W needs it
        wanted = [x for x in record.inputs if x.requires_grad]
        grads = iter(
            torch.autograd.grad(record.output, wanted, grad_output, retain_graph=True) if wanted else ()
        )
        # the layer's graph is kept (retain_graph) for W; the stitch passes only the input gradients on
        passed = [next(grads) if x.requires_grad else None for x in record.inputs]
        record.inputs = []  # the graph keeps what W needs of them
        return (None, None, None, *passed)


class BackwardSplitter:
    """Makes the layers of ``modules`` record their calls so that B and W can run apart.

    Args:
        modules: the stages (or any modules) whose backward is to be split.
    """

    def __init__(self, modules: list[nn.Module]):
        self._recording: MicroBatchRecord | None = None
        self._pending: list[torch.Tensor] = []  # the inputs of the layer being called, between its hooks
        self._handles = []
        for module in modules:
            for name, layer in module.named_modules():
                holds = [n for n, p in layer.named_parameters(recurse=False) if p.requires_grad]
                if not holds:
                    continue
                if any(True for _ in layer.children()):
                    raise UserError(
                        f"to split the backward into B and W, every parameter must sit in a layer without "
                        f"sub-layers (nn.Linear, nn.LayerNorm, ...): {name or 'the stage'} "
                        f"({type(layer).__name__}) holds {holds[0]!r} and sub-layers too; move the parameter "
                        "into a layer of its own"
                    )
                self._handles.append(layer.register_forward_pre_hook(self._detach_inputs))
                self._handles.append(layer.register_forward_hook(self._stitch))

    def forward(self, module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, MicroBatchRecord]:
        """Run ``module(x)``, recording every layer with weights: the forward of a split stage.

        Args:
            module: the stage.
            x: its input.
        """
        record = MicroBatchRecord(anchor=torch.zeros((), requires_grad=True))
        self._recording = record
        try:
            return module(x), record
        finally:
            self._recording = None

    @staticmethod
    def backward_input(
        record: MicroBatchRecord, output: torch.Tensor, grad_output: torch.Tensor | None, x: torch.Tensor
    ) -> torch.Tensor | None:
        """B: the gradient of the stage's input only; the stage's graph is freed, each layer's kept for W.

        Args:
            record: what the micro-batch's forward recorded.
            output: the stage's output (or, on the last stage, the loss).
            grad_output: the gradient of ``output`` (None for the loss).
            x: the stage's input; its gradient is returned (None if it needs none).
        """
        wanted = [record.anchor, *([x] if x.requires_grad else [])]
        grads = torch.autograd.grad(output, wanted, grad_output, allow_unused=True)
        return grads[1] if x.requires_grad else None

    @staticmethod
    def backward_weights(record: MicroBatchRecord) -> None:
        """W: each layer's weight gradients from its kept input and output gradient, added to ``.grad``.

        Args:
            record: the micro-batch's record, after its B.
        """
        for call in record.layers:
            if call.grad_output is None:  # the output did not reach the loss: no gradient
                continue
            params = [p for p in call.layer.parameters(recurse=False) if p.requires_grad]
            for param, grad in zip(params, torch.autograd.grad(call.output, params, call.grad_output)):
                param.grad = grad if param.grad is None else param.grad + grad
        record.layers.clear()  # the layers' graphs, inputs and output gradients go now

    def remove(self) -> None:
        """Take the hooks off the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _detach_inputs(self, layer, args):
        if self._recording is None:  # not a split forward (or a recomputation inside B)
            return None
        self._pending = [a for a in args if isinstance(a, torch.Tensor)]
        return tuple(
            a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
        )

    def _stitch(self, layer, args, output):
        if self._recording is None:
            return None
        originals, self._pending = self._pending, []
        if not isinstance(output, torch.Tensor):
            raise UserError(
                f"to split the backward into B and W, every layer with weights must return one tensor: "
                f"{type(layer).__name__} returns a {type(output).__name__}; wrap it in a module that "
                "returns the tensor the next layer reads, or use a schedule without W (1f1b)"
            )
        copies = [a for a in args if isinstance(a, torch.Tensor)]
        call = LayerRecord(layer=layer, output=get_gradient_edge(output), inputs=copies)
        self._recording.layers.append(call)
        return _Stitch.apply(call, output.detach(), self._recording.anchor, *originals)
