"""The planner against measurement: calibrate on this machine, run small layouts, compare.

``python -m course_lib.tools.plan --validate`` does three things:

1. **Calibrate.** The all-reduce's alpha and beta as a training step sees them (``probe_link``:
   each all-reduce after some computation, the mean of every call; ``scaling.fit_ring_all_reduce``).
   Then the compute speed (``probe_compute``, measured again beside every layout, because a
   shared machine's speed drifts by a fifth over minutes): one core's matmul rate
   (``flops.measure_matmul_tflops``), the optimizer step's bandwidth, and from one-process
   forward and backward passes at two batch sizes, the bandwidth of the norms and activation
   functions and the host's time per dispatched operation (``with_speed``). The machine becomes
   a ``ClusterSpec`` that overlaps no communication: gloo's threads need the cores that compute.
2. **Run** each layout of ``LAYOUTS`` on local processes with ``plan.parallelize``: a few
   training steps of the same ``TinyTransformer``, measuring what every rank holds
   (``memory.measure_model_states``), what one forward leaves alive for backward
   (``memory.live_tensor_bytes``; the pipeline's in-flight peak), the bytes it sends in one
   step (``comm.CommLog``), the operations one forward and backward dispatch
   (``OperationCounter``: a count, like the FLOPs, not a time) and the median step time after
   warm-up steps. Collectives are not checked across ranks while timed (``launch``'s
   ``check_collectives``): the check is one more all-gather per collective.
3. **Compare** with ``cost_model.predict`` for the same layout: model states, activations and
   bytes sent to the byte where the formula is exact, and the step time as a ratio.

A layout with more processes than cores shares them and is timed slower than the model says:
its time is reported, not judged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import models
from ...data import zen_windows
from ...distributed import comm, environment, runtime
from ...errors import UserError
from ...parallel import memory
from ...parallel.mesh import Mesh
from ...plan import cost_model, flops, scaling, specs
from ...plan.layout import Layout
from ...plan.parallelize import parallelize


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
    steps: int = 16
    warmup: int = 3

    def model(self) -> models.TinyTransformer:
        """The transformer, seeded: the same weights on every rank."""
        vocabulary = zen_windows(seq_len=self.seq_len)[2]
        torch.manual_seed(0)
        return models.TinyTransformer(
            len(vocabulary), d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers,
            max_seq_len=self.seq_len,
        )  # fmt: skip

    def spec(self) -> specs.ModelSpec:
        return specs.ModelSpec.of(self.model())


SWEEP = Sweep()

LAYOUTS = [
    Layout(data=2, sharding="ddp"),
    Layout(data=2, sharding="zero1"),
    Layout(data=2, sharding="zero2"),
    Layout(data=2, sharding="fsdp"),
    Layout(data=2, sharding="ddp", recomputation="full"),
    Layout(data=2, sharding="ddp", recomputation="selective"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=False, loss_parallel=False),
    Layout(tensor=2, sharding="ddp", sequence_parallel=False, loss_parallel=False, recomputation="selective"),
    Layout(tensor=2, sharding="ddp", sequence_parallel=True, loss_parallel=False),
    Layout(tensor=2, sharding="ddp", sequence_parallel=True, loss_parallel=True),
    Layout(context=2, sharding="ddp"),
    Layout(context=2, sharding="ddp", recomputation="full"),
    Layout(pipeline=2, sharding="ddp", schedule="1f1b", micro_batch=2),
    Layout(pipeline=2, sharding="ddp", schedule="gpipe", micro_batch=2),
    Layout(data=2, tensor=2, sharding="ddp", sequence_parallel=False, loss_parallel=False),
]
"""The sweep: every axis on 2 processes, each with one policy or variant changed, and a 2-D layout."""


def course_layout(layout: Layout, sweep: Sweep = SWEEP) -> Layout:
    """The layout as the course runs it on CPU: fp32, one micro-batch a replica without a pipeline."""
    micro = layout.micro_batch if layout.pipeline > 1 else sweep.global_batch // layout.data
    return layout.with_(precision="fp32", micro_batch=micro)


def label(layout: Layout) -> str:
    """``Layout.name`` and, with tensor parallelism, how the norms and the vocabulary are split."""
    if layout.tensor == 1:
        return layout.name()
    # the split said once, where it applies: "no-sp" as the name says it, "vocab" where it is on
    words = [word for word in layout.name().split() if word not in ("no-sp", "no-loss-parallel")]
    return (
        " ".join(words)
        + ("" if layout.sequence_parallel else " no-sp")
        + (" vocab" if layout.loss_parallel else "")
    )


def measure_layout(layout: Layout, sweep: Sweep = SWEEP) -> dict | None:
    """Train a few steps laid out as ``layout`` here; rank 0 returns the most any rank measured.

    First, on the same processes and without communication, the machine's speed at that moment
    (``probe_compute``): a shared machine's speed drifts by a fifth over minutes, and the time
    model is judged against the machine the layout ran on, not the one of a minute before.
    """
    torch.set_num_threads(1)  # one core per process, as the time model assumes
    speed = probe_compute(sweep)
    layout = course_layout(layout, sweep)
    seq_len = sweep.seq_len
    mesh = Mesh(data=layout.data, pipeline=layout.pipeline, context=layout.context, tensor=layout.tensor)
    inputs, targets, _ = zen_windows(seq_len=seq_len)
    model = parallelize(sweep.model(), mesh, layout, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mine = torch.arange(sweep.global_batch)[mesh.coordinates.data :: layout.data]
    x, y = inputs[mine], targets[mine]
    sequence = layout.sequence_chunks(seq_len)
    if layout.context > 1:
        x, y = (sequence.local(t, mesh.coordinates.context) for t in (x, y))

    executors = {}
    if layout.pipeline > 1:  # one counts the memory in flight (slowly), the other is timed
        for measuring in (True, False):
            executors[measuring] = model.executor(
                micro_batch=layout.micro_batch,
                microbatches=len(mine) // layout.micro_batch,
                measure_memory=measuring,
            )

    def step(executor=None, counter: OperationCounter | None = None) -> None:
        optimizer.zero_grad()
        with counter or contextlib.nullcontext():  # forward, backward and the gradients' collectives
            forward_backward(executor)
        optimizer.step()

    def forward_backward(executor) -> None:
        model.forward_backward(x, y, executor)
        model.finish_gradients()  # one collective for each axis, as the model counts them

    if not executors:  # what one forward leaves alive for its backward (its loss included)
        with memory.live_tensor_bytes() as live:
            loss = model.loss_fn(model.stages[0](x), y)
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
    counter = OperationCounter()
    step(executors.get(False), counter)
    stage, *others = model.stages.values()  # one stage a rank, but with virtual stages
    states = None if others else memory.measure_model_states(stage, optimizer=optimizer)
    record = {
        "operations": counter.operations,
        "model_state_bytes": states.total if states else None,
        "activation_bytes": activation_bytes,
        "sent_bytes": sent,
        "step_s": statistics.median(times[sweep.warmup :]),
    }
    gathered = [None] * runtime.world_size()
    torch.distributed.all_gather_object(gathered, (record, speed))
    if not runtime.is_main():
        return None
    records = [r for r, _ in gathered]
    most = {key: max(r[key] for r in records if r[key] is not None) for key in record}
    return most | {"speed": median_speed([s for _, s in gathered])}


def median_speed(speeds: list[dict]) -> dict:
    """The median over processes of what ``probe_compute`` measured on each."""
    return {
        "matmul_flops": statistics.median(s["matmul_flops"] for s in speeds),
        "forward_backward_s": {
            b: statistics.median(s["forward_backward_s"][b] for s in speeds)
            for b in speeds[0]["forward_backward_s"]
        },
        "optimizer_s": statistics.median(s["optimizer_s"] for s in speeds),
        "operations": speeds[0]["operations"],
    }


def calibrate(launch, sweep: Sweep = SWEEP) -> dict:
    """Measure this machine: the all-reduce's alpha and beta, a core's matmul rate and memory bandwidth.

    The rates are measured with every core busy, one process each, as in the layouts' runs: two
    processes share the memory's bandwidth, and one process alone would see more of it.

    Args:
        launch: ``launch.launch``, which runs a function on N local processes.
        sweep: the transformer whose one-process step calibrates the memory bandwidth.
    """
    link = launch(probe_link, 2, check_collectives=False)[0]
    latency, bandwidth = scaling.fit_ring_all_reduce(2, message_bytes=list(link), seconds=list(link.values()))
    cores = min(environment.usable_cpus(), max(layout.gpus for layout in LAYOUTS))
    side_by_side = launch(probe_compute, cores, sweep, check_collectives=False)
    calibration = {
        "latency_s": latency,
        "bandwidth_bytes_per_s": bandwidth,
        "cores": environment.usable_cpus(),
    }
    return with_speed(calibration, median_speed(side_by_side), sweep)


def probe_link(
    sizes: tuple[int, ...] = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20), calls: int = 24
) -> dict[int, float] | None:
    """All-reduces as training makes them: each after some computation, their mean time per size.

    ``bench allreduce`` times all-reduces back to back and keeps the median, the link's best. A
    training step makes each one after a stretch of compute, when the ranks arrive a little apart
    and the transport's threads have gone to sleep, and it pays every call, the slow ones too: the
    mean of calls made that way is the link a step sees. Rank 0 returns {bytes: seconds}.

    Args:
        sizes: message sizes in bytes (multiples of 4).
        calls: all-reduces timed per size, after two untimed ones.
    """
    torch.set_num_threads(1)
    left, right = torch.randn(256, 256), torch.randn(256, 256)
    result = {}
    for size in sizes:
        message, times = torch.zeros(size // 4), []
        for call in range(calls + 2):
            for _ in range(4):  # a few milliseconds of work, as between two collectives of a step
                left @ right
            start = time.perf_counter()
            torch.distributed.all_reduce(message)
            if call >= 2:
                times.append(time.perf_counter() - start)
        mean = torch.tensor([statistics.mean(times)], dtype=torch.float64)
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.MAX)
        result[size] = float(mean)
    return result if runtime.is_main() else None


def with_speed(calibration: dict, speed: dict, sweep: Sweep = SWEEP) -> dict:
    """The calibration with the compute speed ``probe_compute`` measured.

    The matmul rate is the probe's; the optimizer's bandwidth is the bytes AdamW moves
    (``specs.OPTIMIZER_BYTES`` a parameter) over its step's time. The rest of a forward and
    backward is two unknowns: the bandwidth its norms and activation functions reach (their
    bytes are ``cost_model``'s) and the host's time per dispatched operation (their number is
    counted). Two batch sizes give two equations: the operations are the same at both, the
    bytes are not.

    Args:
        calibration: the link's figures (``latency_s``, ``bandwidth_bytes_per_s``) and ``cores``.
        speed: what ``probe_compute`` returned: ``matmul_flops``, ``forward_backward_s`` (seconds
            at each batch size), ``optimizer_s`` and ``operations`` (of a forward and backward).
        sweep: the transformer those steps trained.
    """
    steps = speed["forward_backward_s"]
    parameters = sweep.spec().parameters()
    calibration = calibration | {
        "matmul_flops": speed["matmul_flops"],
        "memory_bandwidth": 1.0,  # for the moment: the memory-bound "seconds" below are bytes
        "optimizer_bandwidth": specs.OPTIMIZER_BYTES["fp32"] * parameters / speed["optimizer_s"],
        "host_seconds_per_operation": 0.0,
        "one_process_step_s": steps[sweep.global_batch] + speed["optimizer_s"],
        "one_process_operations": speed["operations"],
    }
    rest, moved = {}, {}  # per batch size: the seconds not in matmuls, the bytes moved
    for batch, seconds in steps.items():
        single = cost_model.predict(
            sweep.spec(),
            machine(calibration),
            course_layout(Layout(), dataclasses.replace(sweep, global_batch=batch)),
            seq_len=sweep.seq_len,
            global_batch=batch,
        )
        moved[batch] = single.time["memory-bound operations"]
        rest[batch] = seconds - single.time["compute"]
    big, small = max(rest), min(rest)
    if rest[big] <= 0:
        raise UserError(
            f"the one-process forward and backward ({steps[big] * 1e3:.0f} ms) took less than its matmuls "
            "at the probe's rate: something else ran during the matmul probe; run again"
        )
    seconds_per_byte = (rest[big] - rest[small]) / (moved[big] - moved[small])
    host = (rest[big] - moved[big] * seconds_per_byte) / speed["operations"]
    if seconds_per_byte <= 0 or host < 0:  # the two disagree (noise): call all of it memory-bound
        seconds_per_byte, host = rest[big] / moved[big], 0.0
    calibration["memory_bandwidth"] = 1 / seconds_per_byte
    calibration["host_seconds_per_operation"] = host
    return calibration


class OperationCounter(TorchDispatchMode):
    """Count the operations dispatched while the ``with`` block runs (backward's included).

    >>> with OperationCounter() as counter:
    ...     loss.backward()
    >>> counter.operations
    """

    def __init__(self):
        super().__init__()
        self.operations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        return func(*args, **(kwargs or {}))


def probe_compute(sweep: Sweep = SWEEP) -> dict:
    """On each process at once, no communication: a core's matmul rate and one-process steps.

    The steps train ``sweep``'s transformer on its whole batch and on a quarter of it, their
    forward and backward timed apart from the optimizer step, taken in turn with the matmul probe
    so that all see the machine in the same mood; the operations a forward and backward
    dispatch are counted once (``OperationCounter``).

    Args:
        sweep: the transformer whose training step is timed.
    """
    torch.set_num_threads(1)
    inputs, targets, _ = zen_windows(seq_len=sweep.seq_len)
    model = sweep.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = (sweep.global_batch, max(1, sweep.global_batch // 4))  # the operations alike, the bytes not

    def forward_backward(batch: int) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        models.lm_loss(model(inputs[:batch]), targets[:batch]).backward()
        return time.perf_counter() - start

    def optimizer_step() -> float:
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    rates, optimizer_times, times = [], [], {batch: [] for batch in batches}
    for _ in range(sweep.steps):
        rates.append(flops.measure_matmul_tflops(size=512, repeats=3, warmup=1) * 1e12)
        for batch in batches:
            times[batch].append(forward_backward(batch))
            optimizer_times.append(optimizer_step())
    with OperationCounter() as counter:
        forward_backward(sweep.global_batch)
    skip = 2 * sweep.warmup
    return {
        "matmul_flops": statistics.median(rates[sweep.warmup :]),
        "forward_backward_s": {b: statistics.median(s[sweep.warmup :]) for b, s in times.items()},
        "optimizer_s": statistics.median(optimizer_times[skip:]),
        "operations": counter.operations,
    }


def machine(calibration: dict) -> specs.ClusterSpec:
    """This machine as the planner sees it: one node of ``cores`` "GPUs" joined by the measured link."""
    link = specs.Link(calibration["latency_s"], calibration["bandwidth_bytes_per_s"])
    return specs.ClusterSpec(
        name="this machine",
        gpus_per_node=calibration["cores"],
        gpu_memory_bytes=1e12,
        peak_flops=calibration["matmul_flops"],
        achieved_flops=calibration["matmul_flops"],
        memory_bandwidth=calibration["memory_bandwidth"],
        inside_node=link,
        between_nodes=link,
        overlaps_communication=False,
        source="calibrated by plan --validate",
        optimizer_bandwidth=calibration.get("optimizer_bandwidth"),
        host_seconds_per_operation=calibration.get("host_seconds_per_operation", 0.0),
    )


def predict_beside(
    measured: dict, layout: Layout, calibration: dict, sweep: Sweep = SWEEP
) -> tuple[specs.ClusterSpec, cost_model.Prediction]:
    """The prediction for a layout ``measure_layout`` ran: this machine at the speed measured beside
    the run, with the operations the run counted; and that machine.

    Args:
        measured: what ``measure_layout`` returned.
        layout: the layout it ran.
        calibration: the link's figures and ``cores`` (``calibrate``'s, or a cluster's).
        sweep: the transformer it trained.
    """
    cluster = machine(with_speed(calibration, measured["speed"], sweep))
    predicted = cost_model.predict(
        sweep.spec(),
        cluster,
        course_layout(layout, sweep),
        seq_len=sweep.seq_len,
        global_batch=sweep.global_batch,
        operations=measured["operations"],
    )
    return cluster, predicted


def validate(launch, *, layouts: list[Layout] = LAYOUTS, sweep: Sweep = SWEEP) -> dict:
    """Calibrate, run every layout, and put each prediction beside its measurement.

    Args:
        launch: ``launch.launch``, which runs a function on N local processes.
        layouts: the layouts to run.
        sweep: the transformer they train, and for how many steps.
    """
    calibration = calibrate(launch, sweep)
    spec = sweep.spec()
    rows = []
    for layout in layouts:
        # unchecked: checking a collective's call is one more all-gather per collective, which a
        # layout with a hundred small collectives a step (sequence parallelism) would be timed with
        measured = launch(measure_layout, layout.gpus, layout, sweep, check_collectives=False)[0]
        cluster, predicted = predict_beside(measured, layout, calibration, sweep)
        states = predicted.peak.model_states
        row = {
            "layout": label(layout),
            "processes": layout.gpus,
            "own_core": layout.gpus <= calibration["cores"],
            "speed_beside": {
                "matmul_flops": cluster.achieved_flops,
                "memory_bandwidth": cluster.memory_bandwidth,
                "host_seconds_per_operation": cluster.host_seconds_per_operation,
                "optimizer_bandwidth": cluster.optimizer_bandwidth,
                "one_process_forward_backward_s": measured["speed"]["forward_backward_s"],
            },
            "operations": measured["operations"],
            "model_state_bytes": {"predicted": states, "measured": measured["model_state_bytes"]},
            "activation_bytes": {
                "predicted": predicted.peak.activations_kept,
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
