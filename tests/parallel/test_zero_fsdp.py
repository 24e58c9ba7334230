"""The course's ZeRO-1/2 and FSDP equal one process and PyTorch's FSDP2; they shard memory as modelled."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import memory, zero
from course_lib.parallel.fsdp import FullyShardedDataParallel, MixedPrecision
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.tools import bench

from conftest import assert_accounted, run_bench, unexplained_beyond_load_share

GLOBAL_BATCH, STEPS = 60, 3
TOLERANCE = dict(rtol=1e-5, atol=5e-6)
# bf16 keeps 8 bits of mantissa: ~0.4% per rounding, a few steps of it
BF16_TOLERANCE = dict(rtol=0, atol=2e-2)
ADAM_LR = 1e-2
PARAMS = 35_173  # digits_cnn: odd, divisible by none of 2, 3, 4
VARIANTS = {
    "zero1": ("zero", dict(stage=1)),
    "zero2": ("zero", dict(stage=2)),
    "FULL_SHARD": ("fsdp", dict(sharding_strategy="FULL_SHARD")),
    "SHARD_GRAD_OP": ("fsdp", dict(sharding_strategy="SHARD_GRAD_OP")),
    "NO_SHARD": ("fsdp", dict(sharding_strategy="NO_SHARD")),
}
NO_PREFETCH = dict(forward_prefetch=False, backward_prefetch=False)
# the same without overlap: prefetching and asynchronous reduce-scatters change when, never what
VARIANTS |= {
    f"{name}, no prefetch": ("fsdp", options | NO_PREFETCH)
    for name, (kind, options) in VARIANTS.items()
    if kind == "fsdp"
}
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=ADAM_LR, weight_decay=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _global_batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=generator), torch.randint(
        0, 10, (GLOBAL_BATCH,), generator=generator
    )


def _wrap(kind: str, model: nn.Module, **options) -> nn.Module:
    if kind == "zero":
        return ZeroDataParallel(model, **options)
    if kind == "fsdp":
        return FullyShardedDataParallel(model, auto_wrap_policy=models.sharding_units(model), **options)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in models.sharding_units(model):
            fully_shard(unit, **options)
        return fully_shard(model, **options)
    return model


def _full_weights(model: nn.Module) -> torch.Tensor:
    """All weights in the order of a plain model's state dict, whatever the wrapper."""
    if hasattr(model, "full_state_dict"):
        state = model.full_state_dict()
    else:
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()
        }
    keys = models.build_model("digits_cnn").state_dict().keys()
    return torch.cat([state[k].detach().float().reshape(-1) for k in keys])


def _train(kind: str, optimizer: str = "adamw", steps: int = STEPS, clip: float | None = None, **options):
    """``steps`` optimizer steps; every rank computes on its interleaved slice of each global batch."""
    n, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    model = _wrap(kind, models.build_model("digits_cnn"), **options)
    opt = OPTIMIZERS[optimizer](model.parameters())
    norms = []
    for step in range(steps):
        inputs, targets = _global_batch(step)
        if kind != "single":
            inputs, targets = inputs[rank::n], targets[rank::n]
        opt.zero_grad()
        F.cross_entropy(model(inputs).float(), targets).backward()
        if clip is not None:
            clipper = (
                model.clip_grad_norm_
                if hasattr(model, "clip_grad_norm_")
                else (lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))
            )
            norms.append(float(clipper(clip)))
        opt.step()
    return _full_weights(model), norms


def _all_variants(optimizer: str):
    results = {name: _train(kind, optimizer, **options)[0] for name, (kind, options) in VARIANTS.items()}
    results["fsdp2"] = _train("fsdp2", optimizer)[0]
    return results


@pytest.fixture(scope="module")
def single():
    return {name: launch(_train, 1, "single", name)[0][0] for name in OPTIMIZERS}


@pytest.mark.parametrize("world_size, optimizer", [(1, "adamw"), (2, "adamw"), (3, "sgd"), (4, "adam")])
def test_every_stage_and_strategy_equals_one_process_and_fsdp2(world_size, optimizer, single):
    ranks = launch(_all_variants, world_size, optimizer)
    for rank_result in ranks[1:]:  # every rank ends with the same model
        for name in VARIANTS:
            torch.testing.assert_close(rank_result[name], ranks[0][name], rtol=0, atol=0)
    for name in VARIANTS:
        torch.testing.assert_close(
            ranks[0][name], single[optimizer], **TOLERANCE, msg=f"{name} vs one process"
        )
        torch.testing.assert_close(ranks[0][name], ranks[0]["fsdp2"], **TOLERANCE, msg=f"{name} vs FSDP2")


def _hybrid():
    from torch.distributed.device_mesh import init_device_mesh

    ours = _train("fsdp", sharding_strategy="HYBRID_SHARD", hybrid_shard_size=2)[0]
    unhurried = _train("fsdp", sharding_strategy="HYBRID_SHARD", hybrid_shard_size=2, **NO_PREFETCH)[0]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    theirs = _train("fsdp2", mesh=mesh)[0]  # FSDP2 on a 2-D mesh is HSDP
    return ours, unhurried, theirs


def test_hybrid_shard_on_a_2x2_mesh_equals_hsdp_and_one_process(single):
    ours, unhurried, theirs = launch(_hybrid, 4)[0]
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    torch.testing.assert_close(ours, single["adamw"], **TOLERANCE)
    torch.testing.assert_close(unhurried, ours, rtol=0, atol=0)


def _offload_and_checkpointing():
    plain = _train("fsdp")[0]
    results = {"plain": plain}
    for prefetch, options in (("", {}), (", no prefetch", NO_PREFETCH)):
        for mode in ("params", "full"):
            results[mode + prefetch] = _train("fsdp", cpu_offload=mode, **options)[0]
        results["checkpointed" + prefetch] = _train("fsdp", activation_checkpointing=True, **options)[0]
    return results


def test_offload_and_activation_checkpointing_change_nothing_numerically():
    results = launch(_offload_and_checkpointing, 3)[0]
    for name, weights in results.items():
        torch.testing.assert_close(weights, results["plain"], rtol=0, atol=0, msg=name)


def _bf16():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _train("fsdp", mixed_precision=precision)[0]
    unhurried = _train("fsdp", mixed_precision=precision, **NO_PREFETCH)[0]
    assert torch.equal(ours, unhurried)  # overlap changes when things happen, never what
    theirs = _train(
        "fsdp2", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )[0]
    return ours, theirs


def test_bf16_mixed_precision_stays_within_tolerance(single):
    ours, theirs = launch(_bf16, 2)[0]
    torch.testing.assert_close(ours, theirs, **BF16_TOLERANCE)  # the same recipe as PyTorch's
    # Against fp32: Adam divides by the gradient's own scale, so where a gradient is near zero bf16
    # rounding can flip the sign of a step; one step moves a weight by at most about lr, so the
    # bound is 2·lr per step. Almost all weights are far closer.
    difference = (ours - single["adamw"]).abs()
    assert difference.max() <= 2 * ADAM_LR * STEPS
    assert difference.median() < 1e-3
    assert difference.max() > 0  # it really computed in bf16


@pytest.mark.parametrize("kind, options", [("fsdp", {}), ("zero", dict(stage=2))])
def test_clip_grad_norm_equals_the_single_process_norm(kind, options):
    reference_weights, reference_norms = launch(_train, 1, "single", "adamw", STEPS, 0.25)[0]
    weights, norms = launch(_train, 3, kind, "adamw", STEPS, 0.25, **options)[0]
    assert min(reference_norms) > 0.25  # the clip really acted
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    torch.testing.assert_close(weights, reference_weights, **TOLERANCE)


def test_clip_grad_max_norm_is_the_max_over_all_shards():
    ours, expected = launch(_clip_inf, 3, "fsdp", {})[0]
    assert ours == pytest.approx(expected, rel=1e-6)


def _clip_inf(kind: str, options: dict):
    """Max-norm: compare the sharded result with the max over the full averaged gradient, same step."""
    n, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    model = _wrap(kind, models.build_model("digits_cnn"), **options)
    torch.manual_seed(0)
    reference = models.build_model("digits_cnn")
    inputs, targets = _global_batch(0)
    F.cross_entropy(reference(inputs), targets).backward()
    expected = max(p.grad.abs().max() for p in reference.parameters())
    F.cross_entropy(model(inputs[rank::n]), targets[rank::n]).backward()
    return float(model.clip_grad_norm_(1e-3, norm_type=float("inf"))), float(expected)


def _measure(sharding: str):
    """Model-state bytes held by this rank after two Adam steps, and bytes sent during the second."""
    torch.manual_seed(0)
    model = models.build_model("digits_cnn")
    inputs, targets = _global_batch(0)
    return bench.measure_sharding(model, sharding, inputs, targets, units=models.sharding_units(model))


@pytest.mark.parametrize("sharding", memory.SHARDINGS)
def test_memory_per_rank_falls_with_n_as_the_model_says_and_traffic_matches(sharding):
    measured_totals = []
    for world_size in (2, 4):
        measured, sent = launch(_measure, world_size, sharding)[0]
        model = memory.model_state_bytes(PARAMS, world_size, sharding, **memory.FP32_ADAM)
        assert measured.params == pytest.approx(model.params, rel=0.02)
        assert measured.grads == pytest.approx(model.grads, rel=0.02)
        assert measured.optimizer == pytest.approx(model.optimizer, rel=0.02)
        theory = 4 * memory.traffic_elements_per_rank(PARAMS, world_size, sharding)
        assert sent == pytest.approx(theory, rel=0.001)  # padding adds a few elements
        measured_totals.append(measured.total)
    if sharding != "ddp":
        assert measured_totals[1] < measured_totals[0]


def _save_sharded(directory: str, steps: int):
    torch.manual_seed(0)
    model = _wrap("fsdp", models.build_model("digits_cnn"))
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    _steps(model, optimizer, range(steps))
    dcp.save(
        {"model": model.sharded_state_dict(), "optimizer": model.sharded_optimizer_state_dict(optimizer)},
        checkpoint_id=directory,
    )
    return _full_weights(model)


def _steps(model, optimizer, steps):
    n, rank = runtime.world_size(), runtime.rank()
    for step in steps:
        inputs, targets = _global_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[rank::n]), targets[rank::n]).backward()
        optimizer.step()


def _resume_sharded(directory: str, first_step: int, last_step: int):
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = _wrap("fsdp", models.build_model("digits_cnn"))
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    state = {"model": model.sharded_state_dict(), "optimizer": model.sharded_optimizer_state_dict(optimizer)}
    dcp.load(state, checkpoint_id=directory)  # reads, in place, the pieces this layout needs
    loaded = _full_weights(model)
    _steps(model, optimizer, range(first_step, last_step))
    return loaded, _full_weights(model)


def test_sharded_checkpoint_saved_on_2_ranks_resumes_on_1_3_and_4(tmp_path):
    saved = launch(_save_sharded, 2, str(tmp_path / "ckpt"), 2)[0]
    uninterrupted = launch(_train, 2, "fsdp", "adamw", 4)[0][0]
    for world_size in (1, 3, 4):
        loaded, continued = launch(_resume_sharded, world_size, str(tmp_path / "ckpt"), 2, 4)[0]
        torch.testing.assert_close(loaded, saved, rtol=0, atol=0)
        torch.testing.assert_close(
            continued, uninterrupted, **TOLERANCE, msg=f"resumed on {world_size} ranks"
        )


def _full_state_round_trip():
    torch.manual_seed(0)
    model = _wrap("fsdp", models.build_model("digits_cnn"))
    _steps(model, OPTIMIZERS["sgd"](model.parameters()), range(2))
    state = model.full_state_dict()
    plain = models.build_model("digits_cnn")
    plain.load_state_dict(state)  # the original names and shapes
    fresh = _wrap("fsdp", models.build_model("digits_cnn"), sharding_strategy="SHARD_GRAD_OP")
    fresh.load_full_state_dict(state)
    inputs = _global_batch(9)[0]
    with torch.no_grad():
        return plain(inputs), fresh(inputs), model(inputs)


def test_full_state_dict_loads_into_a_plain_model_and_back():
    plain, fresh, original = launch(_full_state_round_trip, 3)[1]
    torch.testing.assert_close(plain, original, **TOLERANCE)
    torch.testing.assert_close(fresh, original, rtol=0, atol=0)


def _gather_and_stats():
    torch.manual_seed(0)
    model = _wrap("fsdp", models.build_model("digits_cnn"))
    optimizer = torch.optim.Adam(model.parameters())
    _steps(model, optimizer, range(1))
    before = model.memory_stats(optimizer)
    with model.gathered_parameters():
        weight = model.module[3].weight.detach().clone()  # the head, whole, under its usual name
        during = model.memory_stats()
    after = model.memory_stats()
    return weight, model.full_state_dict()["3.weight"], before, during, after


def test_gather_parameters_and_memory_stats():
    weight, expected, before, during, after = launch(_gather_and_stats, 2)[0]
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)
    assert before["current"]["unsharded_params"] == 0 == after["current"]["unsharded_params"]
    # every unit whole: the model plus at most one element of padding per unit of 2 shards
    assert 4 * PARAMS <= during["current"]["unsharded_params"] <= 4 * (PARAMS + 4)
    assert before["current"]["sharded_params"] == pytest.approx(4 * PARAMS / 2, rel=0.01)
    assert before["current"]["optimizer_state"] >= 2 * before["current"]["sharded_params"]
    assert before["peak"]["unsharded_grads"] > 0  # a unit's full gradient existed during backward
    assert before["peak"]["total"] >= before["current"]["sharded_params"]


def _accumulate():
    n, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    model = _wrap("fsdp", models.build_model("digits_cnn"))
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    for step in range(STEPS):
        inputs, targets = _global_batch(step)
        inputs, targets = inputs[rank::n].chunk(2), targets[rank::n].chunk(2)
        optimizer.zero_grad()
        with model.no_sync():
            (F.cross_entropy(model(inputs[0]), targets[0]) / 2).backward()
        (F.cross_entropy(model(inputs[1]), targets[1]) / 2).backward()
        optimizer.step()
    return _full_weights(model)


def test_no_sync_accumulation_equals_one_step_on_the_whole_batch(single):
    torch.testing.assert_close(launch(_accumulate, 3)[0], single["sgd"], **TOLERANCE)


class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
        self.head = nn.Linear(3, 2)


def _bad_inputs():
    errors = {}
    cases = {
        "nothing": lambda: _wrap_with(models.build_model("digits_cnn"), auto_wrap_policy=nn.LSTM),
        "everything": lambda: _wrap_with(
            models.build_model("digits_cnn"), auto_wrap_policy=lambda module: True
        ),
        "root": lambda: _wrap_with(models.build_model("digits_cnn"), auto_wrap_policy=models.DigitsCNN),
        "hybrid": lambda: _wrap_with(
            models.build_model("digits_cnn"), sharding_strategy="HYBRID_SHARD", hybrid_shard_size=3
        ),
        "offload": lambda: _wrap_with(models.build_model("digits_cnn"), cpu_offload="params", device="cuda"),
        "dtypes": lambda: FullyShardedDataParallel(_TwoDtypes()),
        "mixed_precision": lambda: _wrap_with(
            models.build_model("digits_cnn"), mixed_precision=MixedPrecision(param_dtype=torch.int8)
        ),
        "strategy": lambda: _wrap_with(models.build_model("digits_cnn"), sharding_strategy="FULL"),
        "zero_stage": lambda: ZeroDataParallel(models.build_model("digits_cnn"), stage=3),
    }
    for name, case in cases.items():
        try:
            case()
            errors[name] = None
        except UserError as error:
            errors[name] = str(error)
    comm.barrier()  # every rank got here: nobody hangs
    return errors


def _wrap_with(model, **options):
    options.setdefault("auto_wrap_policy", models.sharding_units(model))
    return FullyShardedDataParallel(model, **options)


def test_bad_inputs_get_clear_errors_on_every_rank():
    if torch.cuda.is_available():
        pytest.skip("the offload case checks the message for a machine without CUDA")
    errors = launch(_bad_inputs, 2, timeout_s=120)
    assert errors[0] == errors[1]
    errors = errors[0]
    assert "wraps no submodule with parameters" in errors["nothing"] and "'Sequential'" in errors["nothing"]
    assert (
        "wraps every one of the 12 submodules, even 5 without parameters (such as ReLU)"
        in errors["everything"]
    )
    assert "matches the model itself (DigitsCNN)" in errors["root"]
    assert "shard group size that divides the 2 ranks, got 3" in errors["hybrid"]
    assert "sees no CUDA device" in errors["offload"] and "cpu_offload='params'" in errors["offload"]
    assert "mixes block.0.weight (torch.float32" in errors["dtypes"]
    assert "block.1.weight (torch.float64" in errors["dtypes"]
    assert "use a floating-point torch dtype" in errors["mixed_precision"]
    assert "unknown sharding strategy 'FULL'" in errors["strategy"]
    assert "does stage 1 or 2" in errors["zero_stage"]


@pytest.mark.slow
@pytest.mark.timing
def test_fsdp_benchmark_prints_the_promised_json():
    result = run_bench(
        "fsdp", "--width", "63", "--layers", "3", "--steps", "2", "--warmup", "1", "--world-size", "3"
    )
    for key in ("torch_step_ms", "course_step_ms", "ratio", "step_ms_by_sharding_strategy"):
        assert key in result
    assert set(result["step_ms_by_sharding_strategy"]) == {
        "FULL_SHARD",
        "SHARD_GRAD_OP",
        "NO_SHARD",
        "HYBRID_SHARD",
        "FULL_SHARD, no prefetch",
    }
    assert result["ratio_no_prefetch"] == result["course_no_prefetch_step_ms"] / result["torch_step_ms"]
    for variant in ("course", "torch", "course_no_prefetch"):  # where each step goes, side by side
        assert 0 <= result[variant]["exposed_communication_share"] <= 1
        assert unexplained_beyond_load_share(result[variant]) <= 0.10
    assert result["params"] == 3 * 64 * 63
    # two all-gathers and one reduce-scatter of the padded units: a few elements more than 3(N-1)/N Ψ
    assert result["full_shard_bytes_per_rank_measured"] == pytest.approx(
        result["full_shard_bytes_per_rank_theory"], rel=1e-3
    )


@pytest.mark.slow
@pytest.mark.timing
def test_memory_benchmark_matches_the_model_within_two_percent():
    result = run_bench("memory", "--width", "65", "--layers", "2", "--world-sizes", "2", "3")
    assert [(row["world_size"], row["sharding"]) for row in result["rows"]] == [
        (n, sharding) for n in (2, 3) for sharding in memory.SHARDINGS
    ]
    assert result["max_ratio_error"] < 0.02
    assert result["max_traffic_ratio_error"] < 0.01
    for row in result["rows"]:  # ddp, zero1, zero2, fsdp: where each one's step goes
        assert_accounted(row, ["course"])


def _zero2_gradient_memory() -> tuple[int, int, int, list[int]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 8 x 257 KB of fp32 gradients
    wrapped = ZeroDataParallel(model, stage=2, bucket_mb=0.25)  # a bucket closes at each weight
    optimizer = torch.optim.Adam(wrapped.parameters())
    peak = [0]  # read after each gradient arrives, once the wrapper's own hook has run

    def read(_):
        peak[0] = max(peak[0], wrapped.gradient_bytes_held())

    for slot in wrapped.flat.slots:
        slot.leaf.register_post_accumulate_grad_hook(read)
    inputs = torch.randn(16, 256) + runtime.rank()
    with comm.CommLog() as log:
        for _ in range(2):
            optimizer.zero_grad()
            wrapped(inputs).square().mean().backward()
            optimizer.step()
    full = 4 * sum(slot.numel for slot in wrapped.flat.slots)
    held_after = memory.measure_model_states(wrapped, optimizer=optimizer).grads
    sizes = [r.tensor_bytes for r in log.records if r.op == "reduce_scatter"]
    return peak[0], full, held_after, sizes


def test_zero2_reduces_bucket_by_bucket_and_never_holds_the_whole_gradient():
    peak, full, held_after, sizes = launch(_zero2_gradient_memory, 4)[0]
    assert len(sizes) == 2 * 8 and sum(sizes) == 2 * full  # one reduce-scatter per bucket, every element once
    shard = 4 * math.ceil(full / 4 / 4)
    assert held_after == shard  # after backward only this rank's shard of the gradient is kept
    # during backward: the shard, one parameter's gradient, and at most two buckets in flight
    assert peak <= shard + (zero.BUCKETS_IN_FLIGHT + 1) * max(sizes), (peak, full)
    assert peak < 0.7 * full, (peak, full)  # the whole gradient never exists at once


def _frozen_middle(kind: str):
    n, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Sequential(nn.Linear(7, 7), nn.Tanh()), nn.Linear(7, 3))
    model[1].requires_grad_(False)  # a frozen block between two trained ones
    if kind == "fsdp":
        model = FullyShardedDataParallel(model, auto_wrap_policy=[model[0], model[1], model[2]])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(12, 5, generator=generator), torch.randn(12, 3, generator=generator)
    if kind == "fsdp":
        inputs, targets = inputs[rank::n], targets[rank::n]
    for _ in range(3):
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    state = model.full_state_dict() if kind == "fsdp" else model.state_dict()
    return torch.cat([state[key].reshape(-1) for key in sorted(state)])


def test_a_frozen_unit_is_gathered_for_backward_and_not_updated():
    torch.testing.assert_close(
        launch(_frozen_middle, 3, "fsdp")[0], launch(_frozen_middle, 1, "single")[0], **TOLERANCE
    )


def _units_in_flight(prefetch: bool, reshard_first: bool = True):
    """The most units whole at once during two steps of a 6-unit MLP, and its weights after them."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])  # six units; the root holds none
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=nn.Linear, forward_prefetch=prefetch, backward_prefetch=prefetch
    )
    if not reshard_first:
        wrapped.set_reshard_after_forward(model[0], False)  # FSDP2-style, for this unit only
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    inputs = torch.randn(8, 16) + runtime.rank()
    with comm.CommLog() as log:
        for _ in range(2):
            optimizer.zero_grad()
            wrapped(inputs).square().mean().backward()
            optimizer.step()
    return wrapped.max_units_gathered, log.count("all_gather"), wrapped.full_state_dict()


def test_prefetch_keeps_at_most_two_units_whole_and_changes_no_number():
    with_prefetch, gathers, weights = launch(_units_in_flight, 2, True)[0]
    without, gathers_without, weights_without = launch(_units_in_flight, 2, False)[0]
    assert with_prefetch == 2  # the next unit's parameters travel while one computes: two at once
    assert without == 1  # one after the other
    assert gathers == gathers_without == 2 * 2 * 6  # the same all-gathers, only earlier
    for name in weights:
        torch.testing.assert_close(weights[name], weights_without[name], rtol=0, atol=0)


def test_a_unit_kept_whole_after_forward_needs_no_second_all_gather():
    _, resharded, weights = launch(_units_in_flight, 2, True)[0]
    _, kept, weights_kept = launch(_units_in_flight, 2, True, False)[0]
    assert kept == resharded - 2  # one all-gather less per step, for the unit kept whole
    for name in weights:
        torch.testing.assert_close(weights[name], weights_kept[name], rtol=0, atol=0)
