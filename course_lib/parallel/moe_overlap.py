"""Two micro-batches through an expert-parallel layer: one's all-to-all in flight while the other computes.

An expert-parallel layer waits twice on the network: for its dispatch before the experts can
start, and for its combine before the tokens can be mixed. With two micro-batches the waits can
hide under each other's work: post A's dispatch, route B while it travels, post B's dispatch,
compute A's experts while B's travels, post A's combine, compute B's experts while it travels,
and so on. DeepSeek-V3 pairs the chunks of two micro-batches this way in DualPipe (arXiv:
2412.19437, section 3.2.1): forward and backward chunks side by side, each one's all-to-all
under the other's attention and experts. This lesson builds the forward half of the pairing:
``overlapped_forward`` gives each micro-batch exactly what ``DroplessMoE.forward`` gives it (the
tests hold it so), with the collectives posted asynchronously in the interleaved order.

What it costs on a GPU: the transfers run on the copy engines and NICs, but the all-to-all
kernels that pack, send and receive rows occupy streaming multiprocessors that the matmuls then
lack. DeepSeek-V3's kernels (DeepEP) take 20 of the H800's 132 SMs (section 3.2.1): about 15% of
the compute, paid so that the communication disappears from the step. On a CPU, gloo's thread
shares the cores with the computing threads, so the overlap shows in the order of the events,
not in the time saved.
"""

from __future__ import annotations

import time

import torch

from ..checks import check_instance, check_module
from ..errors import UserError
from .all_to_all import post_rows
from .dropless import DroplessMoE


@torch.no_grad()
def overlapped_forward(
    layer: DroplessMoE, micro_batches: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[tuple[int, str, float, float]]]:
    """Each micro-batch through an expert-parallel ``layer``, their all-to-alls interleaved.

    Returns the outputs (what ``layer(x)`` returns for each) and the events, ``(micro-batch,
    phase, start, end)`` in seconds from the call, phases ``route``, ``dispatch`` (posting it, then
    waiting for it), ``experts``, ``combine`` and ``mix``: the step's anatomy.

    Args:
        layer: a ``DroplessMoE`` spread over its group (``expert.apply_expert_parallel``).
        micro_batches: two or more (tokens, d_model) tensors, the same count on every rank.
    """
    check_module("layer", layer)
    check_instance("layer", layer, DroplessMoE)
    if not layer.sharded:
        raise UserError("overlapped_forward overlaps an expert-parallel layer's all-to-alls: spread it first")
    if len(micro_batches) < 2:
        raise UserError(f"overlap needs two micro-batches or more, got {len(micro_batches)}")
    start, events = time.perf_counter(), []

    def timed(index: int, phase: str, work):
        begin = time.perf_counter() - start
        result = work()
        events.append((index, phase, begin, time.perf_counter() - start))
        return result

    state = []
    for i, x in enumerate(micro_batches):  # route each and post its dispatch: the next routes meanwhile
        tokens = x.reshape(-1, x.shape[-1])
        routing, order = timed(i, "route", lambda tokens=tokens: layer.route(tokens))
        splits = layer.splits(routing.load.tolist(), x.device)
        rows = tokens[routing.token[order]]
        arrived, work = timed(
            i,
            "dispatch",
            lambda r=rows, s=splits: post_rows(r, s.send, s.receive, group=layer.group, async_op=True),
        )
        state.append([tokens, routing, order, splits, arrived, work])
    for i, entry in enumerate(state):  # each one's experts while the others' rows travel
        tokens, routing, order, splits, arrived, work = entry
        timed(i, "dispatch", work.wait)
        results = timed(i, "experts", lambda a=arrived, s=splits: layer.experts(a[s.gather], s.per_expert))
        done = torch.empty_like(arrived).index_copy(0, splits.gather, results)
        entry[4:] = timed(
            i,
            "combine",
            lambda d=done, s=splits: post_rows(d, s.receive, s.send, group=layer.group, async_op=True),
        )
    outputs = []
    for i, (tokens, routing, order, _, back, work) in enumerate(state):
        timed(i, "combine", work.wait)
        mixed = timed(i, "mix", lambda t=tokens, r=routing, o=order, b=back: layer.mix(t, r, o, b))
        outputs.append(mixed.reshape(micro_batches[i].shape))
    return outputs, events
