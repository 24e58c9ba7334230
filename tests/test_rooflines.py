"""The rooflines: each threshold derived on paper agrees with the planner's own breakdown."""

from __future__ import annotations

import pytest

from course_lib.plan import cost_model, rooflines
from course_lib.plan.layout import Layout
from course_lib.plan.specs import CLUSTERS, MODELS

LLAMA_8B = MODELS["llama3-8b"]


@pytest.mark.parametrize("cluster", ["h100-node", "alps"])
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_the_data_axis_hides_past_its_tokens_per_gpu(cluster, sharding):
    """One sequence a GPU on 16 GPUs: below half the threshold the planner exposes data-parallel
    time, at the threshold none (the memory-bound work hides a little more than the formula says)."""
    limits = rooflines.rooflines(LLAMA_8B, CLUSTERS[cluster], data_gpus=16)
    threshold = limits.data_tokens_fsdp if sharding == "fsdp" else limits.data_tokens_ddp

    def exposed(tokens: float) -> float:
        seq_len = int(tokens) // 64 * 64
        layout = Layout(data=16, sharding=sharding)
        prediction = cost_model.predict(LLAMA_8B, CLUSTERS[cluster], layout, seq_len=seq_len, global_batch=16)
        return prediction.time["data (exposed)"]

    assert exposed(0.5 * threshold) > 0
    assert exposed(threshold) == 0


def test_tensor_parallelism_is_compute_bound_below_its_degree():
    """On Alps (150 GB/s NVLink a GPU) Llama 3 8B stays compute-bound to a tensor degree of about 5:
    at 4 the planner's exposed tensor time is below the blocks' compute, at 8 above it."""
    alps = CLUSTERS["alps"]
    degree = rooflines.rooflines(LLAMA_8B, alps).tensor_degree
    assert 4 < degree < 8
    for tensor in (4, 8):
        prediction = cost_model.predict(
            LLAMA_8B, alps, Layout(tensor=tensor, sharding="ddp"), seq_len=8192, global_batch=1
        )
        communication_bound = prediction.time["tensor (exposed)"] > prediction.time["compute"]
        assert communication_bound == (tensor > degree)


def test_ring_attention_hides_its_chunks_past_the_chunk_size():
    """Context degree 8 inside an H100 node: chunks below the threshold expose the ring's passes,
    chunks well above it hide them under the attention."""
    node = CLUSTERS["h100-node"]
    chunk = rooflines.rooflines(LLAMA_8B, node).context_chunk_tokens

    def exposed(chunk_tokens: float) -> float:
        seq_len = int(8 * chunk_tokens) // 128 * 128
        layout = Layout(context=8, sharding="ddp")
        return cost_model.predict(LLAMA_8B, node, layout, seq_len=seq_len, global_batch=1).time[
            "context (exposed)"
        ]

    assert exposed(0.5 * chunk) > 0
    assert exposed(2 * chunk) == 0


def test_the_thresholds_scale_as_their_formulas_say():
    node, alps = CLUSTERS["h100-node"], CLUSTERS["alps"]
    here, there = rooflines.rooflines(LLAMA_8B, node), rooflines.rooflines(LLAMA_8B, alps)
    # the same GPU: F is the same; Alps' links are slower, every threshold rises by their ratio
    assert here.flops == pytest.approx(there.flops)
    assert there.expert_ffn / here.expert_ffn == pytest.approx(
        node.between_nodes.bandwidth / alps.between_nodes.bandwidth
    )
    assert there.context_chunk_tokens / here.context_chunk_tokens == pytest.approx(
        node.inside_node.bandwidth / alps.inside_node.bandwidth
    )
    # a wider model: more compute per byte of TP traffic, a larger degree
    assert rooflines.rooflines(MODELS["llama3-70b"], alps).tensor_degree > there.tensor_degree
