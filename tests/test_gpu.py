"""The GPU path: NCCL, bf16 autocast, FSDP's pinned offload, the CUDA allocator, throughput and MFU.

CI has no GPU, so these are skipped there, with the reason shown; on a GPU machine run
``pytest -m gpu -s`` (``-s`` shows the throughput lines). Each check runs in a fresh process
(``tests/gpu_checks.py`` or the training command): the pytest process never touches CUDA, so the
rest of the suite may still fork its CPU ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, clean_env, latest_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (this machine has none): run pytest -m gpu on one",
    ),
]


def _fresh_python(*args: str) -> str:
    """``python ARGS`` in a fresh process, which must succeed; its standard output."""
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _check(name: str) -> dict:
    """One check of ``tests/gpu_checks.py``: the JSON line it printed."""
    return json.loads(_fresh_python(str(REPO / "tests" / "gpu_checks.py"), name).strip().splitlines()[-1])


def _train(tmp_path, name: str, *flags: str) -> list[dict]:
    """``python -m course_lib.train`` on the GPU; the metrics it wrote, one record per epoch."""
    metrics = tmp_path / f"{name}.jsonl"
    _fresh_python("-m", "course_lib.train", "--no-progress", "--metrics", str(metrics), *flags)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_the_anatomy_reads_a_gpu_trace_its_kernels_are_the_compute():
    result = _check("anatomy_on_cuda")
    assert result["device"] == "cuda"
    assert result["parts_ms"] == pytest.approx(result["step_ms"], rel=1e-9)
    assert result["compute_share"] > 0.5  # six 2048-wide products on a batch of 1024: the GPU is busy
    assert result["unexplained_share"] <= 0.10


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs or more (a rank per GPU)")
def test_ddp_and_fsdp_hide_most_of_their_communication_on_a_large_model():
    gpus = min(torch.cuda.device_count(), 4)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    result = json.loads(
        _fresh_python(*launcher, str(REPO / "tests" / "gpu_checks.py"), "communication_hidden")
        .strip()
        .splitlines()[-1]
    )
    print(f"\n{json.dumps(result, indent=1)}")
    for name in ("ddp", "fsdp"):
        measured = result[name]
        assert measured["device"] == "cuda" and measured["communication_ms"] > 0
        # mostly hidden: more than half the time in flight runs under a kernel that computes
        assert measured["hidden_communication_ms"] > 0.5 * measured["communication_ms"], measured
        assert measured["unexplained_share"] <= 0.10, measured


def test_the_measured_matmul_peak_is_below_the_datasheets():
    result = _check("matmul_peak")
    # a large bf16 product reaches most of the datasheet's dense peak, never more
    assert 0.3 * result["datasheet_tflops"] < result["measured_tflops"] <= 1.05 * result["datasheet_tflops"]


def test_nccl_starts_for_a_world_of_one():
    assert _check("nccl_world_of_one") == {"backend": "nccl", "device": "cuda:0", "sum": 6.0}


def test_bf16_autocast_stays_close_to_fp32_on_the_gpu(tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        flags = ["--sharding", "single", "--global-batch-size", "60", "--epochs", "1", "--max-steps", "4"]
        history = _train(
            tmp_path,
            precision,
            *flags,
            "--precision",
            precision,
            "--checkpoint-dir",
            str(tmp_path / precision),
        )
        assert history[-1]["device"] == "cuda" and history[-1]["precision"] == precision
        _, weights = latest_weights(tmp_path / precision)
        runs[precision] = torch.cat([tensor.flatten().float() for tensor in weights.values()])
    # the bound of the CPU test (tests/test_trainer.py): the directions agree, the digits do not
    assert (runs["bf16"] - runs["fp32"]).abs().max() < 5e-2
    assert torch.nn.functional.cosine_similarity(runs["bf16"], runs["fp32"], dim=0) > 0.999
    assert not torch.equal(runs["bf16"], runs["fp32"])  # it really computed in bf16


def test_the_course_fsdp_offloads_to_pinned_memory_and_trains_like_the_gpu():
    result = _check("fsdp_offload")
    assert result["shards_on_cpu"] and result["shards_pinned"]
    assert result["max_weight_error"] < 1e-4  # Adam on the CPU and on the GPU: same steps, other kernels


def test_model_state_memory_on_the_cuda_allocator_matches_the_model_within_2_percent():
    result = _check("model_state_memory")
    assert result["counted_bytes"] == result["model_bytes"] + result["step_counter_bytes"]
    assert result["allocator_bytes"] == pytest.approx(result["model_bytes"], rel=0.02)


@pytest.mark.parametrize("model", ["cifar_cnn", "resnet18"])
def test_throughput_and_mfu_of_the_lab_models_on_one_gpu(tmp_path, model):
    flags = ["--sharding", "single", "--dataset", "synthetic", "--model", model, "--global-batch-size", "256"]
    history = _train(tmp_path, model, *flags, "--epochs", "2", "--precision", "bf16")
    record = history[-1]  # the second epoch: compiled kernels and the allocator have settled
    print(
        f"\n{model}, bf16, batch 256: {record['samples_per_s']:.0f} samples/s, "
        f"{record['model_tflops']:.1f} TFLOP/s, MFU {record['mfu']:.1%}, peak {record['peak_mem_mb']:.0f} MB"
    )
    assert record["device"] == "cuda" and record["samples_per_s"] > 0
    assert record["mfu"] is not None and 0 < record["mfu"] < 1
