"""Predict a layout before launching it: memory per GPU, bytes sent, step time, MFU.

Every term is a formula the course has already measured on real processes; this lesson adds
them up for a model and a cluster too large for a laptop. One file per part, read in this order:

- ``specs.py``: the models and the machines, and one step's shape on the fullest GPU;
- ``memory_model.py``: model states (ZeRO's formula on the stage's parameters) and activations
  (Korthikanti et al.'s count for a Llama-style block, times what the schedule keeps in flight);
- ``compute_model.py``: the matmuls at a measured rate, the memory-bound work at the memory's
  bandwidth, recomputation, and the pipeline's bubble (the schedule simulated);
- ``network_model.py``: each axis's collectives in the alpha-beta model, on the link the axis
  runs on, less what compute hides: one function per axis, returning seconds and bytes;
- here, ``predict``: their sum, and ``check``, the one reason a layout cannot run;
- ``planner.py``: every layout of a job predicted and ranked.

The host: where the core that dispatches is the one that computes (a CPU), each operation a step
dispatches costs the host a few microseconds; the count comes from the implementation
(``predict``'s ``operations``), the cost per operation from calibration. A GPU's host queues its
kernels ahead and the term is 0.

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

from dataclasses import dataclass, field

from ..checks import check_instance, check_int
from ..errors import UserError
from ..parallel.ulysses import check_heads
from . import kernels
from .compute_model import compute_seconds
from .frameworks import COURSE_PROFILE, Framework
from .layout import Layout
from .memory_phases import MemoryPeak, memory_peak
from .network_model import (
    contention_seconds,
    context_axis,
    data_collectives,
    expert_axis,
    pipeline_axis,
    tensor_axis,
)
from .specs import GIB, ClusterSpec, ModelSpec, StepShape


@dataclass
class Prediction:
    """What ``predict`` says of one layout: bytes per GPU (the fullest one), seconds per step.

    ``memory`` and ``time`` are breakdowns whose ``total`` is the sum of the other entries;
    ``traffic`` is the bytes one GPU sends per step, by axis. ``problem`` is the one reason the
    layout cannot run (None: it can). ``microbatches``: the micro-batches a replica runs a step
    (0 where the layout was refused before any part was predicted). ``memory`` is what the card
    holds at the step's peak; ``peak`` has the phases, the allocated and reserved peaks and the
    phase that sets them (``memory_phases``). ``note``: what to know of a layout that fits only
    by the allocator releasing its cache.
    """

    layout: Layout
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    traffic: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    problem: str | None = None
    microbatches: int = 0
    peak: MemoryPeak | None = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.problem is None


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
    if ulysses:  # the heads each tensor rank holds, dealt out over the context ranks (query heads whole)
        try:
            check_heads(
                model.heads // layout.tensor, layout.context, kv_heads=model.kv_heads // layout.tensor
            )
        except UserError as error:
            rule = str(error).split(":")[0]  # the rule, without the advice meant for a hand-built layout
            return rule + (
                f" (a tensor rank's share, at tensor degree {layout.tensor})" if layout.tensor > 1 else ""
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


def predict(
    model: ModelSpec,
    cluster: ClusterSpec,
    layout: Layout,
    *,
    seq_len: int,
    global_batch: int,
    operations: int = 0,
    framework: Framework = COURSE_PROFILE,
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
        framework: what the training stack keeps and overlaps (``frameworks.FRAMEWORKS``; the
            course's own by default).
    """
    for name, value, kind in (
        ("model", model, ModelSpec), ("cluster", cluster, ClusterSpec), ("layout", layout, Layout),
        ("framework", framework, Framework),
    ):  # fmt: skip
        check_instance(f"predict's {name}", value, kind)
    check_int("predict's seq_len", seq_len, minimum=1)
    check_int("predict's global_batch", global_batch, minimum=1)
    check_int("predict's operations", operations, minimum=0)
    result = Prediction(layout)
    problem = check(model, layout, gpus=layout.gpus, seq_len=seq_len, global_batch=global_batch)
    if problem:
        result.problem = problem
        return result
    if layout.precision == "fp8" and not (cluster.gpu and kernels.GPUS[cluster.gpu].fp8_flops):
        result.problem = f"fp8 products need GPUs with fp8 tensor cores: {cluster.name} has none"
        return result
    step = StepShape(model, cluster, layout, seq_len, global_batch, framework)
    result.microbatches = step.microbatches
    result.peak = memory_peak(step)
    result.memory = result.peak.parts
    work = compute_seconds(step)
    data_exposed, data_sent, data_whole = data_collectives(
        step, work.forward_and_backward + work.recomputation
    )
    axes = {
        "tensor": tensor_axis(step, work.matmuls + work.recomputation),
        "context": context_axis(step, work.attention_flops),
        "data": (data_exposed, data_sent),
        "pipeline": pipeline_axis(step),
        "expert": expert_axis(step),
    }
    result.time = {
        "compute": work.matmuls,
        "memory-bound operations": work.pointwise_blocks + work.pointwise_head,
        "optimizer step": work.optimizer,
        "casts and copies": work.copies,
        "recomputation": work.recomputation,
        "pipeline bubble": work.bubble,
        "tensor (exposed)": axes["tensor"][0],
        "context (exposed)": axes["context"][0],
        "data (exposed)": axes["data"][0],
        "pipeline sends (exposed)": axes["pipeline"][0],
        "expert (exposed)": axes["expert"][0],
        "communication contention": contention_seconds(step, max(0.0, data_whole - data_exposed)),
        "host (dispatching operations)": operations * cluster.host_seconds_per_operation,
    }
    result.time["total"] = sum(result.time.values())
    result.traffic = {axis: sent for axis, (_, sent) in axes.items()}
    result.tokens_per_s = global_batch * seq_len / result.time["total"]
    result.mfu = model.flops_per_token(seq_len) * result.tokens_per_s / (layout.gpus * cluster.peak_flops)
    result.problem, result.note = memory_verdict(result.peak, cluster)
    return result


def memory_verdict(peak: MemoryPeak, cluster: ClusterSpec) -> tuple[str | None, str]:
    """(the reason a step does not fit, or None; a note where it fits only by the allocator
    releasing its cache), in GiB as the device counts.

    It fits when what the card holds (reserved, the CUDA context, NCCL's buffers) fits in the
    memory the device reports. Where only the allocated peak does, a failed ``cudaMalloc`` makes
    PyTorch's allocator free its cached blocks and retry: it runs, slower.
    """
    capacity, parts = cluster.gpu_memory_bytes, peak.parts
    outside = parts["CUDA context"] + parts["NCCL buffers"]
    if peak.allocated + outside > capacity:
        return (
            f"needs {(peak.allocated + outside) / GIB:.1f} GiB per GPU of {capacity / GIB:.1f} at its "
            f"{peak.phase} ({parts['activations'] / GIB:.1f} GiB activations, "
            f"{peak.model_states / GIB:.1f} GiB model states, {outside / GIB:.1f} GiB CUDA context and NCCL)"
        ), ""
    if parts["total"] > capacity:
        return None, (
            f"fits only as the allocator releases cached blocks: {parts['total'] / GIB:.1f} GiB reserved "
            f"and outside it, of {capacity / GIB:.1f} (allocated {peak.allocated / GIB:.1f} GiB at the "
            f"{peak.phase})"
        )
    return None, ""
