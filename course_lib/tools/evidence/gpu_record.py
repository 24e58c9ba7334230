"""``python -m course_lib.tools.evidence.gpu_record``: what one GPU really does, recorded for the planner.

The planner's compute model needs rates, not a datasheet: how fast this GPU multiplies the very
matrices of a transformer block (the products of Llama 3 8B, 70B and Mixtral's blocks, split by
tensor parallelism, at the token counts of a micro-batch), in bf16 and in fp8 with tensorwise and
rowwise scales; how fast a mixture of experts' products run grouped in one call against one
expert at a time; how fast its fused attention runs; and what bandwidth its memory-bound operations
reach, eager and compiled. Small hidden sizes lose to tile and wave quantization, attention runs
at its own rate, a norm is bound by memory: each of these is measured here, one JSON file per GPU
(``slides/recorded/gpu/<gpu>.json``), beside the ``gpu``-marked tests' verdict.

Every rate is a median of CUDA-event timings after warm-up products, on random data (zeros run
faster: the power the multipliers draw depends on the bits). The FLOPs are the model's: 2·M·N·K
for a product, 4·s²·d per head for causal attention's forward (half of the square), twice that
for its backward; bytes are those the operation must move at least once.

Usage: ``make gpu-record`` (2.7 minutes on an H100, its tests included), or ``python -m
course_lib.tools.evidence.gpu_record --out DIR``. On a CPU, ``--device cpu`` records the same
fields in fp32 at small sizes, to check the command itself.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import checks
from ...errors import EXIT_USER_ERROR, UserError
from ...llama import LlamaBlock
from ...parallel import dropless
from ...plan.kernels import slug
from ...plan.specs import MODELS, ModelSpec
from .. import RECORDED, REPOSITORY

RECORDED_GPU = RECORDED / "gpu"
TOKENS = (2048, 8192)
"""Tokens of one micro-batch (M of every product): a 2,048-token and an 8,192-token sequence."""
TESTS_TIMEOUT_MAX_S = 480
"""The most the gpu-marked tests may take: ``make gpu-record`` has 8 minutes of a lent GPU in all."""
TENSOR_DEGREES = (1, 2, 4, 8)
"""Tensor-parallel degrees whose split products are measured (N or K divided by the degree)."""
PASSES = ("forward", "input_grad", "weight_grad")
"""A linear layer's three products: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x."""


def block_products(spec: ModelSpec, *, tokens: int, tensor: int) -> list[dict]:
    """The matrix products of one block and the head, as the fullest GPU runs them.

    Each is ``(name, M, K, N)`` for the forward product of an (M x K) activation with a (K x N)
    weight; column-parallel layers divide N by the tensor degree, row-parallel ones K. A mixture
    of experts gives each expert ``tokens · top_k / experts`` rows (routing balanced).

    Args:
        spec: the model.
        tokens: rows of the activation (a micro-batch's tokens).
        tensor: the tensor-parallel degree.
    """
    h, q, kv = spec.d_model, spec.attention_width, spec.kv_heads * spec.head_dim
    expert_rows = tokens * spec.top_k // spec.experts if spec.experts > 1 else tokens
    mlp_in = (2 if spec.gated_mlp else 1) * spec.ffn_hidden
    return [
        {"matmul": "qkv", "m": tokens, "k": h, "n": (q + 2 * kv) // tensor},
        {"matmul": "attention_out", "m": tokens, "k": q // tensor, "n": h},
        {"matmul": "mlp_in", "m": expert_rows, "k": h, "n": mlp_in // tensor},
        {"matmul": "mlp_out", "m": expert_rows, "k": spec.ffn_hidden // tensor, "n": h},
        {"matmul": "head", "m": tokens, "k": h, "n": spec.vocab // tensor},
    ]


def pass_shape(m: int, k: int, n: int, which: str) -> tuple[int, int, int]:
    """The (rows, inner, columns) of one of a linear layer's three products."""
    return {"forward": (m, k, n), "input_grad": (m, n, k), "weight_grad": (k, m, n)}[which]


HIGH_PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The precisions a product runs in without scales, by name: what the records call them."""


def _precision(device: torch.device) -> str:
    """What the recorded work computes in: bf16 on a GPU, as training does; fp32 on a CPU check."""
    return "bf16" if device.type == "cuda" else "fp32"


def _dtype(device: torch.device) -> torch.dtype:
    """``_precision(device)`` as a dtype."""
    return HIGH_PRECISIONS[_precision(device)]


class Timer:
    """Median seconds of a function on one device: CUDA events on a GPU, the wall clock on a CPU.

    Args:
        device: where the function runs.
        warmup: untimed calls first.
        repeats: timed calls; the median is kept.
    """

    def __init__(self, device: torch.device, *, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def __call__(self, function: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            function()
        seconds = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                function()
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                function()
                seconds.append(time.perf_counter() - begin)
        return statistics.median(seconds)


_RANDOM_POOL: dict[str, torch.Tensor] = {}


def _random_operand(rows: int, columns: int, *, device) -> torch.Tensor:
    """A (rows, columns) view of random numbers drawn once per device and reused (never written to).

    A product's time does not depend on the values; drawing a model's weight matrices anew for
    each shape and pass took most of a CPU recording (tens of millions of normal samples each).
    """
    key, wanted = str(device), rows * columns
    pool = _RANDOM_POOL.get(key)
    if pool is None or pool.numel() < wanted:
        pool = _RANDOM_POOL[key] = torch.randn(wanted, device=device)
    return pool[:wanted].view(rows, columns)


def matmul_function(rows: int, inner: int, columns: int, precision: str, which: str, device) -> Callable:
    """One product at ``precision``: ``bf16``, ``fp32`` (the CPU check's: a CPU without bf16 units
    multiplies bf16 a hundred times slower), or ``fp8-tensorwise``/``fp8-rowwise`` through
    ``torch._scaled_mm``, cast as torchao's recipes cast: e4m3 activations and weights; the
    gradient e5m2 under tensorwise scales and e4m3 under rowwise ones; fast accumulation in the
    forward product only.

    The left operand is row-major and the right column-major: the layout of ``x @ W.t()`` for an
    ``nn.Linear`` weight, and the one the scaled product requires.
    """
    left = _random_operand(rows, inner, device=device)
    right = _random_operand(columns, inner, device=device).t()
    if precision in HIGH_PRECISIONS:
        left, right = left.to(HIGH_PRECISIONS[precision]), right.to(HIGH_PRECISIONS[precision])
        return lambda: torch.mm(left, right)
    gradient = which != "forward" and precision == "fp8-tensorwise"
    left_dtype = torch.float8_e5m2 if gradient else torch.float8_e4m3fn
    left, right = left.to(left_dtype), right.to(torch.float8_e4m3fn)
    if precision == "fp8-tensorwise":
        scale_left = scale_right = torch.tensor(1.0, device=device)
    else:
        scale_left = torch.ones(rows, 1, device=device)
        scale_right = torch.ones(1, columns, device=device)
    fast = which == "forward"
    return lambda: torch._scaled_mm(
        left, right, scale_a=scale_left, scale_b=scale_right, out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def record_matmuls(
    models: list[ModelSpec], *, tokens, tensors, precisions, timer: Timer, device, report
) -> list[dict]:
    """Every block product of every model, split and not, in each precision, each pass."""
    measured: dict[tuple, float] = {}  # one timing per shape and precision: models share shapes
    rows = []
    for spec in models:
        for m in tokens:
            for t in tensors:
                for product in block_products(spec, tokens=m, tensor=t):
                    for which in PASSES:
                        shape = pass_shape(product["m"], product["k"], product["n"], which)
                        for precision in precisions:
                            key = (*shape, precision, which)
                            if key not in measured:
                                measured[key] = _time_product(shape, precision, which, timer, device)
                            seconds = measured[key]
                            if seconds is None:
                                continue  # this GPU or this PyTorch cannot run it: said once
                            flops = 2 * shape[0] * shape[1] * shape[2]
                            rows.append(
                                {
                                    "model": spec.name,
                                    "tokens": m,
                                    "tensor": t,
                                    **product,
                                    "pass": which,
                                    "precision": precision,
                                    "shape": list(shape),
                                    "seconds": seconds,
                                    "tflops": flops / seconds / 1e12,
                                }
                            )
        report(f"matmuls of {spec.name}: {len(measured)} shapes timed so far")
    return rows


def _time_product(shape, precision: str, which: str, timer: Timer, device) -> float | None:
    """The median seconds of one product, or None (and one line) where it cannot run here."""
    try:
        return timer(matmul_function(*shape, precision, which, device))
    except (RuntimeError, NotImplementedError) as error:
        print(f"{precision} {which} {shape}: not run here ({str(error).splitlines()[0]})", file=sys.stderr)
        return None


GROUPED_SHAPES = (
    (8, 4096, 14336, "Mixtral 8x7B's experts"),
    (64, 2048, 1408, "DeepSeek-V2-Lite's 64 experts"),
)
"""(experts on the GPU, d_model, each expert's hidden width, whose): coarse and fine-grained experts."""


def record_grouped(*, tokens: tuple[int, ...], timer: Timer, device, report) -> list[dict]:
    """Experts' up-projections on their rows (top-2, the rows dealt out evenly), two ways: one
    grouped call (``dropless.grouped_mm``: ``torch._grouped_mm`` on a Hopper GPU in bf16, else
    a loop) and one product per expert; the rate of each, in TFLOP/s."""
    on_gpu, rows_of = device.type == "cuda", []
    shapes = GROUPED_SHAPES if on_gpu else ((4, 64, 128, "small, to check the command"),)
    for experts, d_model, hidden, whose in shapes:
        for count in tokens:
            rows = 2 * count
            counts = [rows // experts + (e < rows % experts) for e in range(experts)]
            x = torch.randn(rows, d_model, device=device, dtype=_dtype(device))
            weights = torch.randn(experts, d_model, hidden, device=device, dtype=_dtype(device))
            grouped = timer(lambda x=x, w=weights, c=counts: dropless.grouped_mm(x, w, c))
            loop = timer(
                lambda x=x, w=weights, c=counts: [p @ wi for p, wi in zip(x.split(c), w, strict=True)]
            )
            flops = 2 * rows * d_model * hidden
            rows_of.append({
                "experts": experts, "d_model": d_model, "hidden": hidden, "rows": rows, "whose": whose,
                "one_kernel": dropless.one_kernel(x),
                "grouped_s": grouped, "loop_s": loop,
                "grouped_tflops": flops / grouped / 1e12, "loop_tflops": flops / loop / 1e12,
            })  # fmt: skip
            report(f"grouped {experts} x ({d_model} x {hidden}), {rows} rows: {flops / grouped / 1e12:.1f} "
                   f"TFLOP/s in one call, {flops / loop / 1e12:.1f} one expert at a time")  # fmt: skip
    return rows_of


def record_attention(
    models: list[ModelSpec], *, seq_lens, tensors, timer: Timer, device, report
) -> list[dict]:
    """Causal fused attention (``scaled_dot_product_attention``), forward and forward + backward,
    with the key/value heads repeated to the query heads first (as torchtitan's Llama does)."""
    rows = []
    for spec in models:
        for seq_len in seq_lens:
            for t in tensors:
                heads = spec.heads // t
                dtype = _dtype(device)
                shape = (1, heads, seq_len, spec.head_dim)
                q, k, v = (
                    torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
                )
                grad = torch.randn(shape, device=device, dtype=dtype)

                def forward(q=q, k=k, v=v):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                out = forward()  # backward alone, timed on a graph kept for it
                forward_s = timer(forward)
                backward_s = timer(lambda out=out, grad=grad: out.backward(grad, retain_graph=True))
                flops = 4 * heads * seq_len**2 * spec.head_dim / 2  # causal: half the square
                rows.append(
                    {
                        "model": spec.name,
                        "seq_len": seq_len,
                        "tensor": t,
                        "heads": heads,
                        "head_dim": spec.head_dim,
                        "forward_s": forward_s,
                        "backward_s": backward_s,
                        "forward_tflops": flops / forward_s / 1e12,
                        "backward_tflops": 2 * flops / backward_s / 1e12,
                    }
                )
                del q, k, v, grad, out
        report(f"attention of {spec.name} timed")
    return rows


def record_blocks(
    models: list[ModelSpec], *, tokens: int, compile_too: bool, timer: Timer, device, report
) -> list[dict]:
    """A whole block's forward and backward in bf16, eager and compiled, beside the sum of its
    parts as recorded above: what the planner adds up, held against what the GPU does."""
    rows = []
    for spec in models:
        if spec.experts > 1:
            continue  # routing and uneven experts: not a Llama block
        torch.manual_seed(0)
        dtype = _dtype(device)
        block = LlamaBlock(spec).to(device=device, dtype=dtype)  # the course's own, rotary positions too
        x = torch.randn(1, tokens, spec.d_model, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        variants = {"eager": block}
        if compile_too:
            variants["compiled"] = torch.compile(block)
        for mode, module in variants.items():
            begin = time.perf_counter()
            module(x).backward(grad)  # the first call compiles
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - begin
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = timer(lambda module=module, x=x, grad=grad: module(x).backward(grad))
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            flops = _block_flops(spec, tokens)
            rows.append(
                {"model": spec.name, "tokens": tokens, "precision": _precision(device), "mode": mode,
                 "seconds": seconds, "first_call_s": first_s, "flops": flops,
                 "tflops": flops / seconds / 1e12, "peak_memory_bytes": peak}
            )  # fmt: skip
        del block, variants, x, grad
        report(f"a block of {spec.name} timed")
    return rows


def _block_flops(spec: ModelSpec, tokens: int) -> float:
    """One block's forward and backward FLOPs: 6 per weight of its products per token, and the
    causal attention's 4·s²·d per head forward (half of the square), three times that in all."""
    products = block_products(spec, tokens=1, tensor=1)
    weights = sum(row["k"] * row["n"] for row in products if row["matmul"] != "head")
    return 6 * tokens * weights + 3 * 4 * spec.heads * tokens**2 * spec.head_dim / 2


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's pointwise part."""
    return F.silu(gate) * up


def norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A residual add, then RMSNorm: the pointwise work between two blocks' products."""
    total = x + residual
    return F.rms_norm(total, (total.shape[-1],), weight)


def record_pointwise(
    *, elements: int, width: int, compile_too: bool, timer: Timer, device, report
) -> list[dict]:
    """Memory-bound operations as rates: the bytes they must move over their time, eager (one
    kernel per operation, each reading and writing memory) and compiled (fused by inductor)."""
    dtype = _dtype(device)
    size = dtype.itemsize
    rows_of = elements // width
    a, b = (torch.randn(rows_of, width, device=device, dtype=dtype) for _ in range(2))
    weight = torch.ones(width, device=device, dtype=dtype)
    cases = {
        "copy": (lambda: a.clone(), 2),  # read, write
        "add": (lambda: a + b, 3),
        "silu_mul": (lambda: silu_mul(a, b), 3),
        "norm_add": (lambda: norm_add(a, b, weight), 3),
    }
    rows = []
    for name, (function, accesses) in cases.items():
        seconds = timer(function)
        rows.append(
            {
                "operation": name,
                "mode": "eager",
                "elements": a.numel(),
                "bytes": accesses * a.numel() * size,
                "seconds": seconds,
                "gbps": accesses * a.numel() * size / seconds / 1e9,
            }
        )
    if compile_too:
        for name, plain in (("silu_mul", silu_mul), ("norm_add", norm_add)):
            compiled = torch.compile(plain, dynamic=False)
            args = (a, b) if name == "silu_mul" else (a, b, weight)
            begin = time.perf_counter()
            compiled(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - begin
            seconds = timer(lambda compiled=compiled, args=args: compiled(*args))
            rows.append(
                {
                    "operation": name,
                    "mode": "compiled",
                    "elements": a.numel(),
                    "bytes": 3 * a.numel() * size,
                    "seconds": seconds,
                    "compile_s": compile_s,
                    "gbps": 3 * a.numel() * size / seconds / 1e9,
                }
            )
    rows.append(_cross_entropy(rows_of=min(rows_of, 8192), vocab=width * 32, timer=timer, device=device))
    rows.append(_adamw(elements=elements, timer=timer, device=device))
    report("memory-bound operations timed")
    return rows


def _cross_entropy(*, rows_of: int, vocab: int, timer: Timer, device) -> dict:
    """The loss over bf16 logits, forward and backward: the head's memory-bound work."""
    dtype = _dtype(device)
    logits = torch.randn(rows_of, vocab, device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (rows_of,), device=device)
    seconds = timer(lambda: F.cross_entropy(logits, targets).backward())
    logit_bytes = logits.numel() * dtype.itemsize
    return {
        "operation": "cross_entropy_forward_backward",
        "mode": "eager",
        "elements": logits.numel(),
        "bytes": 2 * logit_bytes,
        "seconds": seconds,
        "gbps": 2 * logit_bytes / seconds / 1e9,
    }


def _adamw(*, elements: int, timer: Timer, device) -> dict:
    """One fused AdamW step over fp32 parameters: 16 bytes read and 12 written a parameter."""
    parameter = torch.nn.Parameter(torch.randn(elements, device=device))
    parameter.grad = torch.randn_like(parameter)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW([parameter], lr=1e-4, fused=fused, foreach=None if fused else False)
    seconds = timer(optimizer.step)
    return {
        "operation": "adamw_step",
        "mode": "fused" if fused else "for-loop",
        "elements": elements,
        "bytes": 28 * elements,
        "seconds": seconds,
        "gbps": 28 * elements / seconds / 1e9,
    }


def describe_device(device: torch.device) -> dict:
    """The GPU's name, its multiprocessors, memory, power limit and the software that ran."""
    info = {"torch": torch.__version__, "device": device.type}
    if device.type != "cuda":
        info.update(name="cpu", threads=torch.get_num_threads())
        return info
    properties = torch.cuda.get_device_properties(device)
    torch.ones(1, device=device) @ torch.ones(1, 1, device=device)  # the context and cuBLAS's workspace
    free, total = torch.cuda.mem_get_info(device)
    info.update(
        name=properties.name,
        multiprocessors=properties.multi_processor_count,
        cuda=torch.version.cuda,
        memory_bytes=total,
        free_after_context_bytes=free,
    )
    try:  # the power limit tells an H100 SXM (700 W) from its 500 W variants
        query = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=power.limit,clocks.max.sm,clocks.max.mem,driver_version",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        power, sm_clock, memory_clock, driver = (
            part.strip() for part in query.stdout.splitlines()[0].split(",")
        )
        info.update(
            power_limit_w=float(power),
            max_sm_mhz=int(sm_clock),
            max_memory_mhz=int(memory_clock),
            driver=driver,
        )
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
        info["nvidia_smi"] = f"not read: {error}"
    return info


def run_gpu_tests(report, *, timeout_s: float) -> dict:
    """The ``gpu``-marked tests in a fresh pytest, their summary kept beside the rates."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-s",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "tests/test_gpu.py",
    ]
    begin = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as stopped:
        printed = (
            (stopped.stdout or b"").decode(errors="replace")
            if isinstance(stopped.stdout, bytes)
            else (stopped.stdout or "")
        )
        report(printed[-4000:])
        return {"returncode": None, "summary": f"stopped after {timeout_s:.0f} s", "seconds": timeout_s}
    lines = done.stdout.strip().splitlines()
    report(done.stdout[-4000:] + done.stderr[-2000:])
    return {
        "returncode": done.returncode,
        "summary": lines[-1] if lines else "",
        "seconds": time.perf_counter() - begin,
        "printed": [line for line in lines if "samples/s" in line or "FAILED" in line],
    }


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.evidence.gpu_record", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", type=checks.folder_to_write, default=RECORDED_GPU, help="folder of the JSON file"
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the command at small sizes"
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=checks.int_at_least(16),
        default=None,
        help=f"rows of every product [GPU: {' '.join(map(str, TOKENS))}; CPU: 64]",
    )
    parser.add_argument("--no-tests", action="store_true", help="record the rates only")
    parser.add_argument(
        "--tests-timeout",
        type=checks.argument_type(checks.check_number, float, above=0, maximum=TESTS_TIMEOUT_MAX_S),
        default=300.0,
        help="seconds the gpu-marked tests may take",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled pointwise operations")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run it on a GPU machine, or pass --device cpu to check the command")
    on_gpu = args.device == "cuda"
    device = torch.device(args.device, 0) if on_gpu else torch.device("cpu")
    models = [MODELS[name] for name in args.models]
    # a CPU run checks the command: one timing a product
    timer = Timer(device, warmup=3 if on_gpu else 1, repeats=10 if on_gpu else 1)
    begin = time.perf_counter()

    def report(line: str) -> None:
        print(f"[{time.perf_counter() - begin:6.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        record = {"device": describe_device(device)}
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / f"{slug(record['device']['name'])}.json"
        tokens = args.tokens or (TOKENS if on_gpu else (64,))
        compile_too = on_gpu and not args.no_compile
        shared = dict(timer=timer, device=device, report=report)
        # on a CPU, what its other parts compute in: the check of the command, not of bf16
        precisions = [_precision(device), "fp8-tensorwise", "fp8-rowwise"] if on_gpu else [_precision(device)]
        tensors = TENSOR_DEGREES if on_gpu else (1,)
        record["matmuls"] = record_matmuls(
            models, tokens=tokens, tensors=tensors, precisions=precisions, **shared
        )
        _write(out, record)  # after each part: a run cut short keeps what it measured
        record["attention"] = record_attention(
            models, seq_lens=tokens, tensors=(1, 8) if on_gpu else (1,), **shared
        )
        _write(out, record)
        record["pointwise"] = record_pointwise(
            elements=2**28 if on_gpu else 2**18,
            width=4096 if on_gpu else 512,
            compile_too=compile_too,
            **shared,
        )
        _write(out, record)
        record["grouped"] = record_grouped(tokens=tokens, **shared)
        _write(out, record)
        record["blocks"] = record_blocks(models, tokens=max(tokens), compile_too=compile_too, **shared)
        record["seconds"] = time.perf_counter() - begin
        _write(out, record)
        if not args.no_tests:
            record["tests"] = run_gpu_tests(report, timeout_s=args.tests_timeout)
            _write(out, record)
    except UserError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(json.dumps(summary(record), indent=1))
    return 0 if record.get("tests", {"returncode": 0})["returncode"] == 0 else 1


def _write(path: Path, record: dict) -> None:
    """Written whole after each part, atomically: a run cut short keeps what it measured."""
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, path)


def summary(record: dict) -> dict:
    """The headline of a record: the best and the median rate of each precision, and the rest."""
    by_precision: dict[str, list[float]] = {}
    for row in record.get("matmuls", []):
        by_precision.setdefault(row["precision"], []).append(row["tflops"])
    return {
        "device": record["device"].get("name"),
        "matmul_tflops": {
            precision: {"max": max(rates), "median": statistics.median(rates), "min": min(rates)}
            for precision, rates in by_precision.items()
        },
        "attention_tflops": {
            "forward_max": max((row["forward_tflops"] for row in record.get("attention", [])), default=None),
            "backward_max": max(
                (row["backward_tflops"] for row in record.get("attention", [])), default=None
            ),
        },
        "pointwise_gbps": {
            f"{row['operation']} ({row['mode']})": row["gbps"] for row in record.get("pointwise", [])
        },
        "blocks": [_block_against_parts(record, row) for row in record.get("blocks", [])],
        "tests": record.get("tests", {}).get("summary"),
    }


def _block_against_parts(record: dict, block: dict) -> dict:
    """A measured block beside the sum of its products and its attention as timed alone: the rest
    is its memory-bound work (norms, SwiGLU's pointwise part, adds, the repeated heads) and launches."""
    products = sum(
        row["seconds"]
        for row in record.get("matmuls", [])
        if (row["model"], row["tokens"], row["tensor"], row["precision"])
        == (block["model"], block["tokens"], 1, block.get("precision", "bf16"))  # older records: bf16
        and row["matmul"] != "head"
    )
    attention = sum(
        row["forward_s"] + row["backward_s"]
        for row in record.get("attention", [])
        if (row["model"], row["seq_len"], row["tensor"]) == (block["model"], block["tokens"], 1)
    )
    return {
        "model": block["model"], "mode": block["mode"], "tokens": block["tokens"],
        "measured_ms": 1e3 * block["seconds"], "products_ms": 1e3 * products, "attention_ms": 1e3 * attention,
        "rest_ms": 1e3 * (block["seconds"] - products - attention), "tflops": block["tflops"],
        "first_call_s": block["first_call_s"],
    }  # fmt: skip


if __name__ == "__main__":
    checks.exit_with(main)
