"""The planner against measurement on real processes: ``plan --validate`` on a small transformer.

Every axis on two processes (a ZeRO stage, FSDP, recomputation both ways, tensor parallelism with
and without sequence parallelism and the vocabulary split, context parallelism by the ring and by
Ulysses, pipeline parallelism) and
grids of four (context or pipeline stages with tensor ranks): the model-state bytes and
the bytes sent equal the prediction, the activations are within 2 %, and the table and JSON say
so. Exact means: but for AdamW's step counter (4 bytes per parameter tensor) and the sharded
flat parameters' padding (fewer than N elements each), which the planner leaves out. Step times
are printed, not judged: a test machine's timings are not the lesson's.
"""

from __future__ import annotations

import pytest

from course_lib.distributed.launch import launch
from course_lib.plan.layout import Layout
from course_lib.tools.evidence import plan_validation as pv

SMALL = pv.Sweep(d_model=32, n_heads=4, n_layers=2, seq_len=16, global_batch=8, steps=3, warmup=1)
LAYOUTS = [
    Layout(data=2, sharding="zero2"),
    Layout(data=2, sharding="fsdp", recomputation="selective"),
    Layout(data=2, sharding="ddp", recomputation="full"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=False, loss_parallel=False, recomputation="selective"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=True, loss_parallel=True),
    Layout(context=2, sharding="ddp", recomputation="full"),
    Layout(context=2, sharding="ddp", recomputation="selective", context_attention="ulysses"),
    Layout(pipeline=2, sharding="ddp", micro_batch=2),
    Layout(context=2, tensor=2, sharding="ddp", sequence_parallel=True, loss_parallel=True),
    Layout(pipeline=2, tensor=2, sharding="ddp", sequence_parallel=False, loss_parallel=True, micro_batch=2),
    Layout(pipeline=2, tensor=2, sharding="ddp", sequence_parallel=True, loss_parallel=True, micro_batch=2),
]


@pytest.fixture(scope="module")
def result():
    return pv.validate(launch, layouts=LAYOUTS, sweep=SMALL)


@pytest.mark.slow
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
    own_core = sum(layout.gpus <= calibration["cores"] for layout in LAYOUTS)
    assert (
        "step time within a factor 1.33:" in text and f"of {own_core} layouts with a core per process" in text
    )
    assert [row["layout"] for row in result["layouts"]][3:] == [
        "t2 ddp sac no-sp",
        "t2 ddp vocab",
        "c2 ddp ac",
        "c2 ddp sac ulysses",
        "p2 ddp 1f1b mb2",
        "c2.t2 ddp vocab",
        "p2.t2 ddp 1f1b mb2 no-sp vocab",
        "p2.t2 ddp 1f1b mb2 vocab",
    ]


def test_the_calibration_recovers_the_bandwidths_and_the_host_cost_it_was_made_from():
    """Steps made by the time model itself, from known rates: ``with_speed`` solves them back."""
    import dataclasses

    from course_lib.plan import cost_model, specs

    link = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9, "cores": 2}
    truth = link | {
        "matmul_flops": 5e10,
        "memory_bandwidth": 3e9,
        "optimizer_bandwidth": 8e9,
        "host_seconds_per_operation": 12e-6,
    }
    operations, batches = 600, (SMALL.global_batch, SMALL.global_batch // 4)
    forward_backward = {}
    for batch in batches:
        time = cost_model.predict(
            SMALL.spec(),
            pv.machine(truth),
            pv.course_layout(Layout(), dataclasses.replace(SMALL, global_batch=batch)),
            seq_len=SMALL.seq_len,
            global_batch=batch,
            operations=operations,
        ).time
        forward_backward[batch] = time["total"] - time["optimizer step"]
    optimizer_s = specs.OPTIMIZER_BYTES["fp32"] * SMALL.spec().parameters() / truth["optimizer_bandwidth"]
    speed = {
        "matmul_flops": truth["matmul_flops"],
        "forward_backward_s": forward_backward,
        "optimizer_s": optimizer_s,
        "operations": operations,
    }
    found = pv.with_speed(link, speed, SMALL)
    for key in ("memory_bandwidth", "optimizer_bandwidth", "host_seconds_per_operation"):
        assert found[key] == pytest.approx(truth[key], rel=1e-6), key


def test_the_operation_counter_counts_forward_and_backward():
    import torch

    weight = torch.ones(3, requires_grad=True)
    with pv.OperationCounter() as forward:
        loss = (weight * 2).sum()
    with pv.OperationCounter() as backward:
        loss.backward()
    assert forward.operations == 2  # mul, sum
    assert backward.operations >= 2  # at least the two backward functions' work


def test_the_host_term_and_the_optimizer_bandwidth_enter_the_prediction():
    import dataclasses

    from course_lib.plan import cost_model

    cluster = pv.machine(
        {
            "latency_s": 1e-4,
            "bandwidth_bytes_per_s": 1e9,
            "cores": 2,
            "matmul_flops": 5e10,
            "memory_bandwidth": 3e9,
        }
    )
    layout, spec = pv.course_layout(Layout(data=2), SMALL), SMALL.spec()

    def time(cluster, operations=0):
        return cost_model.predict(
            spec,
            cluster,
            layout,
            seq_len=SMALL.seq_len,
            global_batch=SMALL.global_batch,
            operations=operations,
        ).time

    plain = time(cluster)
    assert plain["host (dispatching operations)"] == 0.0
    hosted = time(dataclasses.replace(cluster, host_seconds_per_operation=1e-5), operations=1000)
    assert hosted["host (dispatching operations)"] == pytest.approx(0.01)
    assert hosted["total"] == pytest.approx(plain["total"] + 0.01)
    faster = time(dataclasses.replace(cluster, optimizer_bandwidth=2 * cluster.memory_bandwidth))
    assert faster["optimizer step"] == pytest.approx(plain["optimizer step"] / 2)
    assert faster["memory-bound operations"] == plain["memory-bound operations"]
