"""How long one GPU takes for a step's kernels: each matmul by its shape, attention and the
memory-bound work at the rates measured on that GPU.

A flat fraction of the datasheet's peak ("70 % of 989 TFLOP/s") is right for large products and
wrong for the rest. A GPU computes a matmul in tiles, one tile per multiprocessor at a time: a
product whose tiles do not fill the last wave of multiprocessors pays for the whole wave, and
every wave pays a fixed latency (loading its first operands, writing its results). So:

    t(m, n, k) = waves · (2·Tm·Tn·k / (sustained · peak / SMs) + latency)
    waves      = ceil(ceil(m / Tm) · ceil(n / Tn) / SMs)

for an (m x k) by (k x n) product. The tile Tm x Tn, the sustained fraction and the latency are
*fitted*, by least squares on relative error, to the products ``make gpu-record`` timed on the
GPU (``slides/recorded/gpu/``; ``fit_record``). On the H100 record the fit is 256 x 128 tiles,
0.79 of the peak and 6.9 µs a wave: 0.14 RMS error in log time over 360 products of the
built-in models' blocks, where one flat 70 % gives 0.33 (its worst product is 3.8x off; the
fit's, 1.65x). A small hidden size loses: Llama 3 8B's key/value projection split over 8 tensor
ranks (2048 x 4096 x 768) runs at 28 % of the peak.

Attention (causal flash attention) runs at the record's rate for its shape, forward and backward
apart (``attention_fractions``): a kernel of 64-wide heads runs at two thirds of the rate of
128-wide ones, and few heads on a short sequence leave multiprocessors idle (Llama 3 8B's 32
heads at 8K tokens: 576 TFLOP/s forward on an H200, 4 heads at 2K: 80). Memory-bound work
streams its bytes at the memory's datasheet bandwidth times the fraction the record measured,
eager or compiled (a fused norm and add: 1.5 TB/s eager, 2.5
compiled on an H100), the optimizer's fused AdamW and the loss at theirs.

A GPU without a record of its own uses the H100's fractions with its own peak, multiprocessors
and bandwidth (an assumption its ``source`` names); ``plan calibrate`` fits them from measured
runs instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError

GPU_RECORDS = Path(__file__).resolve().parent.parent.parent / "slides" / "recorded" / "gpu"
"""Where ``make gpu-record`` writes what it measured on a GPU, one JSON file per kind of GPU."""

TILES = ((128, 128), (128, 256), (256, 128))
"""The tiles Hopper's and Ampere's bf16 GEMM kernels use; the fit keeps the one that explains the
record best."""


@dataclass(frozen=True)
class GPU:
    """One kind of GPU, from its datasheet.

    Args:
        name: its name (``GPUS``).
        peak_flops: dense bf16 FLOP/s (NVIDIA's datasheet; the sparse figure halved).
        fp8_flops: dense fp8 FLOP/s (0: no fp8 tensor cores).
        multiprocessors: streaming multiprocessors, the tiles that run at once.
        memory_bandwidth: the memory's datasheet bytes/s.
        record: the ``gpu-record`` file (without ``.json``) whose fitted fractions it uses.
        source: where the figures come from, and what is assumed.
    """

    name: str
    peak_flops: float
    fp8_flops: float
    multiprocessors: int
    memory_bandwidth: float
    record: str = "nvidia-h100-80gb-hbm3"
    source: str = ""


TB = 1e12
ASSUMED = "the H100 record's fitted fractions (no record of this GPU): an assumption"

GPUS = {
    gpu.name: gpu
    for gpu in (
        GPU("h100-sxm", 989.4e12, 1978.9e12, 132, 3.35 * TB,
            source="NVIDIA H100 SXM datasheet (700 W, 80 GB HBM3); fractions fitted to its own record"),
        GPU("h100-sxm-500w-hbm2e", 886e12, 1772e12, 132, 2.4 * TB,
            source="H100 SXM at a 500 W limit with 96 GB HBM2e (Grand Teton, as torchtitan's benchmarks "
            "state). Its peak is unpublished: torchtitan's benchmark says it lies between the SXM's "
            "(989 TFLOP/s at 700 W) and the NVL's (835 at 400 W); taken on the line between the two by "
            "power (a capped clock falls about linearly with the watts, 835 + 154·100/300), an "
            f"assumption; {ASSUMED}"),
        GPU("gh200", 989.4e12, 1978.9e12, 132, 4.0 * TB,
            source=f"NVIDIA GH200's H100 with 96 GB HBM3 at 4 TB/s (CSCS Alps); {ASSUMED}"),
        GPU("h200", 989.4e12, 1978.9e12, 132, 4.8 * TB, record="nvidia-h200",
            source="NVIDIA H200 SXM datasheet (700 W, 141 GB HBM3e); fractions fitted to its own record"),
        GPU("a100-sxm", 312e12, 0.0, 108, 2.039 * TB, source=f"NVIDIA A100 80GB SXM datasheet; {ASSUMED}"),
        GPU("b200", 2250e12, 4500e12, 148, 8.0 * TB,
            source=f"NVIDIA HGX B200 datasheet (1,000 W); {ASSUMED}"),
    )
}  # fmt: skip
"""The GPUs the built-in clusters are made of."""

RECORDED_ON = {"nvidia-h100-80gb-hbm3": "h100-sxm", "nvidia-h200": "h200"}
"""Each committed record, and the GPU of ``GPUS`` it was measured on."""


@dataclass(frozen=True)
class KernelFit:
    """What a GPU's record says of its kernels, as fractions of its datasheet figures.

    Args:
        tile: (rows, columns) of a matmul's tile.
        sustained: the fraction of the peak a full wave of tiles reaches (fitted).
        wave_latency_s: seconds each wave pays beside its arithmetic (fitted).
        attention_forward: causal flash attention's forward at the record's fastest shape, a
            fraction of the peak (measured).
        attention_backward: its backward there (measured).
        pointwise_eager: memory-bound operations run one kernel each, a fraction of the bandwidth.
        pointwise_compiled: the same fused by ``torch.compile``.
        optimizer: fused AdamW's step, a fraction of the bandwidth.
        loss: the cross-entropy's forward and backward on fp32 logits, a fraction of the bandwidth.
        copy: a tensor copied (or cast) from one buffer to another, a fraction of the bandwidth.
        attention_rows: each recorded attention shape, ``(head_dim, heads, seq_len, forward,
            backward)`` with the two as fractions of the peak (``attention_fractions`` reads them).
        grouped_ratio: measured over modelled time of the record's grouped expert products run as
            one kernel (``grouped_matmul_seconds``), their geometric mean: fitted, 1 where the
            record has none (the tile model taken as it is, an assumption).
        grouped_products: how many grouped products measured ``grouped_ratio`` (0: assumed).
        rms_log_error: the fit's root-mean-square error in log time over the record's products.
        flat_rms_log_error: the same for one flat 70 % of the peak, for comparison.
        products: how many products the fit saw.
    """

    tile: tuple[int, int]
    sustained: float
    wave_latency_s: float
    attention_forward: float
    attention_backward: float
    pointwise_eager: float
    pointwise_compiled: float
    optimizer: float
    loss: float
    rms_log_error: float
    flat_rms_log_error: float
    products: int
    copy: float = 0.0
    attention_rows: tuple[tuple[int, int, int, float, float], ...] = ()
    grouped_ratio: float = 1.0
    grouped_products: int = 0


def _waves(m: float, n: float, tile: tuple[int, int], multiprocessors: int, groups: int = 1) -> int:
    """Waves of tiles of ``groups`` (m x n) results launched together."""
    return math.ceil(groups * math.ceil(m / tile[0]) * math.ceil(n / tile[1]) / multiprocessors)


def _fit_tile(products: list[dict], tile, peak: float, sms: int) -> tuple[float, float, float]:
    """(sustained, latency, RMS log error) for one tile: t = waves·(W/sustained + latency) is linear
    in 1/sustained and the latency; least squares on t_model/t_measured - 1."""
    rows = []
    for product in products:
        m, k, n = product["shape"]
        waves = _waves(m, n, tile, sms)
        t = product["seconds"]
        rows.append((waves * 2 * tile[0] * tile[1] * k * sms / peak / t, waves / t))
    x = torch.tensor(rows, dtype=torch.float64)
    inverse, latency = (
        torch.linalg.lstsq(x, torch.ones(len(rows), 1, dtype=torch.float64)).solution[:, 0].tolist()
    )
    errors = [math.log(inverse * w + latency * v) for w, v in rows]  # each row is already over its t
    return 1 / inverse, latency, math.sqrt(sum(e * e for e in errors) / len(errors))


RECORDED_PRECISIONS = {"bf16": "bf16", "fp8": "fp8-tensorwise"}
"""The record's products each matmul precision is fitted to (fp8: tensorwise scaling, torchao's
and Transformer Engine's default)."""


def fit_record(record: dict, gpu: GPU, precision: str = "bf16") -> KernelFit:
    """The kernel model's fractions for ``gpu`` from a ``gpu-record`` file's measurements.

    Args:
        record: the record (``matmuls``, ``attention``, ``pointwise``), as ``gpu_record`` writes it.
        gpu: the GPU it was measured on (its datasheet peak, multiprocessors and bandwidth).
        precision: the products to fit, ``"bf16"`` or ``"fp8"`` (against the fp8 peak).
    """
    recorded = RECORDED_PRECISIONS[precision]
    products = [row for row in record["matmuls"] if row["precision"] == recorded]
    if not products:
        raise UserError(f"the GPU record has no {recorded} matmuls: run make gpu-record again")
    peak = _peak(gpu, precision)
    fits = {tile: _fit_tile(products, tile, peak, gpu.multiprocessors) for tile in TILES}
    tile = min(fits, key=lambda t: fits[t][2])
    sustained, latency, error = fits[tile]
    flat = [math.log(2 * math.prod(p["shape"]) / (0.7 * peak) / p["seconds"]) for p in products]
    attention = max(record["attention"], key=lambda row: row["forward_tflops"])
    rates = {(row["operation"], row["mode"]): row["gbps"] * 1e9 for row in record["pointwise"]}
    eager = [rates[(op, "eager")] for op in ("silu_mul", "norm_add")]
    compiled = [rates[(op, "compiled")] for op in ("silu_mul", "norm_add")]
    bandwidth = gpu.memory_bandwidth
    fit = KernelFit(
        tile=tile,
        sustained=sustained,
        wave_latency_s=latency,
        attention_forward=attention["forward_tflops"] * 1e12 / gpu.peak_flops,
        attention_backward=attention["backward_tflops"] * 1e12 / gpu.peak_flops,
        pointwise_eager=sum(eager) / len(eager) / bandwidth,
        pointwise_compiled=sum(compiled) / len(compiled) / bandwidth,
        optimizer=rates[("adamw_step", "fused")] / bandwidth,
        loss=rates[("cross_entropy_forward_backward", "eager")] / bandwidth,
        rms_log_error=error,
        flat_rms_log_error=math.sqrt(sum(e * e for e in flat) / len(flat)),
        products=len(products),
        copy=rates[("copy", "eager")] / bandwidth,
        attention_rows=tuple(
            (row["head_dim"], row["heads"], row["seq_len"], row["forward_tflops"] * 1e12 / gpu.peak_flops,
             row["backward_tflops"] * 1e12 / gpu.peak_flops)
            for row in record["attention"]
        ),
    )  # fmt: skip
    return _with_grouped_ratio(fit, record, gpu, precision)


def _with_grouped_ratio(fit: KernelFit, record: dict, gpu: GPU, precision: str) -> KernelFit:
    """``fit`` with the record's grouped products' measured over modelled time (``gpu_record``'s
    ``grouped`` rows that ran as one kernel: each expert's rows times its up-projection)."""
    rows = [row for row in record.get("grouped", []) if row.get("one_kernel")]
    if not rows or precision != "bf16":
        return fit
    logs = [
        math.log(row["grouped_s"] / _tile_model_seconds(
            fit, gpu, row["rows"] / row["experts"], row["hidden"], row["d_model"], row["experts"], precision))
        for row in rows
    ]  # fmt: skip
    return dataclasses.replace(fit, grouped_ratio=math.exp(sum(logs) / len(logs)), grouped_products=len(rows))


def _interpolated(points: list[tuple[float, float, float]], at: float) -> tuple[float, float]:
    """(forward, backward) at ``at`` on the line through ``points`` (x, forward, backward) in log x,
    held at the ends (the record says nothing beyond its shapes); equal x averaged."""
    by_x: dict[float, list] = {}
    for x, forward, backward in points:
        by_x.setdefault(x, []).append((forward, backward))
    xs = sorted(by_x)
    ys = [tuple(sum(v) / len(v) for v in zip(*by_x[x], strict=True)) for x in xs]
    if at <= xs[0] or len(xs) == 1:
        return ys[0]
    if at >= xs[-1]:
        return ys[-1]
    right = next(i for i, x in enumerate(xs) if x >= at)
    share = math.log(at / xs[right - 1]) / math.log(xs[right] / xs[right - 1])
    low, high = ys[right - 1], ys[right]
    return tuple(a + share * (b - a) for a, b in zip(low, high, strict=True))


def attention_fractions(
    fit: KernelFit, *, head_dim: int, heads: float, seq_len: float
) -> tuple[float, float]:
    """Causal flash attention's (forward, backward) fractions of the peak for one GPU's shape.

    The record's rows of the nearest head width; among them, at each recorded sequence length the
    rate interpolated in log(heads), then across sequence lengths in log(seq_len), both held at
    the record's ends. More heads and longer sequences fill more multiprocessors: Llama 3 8B's
    32 heads reach 0.58 of an H200's peak forward at 8K tokens, its 4 heads of a tensor rank at 2K,
    0.08.

    Args:
        fit: the GPU's fit (``fit_record``).
        head_dim: features per head.
        heads: query heads on this GPU (a tensor rank's share).
        seq_len: tokens a sequence attends over on this GPU.
    """
    if not fit.attention_rows:
        return fit.attention_forward, fit.attention_backward
    width = min({row[0] for row in fit.attention_rows}, key=lambda w: (abs(math.log(w / head_dim)), -w))
    rows = [row for row in fit.attention_rows if row[0] == width]
    at_lengths = [
        (length, *_interpolated([(h, f, b) for _, h, s, f, b in rows if s == length], heads))
        for length in sorted({row[2] for row in rows})
    ]
    return _interpolated(at_lengths, seq_len)


@functools.cache
def kernel_fit(record: str, precision: str = "bf16") -> KernelFit:
    """The fit of a committed record (``GPU_RECORDS/<record>.json``), for the GPU it names.

    Args:
        record: the record's name.
        precision: its products' precision to fit, ``"bf16"`` or ``"fp8"``.
    """
    path = GPU_RECORDS / f"{record}.json"
    if not path.is_file():
        raise UserError(
            f"no GPU record {path}: run make gpu-record on that GPU, or name a cluster without it"
        )
    content = json.loads(path.read_text())
    measured_on = content.get("device", {}).get("name", "")
    if slug(measured_on) != record:
        raise UserError(
            f"{path} was measured on {measured_on or 'an unnamed device'}, not the GPU it is filed as "
            f"({record}): put each GPU's record under its own name (make gpu-record writes it so)"
        )
    return fit_record(content, GPUS[RECORDED_ON[record]], precision)


def slug(name: str) -> str:
    """A file name for a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _peak(gpu: GPU, precision: str) -> float:
    if precision != "fp8":
        return gpu.peak_flops
    if not gpu.fp8_flops:
        raise UserError(f"the {gpu.name} has no fp8 tensor cores: plan it in bf16")
    return gpu.fp8_flops


def matmul_seconds(gpu: GPU, m: float, n: float, k: float, precision: str = "bf16") -> float:
    """Seconds of one (m x k) by (k x n) product on ``gpu``: its waves of tiles.

    Args:
        gpu: the GPU.
        m: rows of the result (tokens, for a layer's forward).
        n: its columns.
        k: the dimension summed over.
        precision: ``"bf16"``, or ``"fp8"`` (against the fp8 peak and the record's fp8 products).
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return _tile_model_seconds(kernel_fit(gpu.record, precision), gpu, m, n, k, 1, precision)


def _tile_model_seconds(fit: KernelFit, gpu: GPU, m, n, k, groups: int, precision: str) -> float:
    """The fitted tile model for ``groups`` (m x k) by (k x n) products in one launch: its waves,
    each a tile's arithmetic at the sustained rate plus the wave's latency."""
    per_sm = fit.sustained * _peak(gpu, precision) / gpu.multiprocessors
    tile_seconds = 2 * fit.tile[0] * fit.tile[1] * k / per_sm
    return _waves(m, n, fit.tile, gpu.multiprocessors, groups) * (tile_seconds + fit.wave_latency_s)


def grouped_matmul_seconds(
    gpu: GPU, m: float, n: float, k: float, groups: float, precision: str = "bf16"
) -> float:
    """Seconds of ``groups`` (m x k) by (k x n) products run as one grouped kernel (a rank's experts
    in ``torch._grouped_mm`` or CUTLASS's grouped GEMM): one launch whose waves hold every group's
    tiles, so small experts fill the multiprocessors that one launch each would leave idle. The
    tile model of ``matmul_seconds`` over all the tiles together, times the record's
    ``grouped_ratio`` (measured where the record has grouped products; else 1, an assumption).

    Args:
        gpu: the GPU.
        m: each group's rows (an expert's tokens).
        n: the result's columns.
        k: the dimension summed over.
        groups: the products (the experts on this GPU).
        precision: ``"bf16"`` or ``"fp8"``.
    """
    if m <= 0 or n <= 0 or k <= 0 or groups <= 0:
        return 0.0
    fit = kernel_fit(gpu.record, precision)
    return fit.grouped_ratio * _tile_model_seconds(fit, gpu, m, n, k, math.ceil(groups), precision)
