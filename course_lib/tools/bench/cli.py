"""The command: ``python -m course_lib.tools.bench NAME [options]`` runs one benchmark, prints JSON.

It checks the sizes before anything starts (refusing those that cannot fit in this machine's
memory), starts the local processes, and gathers rank 0's result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from ... import checks, data
from ...distributed import environment, hierarchical, runtime
from ...distributed.launch import launch, max_processes
from ...errors import EXIT_USER_ERROR, UserError
from ...parallel import compiled, dropless
from ..plots import image_to_write, plot_allreduce, plot_load_balancing
from . import sequence
from .allreduce import (
    ALLREDUCE_MAX_MB,
    ALLREDUCE_MIN_BYTES,
    allreduce_benchmark,
    allreduce_sizes,
    network_verdict,
)
from .balance import balance_benchmark
from .checkpointing import checkpoint_benchmark
from .common import MLP_BATCH, MLP_LAYERS, MLP_WIDTH, TIMED_STEPS, WARMUP_STEPS
from .compiled import compile_benchmark
from .ddp import DDP_BUCKET_MB, ddp_benchmark
from .float8 import LAST_STEPS, float8_training_benchmark
from .fsdp import fsdp_benchmark
from .hierarchy import hierarchy_benchmark
from .memory_states import memory_benchmark
from .pipeline import (
    PIPELINE_BUBBLE_BATCH,
    PIPELINE_BUBBLE_BLOCKS_PER_STAGE,
    PIPELINE_BUBBLE_HIDDEN,
    PIPELINE_BUBBLE_WIDTH,
    PIPELINE_MICROBATCHES,
    pipeline_benchmark,
    pipeline_bubble_benchmark,
    stage_counts_with_a_core_each,
    zero_bubble_benchmark,
)
from .recompute import recompute_benchmark
from .tensor import TP_HEADS_PER_RANK, tp_benchmark

MAX_LINK_GBPS = 10_000
"""No link a GPU has carries 10 TB/s (NVLink 5: 1.8 TB/s a GPU, NVIDIA's Blackwell datasheet): an
expected bus bandwidth above it is a unit mistake (bytes for gigabytes)."""


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.bench", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="benchmark", required=True)
    _add_options(**_add_benchmarks(sub))
    args = parser.parse_args(argv)
    parser = sub.choices[args.benchmark]  # later mistakes are reported as this subcommand's
    _check_sizes(parser, args)
    needed, processes = memory_needed(args)
    available = available_memory_bytes()
    if available is not None and needed * processes > available:
        parser.error(
            f"these sizes need about {needed / 1e9:.1f} GB on each of {processes} process(es), "
            f"{needed * processes / 1e9:.1f} GB in all, and this machine has {available / 1e9:.1f} GB "
            "available: choose smaller sizes"
        )
    try:
        return _run_benchmark(args)
    except UserError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


BENCHMARKS = (  # (the subcommand, the name its options are added under, its --help line)
    ("ddp", "ddp", "course DDP (3 modes) against torch DDP"),
    ("fsdp", "fsdp", "course FSDP (4 sharding strategies) against FSDP2"),
    ("memory", "mem", "measured memory and traffic of DDP, ZeRO-1/2/3 against the model"),
    ("pipeline", "pipe", "course pipeline schedules against torch.distributed.pipelining"),
    ("tp", "tensor", "course tensor parallelism against DTensor parallelize_module"),
    ("sp", "sequence", "course sequence parallelism against DTensor's SequenceParallel"),
    ("cp", "context", "ring attention: contiguous against zig-zag, bytes and memory"),
    ("attention", "attention",
     "ring, zig-zag ring, Ulysses and the USP hybrid side by side: time, bytes, memory"),
    ("ep", "experts", "a mixture-of-experts layer spread over the ranks (all-to-all)"),
    ("balance", "balancing",
     "a dropless mixture of experts' load, trained unbalanced, with Switch's loss and with DeepSeek-V3's "
     "bias; what capacity would drop; grouped experts against a loop"),
    ("recompute", "recomputation",
     "memory saved and time paid by each recomputation policy (none, full, selective)"),
    ("compile", "compiling",
     "compiled blocks against eager: compile time, step time, graph breaks, under each parallelism"),
    ("float8", "low_precision",
     "a transformer trained in bf16 from two seeds and with each float8 recipe: losses and noise"),
    ("checkpoint", "saving",
     "what a checkpoint costs the training: a blocking save against an asynchronous one"),
    ("hierarchy", "nodes",
     "a flat ring, the hierarchy and the tree all-reduce, timed, with bytes per link class"),
    ("allreduce", "reduce",
     "all-reduce time, algorithm and bus bandwidth per message size, and the alpha-beta fit"),
)  # fmt: skip


def _add_benchmarks(sub) -> dict[str, argparse.ArgumentParser]:
    """One subcommand per benchmark, by the name its options are added under."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    return {key: sub.add_parser(name, help=line, formatter_class=formatter) for name, key, line in BENCHMARKS}


STEP_BENCHMARKS = (
    "ddp", "fsdp", "mem", "pipe", "tensor", "sequence", "context", "attention", "experts", "recomputation",
)  # fmt: skip
"""The benchmarks of a training step: each records its variants' anatomies (``--profile``)."""


def _add_options(*, ddp, fsdp, mem, pipe, tensor, sequence, context, attention, experts, balancing,
                 recomputation, compiling, low_precision, saving, nodes, reduce) -> None:  # fmt: skip
    """Each benchmark's sizes and counts, with their defaults."""
    given = locals()
    for name in STEP_BENCHMARKS:
        given[name].add_argument(
            "--profile",
            type=checks.folder_to_write,
            default=None,
            help="write each variant's per-rank traces and the result (anatomy.json) into this folder",
        )
    _add_allreduce_options(reduce)
    _add_data_parallel_options(ddp=ddp, fsdp=fsdp, mem=mem)
    _add_model_parallel_options(pipe, tensor, sequence, context, attention, experts, recomputation)
    _add_compile_options(compiling)
    _add_float8_options(low_precision)
    _add_balance_options(balancing)
    _add_checkpoint_options(saving)
    _add_hierarchy_options(nodes)


def _add_launched_world_size(command, *, default: int) -> None:
    """``--world-size`` of a benchmark that also runs on a launcher's ranks (srun, torchrun)."""
    command.add_argument(
        "--world-size",
        type=checks.int_at_least(2, max_processes()),
        default=default,
        help="local processes (under srun or torchrun, the launcher's processes are the ranks)",
    )


def _add_hierarchy_options(nodes) -> None:
    """The nodes' size, the message, the repeats (and the ranks, when no launcher started them)."""
    positive = checks.int_at_least(1)
    _add_launched_world_size(nodes, default=4)
    nodes.add_argument("--gpus-per-node", type=positive, default=2, help="consecutive ranks a node holds")
    nodes.add_argument("--mb", type=checks.number_above(0), default=4.0, help="the message, in MB")
    nodes.add_argument("--repeats", type=positive, default=3, help="timed runs of each algorithm")


def _add_checkpoint_options(saving) -> None:
    """The model saved, its ranks, and how many saves of each kind."""
    positive = checks.int_at_least(1)
    saving.add_argument("--world-size", type=checks.int_at_least(1, max_processes()), default=2)
    saving.add_argument("--width", type=positive, default=1024)
    saving.add_argument("--layers", type=positive, default=8)
    saving.add_argument("--batch", type=positive, default=64, help="samples per rank per step")
    saving.add_argument("--steps", type=positive, default=10, help="timed steps without a save")
    saving.add_argument("--saves", type=positive, default=3, help="saves of each kind")


def _add_balance_options(balancing) -> None:
    """The three runs' length and model, the balancing's strengths, the timed rounds (one process)."""
    positive, rate = (
        checks.int_at_least(1),
        checks.argument_type(checks.check_number, float, above=0, maximum=1.0),
    )
    balancing.add_argument("--steps", type=positive, default=60, help="optimizer steps of each run")
    balancing.add_argument(
        "--experts", type=checks.int_at_least(2), default=8, help="routed experts per layer"
    )
    balancing.add_argument("--top-k", type=positive, default=2, help="experts per token (at most --experts)")
    balancing.add_argument("--bias-rate", type=rate, default=0.02, help="the bias's step per optimizer step")
    balancing.add_argument("--aux-weight", type=rate, default=0.01, help="the auxiliary loss's weight")
    balancing.add_argument("--d-model", type=positive, default=32)
    balancing.add_argument("--seq", type=positive, default=16)
    balancing.add_argument("--batch", type=positive, default=16)
    balancing.add_argument("--timed-steps", type=positive, default=20, help="timed rounds of the experts")
    balancing.add_argument("--warmup", type=checks.int_at_least(0), default=3)
    balancing.add_argument(
        "--plot", type=image_to_write, default=None, help="draw the loads and the drops into this PNG"
    )


def _add_float8_options(low_precision) -> None:
    """The four runs' length, model and batch (one process, one thread)."""
    positive = checks.int_at_least(1)
    low_precision.add_argument(
        "--steps",
        type=checks.int_at_least(LAST_STEPS),
        default=60,
        help=f"optimizer steps per run (the final loss is the mean of the last {LAST_STEPS})",
    )
    low_precision.add_argument(
        "--d-model", type=positive, default=64, help="a multiple of 16 (float8's tile)"
    )
    low_precision.add_argument("--seq", type=positive, default=32)
    low_precision.add_argument("--batch", type=positive, default=16)
    low_precision.add_argument(
        "--lr",
        type=checks.argument_type(checks.check_number, float, above=0, maximum=1.0),
        default=3e-3,
        help="AdamW's learning rate (at most 1)",
    )
    low_precision.add_argument(
        "--output", type=checks.json_to_write, default=None, help="also write the JSON here"
    )


def _add_compile_options(compiling) -> None:
    """The stack of blocks compiled, its ranks, and the compiler's backend."""
    positive = checks.int_at_least(1)
    compiling.add_argument(
        "--world-size", type=checks.int_at_least(2, max_processes()), default=2, help="the parallel degree"
    )
    compiling.add_argument("--d-model", type=positive, default=256)
    compiling.add_argument("--heads", type=positive, default=4, help="a multiple of --world-size")
    compiling.add_argument("--seq", type=positive, default=128)
    compiling.add_argument("--batch", type=positive, default=8, help="sequences per step, on every rank")
    compiling.add_argument("--layers", type=positive, default=2, help="blocks, each compiled on its own")
    compiling.add_argument("--steps", type=positive, default=10, help="timed steps per variant")
    compiling.add_argument("--warmup", type=checks.int_at_least(0), default=2)
    compiling.add_argument(
        "--output", type=checks.json_to_write, default=None, help="also write the JSON here"
    )
    compiling.add_argument(
        "--compiler",
        choices=compiled.BACKENDS,
        default="inductor",
        help="torch.compile's backend. inductor: fused generated code (on a CPU, it needs a C++ "
        "compiler); aot_eager: traced, PyTorch's own operators",
    )


def _add_allreduce_options(reduce) -> None:
    """The network's sweep: message sizes, repetitions, where to write, what speed to expect."""
    positive = checks.int_at_least(1)
    _add_launched_world_size(reduce, default=2)
    reduce.add_argument(
        "--min-bytes", type=positive, default=ALLREDUCE_MIN_BYTES, help="the smallest message"
    )
    reduce.add_argument(
        "--max-mb",
        type=checks.number_above(0),
        default=None,
        help=f"the largest message in MB [GPUs: {ALLREDUCE_MAX_MB['cuda']}, CPUs: {ALLREDUCE_MAX_MB['cpu']}]",
    )
    reduce.add_argument("--iterations", type=positive, default=20, help="timed all-reduces per size")
    reduce.add_argument(
        "--warmup", type=checks.int_at_least(0), default=3, help="untimed all-reduces per size"
    )
    reduce.add_argument("--output", type=checks.json_to_write, default=None, help="also write the JSON here")
    reduce.add_argument("--plot", type=image_to_write, default=None, help="draw the sweep as a PNG here")
    reduce.add_argument(
        "--expect-gbps",
        type=checks.argument_type(checks.check_number, float, above=0, maximum=MAX_LINK_GBPS),
        default=None,
        help="the link's speed in GB/s: print a verdict, exit 1 when the bus bandwidth is far below it",
    )


def _add_data_parallel_options(*, ddp, fsdp, mem) -> None:
    """The MLP the data-parallel benchmarks train, and their ranks."""
    positive, processes = checks.int_at_least(1), checks.int_at_least(1, max_processes())
    for command in (ddp, fsdp, mem):
        command.add_argument("--width", type=positive, default=MLP_WIDTH)
        command.add_argument("--layers", type=positive, default=MLP_LAYERS)
        command.add_argument("--batch", type=positive, default=MLP_BATCH, help="samples per rank per step")
    for command in (ddp, fsdp):
        command.add_argument("--world-size", type=processes, default=2)
        command.add_argument("--steps", type=positive, default=TIMED_STEPS, help="timed steps per variant")
        command.add_argument("--warmup", type=checks.int_at_least(0), default=WARMUP_STEPS)
    ddp.add_argument(
        "--bucket-mb",
        type=checks.number_above(0),
        default=DDP_BUCKET_MB,
        help="bucket size, the same for both implementations",
    )
    mem.add_argument("--world-sizes", type=processes, nargs="+", default=[2, 4])


def _add_model_parallel_options(pipe, tensor, sequence, context, attention, experts, recomputation) -> None:
    """The shapes the model-parallel benchmarks cut, and their ranks."""
    positive, processes = checks.int_at_least(1), checks.int_at_least(1, max_processes())
    for command in (pipe, tensor):
        command.add_argument("--d-model", type=positive, default=128)
        command.add_argument("--seq", type=positive, default=64)
        command.add_argument(
            "--batch", type=positive, default=16, help="samples per step (the whole pipeline's batch)"
        )
        command.add_argument("--steps", type=positive, default=10, help="timed steps per variant")
        command.add_argument("--warmup", type=checks.int_at_least(0), default=2)
    pipe.add_argument(
        "--bubble-hidden",
        type=positive,
        default=PIPELINE_BUBBLE_HIDDEN,
        help="hidden features of the compute-bound rows' MLP blocks (their compute per micro-batch)",
    )
    pipe.add_argument(
        "--stages",
        type=checks.int_at_least(2, max_processes()),
        nargs="+",
        default=[2, 4],
        help="pipeline sizes (one run each)",
    )
    tensor.add_argument("--world-size", type=processes, default=2, help="the tensor-parallel degree")
    sequence.add_argument("--world-size", type=processes, default=2, help="the tensor/sequence degree")
    sequence.add_argument("--d-model", type=positive, default=128)
    sequence.add_argument("--heads", type=positive, default=8)
    sequence.add_argument("--seq", type=positive, default=256)
    sequence.add_argument("--batch", type=positive, default=8)
    context.add_argument("--world-size", type=processes, default=4, help="the context-parallel degree")
    context.add_argument("--seq", type=positive, default=2048, help="tokens of the whole sequence")
    context.add_argument("--heads", type=positive, default=4)
    context.add_argument("--head-dim", type=positive, default=32)
    context.add_argument("--batch", type=positive, default=1)
    attention.add_argument("--world-size", type=processes, default=4, help="the ranks sharing the sequence")
    attention.add_argument("--seq", type=positive, default=2048, help="tokens of the whole sequence")
    attention.add_argument("--heads", type=positive, default=8, help="a multiple of --world-size")
    attention.add_argument("--head-dim", type=positive, default=32)
    attention.add_argument("--batch", type=positive, default=1)
    attention.add_argument(
        "--ulysses-degree", type=positive, default=2, help="U of the hybrid (Ulysses inside, ring across)"
    )
    experts.add_argument("--world-size", type=processes, default=2, help="the expert-parallel degree")
    experts.add_argument("--d-model", type=positive, default=128)
    experts.add_argument("--hidden", type=positive, default=256, help="each expert's hidden width")
    experts.add_argument("--experts", type=positive, default=8)
    experts.add_argument("--tokens", type=positive, default=2048, help="tokens per rank per step")
    experts.add_argument("--top-k", type=positive, default=2)
    experts.add_argument("--capacity-factor", type=checks.number_above(0), default=1.25)
    recomputation.add_argument("--world-size", type=processes, default=2, help="data-parallel ranks")
    recomputation.add_argument("--d-model", type=positive, default=256)
    recomputation.add_argument("--layers", type=positive, default=4)
    recomputation.add_argument("--seq", type=positive, default=128)
    recomputation.add_argument("--batch", type=positive, default=4, help="sequences per rank per step")
    for command in (sequence, context, attention, experts, recomputation):
        command.add_argument("--steps", type=positive, default=10, help="timed steps per variant")
        command.add_argument("--warmup", type=checks.int_at_least(0), default=2)


TRAINED_ON_TEXT = ("recompute", "float8", "pipeline", "balance")
"""The benchmarks whose transformer trains on the course's text (``data.zen_windows``)."""


def _check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, as argparse would, sizes that the benchmark cannot cut as asked."""
    if args.benchmark in TRAINED_ON_TEXT:
        try:
            data.check_window(args.seq)
        except UserError as error:
            parser.error(f"argument --seq: {error}")
    if args.benchmark == "pipeline" and args.batch % PIPELINE_MICROBATCHES[-1]:
        parser.error(
            f"argument --batch: must be a multiple of {PIPELINE_MICROBATCHES[-1]} (it is cut into "
            f"{' and '.join(map(str, PIPELINE_MICROBATCHES))} micro-batches), got {args.batch}"
        )
    if args.benchmark == "tp" and args.d_model % (heads := TP_HEADS_PER_RANK * args.world_size):
        parser.error(
            f"argument --d-model: must be a multiple of {heads} (the attention's {TP_HEADS_PER_RANK} heads "
            f"per rank x --world-size {args.world_size}), got {args.d_model}"
        )
    if args.benchmark == "sp":
        for flag, value in (("--seq", args.seq), ("--heads", args.heads), ("--d-model", args.d_model)):
            if value % args.world_size:
                parser.error(
                    f"argument {flag}: must be a multiple of --world-size {args.world_size}, got {value}"
                )
        if args.d_model % args.heads:
            parser.error(
                f"argument --d-model: must be a multiple of --heads {args.heads}, got {args.d_model}"
            )
    if args.benchmark == "cp" and args.seq < 2 * args.world_size:
        parser.error(
            f"argument --seq: must be at least 2 x --world-size ({2 * args.world_size}), got {args.seq}"
        )
    if args.benchmark == "attention":
        if args.heads % args.world_size:
            parser.error(
                f"argument --heads: must be a multiple of --world-size {args.world_size} (Ulysses gives "
                f"every rank whole heads), got {args.heads}"
            )
        if args.world_size % args.ulysses_degree:
            parser.error(
                f"argument --ulysses-degree: must divide --world-size {args.world_size}, "
                f"got {args.ulysses_degree}"
            )
        if args.seq < 2 * args.world_size:
            parser.error(
                f"argument --seq: must be at least 2 x --world-size ({2 * args.world_size}), got {args.seq}"
            )
    if args.benchmark == "balance":
        try:  # the layer's own refusals, as argparse's
            dropless.check_dropless(args.experts, top_k=args.top_k, shared_experts=0,
                                    bias_update_rate=args.bias_rate, nodes=1, node_limit=None)  # fmt: skip
        except UserError as error:
            parser.error(f"argument --top-k: {error}")
        if args.d_model % 4:
            parser.error(f"argument --d-model: must be a multiple of the 4 heads, got {args.d_model}")
    if args.benchmark == "ep" and (args.experts % args.world_size or args.top_k > args.experts):
        parser.error(
            f"argument --experts: must be a multiple of --world-size {args.world_size} and at least --top-k "
            f"{args.top_k}, got {args.experts}"
        )
    if args.benchmark == "compile":
        if args.heads % args.world_size:
            parser.error(
                f"argument --heads: must be a multiple of --world-size {args.world_size}, got {args.heads}"
            )
        if args.d_model % args.heads:
            parser.error(
                f"argument --d-model: must be a multiple of --heads {args.heads}, got {args.d_model}"
            )
    if args.benchmark == "float8" and args.d_model % 16:
        parser.error(
            f"argument --d-model: must be a multiple of 16 (the scaled matmul's tile, so that every "
            f"block's layers convert to float8), got {args.d_model}"
        )
    if args.benchmark == "recompute" and args.d_model % 4:
        parser.error(f"argument --d-model: must be a multiple of the 4 heads, got {args.d_model}")
    if args.benchmark == "allreduce":
        largest_mb = args.max_mb if args.max_mb is not None else ALLREDUCE_MAX_MB["cpu"]
        if args.min_bytes >= largest_mb * 2**19:
            parser.error(
                f"argument --min-bytes: must be below half of the largest message ({largest_mb:g} MB; "
                f"--max-mb sets it), so that the sweep has two sizes to fit a model to, got {args.min_bytes}"
            )


PROCESS_BASE_BYTES = 400e6
"""What one process holds before it computes anything: Python, torch and its libraries."""


def available_memory_bytes() -> float | None:
    """Memory this machine can still give (Linux's MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_needed(args: argparse.Namespace) -> tuple[float, int]:
    """(bytes one process of this benchmark may hold at most, processes on this machine): a generous
    estimate from its sizes alone, so that sizes that cannot fit are refused before anything starts."""
    word = 4  # fp32
    if args.benchmark == "allreduce":
        largest = args.max_mb * 2**20 if args.max_mb is not None else ALLREDUCE_MAX_MB["cpu"] * 2**20
        return PROCESS_BASE_BYTES + 4 * largest, args.world_size  # the message, gloo's copies, the check
    if args.benchmark in ("ddp", "fsdp", "memory"):
        params = args.layers * args.width * (args.width + 1)
        # up to 5 models alive (course and torch variants), each with weights, gradients, Adam's two
        # moments and a gradient bucket, plus the activations of a batch through every layer
        per_process = 5 * 5 * word * params + 3 * word * args.batch * args.width * args.layers
        processes = max(args.world_sizes) if args.benchmark == "memory" else args.world_size
        return PROCESS_BASE_BYTES + per_process, processes
    if args.benchmark in ("pipeline", "tp"):
        tokens = args.batch * args.seq
        attention = args.batch * TP_HEADS_PER_RANK * 4 * args.seq**2  # scores of up to 4 x 4 heads
        per_process = (
            3 * word * (40 * tokens * args.d_model + attention) + 5 * 16 * word * args.d_model**2 * 8
        )
        processes = max(args.stages) if args.benchmark == "pipeline" else args.world_size
        return PROCESS_BASE_BYTES + per_process, processes
    if args.benchmark == "hierarchy":  # the message, its padded copy, the pieces and gloo's buffers
        return PROCESS_BASE_BYTES + 8 * args.mb * 1e6, args.world_size
    if args.benchmark == "checkpoint":  # weights, grads, AdamW's moments, a staged copy, the activations
        params = args.layers * args.width * (args.width + 1)
        return (
            PROCESS_BASE_BYTES + 5 * 4 * params + 3 * word * args.batch * args.width * args.layers,
            args.world_size,
        )
    if args.benchmark == "balance":  # one small transformer of experts at a time, as float8's
        params = 2 * (4 + 2 * args.experts) * args.d_model**2 + 200 * args.d_model
        activations = word * 20 * args.top_k * args.batch * args.seq * args.d_model
        return PROCESS_BASE_BYTES + 4 * word * params + activations, 1
    if args.benchmark == "float8":  # one small transformer at a time, with AdamW and its activations
        params = 2 * 12 * args.d_model**2 + 200 * args.d_model
        activations = (
            2 * word * 20 * args.batch * args.seq * args.d_model + word * args.batch * 4 * args.seq**2
        )
        return PROCESS_BASE_BYTES + 4 * word * params + activations, 1
    if args.benchmark == "compile":  # two copies of the stack per variant, a step's activations each
        params = args.layers * 12 * args.d_model**2
        activations = 2 * word * args.layers * 20 * args.batch * args.seq * args.d_model
        scores = 2 * word * args.batch * args.heads * args.seq**2 * args.layers
        return PROCESS_BASE_BYTES + 2 * 4 * word * params + activations + scores, args.world_size
    if args.benchmark == "recompute":  # three models, and every activation of a step kept
        params = args.layers * 12 * args.d_model**2 + 200 * args.d_model
        activations = 3 * word * args.layers * 20 * args.batch * args.seq * args.d_model
        return PROCESS_BASE_BYTES + 3 * 4 * word * params + activations, args.world_size
    if args.benchmark in ("sp", "cp", "attention"):
        heads = args.heads
        width = args.d_model if args.benchmark == "sp" else args.heads * args.head_dim
        tokens = args.batch * args.seq
        # the one-process reference holds the whole sequence's attention scores
        per_process = 3 * word * (40 * tokens * width + args.batch * heads * args.seq**2)
        return PROCESS_BASE_BYTES + per_process, args.world_size
    # ep: every expert of the one-process reference, and the routed tokens of every rank
    params = args.experts * 2 * args.d_model * args.hidden
    tokens = args.tokens * args.world_size * args.top_k
    per_process = 5 * word * params + 3 * word * tokens * (args.d_model + args.hidden) * 2
    return PROCESS_BASE_BYTES + per_process, args.world_size


def _run_benchmark(args: argparse.Namespace) -> int:
    def given(*flags: str) -> dict:
        """The values of these flags, by the benchmark function's argument names."""
        return {flag: getattr(args, flag) for flag in flags}

    profile = str(args.profile) if getattr(args, "profile", None) else None

    def on(world: int, benchmark: Callable, options: dict):
        return _on_local_processes(args.benchmark, world, benchmark, options | {"profile": profile})

    mlp, transformer, timing = ("width", "layers", "batch"), ("d_model", "seq", "batch"), ("steps", "warmup")
    if args.benchmark == "allreduce":
        return _run_allreduce(args)
    if args.benchmark == "pipeline":
        options = given(*transformer, *timing)
        rows = [row for stages in args.stages for row in on(stages, pipeline_benchmark, options)]
        cores = environment.usable_cpus()
        fits = stage_counts_with_a_core_each(args.stages, cores=cores)
        bubble_options = dict(
            width=PIPELINE_BUBBLE_WIDTH,
            hidden=args.bubble_hidden,
            blocks_per_stage=PIPELINE_BUBBLE_BLOCKS_PER_STAGE,
            batch=PIPELINE_BUBBLE_BATCH,
            **given(*timing),
        )
        compute_bound = [
            row
            for stages in fits
            for row in _on_local_processes("pipeline", stages, pipeline_bubble_benchmark, bubble_options)
        ]
        zero_bubble = [
            row
            for stages in fits
            for row in _on_local_processes("pipeline", stages, zero_bubble_benchmark, bubble_options)
        ]
        result = {
            "benchmark": "pipeline",
            "threads_per_rank": "cores / ranks",
            "rows": rows,
            "compute_bound_rows": compute_bound,
            "compute_bound_max_bubble_error": max(
                (abs(row["bubble_error"]) for row in compute_bound), default=None
            ),
            "zero_bubble_rows": zero_bubble,
            # the schedules as built, without recomputation (with it, B and W each recompute: see the rows)
            "zero_bubble_max_bubble_error": max(
                (abs(row["bubble_error"]) for row in zero_bubble if row["recomputation"] == "none"),
                default=None,
            ),
            "compute_bound_not_run": [
                f"{stages} stages: more processes than the {cores} cores"
                for stages in args.stages
                if stages not in fits
            ],
        }
    elif args.benchmark == "tp":
        result = on(args.world_size, tp_benchmark, given(*transformer, *timing))
    elif args.benchmark in ("sp", "cp", "attention", "ep"):
        benchmark, flags = {
            "sp": (sequence.sp_benchmark, ("d_model", "heads", "seq", "batch")),
            "cp": (sequence.cp_benchmark, ("seq", "heads", "head_dim", "batch")),
            "attention": (
                sequence.attention_benchmark,
                ("seq", "heads", "head_dim", "batch", "ulysses_degree"),
            ),
            "ep": (
                sequence.ep_benchmark,
                ("d_model", "hidden", "experts", "tokens", "top_k", "capacity_factor"),
            ),
        }[args.benchmark]
        result = on(args.world_size, benchmark, given(*flags, *timing))
    elif args.benchmark == "compile":
        compiled.check_compiler(args.compiler)  # refused here, before any process starts
        options = given("d_model", "heads", "seq", "batch", "layers", *timing, "compiler")
        result = _on_local_processes("compile", args.world_size, compile_benchmark, options)
    elif args.benchmark == "hierarchy":
        return _run_hierarchy(args)
    elif args.benchmark == "checkpoint":
        options = given("width", "layers", "batch", "steps", "saves")
        result = _on_local_processes("checkpoint", args.world_size, checkpoint_benchmark, options)
    elif args.benchmark == "balance":
        options = given("steps", "experts", "top_k", "bias_rate", "aux_weight", "d_model", "seq", "batch")
        options |= {"timed_steps": args.timed_steps, "warmup": args.warmup}
        result = _on_local_processes("balance", 1, balance_benchmark, options)
        if args.plot is not None:
            plot_load_balancing(result, path=args.plot)
    elif args.benchmark == "float8":
        options = given("steps", "d_model", "seq", "batch", "lr")
        result = _on_local_processes("float8", 1, float8_training_benchmark, options)
    elif args.benchmark == "recompute":
        result = on(args.world_size, recompute_benchmark, given("d_model", "layers", "seq", "batch", *timing))
    elif args.benchmark == "memory":
        rows = [row for world in args.world_sizes for row in on(world, memory_benchmark, given(*mlp))]
        result = {
            "benchmark": "memory",
            "optimizer": "Adam, fp32 (K = 8 bytes of state per parameter)",
            "max_ratio_error": max(abs(row["ratio"] - 1) for row in rows),
            "max_traffic_ratio_error": max(abs(row["traffic_ratio"] - 1) for row in rows),
            "rows": rows,
        }
    elif args.benchmark == "ddp":
        result = on(args.world_size, ddp_benchmark, given(*mlp, *timing, "bucket_mb"))
    else:
        result = on(args.world_size, fsdp_benchmark, given(*mlp, *timing))
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "output", None) is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        (args.profile / "anatomy.json").write_text(text + "\n")
        print(f"each variant's per-rank traces and anatomy.json are in {args.profile}", file=sys.stderr)
    return 0


def _on_local_processes(name: str, world: int, benchmark: Callable, options: dict):
    """Rank 0's result of ``benchmark`` run on ``world`` local processes."""
    print(f"benchmarking {name} on {world} processes...", file=sys.stderr, flush=True)
    return launch(benchmark, world, timeout_s=1800, check_collectives=False, **options)[0]


def _run_hierarchy(args: argparse.Namespace) -> int:
    """The three all-reduces on this launcher's ranks (srun, torchrun), or on local processes."""
    options = dict(gpus_per_node=args.gpus_per_node, message_bytes=int(args.mb * 1e6), repeats=args.repeats)
    launched = environment.resolve_environment().world_size
    hierarchical.check_node_size(launched if launched > 1 else args.world_size, args.gpus_per_node)
    result = _on_launched_or_local_ranks("hierarchy", args.world_size, hierarchy_benchmark, options)
    if result is not None:  # rank 0 speaks
        print(json.dumps(result, indent=2))
    return 0


def _on_launched_or_local_ranks(
    name: str, world: int, benchmark: Callable, options: dict, *, initialised: bool = False
):
    """Rank 0's result of ``benchmark`` on the ranks a launcher started (srun, torchrun: None on the
    other ranks), or, started alone, on ``world`` local processes."""
    if environment.resolve_environment().world_size > 1:
        if not initialised:
            runtime.init()
        result = benchmark(**options)
        runtime.shutdown()
        return result
    return _on_local_processes(name, world, benchmark, options)


def _run_allreduce(args: argparse.Namespace) -> int:
    """The sweep on this launcher's ranks (srun, torchrun), or on ``--world-size`` local processes."""
    launched = environment.resolve_environment().world_size > 1
    if launched:
        context = runtime.init()
        device = context.device.type
    else:
        device = "cpu"  # local processes share one machine: gloo on its CPU
    max_mb = args.max_mb if args.max_mb is not None else ALLREDUCE_MAX_MB[device]
    options = dict(
        sizes=allreduce_sizes(min_bytes=args.min_bytes, max_bytes=int(max_mb * 2**20)),
        iterations=args.iterations,
        warmup=args.warmup,
    )
    result = _on_launched_or_local_ranks(
        "allreduce", args.world_size, allreduce_benchmark, options, initialised=launched
    )
    if result is None:  # not rank 0 of a launched sweep
        return 0
    healthy = True
    if args.expect_gbps is not None:
        healthy, line = network_verdict(
            busbw_gbps=result["largest_message_busbw_gbps"], expected_gbps=args.expect_gbps
        )
        result["verdict"] = line
        print(line, file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if args.plot is not None:
        plot_allreduce(result, path=args.plot, expected_gbps=args.expect_gbps)
    if not result["all_correct"]:
        wrong = {row["bytes"]: row["wrong"] for row in result["rows"] if row["wrong"]}
        print(
            f"error: all-reduces gave wrong sums ({sum(wrong.values())} wrong elements, at sizes "
            f"{sorted(wrong)} bytes): the transport corrupts data; on Alps, check NCCL_PROTO=^LL128 and "
            "try COURSE_NCCL_NO_EAGER=1",
            file=sys.stderr,
        )
        return 1
    return 0 if healthy else 1
