"""Benchmarks of sequence, context and expert parallelism: ``bench sp``, ``bench cp``, ``bench ep``.

Each runs on local processes, interleaves the variants it times (``timing.interleaved_medians``),
and reports the bytes moved and the activation memory it measured beside the theory's numbers.

``sp``: one transformer block, the course's sequence parallelism against DTensor's
``SequenceParallel`` plan (ratio of step times, same run), Megatron-LM's variant (the gathered
input regathered in backward), collective matmul (``overlap``: its anatomy beside the plain
version's, its bytes beside theirs) and plain tensor parallelism beside them; the bytes each rank sent
against tensor parallelism's and against theory (8 x (T-1)/T x the activation, forward and
backward); the norms' saved activations against 1/T of one process's; the whole block's saved
activations, both variants, against ``activations.block_activation_elements``.

``cp``: ring attention forward and backward on a long sequence, contiguous and zig-zag layouts:
step times (the ring waits for its slowest rank); each rank's own compute time (its blocks
alone, no messages) against the work ``attention_work`` counts, so the balance is measured, not
assumed; the bytes each rank sent against theory; the attention's saved activations per rank
against 1/C of one process's. PyTorch's ``context_parallel`` has no CPU kernel, so the
single-process ``scaled_dot_product_attention`` is the reference time.

``attention``: the four ways to split a sequence's attention over C ranks side by side, on the
same q, k and v: ring attention on contiguous chunks, on zig-zag chunks, Ulysses (all-to-all),
and the USP hybrid (Ulysses inside groups of U ranks, a ring across them). For each: the step
time (forward and backward, timed in turns), the bytes each rank sent against its theory, the
number of messages, the attention's saved activations per rank against one process's, and the
largest difference to one process's output.

``ep``: a mixture-of-experts layer with its experts spread over the ranks, against the same layer
on one process holding every expert (each rank running the layer on its own tokens); the
all-to-all bytes against the routing; dropped tokens, the load per expert and the balancing loss.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

from ... import models
from ...distributed import comm, runtime
from ...parallel import context as cp
from ...parallel import context_chunks, ulysses
from ...parallel import expert as ep
from ...parallel import sequence as sp
from ...parallel import tensor as tp
from ...parallel.memory import saved_tensor_bytes
from ...plan.activations import block_activation_elements
from ..timing import interleaved_medians
from .common import anatomies


def _forward_backward(module, inputs):
    def step():
        module(inputs.detach().requires_grad_()).sum().backward()

    return step


def dtensor_sequence_parallel_plan() -> dict:
    """PyTorch's twin of ``sequence.sequence_parallel_block``: DTensor's plan for one ``models.Block``.

    The norms work on the sequence shards (``SequenceParallel``); attention and the MLP gather the
    sequence on the way in and reduce-scatter it on the way out (``RowwiseParallel`` to ``Shard(1)``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "norm1": SequenceParallel(),
        "attention": PrepareModuleInput(**gather),
        **{f"attention.{name}": ColwiseParallel() for name in ("q", "k", "v")},
        "attention.out": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "mlp": PrepareModuleInput(**gather),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def sp_benchmark(
    *, d_model: int, heads: int, seq: int, batch: int, steps: int, warmup: int, profile: str | None = None
) -> dict | None:
    """One block: the course's sequence parallelism, DTensor's, and plain tensor parallelism.

    Args:
        d_model: the block's width.
        heads: attention heads (a multiple of the ranks).
        seq: tokens per sequence (a multiple of the ranks).
        batch: sequences per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first.
        profile: a folder for each variant's per-rank traces (None: none are written).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    degree, rank = runtime.world_size(), runtime.rank()
    sp.check_sequence_split(seq, degree)
    torch.manual_seed(0)
    dense = models.Block(d_model, heads)
    plan = dtensor_sequence_parallel_plan()
    theirs = parallelize_module(copy.deepcopy(dense), init_device_mesh("cpu", (degree,)), plan)
    ours = sp.sequence_parallel_block(copy.deepcopy(dense))
    regathering = sp.sequence_parallel_block(copy.deepcopy(dense), regather_in_backward=True)
    overlapped = sp.sequence_parallel_block(copy.deepcopy(dense), overlap=True)
    tensor_only = tp.apply_tensor_parallel(copy.deepcopy(dense))
    whole = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1))
    mine = whole.chunk(degree, dim=1)[rank].contiguous()

    def dtensor_step():
        out = theirs(mine.detach().requires_grad_())
        (out.to_local() if hasattr(out, "to_local") else out).sum().backward()

    variants = {
        "course_sp": _forward_backward(ours, mine),
        "course_sp_regathered": _forward_backward(regathering, mine),
        "course_sp_overlapped": _forward_backward(overlapped, mine),
        "torch_sp": dtensor_step,
        "course_tp": _forward_backward(tensor_only, whole),
    }
    median_ms = interleaved_medians(variants, steps, warmup)
    where = anatomies(
        {
            "course": variants["course_sp"],
            "torch": variants["torch_sp"],
            "overlapped": variants["course_sp_overlapped"],
        },
        trace_dir=profile,
    )
    traffic = {}
    for name, block, block_input in (
        ("sp", ours, mine),
        ("overlapped", overlapped, mine),
        ("tp", tensor_only, whole),
    ):
        with comm.CommLog() as log:
            _forward_backward(block, block_input)()
        traffic[name] = log.bytes_per_rank()
    norm_bytes = {}
    for name, block_input in (("sp", mine), ("one_process", whole)):
        with saved_tensor_bytes(ignore=ours.parameters()) as saved:
            ours.norm1(block_input.clone().requires_grad_())  # two activations, as in a block
            ours.norm2(block_input.clone().requires_grad_())
        norm_bytes[name] = saved.bytes
    block_bytes = {}
    for name, block in (("kept", ours), ("regathered", regathering)):
        with saved_tensor_bytes(ignore=block.parameters()) as saved:
            block(mine.clone().requires_grad_())
        block_bytes[name] = saved.bytes
    shape = dict(
        batch=batch, seq=seq, d_model=d_model, heads=heads, tensor_degree=degree, sequence_parallel=True
    )
    activation_bytes = 4 * batch * seq * d_model
    result = where | {
        "benchmark": "sp",
        "tensor_degree": degree,
        "threads_per_rank": torch.get_num_threads(),
        "activation_shape": [batch, seq, d_model],
        "course_step_ms": median_ms["course_sp"],
        "torch_step_ms": median_ms["torch_sp"],
        "ratio": median_ms["course_sp"] / median_ms["torch_sp"],
        "tensor_parallel_step_ms": median_ms["course_tp"],
        "regathered_step_ms": median_ms["course_sp_regathered"],
        "regathered_over_kept": median_ms["course_sp_regathered"] / median_ms["course_sp"],
        # collective matmul: the same block, each collective cut into T - 1 ring steps under the matmuls
        "overlapped_step_ms": median_ms["course_sp_overlapped"],
        "overlapped_over_plain": median_ms["course_sp_overlapped"] / median_ms["course_sp"],
        "bytes_per_rank_overlapped": traffic["overlapped"],
        "block_activation_bytes_kept": block_bytes["kept"],
        "block_activation_bytes_kept_theory": 4 * block_activation_elements(**shape)["total"],
        "block_activation_bytes_regathered": block_bytes["regathered"],
        "block_activation_bytes_regathered_theory": 4
        * block_activation_elements(**shape, regather_in_backward=True)["total"],
        "bytes_per_rank_measured": traffic["sp"],
        "bytes_per_rank_tensor_parallel": traffic["tp"],
        "bytes_per_rank_theory": 8 * comm.ring_bytes("all_gather", activation_bytes, degree),
        "norm_activation_bytes_measured": norm_bytes["sp"],
        "norm_activation_bytes_one_process": norm_bytes["one_process"],
        "norm_activation_bytes_theory": 2 * 4 * batch * (seq // degree) * (d_model + 2),
    }
    return result if rank == 0 else None


def _median_ms(function, steps: int, warmup: int) -> float:
    times = []
    for index in range(warmup + steps):
        started = time.perf_counter()
        function()
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def _one_process_attention(q, k, v, steps: int, warmup: int) -> dict:
    """The reference: causal SDPA on the whole sequence, what it keeps for backward and its time."""
    with saved_tensor_bytes() as saved:
        torch.nn.functional.scaled_dot_product_attention(
            *(t.clone().requires_grad_() for t in (q, k, v)), is_causal=True
        )

    def one_process():
        parts = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*parts, is_causal=True).sum().backward()

    return {
        "one_process_attention_bytes": saved.bytes,
        "one_process_sdpa_ms": _median_ms(one_process, steps, warmup),
    }


def _own_blocks(
    chunks: context_chunks.SequenceChunks, rank: int, shape: tuple[int, int, int], generator
) -> callable:
    """This rank's attention blocks, forward and backward, with no messages: its compute alone."""
    batch, heads, head_dim = shape
    q = torch.randn(batch, heads, chunks.tokens(rank), head_dim, generator=generator)
    blocks = [pair for step in context_chunks.ring_schedule(chunks) for pair in step[rank]["blocks"]]
    keys = {
        owner: torch.randn(2, batch, heads, chunks.tokens(owner), head_dim, generator=generator)
        for owner in range(chunks.degree)
    }
    offsets = {}
    for owner in range(chunks.degree):
        offset = 0
        for segment in chunks.segments(owner):
            offsets[segment] = (owner, offset)
            offset += segment.length
    q_offsets, offset = {}, 0
    for segment in chunks.segments(rank):
        q_offsets[segment] = offset
        offset += segment.length

    def compute():
        for query, key in blocks:
            owner, start = offsets[key]
            k, v = (t.narrow(-2, start, key.length).requires_grad_() for t in keys[owner])
            q_part = q.narrow(-2, q_offsets[query], query.length).requires_grad_()
            scores = q_part @ k.transpose(-1, -2)
            (scores.softmax(-1) @ v).sum().backward()

    return compute


def cp_benchmark(
    *, seq: int, heads: int, head_dim: int, batch: int, steps: int, warmup: int, profile: str | None = None
) -> dict | None:
    """Ring attention, contiguous and zig-zag: step time, each rank's compute, bytes and memory.

    Args:
        seq: the whole sequence's tokens.
        heads: attention heads.
        head_dim: features per head.
        batch: sequences per step.
        steps: timed steps; the median is reported.
        warmup: untimed steps first.
        profile: a folder for each variant's per-rank traces (None: none are written).
    """
    degree, rank = runtime.world_size(), runtime.rank()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=generator) for _ in range(3))
    result = {
        "benchmark": "cp",
        "context_degree": degree,
        "threads_per_rank": torch.get_num_threads(),
        "shape": {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim},
    }
    result |= _one_process_attention(q, k, v, steps, warmup)
    for zigzag in (False, True):
        chunks = context_chunks.SequenceChunks(seq, degree, zigzag=zigzag)
        mine = [chunks.local(t, rank, dim=2).clone() for t in (q, k, v)]

        def ring_step(chunks=chunks, mine=mine):
            parts = [t.detach().requires_grad_() for t in mine]
            cp.ring_attention(*parts, chunks=chunks).sum().backward()

        step_ms = interleaved_medians({"ring": ring_step}, steps, warmup)["ring"]
        layout_name = "zigzag" if zigzag else "contiguous"
        where = anatomies({"course": ring_step}, trace_dir=f"{profile}/{layout_name}" if profile else None)
        own_blocks = _own_blocks(chunks, rank, (batch, heads, head_dim), generator)
        own_ms = None
        for turn in range(degree):  # one rank at a time, so that none competes for the cores
            comm.barrier()
            if turn == rank:
                own_ms = _median_ms(own_blocks, steps, warmup)
        comm.barrier()
        with comm.CommLog() as log, saved_tensor_bytes() as saved:
            parts = [t.detach().requires_grad_() for t in mine]
            out = cp.ring_attention(*parts, chunks=chunks)
        with comm.CommLog() as backward_log:
            out.sum().backward()
        per_rank = [None] * degree
        dist.all_gather_object(
            per_rank,
            {
                "compute_ms": own_ms,
                "bytes": log.bytes_per_rank("send") + backward_log.bytes_per_rank("send"),
                "attention_bytes": saved.bytes,
            },
        )
        work = context_chunks.attention_work(chunks)
        kv_bytes = 2 * batch * heads * head_dim * 4
        compute = [row["compute_ms"] for row in per_rank]
        result[layout_name] = where | {
            "step_ms": step_ms,
            "work_per_rank": work,
            "work_max_over_mean": max(work) / statistics.mean(work),
            "compute_ms_per_rank": compute,
            "compute_max_over_mean": max(compute) / statistics.mean(compute),
            "bytes_per_rank_measured": [row["bytes"] for row in per_rank],
            "bytes_per_rank_theory": [
                context_chunks.ring_bytes_per_rank(chunks, r, bytes_per_token=kv_bytes) for r in range(degree)
            ],
            "attention_bytes_per_rank": [row["attention_bytes"] for row in per_rank],
            "attention_bytes_theory": [
                4 * batch * heads * chunks.tokens(r) * (4 * head_dim + 1) for r in range(degree)
            ],
        }
    result["native_twin"] = (
        "torch.distributed.tensor.experimental.context_parallel has no CPU kernel "
        "(aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy)"
    )
    return result if rank == 0 else None


def attention_benchmark(
    *,
    seq: int,
    heads: int,
    head_dim: int,
    batch: int,
    ulysses_degree: int,
    steps: int,
    warmup: int,
    profile: str | None = None,
) -> dict | None:
    """Ring (contiguous and zig-zag), Ulysses and USP on the same attention: time, bytes, memory, error.

    Args:
        seq: the whole sequence's tokens.
        heads: attention heads (a multiple of the ranks, for Ulysses).
        head_dim: features per head.
        batch: sequences per step.
        ulysses_degree: U of the hybrid (its ring has C / U ranks); 1 or C: no hybrid row.
        steps: timed steps; the median is reported.
        warmup: untimed steps first.
        profile: a folder for each method's per-rank traces (None: none are written).
    """
    degree, rank = runtime.world_size(), runtime.rank()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=generator) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    per_token = batch * heads * head_dim * 4  # one token's q (or k, or v) over every head, fp32
    contiguous, zigzag = (context_chunks.SequenceChunks(seq, degree, zigzag=z) for z in (False, True))
    methods = {  # name: (attention on this rank's q, k, v; this rank's tokens of a whole tensor; theory)
        "ring_contiguous": (
            lambda a, b, c: cp.ring_attention(a, b, c, chunks=contiguous),
            lambda t: contiguous.local(t, rank, dim=2),
            lambda r: context_chunks.ring_bytes_per_rank(contiguous, r, bytes_per_token=2 * per_token),
        ),
        "ring_zigzag": (
            lambda a, b, c: cp.ring_attention(a, b, c, chunks=zigzag),
            lambda t: zigzag.local(t, rank, dim=2),
            lambda r: context_chunks.ring_bytes_per_rank(zigzag, r, bytes_per_token=2 * per_token),
        ),
        "ulysses": (
            lambda a, b, c: ulysses.ulysses_attention(a, b, c, chunks=contiguous),
            lambda t: contiguous.local(t, rank, dim=2),
            lambda r: ulysses.ulysses_bytes_per_rank(contiguous, r, bytes_per_token=per_token),
        ),
    }
    if 1 < ulysses_degree < degree:
        grid = ulysses.UspChunks(seq, degree // ulysses_degree, ulysses_degree)
        inner, across = ulysses.usp_groups(ulysses_degree)
        methods["usp"] = (
            lambda a, b, c: ulysses.usp_attention(
                a, b, c, chunks=grid, ulysses_group=inner, ring_group=across
            ),
            lambda t: grid.local(t, rank, dim=2),
            lambda r: ulysses.usp_bytes_per_rank(grid, r, bytes_per_token=per_token),
        )
    reference = _one_process_attention(q, k, v, steps, warmup)
    step_functions, measured = {}, {}
    for name, (attend, local, _) in methods.items():
        mine = [local(t).clone() for t in (q, k, v)]

        def step(attend=attend, mine=mine):
            attend(*(t.detach().requires_grad_() for t in mine)).sum().backward()

        step_functions[name] = step
        with comm.CommLog() as log:
            with saved_tensor_bytes() as saved:
                out = attend(*(t.detach().requires_grad_() for t in mine))
            out.sum().backward()
        measured[name] = {
            "bytes": log.bytes_per_rank(),
            "calls": log.count(),
            "attention_bytes": saved.bytes,
            "error": (out.detach() - local(expected)).abs().max().item(),
        }
    median_ms = interleaved_medians(step_functions, steps, warmup)
    where = anatomies(step_functions, trace_dir=profile)
    everyone = [None] * degree
    dist.all_gather_object(everyone, measured)
    rows = []
    for name, (_, _, theory) in methods.items():
        per_rank = [row[name] for row in everyone]
        rows.append(
            where[name]
            | {
                "method": name,
                "step_ms": median_ms[name],
                "bytes_per_rank_measured": [row["bytes"] for row in per_rank],
                "bytes_per_rank_theory": [theory(r) for r in range(degree)],
                "calls_per_rank": [row["calls"] for row in per_rank],
                "attention_bytes_per_rank": [row["attention_bytes"] for row in per_rank],
                "attention_bytes_over_one_process": max(row["attention_bytes"] for row in per_rank)
                / reference["one_process_attention_bytes"],
                "max_error_vs_one_process": max(row["error"] for row in per_rank),
            }
        )
    result = {
        "benchmark": "attention",
        "degree": degree,
        "ulysses_degree_of_the_hybrid": ulysses_degree if "usp" in methods else None,
        "threads_per_rank": torch.get_num_threads(),
        "shape": {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim},
        **reference,
        "rows": rows,
    }
    return result if rank == 0 else None


def ep_benchmark(
    *,
    d_model: int,
    hidden: int,
    experts: int,
    tokens: int,
    top_k: int,
    capacity_factor: float,
    steps: int,
    warmup: int,
    profile: str | None = None,
) -> dict | None:
    """A mixture-of-experts layer spread over the ranks, against one process holding every expert.

    Args:
        d_model: the tokens' width.
        hidden: each expert's hidden width.
        experts: E, a multiple of the ranks.
        tokens: tokens per rank per step.
        top_k: experts per token.
        capacity_factor: an expert's room, as a multiple of its fair share.
        steps: timed steps; the median is reported.
        warmup: untimed steps first.
        profile: a folder for each variant's per-rank traces (None: none are written).
    """
    degree, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    full = ep.MoE(d_model, hidden, num_experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    parallel = ep.apply_expert_parallel(copy.deepcopy(full))
    x = torch.randn(1, tokens, d_model, generator=torch.Generator().manual_seed(10 + rank))
    variants = {"expert_parallel": _forward_backward(parallel, x), "one_process": _forward_backward(full, x)}
    median_ms = interleaved_medians(variants, steps, warmup)
    # no PyTorch twin for expert parallelism: the one-process layer beside it
    where = anatomies(
        {"course": variants["expert_parallel"], "one_process": variants["one_process"]}, trace_dir=profile
    )
    with comm.CommLog() as log:
        _forward_backward(parallel, x)()
    routing = parallel.last_routing[0]
    everyone = [None] * degree
    dist.all_gather_object(everyone, routing.expert[routing.kept])
    theory = ep.all_to_all_bytes(everyone, rank, num_experts=experts, row_bytes=d_model * 4)
    result = where | {
        "benchmark": "ep",
        "expert_degree": degree,
        "threads_per_rank": torch.get_num_threads(),
        "experts": experts,
        "top_k": top_k,
        "capacity_factor": capacity_factor,
        "capacity": routing.capacity,
        "tokens_per_rank": tokens,
        "expert_parallel_step_ms": median_ms["expert_parallel"],
        "one_process_step_ms": median_ms["one_process"],
        "ratio": median_ms["expert_parallel"] / median_ms["one_process"],
        "all_to_all_bytes_rank0_measured": log.bytes_per_rank("all_to_all"),
        "all_to_all_bytes_rank0_theory": float(theory),
        "dropped_tokens_rank0": routing.dropped,
        "assignments_per_expert_rank0": routing.tokens_per_expert.tolist(),
        "aux_loss_rank0": float(routing.aux_loss.detach()),
        "expert_parameters_per_rank": sum(p.numel() for p in parallel.experts.parameters()),
        "expert_parameters_one_process": sum(p.numel() for p in full.experts.parameters()),
    }
    return result if rank == 0 else None
