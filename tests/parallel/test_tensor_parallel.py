"""Tensor-parallel layers equal their dense counterparts, forward and backward, at degrees 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib import data, models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import tensor as tp

BATCH, SEQ, D_MODEL, HEADS = 5, 7, 24, 4  # an odd batch and sequence length
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _inputs(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7), requires_grad=True)


def _whole(t):
    return t


def _compare(
    dense: nn.Module, parallel: nn.Module, x: torch.Tensor, slices: dict, input_cut=_whole, output_cut=_whole
):
    """Outputs, input gradients, and each parallel weight's gradient against this rank's cut of the dense one.

    ``input_cut`` / ``output_cut``: what part of the dense input (output) this rank's layer takes (gives).
    """
    x_dense, x_parallel = x.detach().clone().requires_grad_(), input_cut(x.detach()).clone().requires_grad_()
    y_dense, y_parallel = dense(x_dense), parallel(x_parallel)
    weights = torch.randn(y_dense.shape, generator=torch.Generator().manual_seed(3))
    (y_dense * weights).sum().backward()
    (y_parallel * output_cut(weights)).sum().backward()
    dense_params, parallel_params = dict(dense.named_parameters()), dict(parallel.named_parameters())
    grads = {name: (parallel_params[name].grad, cut(dense_params[name].grad)) for name, cut in slices.items()}
    return (y_parallel, output_cut(y_dense)), (x_parallel.grad, input_cut(x_dense.grad)), grads


def _layer_cases():
    rank, size = runtime.rank(), runtime.world_size()
    torch.manual_seed(0)

    def rows(t):
        return t.chunk(size, dim=0)[rank]

    def columns(t):
        return t.chunk(size, dim=-1)[rank]

    wide = nn.Linear(D_MODEL, 4 * D_MODEL)
    narrow = nn.Linear(4 * D_MODEL, D_MODEL)
    mlp, attention = models.MLP(D_MODEL, 4 * D_MODEL), models.SelfAttention(D_MODEL, HEADS)
    x, x_wide = _inputs(BATCH, SEQ, D_MODEL), _inputs(BATCH, SEQ, 4 * D_MODEL)
    return {
        "column": _compare(
            wide,
            tp.ColumnParallelLinear.from_dense(wide),
            x,
            {"weight": rows, "bias": rows},
            output_cut=columns,
        ),
        "column gathered": _compare(
            _copy(wide),
            tp.ColumnParallelLinear.from_dense(wide, gather_output=True),
            x,
            {"weight": rows, "bias": rows},
        ),
        "row": _compare(
            narrow,
            tp.RowParallelLinear.from_dense(narrow),
            x_wide,
            {"weight": columns, "bias": _whole},
            input_cut=columns,
        ),
        "mlp": _compare(
            mlp,
            tp.parallel_mlp(_copy(mlp)),
            x,
            {"fc1.weight": rows, "fc1.bias": rows, "fc2.weight": columns, "fc2.bias": _whole},
        ),
        "attention": _compare(
            attention,
            tp.parallel_attention(_copy(attention), HEADS),
            x,
            {"q.weight": rows, "v.bias": rows, "out.weight": columns, "out.bias": _whole},
        ),
    }


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_layers_equal_their_dense_counterparts_forward_and_backward(degree):
    for rank_results in launch(_layer_cases, degree):
        for name, (outputs, input_grads, grads) in rank_results.items():
            torch.testing.assert_close(*outputs, **TOLERANCE, msg=f"{name} forward")
            torch.testing.assert_close(*input_grads, **TOLERANCE, msg=f"{name} input gradient")
            for param, (ours, expected) in grads.items():
                torch.testing.assert_close(ours, expected, **TOLERANCE, msg=f"{name} {param} gradient")


def _converted_transformer():
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=16)
    dense = models.TinyTransformer(
        len(vocabulary), d_model=D_MODEL, n_heads=HEADS, n_layers=2, max_seq_len=16
    )
    parallel = tp.apply_tensor_parallel(_copy(dense))
    batch, labels = inputs[:BATCH], targets[:BATCH]
    dense_loss, parallel_loss = models.lm_loss(dense(batch), labels), models.lm_loss(parallel(batch), labels)
    dense_loss.backward()
    parallel_loss.backward()
    # replicated parameters (embeddings, norms, row biases) get the full gradient on every rank
    replicated = ["0.tokens.weight", "1.norm1.weight", "1.attention.out.bias", "3.proj.weight"]
    dense_params, parallel_params = dict(dense.named_parameters()), dict(parallel.named_parameters())
    return (
        parallel_loss.detach(),
        dense_loss.detach(),
        [(parallel_params[n].grad, dense_params[n].grad) for n in replicated],
    )


@pytest.mark.parametrize("degree", [2, 4])
def test_a_converted_dense_transformer_computes_the_same(degree):
    for ours, expected, grads in launch(_converted_transformer, degree):
        torch.testing.assert_close(ours, expected, **TOLERANCE)
        for parallel_grad, dense_grad in grads:
            torch.testing.assert_close(parallel_grad, dense_grad, **TOLERANCE)


def _traffic():
    torch.manual_seed(0)
    counted = {}
    for name, block in {
        "mlp": tp.parallel_mlp(models.MLP(D_MODEL, 4 * D_MODEL)),
        "attention": tp.parallel_attention(models.SelfAttention(D_MODEL, HEADS), HEADS),
    }.items():
        with comm.CommLog() as log:
            block(_inputs(BATCH, SEQ, D_MODEL)).sum().backward()  # the input requires grad, as inside a model
        counted[name] = (log.count("all_reduce"), {record.tensor_bytes for record in log.records})
    return counted


@pytest.mark.parametrize("degree", [2, 4])
def test_mlp_and_attention_cost_one_all_reduce_forward_and_one_backward(degree):
    for calls, message_bytes in launch(_traffic, degree)[0].values():
        assert calls == 2
        assert message_bytes == {BATCH * SEQ * D_MODEL * 4}  # the activation, never the 4x wider hidden layer


@pytest.mark.timing
def test_tp_benchmark_prints_the_promised_json():
    from conftest import assert_accounted, run_bench

    result = run_bench("tp", "--d-model", "32", "--seq", "8", "--batch", "3", "--steps", "2", "--warmup", "1")
    for name in ("mlp", "attention"):
        assert {"course_step_ms", "torch_step_ms", "ratio"} <= set(result[name])
        assert_accounted(result[name], ["course", "torch"])
        assert result[name]["bytes_per_rank_measured"] == result[name]["bytes_per_rank_theory"]


def _bad_degrees():
    from conftest import user_errors

    return user_errors(
        {
            "linear": lambda: tp.ColumnParallelLinear(10, 9),
            "heads": lambda: tp.parallel_attention(models.SelfAttention(24, 3), 3),
        }
    )


def test_a_degree_that_does_not_divide_is_refused():
    errors = launch(_bad_degrees, 2)[0]
    assert "output features 9 does not divide by the tensor-parallel degree 2" in errors["linear"]
    assert "attention heads 3 does not divide by the tensor-parallel degree 2" in errors["heads"]
    with pytest.raises(UserError, match="does not divide the attention heads"):
        tp.check_tensor_parallel_degree(64, 4, 256, 3)
