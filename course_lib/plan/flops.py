"""Model FLOPs utilization (MFU): how much of the hardware's arithmetic training really uses.

Samples per second say how fast a run is; MFU says how well it uses the machine. It is the
arithmetic the model needs per second, over what the hardware could do:

    MFU = (training FLOPs per sample x samples per second) / (GPUs x peak FLOP/s of one GPU)

The FLOPs are the *model's*, counted from its operations (a forward pass, and a backward pass
that costs about twice as much), not what the GPU happened to execute: recomputation (activation
checkpointing) or padding do not raise MFU. The peak is the datasheet's dense number at the
precision the matrix products run in. Large transformers reach 40-60 % on H100s; a small CNN
reaches a few percent, because its step is bound by memory traffic and kernel launches, not
arithmetic. That contrast is the lesson: a higher samples/s on a tiny model says little about
how a large one will scale.

A CPU has no datasheet peak in the table below, so ``measure_matmul_tflops`` measures one: the
rate of a large matrix product on this machine, the most its arithmetic does in practice.

Counting: ``torch.utils.flop_counter.FlopCounterMode`` records the FLOPs of every matrix product
and convolution PyTorch runs (2 per multiply-add). ``training_flops_per_sample`` runs one
forward and backward of a copy of the model on the ``meta`` device, where tensors have shapes
but no data: nothing is computed, nothing of the real model is touched.

Paper: MFU was defined for PaLM (Chowdhery et al., "PaLM: Scaling Language Modeling with
Pathways", 2022, appendix B).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..errors import UserError

PEAK_TFLOPS = (
    # (a substring of torch.cuda.get_device_name(), {matmul precision: dense TFLOP/s}), first match
    # wins, from NVIDIA's datasheets (their tensor-core figures are with 2:4 sparsity: halved
    # here). "tf32" is fp32 training whose products run on tensor cores (PyTorch lets cuDNN's
    # convolutions do so by default); "fp8" is e4m3/e5m2 products (Hopper and later).
    ("H100 PCIe", {"fp8": 1513.0, "bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"fp8": 1978.9, "bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM, and GH200's H100
    ("H200", {"fp8": 1978.9, "bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # also GH200: the same GPU
    ("B200", {"fp8": 4500.0, "bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),  # HGX B200, 1,000 W
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # no fp8 tensor cores
)
"""Dense peak TFLOP/s of the GPUs the course runs on, per precision of the matrix products."""


def training_flops_per_sample(model: nn.Module, sample_shape: tuple[int, ...]) -> float:
    """FLOPs of one training step (forward and backward) per sample, counted on a ``meta`` copy.

    Args:
        model: the unwrapped model (it is copied, never run).
        sample_shape: the shape of one input sample, e.g. ``(3, 32, 32)``.
    """
    batch = 2  # batch norm needs more than one sample in training mode
    counted = copy.deepcopy(model).to("meta").train()
    inputs = torch.empty((batch, *sample_shape), device="meta")
    with FlopCounterMode(display=False) as counter:
        counted(inputs).float().sum().backward()
    return counter.get_total_flops() / batch


def matmul_precision(precision: str) -> str:
    """The precision training's products run in: ``bf16``, ``tf32`` (fp32 on tensor cores) or ``fp32``.

    Args:
        precision: the training's ``--precision``: ``"bf16"`` (autocast) or ``"fp32"``.
    """
    if precision == "bf16":
        return "bf16"
    backends = torch.backends
    return "tf32" if backends.cudnn.allow_tf32 or backends.cuda.matmul.allow_tf32 else "fp32"


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The datasheet peak of this GPU at ``precision``, or None (a CPU, a GPU not in the table, or a
    precision it has no tensor cores for).

    Args:
        device: the device training runs on.
        precision: as ``matmul_precision`` returns it.
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for marker, peaks in PEAK_TFLOPS:
        if marker in name:
            return peaks.get(precision)
    return None


def measure_matmul_tflops(
    *,
    device: torch.device | str = "cpu",
    size: int = 1024,
    dtype: torch.dtype = torch.float32,
    repeats: int = 10,
    warmup: int = 3,
) -> float:
    """The matrix-product rate this device really reaches, in TFLOP/s: a measured peak.

    A datasheet gives a GPU's peak; a laptop's CPU has none worth trusting (it depends on the
    cores, the vector units, the clock and what else runs), so we measure it: the median time of
    one ``size x size`` product, after ``warmup`` untimed ones, and ``2 * size**3`` FLOPs for it.
    A model's MFU against this number says how far its step is from the best this machine does.

    Args:
        device: where to multiply (``"cpu"``, ``"cuda"``, ...).
        size: the side of the square matrices; large enough that the product, not the call, costs.
        dtype: the precision of the product (the one training's products run in).
        repeats: timed products; the median is kept.
        warmup: untimed products first (thread pools and caches warm up).
    """
    if size < 1 or repeats < 1 or warmup < 0:
        raise UserError(
            f"size={size}, repeats={repeats}, warmup={warmup}: the size and the repeats must be at "
            "least 1 and the warm-up at least 0"
        )
    device = torch.device(device)
    left = torch.randn(size, size, device=device).to(dtype)
    right = torch.randn(size, size, device=device).to(dtype)
    seconds = []
    for repeat in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a GPU product is queued, not done, when the call returns
        start = time.perf_counter()
        torch.mm(left, right)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat >= warmup:
            seconds.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(seconds) / 1e12


def model_flops_utilization(
    *, flops_per_sample: float, samples_per_s: float, gpus: int, peak_tflops_per_gpu: float
) -> float:
    """MFU: the model's FLOPs per second over the peak of all the GPUs.

    Args:
        flops_per_sample: ``training_flops_per_sample``.
        samples_per_s: the whole job's training throughput.
        gpus: how many GPUs share that throughput.
        peak_tflops_per_gpu: one GPU's peak, in TFLOP/s.
    """
    return flops_per_sample * samples_per_s / (gpus * peak_tflops_per_gpu * 1e12)
