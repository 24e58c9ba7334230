"""The planner against measurement on real processes: ``plan --validate`` on a small transformer.

Every axis on two processes (a ZeRO stage, FSDP, recomputation both ways, tensor parallelism with
and without sequence parallelism, context and pipeline parallelism): the model-state bytes and
the bytes sent equal the prediction, the activations are within 2 %, and the table and JSON say
so. Exact means: but for AdamW's step counter (4 bytes per parameter tensor) and the sharded
flat parameters' padding (fewer than N elements each), which the planner leaves out. Step times
are printed, not judged: a test machine's timings are not the lesson's.
"""

from __future__ import annotations

import pytest

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.tools import plan_validation as pv

SMALL = pv.Sweep(d_model=32, n_heads=4, n_layers=2, seq_len=16, global_batch=8, steps=3, warmup=1)
LAYOUTS = [
    Layout(data=2, sharding="zero2"),
    Layout(data=2, sharding="fsdp", recomputation="selective"),
    Layout(data=2, sharding="ddp", recomputation="full"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=False, recomputation="selective"),
    Layout(tensor=2, sharding="ddp"),
    Layout(context=2, sharding="ddp", recomputation="full"),
    Layout(pipeline=2, sharding="ddp", micro_batch=2),
]


@pytest.fixture(scope="module")
def result():
    return pv.validate(launch, layouts=LAYOUTS, sweep=SMALL)


def test_memory_and_bytes_match_the_prediction_on_every_layout(result):
    assert len(result["layouts"]) == len(LAYOUTS)
    for row in result["layouts"]:
        ratios = {key: row[key]["measured_over_predicted"] for key in ("model_state_bytes", "sent_bytes")}
        assert ratios["model_state_bytes"] == pytest.approx(1.0, abs=1e-3), row["layout"]
        assert ratios["sent_bytes"] == pytest.approx(1.0, abs=1e-4), row["layout"]
        assert row["activation_bytes"]["measured_over_predicted"] == pytest.approx(1.0, abs=0.02), row[
            "layout"
        ]


def test_the_calibration_and_the_table_name_what_they_measured(result):
    calibration = result["calibration"]
    assert calibration["latency_s"] > 0 and calibration["bandwidth_bytes_per_s"] > 0
    assert calibration["matmul_flops"] > 0 and calibration["memory_bandwidth"] > 0
    text = pv.table(result)
    assert text.count("\n") == len(LAYOUTS) + 2
    assert "step time within a factor 1.33:" in text and "of 7 layouts with a core per process" in text
