"""Every figure of the lecture slides, drawn from the course's own code.

``python -m course_lib.tools.figures slides/public/images`` writes one PNG per figure. The pictures are
not drawn by hand: the ZeRO bars come from ``memory.model_state_bytes``, the pipeline charts from
``pipeline.build_schedule``, the grid from ``mesh.grid_groups``, the ring from the same counting
the ring all-reduce does, the scaling plot and the FSDP timelines from recorded measurements
(``slides/recorded``), the layouts' memory from ``cost_model.predict``. Change the code and the
slides follow; a test fails if a committed figure differs from what this command draws.
``--record`` measures again what the slides show measured (the FSDP steps with and without
prefetch, and ``plan --validate``'s sweep, on local processes) and overwrites the recordings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from .. import checks
from ..distributed import runtime
from ..distributed.launch import launch
from ..distributed.ring import ring_all_reduce_counts
from ..observe import profiling
from ..parallel import context_chunks, expert, memory, mesh, pipeline
from ..parallel.fsdp import FullyShardedDataParallel
from ..plan import attention_time, cost_model, kernels, specs
from ..plan.layout import Layout
from . import RECORDED, bench, plots
from .bench import MLP_BATCH, MLP_LAYERS, MLP_WIDTH, mlp, training_step
from .evidence import gpu_runs
from .evidence.plan_validation import validate
from .study import read_csv

PNG_METADATA = {"Software": None}  # no version string in the file: the same drawing gives the same bytes
RECORDED_SCALING = RECORDED / "scaling.csv"
RECORDED_FSDP = {
    "prefetch": RECORDED / "fsdp_prefetch.json",
    "no prefetch": RECORDED / "fsdp_no_prefetch.json",
}
RECORDED_PLAN_CHECK = RECORDED / "plan_validation.json"
RECORDED_COMPILE = RECORDED / "compile_cpu.json"  # python -m course_lib.tools.bench compile --output ...
RECORDED_FLOAT8 = RECORDED / "float8_losses.json"  # python -m course_lib.tools.bench float8 --output ...


def _box(axis, x, y, w, h, text, colour="#dde6f3", size=9):
    axis.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", linewidth=0.8))
    axis.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def _arrow(axis, start, end, colour="black"):
    axis.add_patch(
        FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=colour, linewidth=1)
    )


def _blank(width, height):
    figure = Figure(figsize=(width, height))
    axis = figure.subplots()
    axis.set_axis_off()
    return figure, axis


def data_parallel():
    """N replicas, a slice of the batch each, one all-reduce of the gradients."""
    figure, axis = _blank(7, 3.2)
    for r in range(4):
        x = 0.3 + 1.7 * r
        _box(axis, x, 2.3, 1.3, 0.5, f"batch slice {r}", "#f3e6dd")
        _box(axis, x, 1.2, 1.3, 0.7, f"rank {r}\nfull model", "#dde6f3")
        _arrow(axis, (x + 0.65, 2.3), (x + 0.65, 1.9))
        _arrow(axis, (x + 0.65, 1.2), (x + 0.65, 0.75))
    _box(
        axis,
        0.3,
        0.2,
        6.4,
        0.55,
        "all-reduce (average) of the gradients: 2(N-1)/N x gradient bytes per rank",
        "#e3f3dd",
    )
    axis.set_xlim(0, 7.2)
    axis.set_ylim(0, 3)
    return figure


def ring_all_reduce():
    """How many ranks' values each chunk holds, after each step of a ring all-reduce on 4 ranks."""
    n = 4
    frames = ring_all_reduce_counts(n)
    figure = Figure(figsize=(2.0 * len(frames), 2.3))
    axes = figure.subplots(1, len(frames))
    for step, (axis, frame) in enumerate(zip(axes, frames)):
        axis.imshow(frame, vmin=1, vmax=n, cmap="Blues")
        for r in range(n):
            for c in range(n):
                # white on the dark cells (a chunk that holds every rank's values), black on the light
                colour = "white" if frame[r][c] > (n + 1) / 2 else "black"
                axis.text(c, r, frame[r][c], ha="center", va="center", fontsize=8, color=colour)
        phase = "start" if step == 0 else ("reduce-scatter" if step < n else "all-gather")
        axis.set_title(f"{phase} {step if step else ''}".strip(), fontsize=8)
        axis.set_xticks(range(n))
        axis.set_yticks(range(n))
        axis.tick_params(labelsize=7, length=0)
        axis.set_xlabel("chunk", fontsize=7)
        if step == 0:
            axis.set_ylabel("rank", fontsize=7)
    figure.tight_layout()
    return figure


def zero_memory():
    """Bytes per GPU for 7.5B parameters on 64 GPUs, by sharding (the ZeRO paper's example)."""
    figure = Figure(figsize=(6, 3.2))
    axis = figure.subplots()
    kinds = ("params", "grads", "optimizer")
    bottoms = [0.0] * len(memory.SHARDINGS)
    for kind, colour in zip(kinds, ("#4c72b0", "#55a868", "#c44e52")):
        values = [
            getattr(memory.model_state_bytes(7.5e9, 64, s, **memory.MIXED_PRECISION_ADAM), kind) / 1e9
            for s in memory.SHARDINGS
        ]
        axis.bar(memory.SHARDINGS, values, bottom=bottoms, label=kind, color=colour)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for index, total in enumerate(bottoms):
        axis.text(index, total + 2, f"{total:.1f} GB", ha="center", fontsize=8)
    axis.set_ylabel("GB per GPU")
    axis.set_xlabel("sharding (fsdp is ZeRO stage 3)")
    axis.set_title("7.5B parameters, 64 GPUs, mixed-precision Adam")
    axis.legend()
    figure.tight_layout()
    return figure


def fsdp_timeline(units: int = 4):
    """When each unit's parameters are gathered and freed, forward then backward (FULL_SHARD), with
    prefetch: the next unit's all-gather travels while this unit computes, and each reduce-scatter
    while the next unit's backward computes. A schematic: a unit's forward takes 1, its backward 2,
    a collective 0.3."""
    figure = Figure(figsize=(7.5, 2.6))
    axis = figure.subplots()
    gather, forward, backward = 0.3, 1.0, 2.0
    colours = {
        "all-gather": "#c44e52",
        "forward": "#4c72b0",
        "backward": "#55a868",
        "reduce-scatter": "#8172b2",
    }
    compute_free = 0.0  # when the compute stream is next free
    gathered = gather  # unit 0's gather, waited for at the start
    axis.barh(0, gather, left=0.0, color=colours["all-gather"])
    for phase, order, length in (
        ("forward", list(range(units)), forward),
        ("backward", list(reversed(range(units))), backward),
    ):
        for position, unit in enumerate(order):
            start = max(compute_free, gathered)
            axis.barh(unit, length, left=start, color=colours[phase])
            # the last unit of forward stays whole: its backward comes next (FSDP2 keeps the root's)
            following = order[position + 1] if position + 1 < len(order) else None
            if following is not None:  # prefetch: the next unit's gather starts as this one computes
                axis.barh(following, gather, left=start, color=colours["all-gather"], alpha=0.9)
                gathered = start + gather
            if phase == "backward":  # the gradient leaves while the next unit's backward computes
                axis.barh(unit, gather, left=start + length, color=colours["reduce-scatter"])
            compute_free = start + length
    axis.set_yticks(range(units), [f"unit {u}" for u in range(units)])
    axis.invert_yaxis()
    axis.set_xlabel("time (schematic: a unit's forward = 1)")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    axis.legend(handles, list(colours), ncol=4, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    figure.tight_layout()
    return figure


def tensor_parallel():
    """A column-parallel layer feeding a row-parallel one: one all-reduce at the end."""
    figure, axis = _blank(7, 3)
    colours = ("#dde6f3", "#f3e6dd")
    _box(axis, 0.2, 1.1, 0.8, 0.8, "x\n(all ranks)", "#eeeeee")
    for r in range(2):
        _box(
            axis, 1.6, 0.4 + 1.3 * r, 1.4, 0.9, f"A{r + 1}: rows {r + 1}/2\n(column parallel)", colours[r], 8
        )
        _box(
            axis, 3.6, 0.4 + 1.3 * r, 1.4, 0.9, f"B{r + 1}: columns {r + 1}/2\n(row parallel)", colours[r], 8
        )
        _arrow(axis, (1.0, 1.5), (1.6, 0.85 + 1.3 * r))
        _arrow(axis, (3.0, 0.85 + 1.3 * r), (3.6, 0.85 + 1.3 * r))
        _arrow(axis, (5.0, 0.85 + 1.3 * r), (5.6, 1.5))
    _box(axis, 5.6, 1.1, 1.2, 0.8, "all-reduce\n(sum)", "#e3f3dd")
    axis.set_xlim(0, 7)
    axis.set_ylim(0, 3)
    return figure


def _schedule(name: str, virtual: int = 1) -> Callable:
    def draw():
        actions = pipeline.build_schedule(name, 4, 8, virtual_stages=virtual)
        events = pipeline.simulate_timeline(actions, 4)  # a split backward: B and W each as long as F
        chunks = "chunks in a V" if name in pipeline.V_SHAPED else "virtual stages"
        title = f"{name}: 4 stages, 8 micro-batches" + (f", {virtual} {chunks}" if virtual > 1 else "")
        return plots.plot_timeline(
            events, title=f"{title}, bubble {pipeline.bubble_fraction(events):.0%}", pipeline_size=4
        )

    return draw


def mesh_layout():
    """8 ranks as data 2 x pipeline 2 x tensor 2, with the groups of each axis."""
    groups = mesh.grid_groups(8, data=2, pipeline=2, tensor=2)
    figure = Figure(figsize=(9, 2.6))
    axes = figure.subplots(1, 3)
    for axis, kind in zip(axes, ("tensor", "data", "pipeline")):
        axis.set_axis_off()
        for index, group in enumerate(groups[kind]):
            for position, rank in enumerate(group):
                _box(axis, position * 1.1, 3 - index * 0.9, 1.0, 0.7, f"rank {rank}", f"C{index}", 8)
        axis.set_xlim(-0.1, 2.3)
        axis.set_ylim(0, 4)
        axis.set_title(f"{kind} groups", fontsize=9)
    figure.tight_layout()
    return figure


def ring_attention():
    """The blocks each of 4 ranks computes at each ring step, contiguous and zig-zag, causal."""
    schedules = {
        name: context_chunks.ring_schedule(context_chunks.SequenceChunks(16, 4, zigzag=zigzag))
        for name, zigzag in (("contiguous", False), ("zig-zag", True))
    }
    return plots.plot_ring_attention(schedules, 16)


def sequence_methods():
    """Ring against Ulysses on 4 GH200s, predicted (``attention_time.attention_time_model``), over compute
    alone: inside an Alps node (the all-to-all on all three peers' NVLinks at once) and across four
    nodes (one NIC a GPU), as notebook 12 draws it."""
    seq_lens = [2**n for n in range(12, 20)]
    gpus = dict(heads=32, head_dim=128, degree=4, flops_per_s=400e12, latency_s=20e-6)
    links = {  # (one peer's link: the ring's neighbour, every peer at once: the all-to-all), bytes/s
        "inside an Alps node: NVLink 150 GB/s to each of 3 peers": (150e9, 3 * 150e9),
        "across 4 nodes: one 25 GB/s NIC a GPU": (25e9, 25e9),
    }
    curves = {}
    for title, (link, all_to_all) in links.items():
        predicted = [
            attention_time.attention_time_model(
                seq=s, link_bytes_per_s=link, all_to_all_bytes_per_s=all_to_all, **gpus
            )
            for s in seq_lens
        ]
        curves[title] = {
            "compute alone": [p["compute_s"] for p in predicted],
            "ring (zig-zag)": [p["ring_s"] for p in predicted],
            "Ulysses": [p["ulysses_s"] for p in predicted],
        }
    return plots.plot_sequence_methods(curves, seq_lens)


def expert_load():
    """A skewed router's top-2 assignments per expert against the capacity (factor 1.0)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=generator) + torch.linspace(1.5, -1.5, 8)
    routing = expert.route(logits, top_k=2, capacity_factor=1.0)
    return plots.plot_expert_load(
        {"64 tokens, top-2, 8 experts": (routing.tokens_per_expert.tolist(), routing.capacity)}
    )


def grouped_experts():
    """One grouped kernel against one launch per expert, the kernel model of the H100's record:
    a rank's 16,384 rows (up-projections of DeepSeek-V2-Lite's experts, 2048 x 1408) split evenly
    among 1 to 64 experts."""
    gpu, rows, d_model, hidden = kernels.GPUS["h100-sxm"], 16384, 2048, 1408
    counts = [1, 2, 4, 8, 16, 32, 64]
    flops = 2 * rows * d_model * hidden / 1e12
    one_each = [flops / (e * kernels.matmul_seconds(gpu, rows / e, hidden, d_model)) for e in counts]
    grouped = [flops / kernels.grouped_matmul_seconds(gpu, rows / e, hidden, d_model, e) for e in counts]
    measured = kernels.kernel_fit(gpu.record).grouped_products
    return plots.plot_grouped_experts(
        {"one launch per expert": one_each, "one grouped kernel": grouped},
        counts,
        title=f"H100, {rows} rows, experts {d_model} x {hidden}: the tile model\n"
        + (
            f"({measured} grouped products measured)"
            if measured
            else "(no grouped product measured yet: an assumption)"
        ),
    )


def strong_scaling():
    """The strong-scaling plot of slides/recorded/scaling.csv, as ``study plot`` draws it."""
    rows = read_csv(RECORDED_SCALING)
    return plots.draw_study(rows, panels=("time_per_epoch_s", "speedup"), panel_size=(4.0, 3.2))


def fsdp_prefetch():
    """The course's FSDP step without prefetch and with it, measured (``--record``), one time scale."""
    titles = {
        "no prefetch": "without prefetch: each unit's all-gather waited for",
        "prefetch": "with prefetch: the next unit's all-gather under this unit's compute",
    }
    recorded = {}
    for kind, title in titles.items():
        measured = profiling.load(RECORDED_FSDP[kind])
        summary = measured.summary()
        title += (
            f" ({summary['step_ms']:.0f} ms, {summary['exposed_communication_share']:.0%} exposed "
            f"communication, {summary['hidden_communication_ms']:.0f} ms hidden)"
        )
        recorded[title] = measured
    return plots.plot_anatomies(recorded)


def _fsdp_steps_with_and_without_prefetch() -> dict:
    """Each rank: the bench's MLP under the course's FSDP (a unit per linear), prefetch on and off."""
    import torch

    torch.manual_seed(0)
    reference = mlp(MLP_WIDTH, MLP_LAYERS)
    generator = torch.Generator().manual_seed(runtime.rank())
    inputs, targets = (torch.randn(MLP_BATCH, MLP_WIDTH, generator=generator) for _ in range(2))
    recorded = {}
    for kind in RECORDED_FSDP:
        model = mlp(MLP_WIDTH, MLP_LAYERS)
        model.load_state_dict(reference.state_dict())
        units = [m for m in model if isinstance(m, torch.nn.Linear)]
        on = kind == "prefetch"
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=units, forward_prefetch=on, backward_prefetch=on
        )
        recorded[kind] = profiling.record_steps(training_step(wrapped, inputs, targets), steps=5, warmup=3)
        recorded[kind].conditions |= {"model": f"MLP {MLP_LAYERS} x {MLP_WIDTH}", "batch_per_rank": MLP_BATCH}
    return recorded


def layout_memory():
    """Memory per GPU of seven layouts of Llama 3 8B on 64 GH200s of Alps (``cost_model.predict``)."""
    alps = specs.CLUSTERS["alps"]
    layouts = [
        Layout(data=64, sharding="ddp"),
        Layout(data=64, sharding="fsdp"),
        Layout(data=64, sharding="fsdp", recomputation="selective"),
        Layout(data=64, sharding="fsdp", recomputation="full"),
        Layout(data=16, tensor=4, sharding="fsdp"),
        Layout(data=16, context=4, sharding="fsdp"),
        Layout(data=8, pipeline=2, context=4, sharding="fsdp", schedule="interleaved_1f1b", virtual_stages=2),
    ]
    model = specs.MODELS["llama3-8b"]
    predictions = [
        cost_model.predict(model, alps, layout, seq_len=8192, global_batch=512) for layout in layouts
    ]
    return plots.plot_memory_breakdown(predictions, capacity_bytes=alps.gpu_memory_bytes)


def h200_memory_phases():
    """The H200 runs (``slides/recorded/gpu/h200-runs.csv``): each phase's allocated peak as the
    planner predicts it, beside the measured allocated and reserved peaks."""
    h200 = specs.CLUSTERS["h200-node"]
    checked = gpu_runs.check(gpu_runs.read_runs(), h200)
    return plots.plot_memory_phases(checked, capacity_bytes=h200.gpu_memory_bytes)


def prediction_check():
    """``plan --validate`` as recorded: measured over predicted, per layout, on 2 local processes."""
    return plots.plot_prediction_check(json.loads(RECORDED_PLAN_CHECK.read_text()))


def record() -> list[Path]:
    """Measure again what the slides show measured; the recordings written."""
    recorded = launch(_fsdp_steps_with_and_without_prefetch, 2, check_collectives=False)[0]
    for kind, path in RECORDED_FSDP.items():
        recorded[kind].save(path)
    RECORDED_PLAN_CHECK.write_text(json.dumps(validate(launch), indent=1) + "\n")
    for path, benchmark in ((RECORDED_COMPILE, "compile"), (RECORDED_FLOAT8, "float8")):
        bench.main([benchmark, "--output", str(path)])  # the defaults: what the figures name
    return [*RECORDED_FSDP.values(), RECORDED_PLAN_CHECK, RECORDED_COMPILE, RECORDED_FLOAT8]


def overlap_ratio():
    """Collective matmul: when a chunk's matmul outlasts its transfer, on an H100 node and on Alps."""
    h100, alps = specs.CLUSTERS["h100-node"], specs.CLUSTERS["alps"]
    links = {
        "H100 node, NVLink": (h100.achieved_flops, h100.inside_node.bandwidth),
        "Alps node, NVLink": (alps.achieved_flops, alps.inside_node.bandwidth),
        "H100, across nodes (one NIC)": (h100.achieved_flops, h100.between_nodes.bandwidth),
    }
    llama = specs.MODELS["llama3-70b"]
    marked = {"70B fc1, T=8": llama.ffn_hidden // 8, "70B out proj., T=8": llama.d_model // 8}
    return plots.plot_overlap_ratio(links, marked)


def allreduce_algorithms():
    """A flat ring, the hierarchy and the tree across 16 nodes of Alps and of an 8-H100 cluster."""
    return plots.plot_allreduce_algorithms([specs.CLUSTERS["alps"], specs.CLUSTERS["h100-node"]], nodes=16)


def float8_losses():
    """``bench float8`` as recorded: bf16 from two seeds and both float8 recipes, step by step."""
    return plots.plot_loss_curves(json.loads(RECORDED_FLOAT8.read_text())["curves"])


def compile_cost():
    """``bench compile`` as recorded: compile seconds beside the step eager and compiled."""
    return plots.plot_compile_cost(json.loads(RECORDED_COMPILE.read_text()))


def rooflines_figure():
    """FSDP's data axis on three clusters: where compute hides the traffic (``plots.plot_rooflines``)."""
    return plots.plot_rooflines(
        specs.MODELS["llama3-8b"], [specs.CLUSTERS[n] for n in ("h100-node", "alps", "a100-dgx")]
    )


FIGURES: dict[str, Callable] = {
    "h200_memory_phases": h200_memory_phases,
    "data_parallel": data_parallel,
    "ring_all_reduce": ring_all_reduce,
    "zero_memory": zero_memory,
    "rooflines": rooflines_figure,
    "fsdp_timeline": fsdp_timeline,
    "fsdp_prefetch": fsdp_prefetch,
    "tensor_parallel": tensor_parallel,
    "pipeline_gpipe": _schedule("gpipe"),
    "pipeline_1f1b": _schedule("1f1b"),
    "pipeline_interleaved": _schedule("interleaved_1f1b", 2),
    "pipeline_zb_h1": _schedule("zb_h1"),
    "pipeline_zb_v": _schedule("zb_v", 2),
    "mesh_3d": mesh_layout,
    "strong_scaling": strong_scaling,
    "ring_attention": ring_attention,
    "sequence_methods": sequence_methods,
    "expert_load": expert_load,
    "grouped_experts": grouped_experts,
    "layout_memory": layout_memory,
    "prediction_check": prediction_check,
    "allreduce_algorithms": allreduce_algorithms,
    "overlap_ratio": overlap_ratio,
    "float8_losses": float8_losses,
    "compile_cost": compile_cost,
}


def draw_all(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        path = directory / f"{name}.png"
        plots.save(draw(), path, dpi=110, metadata=PNG_METADATA)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.figures", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("directory", nargs="?", type=checks.folder_to_write, default="slides/public/images")
    parser.add_argument(
        "--record",
        action="store_true",
        help="first measure again what the slides show measured (2 local processes), into slides/recorded",
    )
    args = parser.parse_args(argv)
    if args.record:
        for path in record():
            print(f"recorded {path}")
    for path in draw_all(args.directory):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    checks.exit_with(main)
