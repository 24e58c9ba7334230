"""The kernel model: matmuls in waves of tiles, fitted to a GPU's record; the fit recovers known
terms, explains the committed H100 record better than a flat fraction, and drives the step's
compute when a cluster names its GPU."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from course_lib.errors import UserError
from course_lib.plan import compute_model, kernels, memory_model
from course_lib.plan.layout import Layout
from course_lib.plan.specs import CLUSTERS, MODELS, StepShape

H100 = kernels.GPUS["h100-sxm"]
RECORD = json.loads((kernels.GPU_RECORDS / "nvidia-h100-80gb-hbm3.json").read_text())


def _synthetic_record(tile, sustained, latency, *, noise: float) -> dict:
    """The committed record's shapes, timed by the model itself with known terms and noise."""
    rng = random.Random(0)
    record = json.loads(json.dumps(RECORD))
    for product in record["matmuls"]:
        m, k, n = product["shape"]
        waves = math.ceil(math.ceil(m / tile[0]) * math.ceil(n / tile[1]) / H100.multiprocessors)
        seconds = waves * (
            2 * tile[0] * tile[1] * k / (sustained * H100.peak_flops / H100.multiprocessors) + latency
        )
        product["seconds"] = seconds * math.exp(rng.gauss(0, noise))
    return record


def test_the_fit_recovers_the_terms_that_made_the_times():
    fit = kernels.fit_record(_synthetic_record((128, 256), 0.72, 5e-6, noise=0.02), H100)
    assert fit.tile == (128, 256)
    assert fit.sustained == pytest.approx(0.72, rel=0.02)
    assert fit.wave_latency_s == pytest.approx(5e-6, rel=0.1)
    assert fit.rms_log_error == pytest.approx(0.02, abs=0.01)


def test_the_h100_record_is_explained_better_than_by_a_flat_fraction():
    fit = kernels.kernel_fit("nvidia-h100-80gb-hbm3")
    assert fit.products == 360
    assert fit.rms_log_error < 0.5 * fit.flat_rms_log_error
    assert 0.6 < fit.sustained < 0.95 and 0 < fit.wave_latency_s < 20e-6
    # the record's own rates, as fractions of the datasheet
    assert 0.3 < fit.attention_backward < fit.attention_forward < 0.8
    assert fit.pointwise_eager < fit.pointwise_compiled < 1 and 0 < fit.loss < fit.pointwise_eager


def test_a_product_pays_for_every_wave_it_starts():
    fit = kernels.kernel_fit(H100.record)
    rows, columns = fit.tile
    full = kernels.matmul_seconds(H100, rows * 12, columns * 11, 4096)  # 132 tiles: one wave
    one_more = kernels.matmul_seconds(H100, rows * 12, columns * 11 + 1, 4096)  # 144 tiles: two
    assert one_more == pytest.approx(2 * full)
    small = kernels.matmul_seconds(H100, 2048, 768, 4096)  # 8B's k/v projections over 8 tensor ranks
    big = kernels.matmul_seconds(H100, 8192, 4096, 4096)
    assert 2 * 2048 * 768 * 4096 / small < 0.5 * (2 * 8192 * 4096 * 4096 / big)
    assert kernels.matmul_seconds(H100, 0, 10, 10) == 0


def test_a_grouped_kernel_fills_the_waves_that_one_launch_per_expert_leaves_idle():
    fit = kernels.kernel_fit(H100.record)
    assert fit.grouped_products == 0 and fit.grouped_ratio == 1  # no grouped product recorded: assumed
    rows, columns = fit.tile
    # experts of 132 tiles each fill whole waves: grouping saves nothing
    whole = kernels.matmul_seconds(H100, rows * 12, columns * 11, 4096)
    assert kernels.grouped_matmul_seconds(H100, rows * 12, columns * 11, 4096, 8) == pytest.approx(8 * whole)
    # 16 fine-grained experts of 4 tiles: one wave each alone, one wave for all of them grouped
    small = kernels.matmul_seconds(H100, rows * 2, columns * 2, 2048)
    assert kernels.grouped_matmul_seconds(H100, rows * 2, columns * 2, 2048, 16) == pytest.approx(small)
    assert kernels.grouped_matmul_seconds(H100, 0, 10, 10, 4) == 0


def test_the_grouped_products_a_record_measured_set_the_grouped_rate():
    record = json.loads(json.dumps(RECORD))
    fit = kernels.fit_record(record, H100)
    modelled = kernels._tile_model_seconds(fit, H100, 512, 1408, 2048, 64, "bf16")
    record["grouped"] = [
        {"experts": 64, "d_model": 2048, "hidden": 1408, "rows": 64 * 512, "one_kernel": True,
         "grouped_s": 1.3 * modelled},
        {"experts": 64, "d_model": 2048, "hidden": 1408, "rows": 64 * 512, "one_kernel": False,
         "grouped_s": 9 * modelled},  # a loop standing in for the kernel: not the kernel's rate
    ]  # fmt: skip
    measured = kernels.fit_record(record, H100)
    assert measured.grouped_products == 1 and measured.grouped_ratio == pytest.approx(1.3)


def test_a_missing_record_names_the_command_that_makes_it(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "GPU_RECORDS", tmp_path)
    kernels.kernel_fit.cache_clear()
    try:
        with pytest.raises(UserError, match="run make gpu-record on that GPU"):
            kernels.kernel_fit("nvidia-h100-80gb-hbm3")
    finally:
        kernels.kernel_fit.cache_clear()


def test_a_cluster_that_names_its_gpu_times_each_product_by_its_shape():
    """On an H100 node Llama 3 8B's blocks reach about the record's large-product rate without
    tensor parallelism, and lose a fifth of it at tensor degree 8, whose products are thin."""
    cluster, model = CLUSTERS["h100-node"], MODELS["llama3-8b"]
    rates = {}
    for tensor in (1, 8):
        step = StepShape(model, cluster, Layout(data=8 // tensor, tensor=tensor), 8192, 8)
        shaped = compute_model.products(step)
        flops = (
            (model.flops_per_token(8192) - 6 * model.head_parameters()) * step.tokens_per_gpu_step / tensor
        )
        rates[tensor] = (flops - shaped.attention_flops) / (shaped.block_forward + shaped.block_backward)
    assert rates[1] / cluster.peak_flops == pytest.approx(0.69, abs=0.03)  # the record: 630-730 TFLOP/s
    assert rates[8] < 0.8 * rates[1]


def test_fp8_runs_the_blocks_linear_layers_at_the_fp8_fit_and_needs_fp8_tensor_cores():
    from course_lib.plan.cost_model import predict
    from course_lib.plan.frameworks import TORCHTITAN_PROFILE
    from course_lib.plan.network_model import data_axis

    cluster, model = CLUSTERS["h100-node"], MODELS["llama3-8b"]
    bf16 = StepShape(model, cluster, Layout(data=8), 8192, 8)
    fp8 = StepShape(model, cluster, Layout(data=8, precision="fp8"), 8192, 8)
    before, after = compute_model.products(bf16), compute_model.products(fp8)
    assert after.head == before.head and after.attention_forward == before.attention_forward  # stay bf16
    speedup = (before.block_forward + before.block_backward) / (after.block_forward + after.block_backward)
    assert 1.5 < speedup < 2.0  # twice the peak, a lower sustained fraction (the record's fp8 products)
    assert compute_model.memory_bound(fp8)[0] > compute_model.memory_bound(bf16)[0]  # the casts
    refused = predict(
        model, CLUSTERS["a100-dgx"], Layout(data=8, precision="fp8"), seq_len=8192, global_batch=8
    )
    assert refused.problem == "fp8 products need GPUs with fp8 tensor cores: a100-dgx has none"
    assert Layout.from_name("d8 fsdp fp8").precision == "fp8"
    gathered = StepShape(model, cluster, Layout(data=8, precision="fp8"), 8192, 8, TORCHTITAN_PROFILE)
    in_fp8 = dataclasses.replace(gathered, framework=TORCHTITAN_PROFILE.with_(fp8_all_gather=True))
    # FSDP's gathers in 1 byte an element instead of 2; the fp32 reduce-scatter unchanged
    reduce_scatter = 4 * 7 / 8 * memory_model.stage_parameters(model, Layout(data=8))
    assert data_axis(gathered, 0.0)[1] - reduce_scatter == pytest.approx(
        2 * (data_axis(in_fp8, 0.0)[1] - reduce_scatter)
    )


def test_a_record_filed_under_another_gpus_name_is_refused_naming_both(tmp_path, monkeypatch):
    """The H100's record saved as the H200's: the planner would time an H200 by an H100's kernels."""
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(RECORD))
    monkeypatch.setattr(kernels, "GPU_RECORDS", tmp_path)
    kernels.kernel_fit.cache_clear()
    try:
        with pytest.raises(
            UserError, match=r"measured on NVIDIA H100 80GB HBM3, not the GPU it is filed as \(nvidia-h200\)"
        ):
            kernels.kernel_fit("nvidia-h200")
    finally:
        kernels.kernel_fit.cache_clear()
