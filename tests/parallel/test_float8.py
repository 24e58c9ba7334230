"""Float8 training: scales that fit each tensor into the format, matmuls close to high precision, and a
training run whose loss stays closer to bf16's than two bf16 seeds stay to each other."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from course_lib import models
from course_lib.distributed import comm
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import float8
from course_lib.parallel.fsdp import FullyShardedDataParallel
from course_lib.parallel.fsdp_units import MixedPrecision, check_options

from conftest import tiny_transformer


def _relative_error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.float() - exact.float()).norm() / exact.float().norm()).item()


def test_a_scale_puts_the_largest_magnitude_on_the_formats_largest_value():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 1e-3  # far below e4m3's range
    data, scale = float8.to_float8(x, torch.float8_e4m3fn)
    assert data.float().abs().max().item() == torch.finfo(torch.float8_e4m3fn).max == 448
    # 3 bits of mantissa: each element within half a step, 2^-4 of its magnitude, once scaled back
    back = data.float() * scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-12).all()
    rows, row_scales = float8.to_float8(x, torch.float8_e5m2, dim=1)
    assert row_scales.shape == (64, 1) and rows.dtype == torch.float8_e5m2


def test_rowwise_scales_keep_an_outlier_row_from_costing_the_others_their_digits():
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=generator), torch.randn(64, 48, generator=generator)
    # one token 100,000 times larger than the rest: scaled with it, the others fall below e4m3's
    # smallest normal number (2^-6) and lose their digits (at 1,000 times, both recipes still hold)
    a[0] *= 1e5
    errors = {}
    for recipe in float8.RECIPES:
        product = float8.scaled_matmul(
            a, b, recipe=recipe, a_dtype=torch.float8_e4m3fn, out_dtype=torch.float32
        )
        errors[recipe] = _relative_error(product[1:], a[1:] @ b)
    assert errors["rowwise"] < 0.1 < errors["tensorwise"], errors


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_float8_layer_computes_what_the_linear_layer_does_to_a_few_percent_forward_and_backward(recipe):
    torch.manual_seed(0)
    dense = nn.Linear(64, 48)
    layer = float8.Float8Linear.from_linear(dense, recipe=recipe)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    exact_x = x.detach().clone().requires_grad_()
    ours, exact = layer(x), nn.functional.linear(exact_x, dense.weight.detach().requires_grad_(), dense.bias)
    assert _relative_error(ours, exact) < 0.1
    grad = torch.randn_like(exact)
    ours.backward(grad)
    weight = dense.weight.detach().clone().requires_grad_()
    nn.functional.linear(exact_x, weight, dense.bias.detach()).backward(grad)
    assert _relative_error(x.grad, exact_x.grad) < 0.1  # e5m2 gradients (tensorwise): about 6 %
    assert _relative_error(layer.weight.grad, weight.grad) < 0.1


def _torchao_twin(module: nn.Module, recipe: str, names: list[str]) -> None:
    """torchao's float8 training applied to ``module`` in place, on the layers named."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(module, config=config, module_filter_fn=lambda _, name: name in names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_float8_layer_is_torchaos_float8_linear_bit_for_bit(recipe, dtype):
    """The same casts (scale = 448 / amax, in float64 then float32; rowwise scales a power of two),
    the same three scaled matmuls. In float32, torchao's rowwise product returns bf16 and is cast
    back (a workaround for torch._scaled_mm), so there the two agree to bf16's rounding only."""
    torch.manual_seed(0)
    dense = nn.Linear(64, 48).to(dtype)
    ours = float8.Float8Linear.from_linear(copy.deepcopy(dense), recipe=recipe)
    theirs = nn.Sequential(copy.deepcopy(dense))
    _torchao_twin(theirs, recipe, ["0"])
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    mine, their_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, their_out = ours(mine), theirs(their_x)
    grad = torch.randn_like(out)
    out.backward(grad)
    their_out.backward(grad)
    pairs = [(out, their_out), (mine.grad, their_x.grad), (ours.weight.grad, theirs[0].weight.grad)]
    for ours_tensor, their_tensor in pairs:
        if recipe == "rowwise" and dtype == torch.float32:
            assert _relative_error(ours_tensor, their_tensor) < 2**-8
        else:
            assert torch.equal(ours_tensor, their_tensor)


def test_float8_training_is_torchaos_step_for_step():
    """A bf16 transformer trained 4 steps with the course's float8 layers and with torchao's: the
    same losses and the same weights, bit for bit, under both recipes (the output head stays bf16)."""
    for recipe in float8.RECIPES:
        runs = {}
        for name in ("course", "torchao"):
            model, inputs, targets = tiny_transformer(seq=16, d_model=32, heads=4)
            model = model.bfloat16()
            if name == "course":
                # the head's projection left out by name, as torchtitan leaves it (here its 45-word
                # vocabulary is no multiple of 16 either)
                float8.apply_float8(model, recipe=recipe, skip=(f"{len(model) - 1}.proj",))
                converted = float8.float8_layers(model)
            else:
                _torchao_twin(model, recipe, converted)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for step in range(4):
                loss = models.lm_loss(
                    model(inputs[8 * step : 8 * step + 8]), targets[8 * step : 8 * step + 8]
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            runs[name] = (losses, model.state_dict())
        assert len(converted) == 12 and runs["course"][0] == runs["torchao"][0], (recipe, runs)
        for key, tensor in runs["course"][1].items():
            assert torch.equal(tensor, runs["torchao"][1][key]), (recipe, key)


def test_float8_training_stays_closer_to_bf16_than_two_bf16_seeds_do():
    """``bench float8``'s four runs of 60 steps: each recipe's final loss is nearer bf16's than two
    bf16 seeds' are to each other (in a process of its own, one thread: the suite's other worker
    shares these cores)."""
    from course_lib.tools.bench import float8_training_benchmark

    result = launch(float8_training_benchmark, 1)[0]
    assert set(result["curves"]) == {"bf16", "bf16, another seed", "float8 tensorwise", "float8 rowwise"}
    assert all(len(curve) == 60 for curve in result["curves"].values())
    for recipe in float8.RECIPES:
        assert result["distance_to_bf16"][recipe] < result["seed_noise"], result["final_loss"]


def test_what_the_scaled_matmul_cannot_take_is_refused_in_one_line(monkeypatch):
    with pytest.raises(UserError, match="float8 needs in_features a multiple of 16 .* got 20: pad the layer"):
        float8.Float8Linear(20, 32)
    with pytest.raises(UserError, match="recipe"):
        float8.Float8Linear(32, 32, recipe="blockwise")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 20), nn.Linear(20, 32))
    float8.apply_float8(model, skip=("0",))
    assert float8.float8_layers(model) == []  # 0 skipped, 1 and 2 not multiples of 16
    # a skip list that matches nothing would convert the head it meant to keep: refused by name
    with pytest.raises(UserError, match=r"skip names 'output', which is not a module .* children: 0, 1, 2"):
        float8.apply_float8(model, skip=("output",))
    with pytest.raises(UserError, match=r"write \('0',\)"):
        float8.apply_float8(model, skip="0")
    nested = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)))
    float8.apply_float8(nested, skip=("1",))
    assert float8.float8_layers(nested) == ["0"]  # a module named skips all inside it

    with pytest.raises(UserError, match="the parameters travel in param_dtype .* or as float8"):
        check_options("FULL_SHARD", "none", MixedPrecision(gather_dtype=torch.int8))  # FSDP's door check

    def no_rowwise(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", no_rowwise)
    with pytest.raises(
        UserError, match="cannot scale float8 matmuls by row on cpu .*: use recipe='tensorwise'"
    ):
        float8.Float8Linear(32, 32, recipe="rowwise")


def _fsdp_gathers() -> dict:
    """One forward and backward of FSDP with bf16 parameters gathered as bf16, then as float8: the
    bytes each rank gathered, the loss, and every unit's weights as the ranks rebuilt them."""
    result = {}
    for name, gather in (("bf16", None), ("float8", torch.float8_e4m3fn)):
        model, inputs, targets = tiny_transformer(seq=16, d_model=32, heads=4)
        policy = MixedPrecision(param_dtype=torch.bfloat16, gather_dtype=gather)
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=models.sharding_units(model), mixed_precision=policy
        )
        with comm.CommLog() as log:
            loss = models.lm_loss(wrapped(inputs[:6]), targets[:6])
            loss.backward()
        weights = []
        for unit in wrapped.units:
            unit.flat.gather()
            weights.append(unit.flat.full[: unit.flat.total].float().clone())
        result[name] = {"loss": loss.item(), "gathered": log.bytes_per_rank("all_gather"), "weights": weights}
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_fsdps_float8_all_gather_halves_the_bytes_and_rebuilds_what_one_process_casts(world):
    """One scale per unit, its amax over every rank: the gathered float8 vector is the cast of the
    whole unit, so every rank computes with exactly what one process would (parameter counts that
    divide by neither 2 nor 3)."""
    one = launch(_fsdp_gathers, 1)[0]
    for result in launch(_fsdp_gathers, world):
        assert result["float8"]["gathered"] * 2 == result["bf16"]["gathered"] > 0  # a byte, not two
        for ours, alone in zip(result["float8"]["weights"], one["float8"]["weights"], strict=True):
            assert torch.equal(ours, alone)
        assert result["float8"]["loss"] == pytest.approx(one["float8"]["loss"], rel=1e-6)
        for cast, plain in zip(result["float8"]["weights"], result["bf16"]["weights"], strict=True):
            assert _relative_error(cast, plain) < 0.05  # e4m3's 3 bits of mantissa
    assert sum(w.numel() for w in one["bf16"]["weights"]) % 6  # divides by neither degree
