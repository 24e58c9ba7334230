"""Collective matmul computes what plain sequence parallelism, PyTorch's async-TP reference and
one process compute.

At degrees 1-4 (a parameter count that divides by none of them): the ring steps against
``torch.distributed._symmetric_memory``'s fallbacks (what ``fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter`` compute); a transformer's loss, every gradient and a few AdamW
steps against one process and against the plain version; one block's bytes against the plain
collectives', in T-1 messages each. One process per degree runs all of it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._symmetric_memory import (
    _fused_all_gather_matmul_fallback,
    _fused_matmul_reduce_scatter_fallback,
)

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import collective_matmul as cm
from course_lib.parallel import sequence as sp

from conftest import tiny_transformer

SEQ, D_MODEL, HEADS, BATCH = 12, 48, 12, 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _transformer():
    return tiny_transformer(seq=SEQ, d_model=D_MODEL, heads=HEADS)


def _against_pytorchs_reference() -> dict[str, float]:
    """The ring steps against the fallbacks PyTorch's fused async-TP operators are tested against."""
    size, rank = runtime.world_size(), runtime.rank()
    draw = torch.Generator().manual_seed(3)
    whole = torch.randn(BATCH, SEQ, D_MODEL, generator=draw, dtype=torch.float64)
    shard = whole.chunk(size, dim=1)[rank]
    matrices = [torch.randn(D_MODEL, n, generator=draw, dtype=torch.float64) for n in (8, 5)]
    name = dist.group.WORLD.group_name
    gathered, products = cm.all_gather_matmul(shard, matrices, group=None)
    reference_gathered, references = _fused_all_gather_matmul_fallback(shard, matrices, 1, name)
    partials = torch.randn(
        BATCH, SEQ, 7, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64
    )
    matrix = torch.randn(7, 9, generator=draw, dtype=torch.float64)
    scattered = cm.matmul_reduce_scatter([(partials, matrix)], group=None)
    reference_scattered = _fused_matmul_reduce_scatter_fallback(partials, matrix, "sum", 1, name)
    return {
        "gathered": (gathered - reference_gathered).abs().max().item(),
        "products": max((a - b).abs().max().item() for a, b in zip(products, references)),
        "scattered": (scattered - reference_scattered).abs().max().item(),
        "gathered_is_the_sequence": (gathered - whole).abs().max().item(),
    }


def _train(steps: int) -> dict:
    """One process, plain sequence parallelism and the overlapped version, side by side, same batches."""
    dense, inputs, targets = _transformer()
    plain = sp.apply_sequence_parallel(copy.deepcopy(dense))
    overlapped = sp.apply_sequence_parallel(copy.deepcopy(dense), overlap=True)
    models_ = {"dense": dense, "plain": plain, "overlapped": overlapped}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=3e-3) for name, m in models_.items()}
    generator, losses, grads = torch.Generator().manual_seed(1), [], None
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (BATCH,), generator=generator)
        x, y = inputs[batch], targets[batch]
        for optimizer in optimizers.values():
            optimizer.zero_grad()
        step = {"dense": models.lm_loss(dense(x), y)}
        step["dense"].backward()
        for name in ("plain", "overlapped"):
            share = sp.sequence_parallel_loss(models_[name](x), y)
            share.backward()
            sp.all_reduce_sequence_parallel_gradients(models_[name])
            total = share.detach().clone()
            comm.all_reduce(total, op="sum")
            step[name] = total
        losses.append({name: float(loss) for name, loss in step.items()})
        if grads is None:  # the first step's: every overlapped gradient against the plain one's
            theirs = dict(plain.named_parameters())
            grads = {n: (p.grad.clone(), theirs[n].grad.clone()) for n, p in overlapped.named_parameters()}
        for optimizer in optimizers.values():
            optimizer.step()
    return {"losses": losses, "grads": grads}


def _block_traffic() -> dict:
    torch.manual_seed(0)
    size, rank = runtime.world_size(), runtime.rank()
    dense = models.Block(D_MODEL, HEADS)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(2)).chunk(size, dim=1)[rank]
    traffic = {}
    for overlap in (False, True):
        block = sp.sequence_parallel_block(copy.deepcopy(dense), overlap=overlap)
        with comm.CommLog() as log:
            block(x.clone().requires_grad_()).sum().backward()
        traffic[overlap] = log.totals()
    return traffic


def _everything(steps: int) -> dict:
    return {"reference": _against_pytorchs_reference(), "trained": _train(steps), "traffic": _block_traffic()}


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_collective_matmul_equals_pytorchs_reference_one_process_and_the_plain_version_in_the_same_bytes(
    degree,
):
    assert sum(p.numel() for p in _transformer()[0].parameters()) % 12  # divides by no degree here
    for result in launch(_everything, degree, 3):
        assert all(difference < 1e-12 for difference in result["reference"].values()), result["reference"]
        for step in result["trained"]["losses"]:
            assert step["overlapped"] == pytest.approx(step["dense"], rel=1e-5)
            assert step["overlapped"] == pytest.approx(step["plain"], rel=1e-6)
        for name, (ours, plain) in result["trained"]["grads"].items():
            torch.testing.assert_close(ours, plain, **TOLERANCE, msg=name)
        plain, overlapped = result["traffic"][False], result["traffic"][True]
        if degree == 1:
            assert overlapped == {} and all(t["bytes_per_rank"] == 0 for t in plain.values())
            continue
        plain_bytes = plain["all_gather"]["bytes_per_rank"] + plain["reduce_scatter"]["bytes_per_rank"]
        assert overlapped["send"]["bytes_per_rank"] == plain_bytes  # the same bytes...
        # ...in T-1 messages for each of the 8 collectives (4 forward, 4 backward)
        assert overlapped["send"]["calls"] == 8 * (degree - 1) and "all_gather" not in overlapped


def test_a_chunks_compute_against_its_transfer_and_the_refusals():
    # Llama 3.1 70B's fc1 at T = 8 (28,672 / 8 columns) on an H100 at 600 TFLOP/s of bf16 and 450 GB/s
    ratio = cm.chunk_compute_to_transfer(features_per_rank=3584, flops_per_s=600e12, bytes_per_s=450e9)
    assert ratio == pytest.approx(2 * 3584 * 450e9 / (600e12 * 2))
    assert (
        ratio > 1 > cm.chunk_compute_to_transfer(features_per_rank=512, flops_per_s=600e12, bytes_per_s=450e9)
    )
    with pytest.raises(UserError, match="positive"):
        cm.chunk_compute_to_transfer(features_per_rank=0, flops_per_s=1.0, bytes_per_s=1.0)
    with pytest.raises(UserError, match="choose one of the two"):
        sp.sequence_parallel_block(models.Block(D_MODEL, HEADS), overlap=True, regather_in_backward=True)
    with pytest.raises(UserError, match="overlap must be True or False"):
        sp.apply_sequence_parallel(_transformer()[0], overlap="yes")


def _uneven_shards_in_both_directions() -> dict[str, str]:
    layer = torch.nn.Linear(4, 4)
    messages = {}
    shard = torch.ones(1, 4 - runtime.rank(), 4)  # rank 0: 4 tokens, rank 1: 3
    try:
        cm.all_gather_project(shard, [layer])
    except UserError as error:
        messages["all_gather"] = str(error)
    try:
        cm.matmul_reduce_scatter([(torch.ones(1, 7, 4), torch.ones(4, 4))])
    except UserError as error:
        messages["reduce_scatter"] = str(error)
    return messages


def test_uneven_chunks_are_refused_on_every_rank_in_both_directions():
    """Shards of different lengths would abort a rank inside the transport when the ring passes
    them on; every rank refuses them instead, naming what each holds."""
    for messages in launch(_uneven_shards_in_both_directions, 2):
        assert (
            "rank 0: all_gather of float32 (1, 4, 4); rank 1: all_gather of float32 (1, 3, 4)"
            in (messages["all_gather"])
        )
        assert (
            "a sequence of 7 tokens does not split over tensor/sequence-parallel degree 2"
            in (messages["reduce_scatter"])
        )
