"""Benchmarks: ``python -m course_lib.tools.bench NAME`` prints JSON (see ``--help`` for the names).

How to compare two implementations honestly on a noisy machine: run them in the *same*
processes, on the same model and data, interleaved step by step (their order rotating every
round), and compare medians. Background load then slows both alike, and the ratio is stable
even when the absolute times are not. Unit tests never time anything; this command does.

``ddp``: PyTorch's ``DistributedDataParallel`` against the course's ``DataParallel`` in its
three modes, on an MLP of a few million parameters so that the gradient all-reduce is a real
share of the step. Besides times, it reports the bytes each rank sent per step, measured by
``CommLog``, against the ring formula 2(N-1)/N x gradient bytes.

``fsdp``: PyTorch's FSDP2 ``fully_shard`` against the course's ``FullyShardedDataParallel``
(FULL_SHARD), with the same units (each linear layer), and the course's other sharding
strategies beside them, interleaved the same way.

``memory``: DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) at 2 and 4 ranks, with Adam in fp32: the
bytes of parameters, gradients and optimizer state a rank really holds after two steps, against
``memory.model_state_bytes``; and the bytes it sent during the second step, measured by
``CommLog``, against ``memory.traffic_elements_per_rank``.

``pipeline``: for each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages) at 2 and
4 stages and 4 and 8 micro-batches, the course executor's step time, measured bubble and peak
activations against theory, and ``torch.distributed.pipelining`` on the same split (ratio). Then
the compute-bound rows (GPipe and 1F1B, equal stages of wide MLP blocks whose compute per
micro-batch dwarfs its message): there the measured bubble meets (p - 1) / (m + p - 1); they run
only where each stage has a core of its own.

``sp``, ``cp``, ``ep``: sequence, context and expert parallelism (``bench.sequence``).

``tp``: the course's tensor-parallel MLP and attention against DTensor's ``parallelize_module``
(ColwiseParallel / RowwiseParallel), and the bytes moved per forward+backward against theory:
two all-reduces of the activation per sub-layer.

``allreduce``: the network itself, as ``nccl-tests``' ``all_reduce_perf`` measures it. For each
message size from a few bytes to hundreds of MB (16 MB on CPUs), the time of one all-reduce
(the slowest rank's median over 3 blocks of ``--iterations``), its algorithm bandwidth S/T and its bus
bandwidth S/T x 2(N-1)/N (``comm.bus_bandwidth``), and the alpha-beta model fitted to all of
them (``scaling.fit_ring_all_reduce``): alpha, the latency of one message, and beta, the
bandwidth a link sustains, which the bus bandwidth approaches for large messages. Locally it
starts ``--world-size`` processes on gloo; under ``srun`` or ``torchrun`` every started process
is a rank (NCCL on GPUs), so ``slurm/network_check.sbatch`` measures a cluster's network with
it and ``--expect-gbps`` turns the result into a verdict.

One module per benchmark (``ddp``, ``fsdp``, ``memory_states``, ``pipeline``, ``tensor``,
``sequence``, ``allreduce``), what they share in ``common``, the command in ``cli``. The names
below are the ones the tests, notebooks and slides use.
"""

from .allreduce import (
    ALLREDUCE_MAX_MB,
    ALLREDUCE_MIN_BYTES,
    allreduce_benchmark,
    allreduce_sizes,
    network_verdict,
)
from .cli import available_memory_bytes, main, memory_needed
from .common import MLP_BATCH, MLP_LAYERS, MLP_WIDTH, TIMED_STEPS, WARMUP_STEPS, mlp, training_step
from .ddp import DDP_BUCKET_MB, ddp_benchmark
from .fsdp import fsdp_benchmark
from .memory_states import measure_stage, memory_benchmark, wrap_for_stage
from .pipeline import (
    PIPELINE_BUBBLE_BATCH,
    PIPELINE_BUBBLE_BLOCKS_PER_STAGE,
    PIPELINE_BUBBLE_HIDDEN,
    PIPELINE_BUBBLE_WIDTH,
    PIPELINE_MICROBATCHES,
    pipeline_benchmark,
    pipeline_bubble_benchmark,
    stage_counts_with_a_core_each,
)
from .sequence import cp_benchmark, dtensor_sequence_parallel_plan, ep_benchmark, sp_benchmark
from .tensor import TP_HEADS_PER_RANK, tp_benchmark

__all__ = [
    "ALLREDUCE_MAX_MB",
    "ALLREDUCE_MIN_BYTES",
    "DDP_BUCKET_MB",
    "MLP_BATCH",
    "MLP_LAYERS",
    "MLP_WIDTH",
    "PIPELINE_BUBBLE_BATCH",
    "PIPELINE_BUBBLE_BLOCKS_PER_STAGE",
    "PIPELINE_BUBBLE_HIDDEN",
    "PIPELINE_BUBBLE_WIDTH",
    "PIPELINE_MICROBATCHES",
    "TIMED_STEPS",
    "TP_HEADS_PER_RANK",
    "WARMUP_STEPS",
    "allreduce_benchmark",
    "allreduce_sizes",
    "available_memory_bytes",
    "cp_benchmark",
    "ddp_benchmark",
    "dtensor_sequence_parallel_plan",
    "ep_benchmark",
    "fsdp_benchmark",
    "main",
    "measure_stage",
    "memory_benchmark",
    "memory_needed",
    "mlp",
    "network_verdict",
    "pipeline_benchmark",
    "pipeline_bubble_benchmark",
    "sp_benchmark",
    "stage_counts_with_a_core_each",
    "tp_benchmark",
    "training_step",
    "wrap_for_stage",
]
