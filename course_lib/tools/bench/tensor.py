"""``tp``: the course's tensor-parallel MLP and attention against DTensor's ``parallelize_module``
(ColwiseParallel / RowwiseParallel), and the bytes moved per forward+backward against theory:
two all-reduces of the activation per sub-layer."""

from __future__ import annotations

import torch

from ... import models
from ...distributed import comm, runtime
from ...parallel import tensor as tp
from ..timing import interleaved_medians
from .common import anatomies

TP_HEADS_PER_RANK = 4
"""Attention heads each rank owns in the tensor-parallel benchmark."""


def tp_benchmark(
    *, d_model: int, seq: int, batch: int, steps: int, warmup: int, profile: str | None = None
) -> dict | None:
    """The course's tensor-parallel MLP and attention against DTensor's, and their bytes against theory.

    Args:
        d_model: the transformer's width.
        seq: characters per sequence.
        batch: sequences per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first (allocations, caches and lazy set-up settle in them).
        profile: a folder for each variant's per-rank traces (None: none are written).
    """
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    degree = runtime.world_size()
    mesh = init_device_mesh("cpu", (degree,))
    torch.manual_seed(0)
    heads = TP_HEADS_PER_RANK * degree
    dense = {"mlp": models.MLP(d_model, 4 * d_model), "attention": models.SelfAttention(d_model, heads)}
    plans = {
        "mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
        "attention": {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "out": RowwiseParallel(),
        },
    }
    course = {
        "mlp": tp.parallel_mlp(copy.deepcopy(dense["mlp"])),
        "attention": tp.parallel_attention(copy.deepcopy(dense["attention"]), heads),
    }
    # the input requires grad, as a block's input does inside a model: backward then all-reduces its gradient
    inputs = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    result = {
        "benchmark": "tp",
        "tensor_degree": degree,
        "threads_per_rank": torch.get_num_threads(),
        "activation_shape": [batch, seq, d_model],
    }
    activation_bytes = 4 * batch * seq * d_model
    for name in ("mlp", "attention"):
        theirs = parallelize_module(copy.deepcopy(dense[name]), mesh, plans[name])
        variants = {
            "course": lambda block=course[name]: block(inputs).sum().backward(),
            "torch": lambda block=theirs: block(inputs).sum().backward(),
        }
        median_ms = interleaved_medians(variants, steps, warmup)
        where = anatomies(variants, trace_dir=f"{profile}/{name}" if profile else None)
        with comm.CommLog() as log:
            course[name](inputs).sum().backward()
        course_ms, torch_ms = median_ms["course"], median_ms["torch"]
        result[name] = where | {
            "course_step_ms": course_ms,
            "torch_step_ms": torch_ms,
            "ratio": course_ms / torch_ms,
            "all_reduces_per_step": log.count("all_reduce"),
            "bytes_per_rank_measured": log.bytes_per_rank(),
            "bytes_per_rank_theory": 2 * comm.ring_bytes("all_reduce", activation_bytes, degree),
        }
    return result if runtime.is_main() else None
