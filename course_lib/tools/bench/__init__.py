"""Benchmarks: ``python -m course_lib.tools.bench NAME`` prints JSON (see ``--help`` for the names).

How to compare two implementations honestly on a noisy machine: run them in the *same*
processes, on the same model and data, interleaved step by step (their order rotating every
round), and compare medians. Background load then slows both alike, and the ratio is stable
even when the absolute times are not. Unit tests never time anything; this command does.

Each benchmark is a module of its own, whose docstring says what it compares:

======================  ===================================================================================
``ddp``                 ``ddp.py``: PyTorch's DDP against the course's in its three modes
``fsdp``                ``fsdp.py``: FSDP2 against the course's FSDP, prefetch on and off, every strategy
``memory``              ``memory_states.py``: what each sharding holds and sends, against the model
``pipeline``            ``pipeline.py``: every schedule's step, bubble and activations, against theory
``tp``                  ``tensor.py``: tensor-parallel MLP and attention against DTensor
``sp``, ``cp``, ``ep``  ``sequence.py``: sequence, context and expert parallelism
``recompute``           ``recompute.py``: memory saved and time paid by each recomputation policy
``checkpoint``          ``checkpointing.py``: a blocking save against an asynchronous one
``compile``             ``compiled.py``: compiled blocks against eager, under each parallelism
``hierarchy``           ``hierarchy.py``: a flat ring, the hierarchy and the tree across "nodes"
``float8``              ``float8.py``: float8 training against bf16 and the noise between two bf16 seeds
``allreduce``           ``allreduce.py``: the network itself, as ``nccl-tests`` measures it
======================  ===================================================================================

The benchmarks of a training step (not ``allreduce``, ``hierarchy``, ``checkpoint``, ``compile``,
``float8``) report the step anatomy (``course_lib.observe.anatomy``) of each variant they time,
under the variant's name, and write their traces with ``--profile DIR``.

What the benchmarks share is in ``common``, the command in ``cli``. The names below are the ones
the tests, notebooks and slides use.
"""

from .allreduce import (
    ALLREDUCE_MAX_MB,
    ALLREDUCE_MIN_BYTES,
    allreduce_benchmark,
    allreduce_sizes,
    network_verdict,
)
from .checkpointing import checkpoint_benchmark
from .cli import available_memory_bytes, main, memory_needed
from .common import MLP_BATCH, MLP_LAYERS, MLP_WIDTH, TIMED_STEPS, WARMUP_STEPS, mlp, training_step
from .compiled import compile_benchmark
from .ddp import DDP_BUCKET_MB, ddp_benchmark
from .float8 import float8_training_benchmark
from .fsdp import fsdp_benchmark
from .hierarchy import hierarchy_benchmark
from .memory_states import measure_sharding, memory_benchmark
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
    zero_bubble_stages,
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
    "checkpoint_benchmark",
    "compile_benchmark",
    "cp_benchmark",
    "ddp_benchmark",
    "dtensor_sequence_parallel_plan",
    "ep_benchmark",
    "float8_training_benchmark",
    "fsdp_benchmark",
    "hierarchy_benchmark",
    "main",
    "measure_sharding",
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
    "zero_bubble_benchmark",
    "zero_bubble_stages",
]
