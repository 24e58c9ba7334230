"""flops: the model's arithmetic per sample, counted on a shape-only copy, and MFU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from course_lib import models
from course_lib.plan import flops
from course_lib.train.config import TrainConfig


def test_a_linear_layers_training_flops_are_counted_exactly():
    # forward 2*B*in*out; backward: the weight's gradient (2*B*in*out) and, for the second layer
    # only, the gradient of its input (the first layer's input needs none): 2*B*in*out again.
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
    first, second = 2 * 100 * 50, 2 * 50 * 10
    assert flops.training_flops_per_sample(model, (100,)) == 2 * first + 3 * second


def test_counting_leaves_the_real_model_untouched():
    model = models.build_model("cifar_cnn")
    before = {key: value.clone() for key, value in model.state_dict().items()}  # batch-norm statistics too
    assert flops.training_flops_per_sample(model, (3, 32, 32)) > 0
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and next(model.parameters()).device.type == "cpu"


def test_mfu_and_the_peaks():
    mfu = flops.model_flops_utilization(
        flops_per_sample=1e9, samples_per_s=2e5, gpus=4, peak_tflops_per_gpu=100
    )
    assert mfu == pytest.approx(0.5)
    assert flops.peak_tflops(torch.device("cpu"), "bf16") is None
    assert flops.matmul_precision("bf16") == "bf16"
    assert flops.matmul_precision("fp32") in ("tf32", "fp32")
    for _, peaks in flops.PEAK_TFLOPS:
        assert peaks["bf16"] > peaks["tf32"] > peaks["fp32"] > 0
        # where a GPU has fp8 tensor cores they run at twice bf16's rate (Hopper, Blackwell)
        assert peaks.get("fp8", 2 * peaks["bf16"]) == pytest.approx(2 * peaks["bf16"], rel=0.001)
    assert flops.PEAK_TFLOPS[[m for m, _ in flops.PEAK_TFLOPS].index("A100")][1].get("fp8") is None


def test_the_matmul_peak_is_measured_and_bad_sizes_are_refused():
    from course_lib.errors import UserError

    tflops = flops.measure_matmul_tflops(device="cpu", size=128, repeats=3, warmup=1)
    assert 0 < tflops < 100  # a 2-core CPU does some GFLOP/s, no CPU does 100 TFLOP/s in fp32
    with pytest.raises(UserError, match="at least 1"):
        flops.measure_matmul_tflops(device="cpu", size=0)
    with pytest.raises(UserError, match="at least 1"):
        flops.measure_matmul_tflops(device="cpu", repeats=0)


def test_the_trainer_reports_the_models_tflops_and_no_mfu_on_a_cpu():
    from course_lib.distributed.launch import launch

    config = TrainConfig(sharding="single", global_batch_size=60, epochs=1, max_steps=2, progress=False)
    (history,) = launch(_history, 1, dataclasses.replace(config))
    record = history[-1]
    expected = flops.training_flops_per_sample(models.build_model("digits_cnn"), (1, 8, 8))
    assert record["model_tflops"] == pytest.approx(expected * record["samples_per_s"] / 1e12)
    assert record["mfu"] is None


def _history(config):
    from course_lib.train.loop import train

    return train(config).history
