"""The GPU recorder: its shapes are the model's, its command runs (on a CPU at small sizes), and
what it recorded on a GPU stays below that GPU's datasheet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from course_lib.plan.flops import PEAK_TFLOPS
from course_lib.plan.specs import MODELS
from course_lib.tools.evidence import gpu_record

from conftest import REPO, clean_env


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_products_hold_the_blocks_weights_once_split_by_the_tensor_degree(name):
    spec = MODELS[name]
    whole = gpu_record.block_products(spec, tokens=8192, tensor=1)
    attention = sum(row["k"] * row["n"] for row in whole if row["matmul"] in ("qkv", "attention_out"))
    # the weights: all but the two norms and, where the model has them, the biases
    q, kv, matrices = spec.attention_width, spec.kv_heads * spec.head_dim, 3 if spec.gated_mlp else 2
    attention_biases = q + spec.d_model + 2 * kv if spec.bias else 0
    assert attention == spec.attention_parameters() - 2 * spec.d_model - attention_biases
    mlp = [row for row in whole if row["matmul"] in ("mlp_in", "mlp_out")]
    mlp_biases = (matrices - 1) * spec.ffn_hidden + spec.d_model if spec.bias else 0
    assert sum(row["k"] * row["n"] for row in mlp) == spec.expert_parameters() - mlp_biases
    assert {row["m"] for row in mlp} == {8192 * spec.top_k // spec.experts if spec.experts > 1 else 8192}
    for whole_row, split_row in zip(
        whole, gpu_record.block_products(spec, tokens=8192, tensor=8), strict=True
    ):
        assert whole_row["k"] * whole_row["n"] == 8 * split_row["k"] * split_row["n"]


def test_a_linear_layers_three_products_have_the_same_flops():
    shapes = [gpu_record.pass_shape(8, 16, 32, which) for which in gpu_record.PASSES]
    assert shapes == [(8, 16, 32), (8, 32, 16), (16, 8, 32)]
    assert {rows * inner * columns for rows, inner, columns in shapes} == {8 * 16 * 32}


@pytest.fixture(scope="module")
def cpu_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_record")
    done = subprocess.run(
        [sys.executable, "-m", "course_lib.tools.evidence.gpu_record", "--device", "cpu",
         "--models", "llama3-8b", "--tokens", "16", "--no-tests", "--out", str(out)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "cpu.json").read_text()), json.loads(done.stdout)


@pytest.mark.slow  # the whole record on a CPU: tens of seconds
def test_the_command_records_every_part_on_a_cpu(cpu_record):
    record, summary = cpu_record
    assert record["device"]["device"] == "cpu"
    assert len(record["matmuls"]) == 5 * 3  # five products, three passes, one precision, one degree
    for part in ("matmuls", "attention", "pointwise", "grouped", "blocks"):
        assert record[part], part
    assert all(row["grouped_tflops"] > 0 and row["loop_tflops"] > 0 for row in record["grouped"])
    assert all(row["tflops"] > 0 for row in record["matmuls"])
    assert all(row["forward_tflops"] > 0 and row["backward_tflops"] > 0 for row in record["attention"])
    assert all(row["gbps"] > 0 for row in record["pointwise"])
    (block,) = summary["blocks"]
    assert block["products_ms"] > 0 and block["attention_ms"] > 0
    parts = block["products_ms"] + block["attention_ms"] + block["rest_ms"]
    assert parts == pytest.approx(block["measured_ms"])


def test_asking_for_a_gpu_where_there_is_none_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, "-m", "course_lib.tools.evidence.gpu_record", "--no-tests"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no CUDA GPU here" in done.stderr and "Traceback" not in done.stderr


RECORDS = sorted((REPO / "slides" / "recorded" / "gpu").glob("*.json"))


def test_a_gpu_record_is_committed():
    assert RECORDS, "make gpu-record on a GPU machine writes slides/recorded/gpu/<gpu>.json"


@pytest.mark.parametrize("path", RECORDS, ids=[path.stem for path in RECORDS])
def test_a_recorded_gpu_stays_below_its_datasheet(path):
    record = json.loads(path.read_text())
    peaks = next(peaks for marker, peaks in PEAK_TFLOPS if marker in record["device"]["name"])
    bf16 = [row["tflops"] for row in record["matmuls"] if row["precision"] == "bf16"]
    fp8 = [row["tflops"] for row in record["matmuls"] if row["precision"].startswith("fp8")]
    assert 0.3 * peaks["bf16"] < max(bf16) <= peaks["bf16"]
    assert max(bf16) < max(fp8) <= peaks["fp8"]
    # the products of a block, the attention and the rest add up to the block measured whole
    for block in gpu_record.summary(record)["blocks"]:
        assert block["products_ms"] + block["attention_ms"] < block["measured_ms"]
        assert block["rest_ms"] < 0.2 * block["measured_ms"]
