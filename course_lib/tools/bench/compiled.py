"""``bench compile``: compiled transformer blocks against eager ones, on one process and under three
parallelisms: the course's tensor parallelism, DTensor's, and FSDP2 (``fully_shard``).

For each variant the same stack of ``models.Block``s trains eager and with every block compiled
(``parallel.compiled.apply_compile``, after the parallelism, as torchtitan orders it). Reported:
the seconds of the first compiled step (tracing and code generation, Inductor's caches off: the
compile time on a fresh machine); the median step of each, timed in turns, and their ratio; the
steps a run needs before compiling has paid for itself; the first block's graphs and graph breaks
with their reasons (``graph_breaks``); and the largest difference between the compiled and the
eager loss over the timed steps, which start from the same weights and see the same inputs.

On a CPU Inductor generates C++ (it needs a compiler, refused in one line otherwise) and fuses the
element-wise work between the matmuls; the matmuls stay oneDNN's. ``--compiler aot_eager`` traces
and splits the graphs the same way but runs PyTorch's own operators: quick, and what the tests use.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
from torch import nn

from ... import models
from ...distributed import comm, runtime
from ...parallel import compiled
from ...parallel import tensor as tp
from ..timing import interleaved_medians

VARIANTS = ("one_process", "course_tp", "dtensor_tp", "fsdp2")
"""The parallelisms each block compiles under (one process: no collective at all)."""


def _dtensor_plan(layers: int) -> dict:
    """DTensor's tensor parallelism for a stack of ``layers`` blocks: the course's cut, named per block."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for index in range(layers):
        plan |= {f"{index}.attention.{name}": ColwiseParallel() for name in ("q", "k", "v")}
        plan |= {f"{index}.attention.out": RowwiseParallel()}
        plan |= {f"{index}.mlp.fc1": ColwiseParallel(), f"{index}.mlp.fc2": RowwiseParallel()}
    return plan


def _parallel(stack: nn.Sequential, variant: str) -> nn.Module:
    """``stack`` under ``variant``'s parallelism (the dense weights cut, not drawn anew)."""
    if variant == "course_tp":
        return tp.apply_tensor_parallel(stack)
    if variant == "dtensor_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (runtime.world_size(),))
        return parallelize_module(stack, mesh, _dtensor_plan(len(stack)))
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in stack:
            fully_shard(block)
        return fully_shard(stack)
    return stack


def _local(tensor):
    """A DTensor's local part; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def compile_benchmark(
    *,
    d_model: int,
    heads: int,
    seq: int,
    batch: int,
    layers: int,
    steps: int,
    warmup: int,
    compiler: str,
) -> dict | None:
    """Eager against compiled blocks, on one process and under each parallelism; rank 0's result.

    Args:
        d_model: the blocks' width.
        heads: attention heads (a multiple of the ranks, for tensor parallelism).
        seq: tokens per sequence.
        batch: sequences per step (every rank the same batch: only the parallelism differs).
        layers: blocks in the stack.
        steps: timed steps of each; the median is reported.
        warmup: untimed steps after the first compiled one.
        compiler: torch.compile's backend: ``inductor``, ``aot_eager`` or ``eager`` (``compiled.BACKENDS``).
    """
    compiled.check_compiler(compiler)
    # Inductor keeps generated code on disk and reuses it; without its caches every variant's first
    # step pays the whole compile, as on a fresh machine (with them, fsdp2 reuses one_process's graphs)
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # what we asked for
        return _benchmark_variants(
            d_model=d_model, heads=heads, seq=seq, batch=batch, layers=layers, steps=steps, warmup=warmup,
            compiler=compiler,
        )  # fmt: skip


def _benchmark_variants(*, d_model, heads, seq, batch, layers, steps, warmup, compiler) -> dict | None:
    torch.manual_seed(0)
    dense = nn.Sequential(*(models.Block(d_model, heads) for _ in range(layers)))
    inputs = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1))
    result = {
        "benchmark": "compile",
        "compiler": compiler,
        "world_size": runtime.world_size(),
        "threads_per_rank": torch.get_num_threads(),
        "shape": {"batch": batch, "seq": seq, "d_model": d_model, "heads": heads, "layers": layers},
    }
    for variant in VARIANTS:
        torch._dynamo.reset()  # each variant compiles from nothing: its compile time is its own
        models_by_mode = {mode: _parallel(copy.deepcopy(dense), variant) for mode in ("eager", "compiled")}
        losses = {"eager": [], "compiled": []}

        def step(mode):
            model = models_by_mode[mode]
            loss = _local(model(inputs)).square().mean()
            loss.backward()
            for parameter in model.parameters():
                parameter.grad = None
            losses[mode].append(loss.item())

        probe = _parallel(copy.deepcopy(dense), variant)
        probe(inputs)  # an eager forward first: FSDP2 sets itself up from the root module's first one
        breaks = compiled.graph_breaks(probe[0], inputs)  # the first block traced, not compiled
        torch._dynamo.reset()
        compiled.apply_compile(models_by_mode["compiled"], backend=compiler)
        comm.barrier()
        started = time.perf_counter()
        step("compiled")
        first_step_s = time.perf_counter() - started
        median_ms = interleaved_medians(
            {mode: lambda mode=mode: step(mode) for mode in ("eager", "compiled")}, steps, warmup
        )
        timed = {mode: losses[mode][-(steps + warmup) :] for mode in losses}
        result[variant] = {
            "graphs_per_block": breaks["graphs"],
            "graph_breaks_per_block": breaks["breaks"],
            "break_reasons": sorted(set(breaks["reasons"])),
            "first_compiled_step_s": first_step_s,
            "eager_step_ms": median_ms["eager"],
            "compiled_step_ms": median_ms["compiled"],
            "compiled_over_eager": median_ms["compiled"] / median_ms["eager"],
            "steps_to_repay_compile": _steps_to_repay(first_step_s, median_ms),
            "max_loss_difference": max(
                abs(a - b) for a, b in zip(timed["eager"], timed["compiled"], strict=True)
            ),
        }
    return result if runtime.is_main() else None


def _steps_to_repay(first_step_s: float, median_ms: dict) -> float | None:
    """Steps after which compiling has paid for itself (None: a compiled step is no faster)."""
    saved_ms = median_ms["eager"] - median_ms["compiled"]
    return 1000 * first_step_s / saved_ms if saved_ms > 0 else None
