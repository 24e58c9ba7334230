"""Sequence parallelism computes what tensor parallelism and one process compute, for the same bytes.

At degrees 1-3 (parameter counts that divide by none of them), for both variants (the gathered
input kept, as DTensor does, or regathered in backward, as Megatron-LM does): the loss, every
gradient and a few AdamW steps against one process; the blocks' traffic against plain tensor
parallelism's; each block's saved activations against ``activations.block_activation_elements``,
exactly; one block against DTensor's ``SequenceParallel`` plan, values and saved bytes; a sequence
that does not split refused on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.parallel import sequence as sp
from course_lib.parallel import tensor as tp
from course_lib.parallel.memory import saved_tensor_bytes

from conftest import tiny_transformer

SEQ, D_MODEL, HEADS, BATCH = 12, 24, 6, 5
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _transformer():
    return tiny_transformer(seq=SEQ, d_model=D_MODEL, heads=HEADS)


def _train_against_one_process(steps: int, regather_in_backward: bool = False):
    dense, inputs, targets = _transformer()
    parallel = sp.apply_sequence_parallel(copy.deepcopy(dense), regather_in_backward=regather_in_backward)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (dense, parallel)]
    generator, losses, first_grads = torch.Generator().manual_seed(1), [], None
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (BATCH,), generator=generator)
        x, y = inputs[batch], targets[batch]
        for optimizer in optimizers:
            optimizer.zero_grad()
        expected = models.lm_loss(dense(x), y)
        expected.backward()
        share = sp.sequence_parallel_loss(parallel(x), y)
        share.backward()
        sp.all_reduce_sequence_parallel_gradients(parallel)
        total = share.detach().clone()
        comm.all_reduce(total, op="sum")
        losses.append((float(total), float(expected)))
        if first_grads is None:
            first_grads = _gradients_against_dense(dense, parallel)
        for optimizer in optimizers:
            optimizer.step()
    return losses, first_grads


def _gradients_against_dense(dense, parallel):
    """Every parallel gradient against its cut of the dense one (rows, columns or whole)."""
    size, rank = runtime.world_size(), runtime.rank()
    dense_params = dict(dense.named_parameters())
    pairs = {}
    for name, param in parallel.named_parameters():
        whole = dense_params[name].grad
        if param.shape != whole.shape:
            dim = 0 if param.shape[0] != whole.shape[0] else 1
            whole = whole.chunk(size, dim=dim)[rank]
        pairs[name] = (param.grad.clone(), whole.clone())
    return pairs


@pytest.mark.parametrize("regather_in_backward", [False, True], ids=["gathered-kept", "regathered"])
@pytest.mark.parametrize("degree", [1, 2, 3])
def test_sequence_parallel_trains_like_one_process(degree, regather_in_backward):
    for losses, grads in launch(_train_against_one_process, degree, 3, regather_in_backward):
        for ours, expected in losses:
            assert ours == pytest.approx(expected, rel=1e-5)
        assert len(grads) == sum(1 for _ in _transformer()[0].parameters())
        for name, (ours, expected) in grads.items():
            torch.testing.assert_close(ours, expected, **TOLERANCE, msg=name)


def _block_traffic_and_norm_memory():
    torch.manual_seed(0)
    size, rank = runtime.world_size(), runtime.rank()
    dense = models.Block(D_MODEL, HEADS)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(2))
    measured = {}
    for name, block, block_input in (
        ("tensor", tp.apply_tensor_parallel(copy.deepcopy(dense)), x),
        ("sequence", sp.sequence_parallel_block(copy.deepcopy(dense)), x.chunk(size, dim=1)[rank]),
    ):
        with comm.CommLog() as log:
            block(block_input.clone().requires_grad_()).sum().backward()
        with saved_tensor_bytes(ignore=block.parameters()) as norms:
            block.norm1(block_input.clone().requires_grad_())
        measured[name] = (log.totals(), norms.bytes)
    return measured


@pytest.mark.parametrize("degree", [2, 3])
def test_the_same_bytes_as_tensor_parallelism_and_norm_activations_divided_by_the_degree(degree):
    measured = launch(_block_traffic_and_norm_memory, degree)[0]
    tensor_traffic, tensor_norm_bytes = measured["tensor"]
    sequence_traffic, sequence_norm_bytes = measured["sequence"]
    assert tensor_traffic["all_reduce"]["calls"] == 4  # f and g around attention and MLP, both ways
    assert sequence_traffic["all_gather"]["calls"] == sequence_traffic["reduce_scatter"]["calls"] == 4
    sequence_bytes = sum(sequence_traffic[op]["bytes_per_rank"] for op in ("all_gather", "reduce_scatter"))
    assert sequence_bytes == tensor_traffic["all_reduce"]["bytes_per_rank"]
    assert sequence_bytes == 8 * comm.ring_bytes("all_gather", BATCH * SEQ * D_MODEL * 4, degree)
    # a norm keeps its input and, per token, a mean and an inverse deviation
    assert tensor_norm_bytes == BATCH * SEQ * (D_MODEL + 2) * 4
    assert sequence_norm_bytes == tensor_norm_bytes // degree


def _saved_activations_and_traffic():
    """Each variant of one block: bytes saved for backward, and the collectives of forward and of backward."""
    torch.manual_seed(0)
    size, rank = runtime.world_size(), runtime.rank()
    dense = models.Block(D_MODEL, HEADS)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(2))
    mine = x.chunk(size, dim=1)[rank]
    variants = {
        "one process": (copy.deepcopy(dense), x),
        "tensor": (tp.apply_tensor_parallel(copy.deepcopy(dense)), x),
        "gathered-kept": (sp.sequence_parallel_block(copy.deepcopy(dense)), mine),
        "regathered": (sp.sequence_parallel_block(copy.deepcopy(dense), regather_in_backward=True), mine),
    }
    measured = {}
    for name, (block, block_input) in variants.items():
        with saved_tensor_bytes(ignore=block.parameters()) as saved, comm.CommLog() as forward:
            out = block(block_input.clone().requires_grad_())
        with comm.CommLog() as backward:
            out.sum().backward()
        measured[name] = (saved.bytes, _calls_and_bytes(forward), _calls_and_bytes(backward))
    return measured


def _calls_and_bytes(log: comm.CommLog) -> dict:
    return {op: (row["calls"], row["bytes_per_rank"]) for op, row in log.totals().items()}


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_each_variant_saves_what_the_formula_says_and_regathering_costs_one_all_gather(degree):
    from course_lib.plan.activations import block_activation_elements

    shape = dict(batch=BATCH, seq=SEQ, d_model=D_MODEL, heads=HEADS)
    formulas = {
        "one process": {},
        "tensor": dict(tensor_degree=degree),
        "gathered-kept": dict(tensor_degree=degree, sequence_parallel=True),
        "regathered": dict(tensor_degree=degree, sequence_parallel=True, regather_in_backward=True),
    }
    for measured in launch(_saved_activations_and_traffic, degree):
        for name, (saved, _, _) in measured.items():
            assert saved == 4 * block_activation_elements(**shape, **formulas[name])["total"], name
        assert measured["regathered"][0] * degree == measured["one process"][0]  # all of it, 1/T
        whole_inputs = 2 * BATCH * SEQ * D_MODEL * 4  # q/k/v's and fc1's gathered inputs
        assert (
            measured["gathered-kept"][0] - measured["regathered"][0] == whole_inputs * (degree - 1) / degree
        )
        (_, kept_forward, kept_backward), (_, forward, backward) = (
            measured["gathered-kept"],
            measured["regathered"],
        )
        assert forward == kept_forward  # the same forward
        assert kept_backward["all_gather"][0] == 2 and backward["all_gather"][0] == 4
        extra = backward["all_gather"][1] - kept_backward["all_gather"][1]
        assert extra == 2 * comm.ring_bytes("all_gather", BATCH * SEQ * D_MODEL * 4, degree)
        assert backward["reduce_scatter"] == kept_backward["reduce_scatter"]


def test_the_activation_formula_refuses_a_variant_without_its_parallelism():
    from course_lib.plan.activations import block_activation_elements

    from conftest import user_errors

    errors = user_errors(
        {
            "regather": lambda: block_activation_elements(
                batch=1, seq=4, d_model=8, heads=2, tensor_degree=2, regather_in_backward=True
            ),
            "degree": lambda: block_activation_elements(batch=1, seq=4, d_model=8, heads=2, tensor_degree=0),
        }
    )
    assert "pass sequence_parallel=True too" in errors["regather"]
    assert "tensor_degree must be at least 1, got 0" in errors["degree"]


def _against_dtensor_sequence_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from course_lib.tools.bench import dtensor_sequence_parallel_plan

    size, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    dense = models.Block(D_MODEL, HEADS)
    plan = dtensor_sequence_parallel_plan()
    theirs = parallelize_module(copy.deepcopy(dense), init_device_mesh("cpu", (size,)), plan)
    ours = sp.sequence_parallel_block(copy.deepcopy(dense))
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(2)).chunk(size, dim=1)[rank]
    outputs, saved_bytes = [], []
    for block in (ours, theirs):
        mine = x.clone().requires_grad_()
        with saved_tensor_bytes(ignore=block.parameters()) as saved:
            out = block(mine)
        saved_bytes.append(saved.bytes)
        out = out.to_local() if hasattr(out, "to_local") else out
        (out * out).sum().backward()
        outputs.append((out.detach(), mine.grad))
    sp.all_reduce_sequence_parallel_gradients(ours)
    grads = {}
    replicated = ("norm1.weight", "norm2.bias", "attention.out.bias")
    for name in (*replicated, "attention.q.weight", "mlp.fc1.weight", "mlp.fc2.weight"):
        theirs_grad = dict(theirs.named_parameters())[name].grad
        theirs_grad = theirs_grad.full_tensor() if name in replicated else theirs_grad.to_local()
        grads[name] = (dict(ours.named_parameters())[name].grad, theirs_grad)
    return outputs, grads, saved_bytes


def test_one_block_equals_dtensor_sequence_parallel():
    for outputs, grads, (our_saved, their_saved) in launch(_against_dtensor_sequence_parallel, 2):
        assert our_saved == their_saved  # DTensor too keeps the gathered input whole
        (our_out, our_grad), (their_out, their_grad) = outputs
        torch.testing.assert_close(our_out, their_out, **TOLERANCE)
        torch.testing.assert_close(our_grad, their_grad, **TOLERANCE)
        for name, (ours, theirs) in grads.items():  # gradients up to ~75: sums in another order
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-5, msg=name)


def _refusals():
    from conftest import user_errors

    model, inputs, _ = _transformer()
    return user_errors(
        {
            "sequence": lambda: sp.apply_sequence_parallel(model)(inputs[:2, : SEQ - 1]),
            "heads": lambda: sp.sequence_parallel_block(models.Block(D_MODEL, 4)),
        }
    )


def test_a_sequence_or_heads_that_do_not_split_are_refused_on_every_rank():
    for errors in launch(_refusals, 3):
        assert (
            "a sequence of 11 tokens does not split over tensor/sequence-parallel degree 3"
            in errors["sequence"]
        )
        assert "attention heads 4 does not divide by the tensor-parallel degree 3" in errors["heads"]


@pytest.mark.slow
@pytest.mark.timing
def test_sp_benchmark_prints_the_promised_json():
    from conftest import assert_accounted, run_bench

    result = run_bench("sp", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "2", "--steps", "2")
    assert {
        "course_step_ms",
        "torch_step_ms",
        "ratio",
        "tensor_parallel_step_ms",
        "regathered_step_ms",
    } <= set(result)
    for variant in ("kept", "regathered"):
        assert (
            result[f"block_activation_bytes_{variant}"] == result[f"block_activation_bytes_{variant}_theory"]
        )
    assert result["block_activation_bytes_regathered"] < result["block_activation_bytes_kept"]
    assert_accounted(result, ["course", "torch", "overlapped"])
    assert result["overlapped_step_ms"] > 0 and result["overlapped_over_plain"] > 0
    assert result["overlapped"]["communication_ms"] > 0  # the ring steps, timed like any collective
    assert result["bytes_per_rank_overlapped"] == result["bytes_per_rank_measured"]
    assert result["bytes_per_rank_measured"] == result["bytes_per_rank_tensor_parallel"]
    assert result["bytes_per_rank_measured"] == result["bytes_per_rank_theory"]
    assert result["norm_activation_bytes_measured"] == result["norm_activation_bytes_theory"]
    assert result["norm_activation_bytes_one_process"] == 2 * result["norm_activation_bytes_measured"]
