"""The planner against measurement: calibrate on this machine, run small layouts, compare.

``python -m course_lib.tools.plan --validate`` does three things:

1. **Calibrate.** The all-reduce's alpha and beta from a sweep on 2 local processes
   (``bench allreduce``'s measurement and ``scaling.fit_ring_all_reduce_by_regime``); the matmul
   rate of one core (``flops.measure_matmul_tflops``); and the memory bandwidth the rest of a
   one-process step of the course's transformer reaches (the bytes ``cost_model`` says its norms,
   activation functions and optimizer move, over the step's time not spent in matmuls). The
   machine becomes a ``ClusterSpec`` that overlaps no communication: gloo's threads need the
   cores that compute.
2. **Run** each layout of ``LAYOUTS`` on local processes with ``layout.parallelize``: a few
   training steps of the same ``TinyTransformer``, measuring what every rank holds
   (``memory.measure_model_states``), what one forward leaves alive for backward
   (``memory.live_tensor_bytes``; the pipeline's in-flight peak), the bytes it sends in one
   step (``comm.CommLog``) and the median step time after warm-up steps.
3. **Compare** with ``cost_model.predict`` for the same layout: model states, activations and
   bytes sent to the byte where the formula is exact, and the step time as a ratio.

A layout with more processes than cores shares them and is timed slower than the model says:
its time is reported, not judged.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from .. import comm, cost_model, flops, memory, models, runtime
from ..data import zen_windows
from ..errors import UserError
from ..layout import Layout, parallelize
from ..parallel import context as cp
from ..parallel import pipeline as pp
from ..parallel import sequence as sp
from ..parallel.mesh import Mesh


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """The transformer every layout trains, and how long each is timed.

    The default is wide enough that matrix products take half of a step on one core, small
    enough for a laptop; the tests run a smaller one.

    Args:
        d_model: the transformer's width.
        n_heads: attention heads per block.
        n_layers: blocks.
        seq_len: tokens per sequence.
        global_batch: sequences per step, over every replica.
        steps: steps timed per layout (the first ones untimed, see ``warmup``).
        warmup: steps left out of the median.
    """

    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    seq_len: int = 64
    global_batch: int = 8
    steps: int = 8
    warmup: int = 3

    def model(self) -> models.TinyTransformer:
        """The transformer, seeded: the same weights on every rank."""
        vocabulary = zen_windows(seq_len=self.seq_len)[2]
        torch.manual_seed(0)
        return models.TinyTransformer(
            len(vocabulary), d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers,
            max_seq_len=self.seq_len,
        )  # fmt: skip

    def spec(self) -> cost_model.ModelSpec:
        return cost_model.ModelSpec.of(self.model())


SWEEP = Sweep()

LAYOUTS = [
    Layout(data=2, sharding="ddp"),
    Layout(data=2, sharding="zero1"),
    Layout(data=2, sharding="zero2"),
    Layout(data=2, sharding="fsdp"),
    Layout(data=2, sharding="ddp", recomputation="full"),
    Layout(data=2, sharding="ddp", recomputation="selective"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=False),
    Layout(tensor=2, sharding="ddp", sequence_parallel=False, recomputation="selective"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=True),
    Layout(context=2, sharding="ddp"),
    Layout(context=2, sharding="ddp", recomputation="full"),
    Layout(pipeline=2, sharding="ddp", schedule="1f1b", micro_batch=2),
    Layout(pipeline=2, sharding="ddp", schedule="gpipe", micro_batch=2),
    Layout(data=2, tensor=2, sharding="ddp", sequence_parallel=False),
]
"""The sweep: every axis on 2 processes, each with one policy or variant changed, and a 2-D layout."""


def course_layout(layout: Layout, sweep: Sweep = SWEEP) -> Layout:
    """The layout as the course runs it on CPU: fp32, the head not split over the vocabulary."""
    micro = layout.micro_batch if layout.pipeline > 1 else sweep.global_batch // layout.data
    return layout.with_(precision="fp32", loss_parallel=False, micro_batch=micro)


def measure_layout(layout: Layout, sweep: Sweep = SWEEP) -> dict | None:
    """Train a few steps laid out as ``layout`` here; rank 0 returns the most any rank measured."""
    torch.set_num_threads(1)  # one core per process, as the time model assumes
    layout = course_layout(layout, sweep)
    seq_len = sweep.seq_len
    mesh = Mesh(data=layout.data, pipeline=layout.pipeline, context=layout.context, tensor=layout.tensor)
    inputs, targets, _ = zen_windows(seq_len=seq_len)
    stages = parallelize(sweep.model(), mesh, layout, seq_len=seq_len)
    params = [p for stage in stages.values() for p in stage.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    mine = torch.arange(sweep.global_batch)[mesh.coordinates.data :: layout.data]
    x, y = inputs[mine], targets[mine]
    sequence = cp.SequenceLayout(seq_len, layout.context, zigzag=True)
    if layout.context > 1:
        x, y = (sequence.local(t, mesh.coordinates.context) for t in (x, y))
    executors = {}
    if layout.pipeline > 1:  # one counts the memory in flight (slowly), the other is timed
        for measuring in (True, False):
            executors[measuring] = pp.PipelineExecutor(
                stages,
                layout.pipeline,
                layout.schedule,
                len(mine) // layout.micro_batch,
                models.lm_loss,
                (layout.micro_batch, seq_len, sweep.d_model),
                group=mesh.group("pipeline"),
                measure_memory=measuring,
            )
    stage = stages[min(stages)]

    def loss_of(logits):
        if layout.context > 1:
            return cp.context_parallel_loss(logits, y, total_tokens=len(mine) * seq_len)
        if layout.tensor > 1 and layout.sequence_parallel:
            return sp.sequence_parallel_loss(logits, y, group=mesh.group("tensor"))
        return models.lm_loss(logits, y)

    def step(executor=None) -> None:
        optimizer.zero_grad()
        if executor is not None:
            executor.step(x, y)
        else:
            loss_of(stage(x)).backward()
        if layout.tensor > 1 and layout.sequence_parallel:
            sp.all_reduce_sequence_parallel_gradients(stage, group=mesh.group("tensor"))
        if layout.context > 1:  # each chunk of the sequences adds its part of every gradient
            for param in params:
                comm.all_reduce(param.grad, op="sum", group=mesh.group("context"))
        if executors and layout.data > 1:
            for param in params:
                comm.all_reduce(param.grad, op="mean", group=mesh.group("data"))
        optimizer.step()

    if not executors:  # what one forward leaves alive for its backward (its loss included)
        with memory.live_tensor_bytes() as live:
            loss = loss_of(stage(x))
            activation_bytes = live.now
            loss.backward()
        optimizer.zero_grad()
    else:
        with comm.CommLog() as log:
            step(executors[True])
        activation_bytes, sent = executors[True].stats.peak_kept_bytes, log.bytes_per_rank()
    times = []
    for _ in range(sweep.steps):
        with comm.CommLog() as log:
            start = time.perf_counter()
            step(executors.get(False))
            times.append(time.perf_counter() - start)
        sent = log.bytes_per_rank()
    states = memory.measure_model_states(stage, optimizer=optimizer) if len(stages) == 1 else None
    record = {
        "model_state_bytes": states.total if states else None,
        "activation_bytes": activation_bytes,
        "sent_bytes": sent,
        "step_s": statistics.median(times[sweep.warmup :]),
    }
    gathered = [None] * runtime.world_size()
    torch.distributed.all_gather_object(gathered, record)
    if not runtime.is_main():
        return None
    return {key: max(r[key] for r in gathered if r[key] is not None) for key in record}


def calibrate(launch, sweep: Sweep = SWEEP) -> dict:
    """Measure this machine: the all-reduce's alpha and beta, a core's matmul rate and memory bandwidth.

    The rates are measured with every core busy, one process each, as in the layouts' runs: two
    processes share the memory's bandwidth, and one process alone would see more of it.
    """
    from .bench.allreduce import allreduce_benchmark, allreduce_sizes

    all_reduce = launch(
        allreduce_benchmark,
        2,
        sizes=allreduce_sizes(min_bytes=1024, max_bytes=4 << 20),
        iterations=10,
        warmup=3,
    )[0]
    fit = all_reduce.get("fit_by_regime", all_reduce["fit"])
    cores = min(runtime.usable_cpus(), max(layout.gpus for layout in LAYOUTS))
    side_by_side = launch(_probe_and_step_alone, cores, sweep)
    rate = statistics.median(r[0] for r in side_by_side)
    step_s = statistics.median(r[1] for r in side_by_side)
    calibration = {
        "latency_s": fit["latency_us"] * 1e-6,
        "bandwidth_bytes_per_s": fit["bandwidth_gbps"] * 1e9,
        "matmul_flops": rate,
        "memory_bandwidth": 1.0,  # for the moment: the memory-bound "seconds" below are bytes
        "one_process_step_s": step_s,
        "cores": runtime.usable_cpus(),
    }
    single = cost_model.predict(
        sweep.spec(),
        machine(calibration),
        course_layout(Layout(), sweep),
        seq_len=sweep.seq_len,
        global_batch=sweep.global_batch,
    )
    moved = single.time["memory-bound operations"] + single.time["optimizer step"]
    rest = step_s - single.time["compute"]
    if rest <= 0:
        raise UserError(
            f"the one-process step ({step_s * 1e3:.0f} ms) took less than its matmuls at the probe's rate "
            f"({single.time['compute'] * 1e3:.0f} ms): something else ran during the matmul probe; run again"
        )
    calibration["memory_bandwidth"] = moved / rest
    return calibration


def _probe_and_step_alone(sweep: Sweep) -> tuple[float, float]:
    """On each process at once, no communication: a core's matmul rate and a one-process step."""
    torch.set_num_threads(1)
    rate = flops.measure_matmul_tflops(size=512) * 1e12
    inputs, targets, _ = zen_windows(seq_len=sweep.seq_len)
    model = sweep.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = inputs[: sweep.global_batch], targets[: sweep.global_batch]
    times = []
    for _ in range(sweep.steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        models.lm_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return rate, statistics.median(times[sweep.warmup :])


def machine(calibration: dict) -> cost_model.ClusterSpec:
    """This machine as the planner sees it: one node of ``cores`` "GPUs" joined by the measured link."""
    link = cost_model.Link(calibration["latency_s"], calibration["bandwidth_bytes_per_s"])
    return cost_model.ClusterSpec(
        name="this machine",
        gpus_per_node=calibration["cores"],
        gpu_memory_bytes=1e12,
        reserved_bytes=0.0,
        peak_flops=calibration["matmul_flops"],
        achieved_flops=calibration["matmul_flops"],
        memory_bandwidth=calibration["memory_bandwidth"],
        inside_node=link,
        between_nodes=link,
        overlaps_communication=False,
        source="calibrated by plan --validate",
    )


def validate(launch, *, layouts: list[Layout] = LAYOUTS, sweep: Sweep = SWEEP) -> dict:
    """Calibrate, run every layout, and put each prediction beside its measurement.

    Args:
        launch: ``launch.launch``, which runs a function on N local processes.
        layouts: the layouts to run.
        sweep: the transformer they train, and for how many steps.
    """
    calibration = calibrate(launch, sweep)
    cluster, spec = machine(calibration), sweep.spec()
    rows = []
    for layout in layouts:
        measured = launch(measure_layout, layout.gpus, layout, sweep)[0]
        course = course_layout(layout, sweep)
        predicted = cost_model.predict(
            spec, cluster, course, seq_len=sweep.seq_len, global_batch=sweep.global_batch
        )
        states = (
            predicted.memory["parameters"] + predicted.memory["gradients"] + predicted.memory["optimizer"]
        )
        row = {
            "layout": layout.name() + ("" if layout.sequence_parallel or layout.tensor == 1 else " no-sp"),
            "processes": layout.gpus,
            "own_core": layout.gpus <= calibration["cores"],
            "model_state_bytes": {"predicted": states, "measured": measured["model_state_bytes"]},
            "activation_bytes": {
                "predicted": predicted.memory["activations"],
                "measured": measured["activation_bytes"],
            },
            "sent_bytes": {"predicted": sum(predicted.traffic.values()), "measured": measured["sent_bytes"]},
            "step_s": {"predicted": predicted.time["total"], "measured": measured["step_s"]},
        }
        for key in ("model_state_bytes", "activation_bytes", "sent_bytes", "step_s"):
            pair = row[key]
            pair["measured_over_predicted"] = (
                pair["measured"] / pair["predicted"]
                if pair["predicted"] and pair["measured"] is not None
                else None
            )
        rows.append(row)
    timed = [r for r in rows if r["own_core"]]
    within = [r for r in timed if 1 / 1.33 <= r["step_s"]["measured_over_predicted"] <= 1.33]
    return {
        "calibration": calibration,
        "model": dataclasses.asdict(spec) | {"global_batch": sweep.global_batch, "seq_len": sweep.seq_len},
        "layouts": rows,
        "step_time_within_1_33": f"{len(within)} of {len(timed)} layouts with a core per process",
    }


def table(result: dict) -> str:
    """The comparison as text: one line per layout.

    Args:
        result: what ``validate`` returns.
    """
    lines = [
        f"{'layout':<34}{'procs':>6}  {'states':>8}  {'activations':>11}  {'sent':>8}  {'step ms':>16}",
        f"{'':<34}{'':>6}  {'meas/pred':>8}  {'meas/pred':>11}  {'meas/pred':>8}  {'pred -> meas':>16}",
    ]

    def ratio(pair):
        value = pair["measured_over_predicted"]
        return "-" if value is None else f"{value:.3f}"

    for row in result["layouts"]:
        step = row["step_s"]
        shared = "" if row["own_core"] else " (shares cores)"
        lines.append(
            f"{row['layout']:<34}{row['processes']:>6}  {ratio(row['model_state_bytes']):>8}  "
            f"{ratio(row['activation_bytes']):>11}  {ratio(row['sent_bytes']):>8}  "
            f"{step['predicted'] * 1e3:>7.1f} -> {step['measured'] * 1e3:>6.1f}{shared}"
        )
    lines.append(f"step time within a factor 1.33: {result['step_time_within_1_33']}")
    return "\n".join(lines)
