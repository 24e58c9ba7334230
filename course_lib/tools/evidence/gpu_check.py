"""One GPU, measured against the planner: ``make gpu-check``.

``python -m course_lib.tools.evidence.gpu_check`` trains single-GPU steps of the course's own Llama module
(``llama.Llama``, the model a ``ModelSpec`` describes) over a grid chosen to exercise the planner's
terms, and prints the planner's prediction beside every measurement:

- the grid: Llama shapes of 1.5B, 3.6B and 8B parameters, sequences of 2K to 16K tokens, 1 to 4
  sequences a micro-batch, no, full or selective recomputation, the ``fp32-master`` (PyTorch's
  autocast) and ``torchtitan`` (FSDP2 on a world of one) recipes as their profiles describe them,
  eager or compiled. The planner's own predictions for the card at hand pick the runs: some well
  inside its memory, some around its capacity, those last;
- each run: the median step time, ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``,
  the allocated peak of each phase of one step (forward, the loss's backward, the blocks'
  backward, the optimizer step: ``plan.memory_phases``), or that it ran out of memory (a data
  point, not a failure);
- one step's memory timeline by category (parameters, gradients, optimizer state, activations and
  temporaries), from ``torch.cuda.memory._record_memory_history`` (its snapshot is kept too);
- all of it in ``slides/recorded/gpu/<gpu>-steps.json``, whose runs ``plan check-gpu-runs`` and
  ``plan calibrate`` read.

``--device cpu`` runs the same command at tiny sizes (memory from ``parallel.memory``'s
``live_tensor_bytes``): what the tests run. The grid is refused before it starts if its predicted
time exceeds ``--budget-s``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import gc
import json
import os
import pickle
import sys
import time
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ... import checks
from ...llama import Llama
from ...parallel import memory, recompute
from ...plan import kernels, memory_phases
from ...plan.cost_model import Prediction, predict
from ...plan.frameworks import FRAMEWORKS
from ...plan.layout import Layout
from ...plan.specs import CLUSTERS, CUDA_CONTEXT, GIB, ClusterSpec, Link, ModelSpec
from .. import plots
from .gpu_record import Timer

STACKS = ("course", "fp32-master", "torchtitan")
"""The stacks a run trains with, by the planner's profile that describes each: ``course`` (bf16
weights and gradients, the gradients kept in one buffer, an fp32 master copy and Adam's moments:
``MasterAdamW``), ``fp32-master`` (PyTorch's autocast on an fp32 model), ``torchtitan`` (FSDP2 on a
world of one, bf16 compute, fp32 shards and gradients)."""

GPU_MODELS = (
    ModelSpec("llama-1.5b", 16, 2048, 32, 8, 8192, 128256, source="slides/recorded/gpu/configs"),
    ModelSpec("llama-3.6b", 28, 3072, 24, 8, 8192, 128256, source="slides/recorded/gpu/configs"),
    ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256, source="Llama 3 8B"),
)  # fmt: skip
CPU_MODEL = ModelSpec("tiny-llama", 2, 48, 6, 2, 80, 97, source="gpu_check --device cpu")

MEASURED_PHASES = tuple(phase for phase in memory_phases.PHASES if phase != "backward end")
"""The phases whose allocated peak a run measures: the planner's (``memory_phases.PHASES``) but the
backward's end, a moment rather than a span, read as what is allocated then ("backward end
(allocated)")."""


@dataclass(frozen=True)
class Run:
    """One run of the grid: a model, a recipe, a step's shape.

    Args:
        spec: the model's shapes (the Llama module is built from it).
        recipe: the stack, one of ``STACKS``.
        seq_len: tokens per sequence.
        micro_batch: sequences a step.
        recomputation: ``"none"``, ``"full"`` or ``"selective"`` (the course's policies).
        compiled: each block compiled (``torch.compile``).
    """

    spec: ModelSpec
    recipe: str
    seq_len: int
    micro_batch: int
    _: KW_ONLY
    recomputation: str = "none"
    compiled: bool = False

    @property
    def layout(self) -> Layout:
        return Layout(
            sharding="fsdp" if self.recipe == "torchtitan" else "ddp",
            recomputation=self.recomputation,
            micro_batch=self.micro_batch,
        )

    @property
    def name(self) -> str:
        extra = {"none": "", "full": "-ac", "selective": "-sac"}[self.recomputation]
        compiled = "-compile" if self.compiled else ""
        return f"{self.spec.name}-{self.recipe}-s{self.seq_len}-mb{self.micro_batch}{extra}{compiled}"

    def framework(self):
        """The recipe's profile as this run uses it: compiled or not, "selective" as the course's
        recomputation keeps it (what ``build`` applies, whatever the stack's own policy), and for
        the ``course`` recipe the loss every recipe computes (``Step.forward``: fp32 logits)."""
        profile = FRAMEWORKS[self.recipe].with_(selective="course")
        if self.recipe == "course":  # its loss is every recipe's: the logits upcast to fp32
            profile = profile.with_(logits_upcast=True, loss_bytes_per_logit=2 + 4 + 4)
        return profile.with_(compiled=True) if self.compiled else profile


def predicted(run: Run, cluster: ClusterSpec) -> Prediction:
    """The planner's prediction of ``run`` on ``cluster`` (one micro-batch a step)."""
    return predict(
        run.spec, cluster, run.layout, seq_len=run.seq_len, global_batch=run.micro_batch,
        framework=run.framework(),
    )  # fmt: skip


def cluster_for(device: torch.device) -> ClusterSpec:
    """The planner's view of this device: on a GPU the built-in cluster of its kind (its record's
    kernels) with the memory this card reports and the CUDA context it measures; a GPU the
    planner has no record of is planned as an H100 (said); on a CPU an uncalibrated machine whose
    time predictions mean nothing (its memory's do)."""
    if device.type != "cuda":
        link = Link(1e-5, 1e9)
        return ClusterSpec(
            "this-cpu (uncalibrated)", 1, 2**40, 1e11, 1e11, 1e10, link, link, overlaps_communication=False,
            source="gpu_check --device cpu: memory is what it checks",
        )  # fmt: skip
    free, total = torch.cuda.mem_get_info(device)
    gpu = kernels.RECORDED_ON.get(kernels.slug(torch.cuda.get_device_name(device)))
    base = next((c for c in CLUSTERS.values() if c.gpu == gpu), None)
    if base is None:
        print(f"no record of a {torch.cuda.get_device_name(device)}: planned as an H100", file=sys.stderr)
        base = CLUSTERS["h100-node"]
    return dataclasses.replace(base, gpu_memory_bytes=total, context_bytes=max(total - free, CUDA_CONTEXT))


def grid(device: torch.device, cluster: ClusterSpec) -> list[Run]:
    """The runs for this device, the fullest last: on a CPU a tiny model's few; on a GPU ``choose``'s
    of ``candidates``."""
    if device.type != "cuda":
        runs = [
            Run(CPU_MODEL, recipe, 64, batch, recomputation=policy)
            for recipe in STACKS
            for batch, policy in ((1, "none"), (2, "full"), (1, "selective"))
        ]
        return sorted(runs, key=lambda run: predicted(run, cluster).memory["total"])
    return choose(candidates(), cluster)


def choose(runs: list[Run], cluster: ClusterSpec) -> list[Run]:
    """Of ``runs``, 8 the planner puts well inside the card (below 70 % of its memory) and 4 around
    its capacity (85 % to 110 %), each taken evenly through the list (it varies the model, the
    recipe, the length and the batch), the fullest last. The bands and counts are choices: wide
    enough apart that a run inside cannot straddle, few enough for the 8 minutes."""
    capacity = cluster.gpu_memory_bytes
    share = {run: predicted(run, cluster).memory["total"] / capacity for run in runs}
    inside = [run for run, s in share.items() if s < 0.7]
    edge = [run for run, s in share.items() if 0.85 <= s <= 1.1]
    return sorted(_spread(inside, 8) + _spread(edge, 4), key=share.__getitem__)


def candidates() -> list[Run]:
    """Every run the GPU grid may choose from."""
    runs = []
    for spec in GPU_MODELS:
        for recipe in STACKS:
            for seq_len in (2048, 4096, 8192, 16384):
                for batch in (1, 2, 4):
                    for policy in ("none", "full", "selective"):
                        runs.append(Run(spec, recipe, seq_len, batch, recomputation=policy))
    runs.append(Run(GPU_MODELS[0], "torchtitan", 8192, 1, compiled=True))
    return runs


def _spread(runs: list[Run], count: int) -> list[Run]:
    """``count`` of ``runs`` taken evenly through them (they vary model, recipe, length, batch)."""
    if len(runs) <= count:
        return runs
    return [runs[round(i * (len(runs) - 1) / (count - 1))] for i in range(count)]


def estimated_seconds(runs: list[Run], cluster: ClusterSpec, *, steps: int) -> float:
    """What the grid should take: each run's steps at the predicted step time, and its set-up, 10 s
    (building and initializing the model, an assumption) and for a compiled one 60 s more
    (``gpu_record`` measured 3.5 to 4.8 s to compile one block on an H200; a model's blocks
    share one compilation, whose guards and autotuning take longer: an assumption)."""
    total = 0.0
    for run in runs:
        step = predicted(run, cluster).time.get("total", 0.0)
        total += 10 + 60 * run.compiled + steps * step
    return total


class Meter:
    """Allocated bytes now and at the peak since ``reset``, on either device: CUDA's allocator
    statistics, or on a CPU ``memory.live_tensor_bytes`` (which counts what was made inside it:
    the run builds its model there)."""

    def __init__(self, device: torch.device, live: memory.live_tensor_bytes | None = None):
        self.device, self.live, self._highest, self._reserved = device, live, 0, 0

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.live is None else self.live.now

    def peak(self) -> int:
        if self.live is None:
            return torch.cuda.max_memory_allocated(self.device)
        return self.live.peak

    def peak_over_run(self) -> int:
        """The allocated peak since the run began (``max_memory_allocated``; on a CPU the highest
        of the phases' peaks, read as they passed)."""
        return max(self.peak(), self._highest)

    def reserved_over_run(self) -> float | None:
        """``max_memory_reserved`` since the run began (None on a CPU: no caching allocator)."""
        if self.live is not None:
            return None
        return max(torch.cuda.max_memory_reserved(self.device), self._reserved)

    def reset(self) -> None:
        self._highest = max(self._highest, self.peak())
        if self.live is None:
            self._reserved = max(self._reserved, torch.cuda.max_memory_reserved(self.device))
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.live.reset_peak()


def _process_group(device: torch.device) -> None:
    """A world of one for FSDP2 (NCCL on a GPU, gloo on a CPU), once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


class MasterAdamW:
    """The ``course`` profile's optimizer on one GPU: bf16 parameters whose gradients are views of
    one bf16 buffer kept all step (as the course's DDP buckets keep them), an fp32 master copy of
    each and AdamW's two fp32 moments (fused), stepped one tensor at a time so that only one
    tensor's fp32 gradient exists at once: 2 + 2 + 4 + 8 bytes a parameter.

    Args:
        parameters: the model's parameters, in bf16.
        lr: the learning rate.
    """

    def __init__(self, parameters, *, lr: float):
        self.parameters = list(parameters)
        self.masters = [p.detach().float() for p in self.parameters]
        self.steppers = [torch.optim.AdamW([master], lr=lr, fused=True) for master in self.masters]
        sizes = [p.numel() for p in self.parameters]
        self.buffer = torch.zeros(
            sum(sizes), dtype=self.parameters[0].dtype, device=self.parameters[0].device
        )
        for p, view in zip(self.parameters, self.buffer.split(sizes), strict=True):
            p.grad = view.view_as(p)  # backward accumulates into the buffer

    @property
    def state(self) -> dict:
        """Every master's moments, and the masters themselves (what the step keeps beside the model)."""
        states = {
            id(m): {"master": m, **stepper.state[m]}
            for m, stepper in zip(self.masters, self.steppers, strict=True)
        }
        return states

    @torch.no_grad()
    def step(self) -> None:
        for p, master, stepper in zip(self.parameters, self.masters, self.steppers, strict=True):
            master.grad = p.grad.float()
            stepper.step()
            master.grad = None
            p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the kept buffer (``set_to_none`` is ignored: the gradients live all step)."""
        self.buffer.zero_()


@dataclass
class Step:
    """One training step of a run, in its three parts (so that each can be measured apart)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    autocast: bool
    device: torch.device

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss; the logits are not kept through the backward (as torchtitan's ``del pred``)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.forward(x, y).backward()
        self.update()


def build(run: Run, device: torch.device) -> Step:
    """``run``'s model and optimizer, as the recipe its profile describes builds them."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(run.spec)
    recompute.apply_recomputation(model, policy=run.recomputation)
    if run.recipe == "torchtitan":  # FSDP2 on every block and the root, bf16 compute, fp32 reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _process_group(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in list(model)[1:-1]:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    if run.compiled:
        for block in list(model)[1:-1]:
            block.compile()
    if run.recipe == "course":
        model.to(torch.bfloat16)
        return Step(model, MasterAdamW(model.parameters(), lr=1e-4), False, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return Step(model, optimizer, run.recipe == "fp32-master", device)


def measure_phases(step: Step, meter: Meter, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One step's allocated peak phase by phase, in GiB: the forward (the loss's included), the
    head's and loss's backward (until the gradient reaches the final norm's input), the blocks'
    backward, the optimizer step; and what is allocated at the backward's end."""
    peaks: dict[str, float] = {}

    def head_done(_grad):
        peaks["loss backward"] = meter.peak() / GIB
        meter.reset()

    def on_head(_module, args):
        if args[0].requires_grad:
            args[0].register_hook(head_done)

    handle = step.model[-1].register_forward_pre_hook(on_head)
    try:
        meter.reset()
        loss = step.forward(x, y)
        peaks["forward"] = meter.peak() / GIB
        meter.reset()
        loss.backward()
        peaks["blocks backward"] = meter.peak() / GIB
    finally:
        handle.remove()
    peaks["backward end (allocated)"] = meter.now() / GIB
    meter.reset()
    step.update()
    peaks["optimizer step"] = meter.peak() / GIB
    return peaks


def _tokens(run: Run, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, run.spec.vocab, (run.micro_batch, run.seq_len + 1), generator=generator)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


@contextlib.contextmanager
def _metered(device: torch.device):
    """A ``Meter`` for one run, the device's statistics cleared first."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        yield Meter(device)
        return
    with memory.live_tensor_bytes() as live:
        yield Meter(device, live)


def measure(run: Run, device: torch.device, cluster: ClusterSpec, *, steps: int, warmup: int) -> dict:
    """One run trained and measured, with the planner's prediction beside it (an out-of-memory
    error is a row with ``status`` "oom")."""
    expected = predicted(run, cluster)
    row = {
        "run": run.name, "model": run.spec.name, "framework": run.recipe, "layout": run.layout.name(),
        "seq_len": run.seq_len, "global_batch": run.micro_batch, "compiled": "yes" if run.compiled else "no",
        "predicted": {
            "allocated_gib": expected.peak.allocated / GIB, "reserved_gib": expected.peak.reserved / GIB,
            "peak_phase": expected.peak.phase, "step_s": expected.time["total"], "fits": expected.fits,
            "phases_gib": {phase: value / GIB for phase, value in expected.peak.phases.items()},
        },
    }  # fmt: skip
    x, y = _tokens(run, device)
    try:
        with _metered(device) as meter:
            step = build(run, device)
            for _ in range(warmup):
                step(x, y)
            phases = measure_phases(step, meter, x, y)
            median = Timer(device, warmup=0, repeats=steps)(functools.partial(step, x, y))
            row |= {
                "status": "ok", "step_s": median,
                "tokens_per_s_per_gpu": run.micro_batch * run.seq_len / median,
                "peak_allocated_gib": meter.peak_over_run() / GIB,
                "peak_reserved_gib": reserved / GIB if (reserved := meter.reserved_over_run()) else None,
                "phases_gib": phases,
            }  # fmt: skip
            del step
    except torch.OutOfMemoryError:
        row |= {"status": "oom"}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


CATEGORIES = ("parameters", "optimizer state", "gradients", "activations and temporaries")


def step_timeline(run: Run, device: torch.device, *, warmup: int = 1) -> dict:
    """One step of ``run`` recorded allocation by allocation, as bytes alive by category at each
    recorded event, with the phases' starts marked: on a GPU from
    ``torch.cuda.memory._record_memory_history`` (its snapshot returned under ``snapshot``), on a
    CPU from ``live_tensor_bytes(timeline=True)``. An allocation is a gradient when it sits at a
    gradient's address from before the optimizer step until past it; the parameters and the
    optimizer's state, made before the step, are constant bands.

    Args:
        run: the run whose step is recorded.
        device: where it runs.
        warmup: steps before the recorded one (the optimizer's state is made in the first).
    """
    step = build(run, device)
    x, y = _tokens(run, device)
    for _ in range(warmup):
        step(x, y)
    parameters = sum(p.numel() * p.element_size() for p in step.model.parameters())
    kept = sum(p.grad.numel() * p.grad.element_size() for p in step.model.parameters() if p.grad is not None)
    marks, owned = [], {}
    recorder = None if device.type == "cuda" else memory.live_tensor_bytes(timeline=True)

    def mark(label: str) -> None:
        if recorder is not None:
            recorder.mark(label)
        else:  # the allocator's trace is stamped in microseconds of the wall clock
            marks.append((time.time_ns() // 1000, label))

    def run_step() -> None:
        mark("forward")
        loss = step.forward(x, y)
        mark("backward")
        loss.backward()
        owned["gradients"] = {
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).untyped_storage().data_ptr()
            for p in step.model.parameters()
            if p.grad is not None
        }
        mark("optimizer step")
        step.update()
        mark("end")

    if recorder is None:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        run_step()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events, marks = _cuda_events(snapshot, device, marks)
    else:
        with recorder:
            run_step()
        events, marks, snapshot = recorder.events, recorder.marks, None
    state = sum(
        t.numel() * t.element_size() for values in step.optimizer.state.values() for t in values.values()
        if isinstance(t, torch.Tensor)
    )  # fmt: skip
    update = next((position for position, label in marks if label == "optimizer step"), 0)
    grown_by = next((i for i, event in enumerate(events) if event[0] >= update), len(events))
    constant = {"parameters": parameters, "optimizer state": state, "gradients": kept}
    return {
        "run": run.name, "marks": marks, "snapshot": snapshot,
        **_by_category(events, constant, owned["gradients"], grown_by),
    }  # fmt: skip


def _cuda_events(snapshot: dict, device: torch.device, marks: list) -> tuple[list, list]:
    """The caching allocator's trace as ``(event, "alloc" or "free", address, bytes)``, and the
    marks placed at the first event after their wall-clock time (the trace's ``time_us``)."""
    trace = snapshot["device_traces"][device.index or 0]
    events, times = [], []
    for entry in trace:
        if entry["action"] in ("alloc", "free_completed"):
            kind = "alloc" if entry["action"] == "alloc" else "free"
            events.append((len(events), kind, entry["addr"], entry["size"]))
            times.append(entry.get("time_us", 0))
    placed = [(next((i for i, t in enumerate(times) if t >= at), len(times)), label) for at, label in marks]
    return events, placed


def _by_category(events: list, constant: dict[str, int], gradients: set[int], grown_by: int) -> dict:
    """Bytes alive after each event, by ``CATEGORIES``: ``constant`` bands (what the step found
    made: the parameters, the optimizer's state), the gradients (an allocation at a gradient's
    address, made before ``grown_by`` and alive past it), the rest activations and temporaries."""
    freed_at: dict[int, int] = {}
    open_at: dict[int, int] = {}
    for index, (_, kind, address, _size) in enumerate(events):
        if kind == "alloc":
            open_at[address] = index
        elif address in open_at:
            freed_at[open_at.pop(address)] = index
    series = {name: [] for name in CATEGORIES}
    totals = {name: constant.get(name, 0) for name in CATEGORIES}
    alive: dict[int, tuple[str, int]] = {}
    positions = []
    for index, (position, kind, address, size) in enumerate(events):
        if kind == "alloc":
            lasting = freed_at.get(index, len(events)) > grown_by > index
            category = "gradients" if address in gradients and lasting else "activations and temporaries"
            alive[address] = (category, size)
            totals[category] += size
        elif address in alive:
            category, size = alive.pop(address)
            totals[category] -= size
        positions.append(position)
        for name in CATEGORIES:
            series[name].append(totals[name])
    return {"positions": positions, "bytes": series}


def config_of(spec: ModelSpec) -> dict:
    """A Hugging Face style ``config.json`` of ``spec`` (what ``plan.from_files`` reads back)."""
    return {
        "model_type": "llama", "hidden_size": spec.d_model, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn_hidden, "vocab_size": spec.vocab, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "tie_word_embeddings": spec.tied_embeddings,
    }  # fmt: skip


CSV_COLUMNS = (
    "run", "model", "framework", "layout", "seq_len", "global_batch", "tokens_per_s_per_gpu",
    "peak_memory_gib", "peak_allocated_gib", "peak_reserved_gib", "step_s", "status", "compiled",
)  # fmt: skip


def write(out: Path, name: str, record: dict) -> list[Path]:
    """The record as ``<name>-steps.json``, its runs as ``<name>-steps.csv`` (the columns ``plan
    check-gpu-runs`` and ``plan calibrate`` read, each model's config beside it), the timeline as
    a figure and, on a GPU, the allocator's snapshot (``torch.cuda.memory._dump_snapshot``'s
    format: drop it on pytorch.org/memory_viz)."""
    written = []
    (out / "configs").mkdir(parents=True, exist_ok=True)
    specs = {spec.name: spec for spec in (*GPU_MODELS, CPU_MODEL)}
    rows = []
    for run in record["runs"]:
        config = out / "configs" / f"{run['model']}.json"
        config.write_text(json.dumps(config_of(specs[run["model"]]), indent=1) + "\n")
        measured = {key: run.get(key, "") for key in CSV_COLUMNS}
        measured["model"] = f"configs/{config.name}"
        measured["peak_memory_gib"] = run.get("peak_reserved_gib") or run.get("peak_allocated_gib") or ""
        rows.append({key: "" if value is None else value for key, value in measured.items()})
    with (out / f"{name}-steps.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    timeline = record.get("timeline")
    if timeline and timeline.get("snapshot") is not None:
        with (out / f"{name}-step-snapshot.pickle").open("wb") as file:
            pickle.dump(timeline.pop("snapshot"), file)
        written.append(out / f"{name}-step-snapshot.pickle")
    elif timeline:
        timeline.pop("snapshot", None)
    if timeline:
        plots.plot_memory_timeline(timeline, path=out / f"{name}-step-memory.png")
        written.append(out / f"{name}-step-memory.png")
    (out / f"{name}-steps.json").write_text(json.dumps(record, indent=1) + "\n")
    return [out / f"{name}-steps.json", out / f"{name}-steps.csv", *written]


def table(rows: list[dict]) -> str:
    """One line a run: measured/predicted allocated and reserved GiB, the predicted peak's phase,
    the step's seconds."""
    lines = [f"{'run':<44} {'allocated GiB':>14} {'reserved GiB':>14}  {'peak at':<14} {'step s':>14}"]
    for row in rows:
        guess = row["predicted"]
        if row["status"] == "oom":
            verdict = "fits" if guess["fits"] else "does not fit"
            lines.append(f"{row['run']:<44} out of memory; the planner: {verdict}")
            continue
        reserved = f"{row['peak_reserved_gib']:.1f}" if row["peak_reserved_gib"] is not None else "-"
        lines.append(
            f"{row['run']:<44} {row['peak_allocated_gib']:>6.1f}/{guess['allocated_gib']:<7.1f} "
            f"{reserved:>6}/{guess['reserved_gib']:<7.1f}  {guess['peak_phase']:<14} "
            f"{row['step_s']:>6.3f}/{guess['step_s']:<7.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.evidence.gpu_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: check the command at tiny sizes"
    )
    parser.add_argument(
        "--out", type=checks.folder_to_write, default=kernels.GPU_RECORDS, help="folder of the record"
    )
    parser.add_argument(
        "--steps", type=checks.int_at_least(1), default=6, help="timed steps a run (the median is kept)"
    )
    parser.add_argument(
        "--warmup", type=checks.int_at_least(1), default=3, help="steps a run before the timed ones"
    )
    parser.add_argument(
        "--budget-s", type=checks.argument_type(checks.check_number, float, above=0), default=480.0,
        help="refuse a grid whose predicted time is longer",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run it on a GPU machine, or pass --device cpu to check the command")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    cluster = cluster_for(device)
    runs = grid(device, cluster)
    expected = (
        estimated_seconds(runs, cluster, steps=args.warmup + args.steps)
        if device.type == "cuda"
        else 5.0 * len(runs)
    )
    if expected > args.budget_s:
        print(
            f"error: the grid's {len(runs)} runs would take about {expected:.0f} s, more than --budget-s "
            f"{args.budget_s:.0f}: raise it, or lower --steps and --warmup",
            file=sys.stderr,
        )
        return 2
    begin = time.perf_counter()
    rows = []
    for number, run in enumerate(runs, 1):
        rows.append(measure(run, device, cluster, steps=args.steps, warmup=args.warmup))
        print(
            f"[{time.perf_counter() - begin:6.1f} s] {number}/{len(runs)} {run.name}: {rows[-1]['status']}",
            file=sys.stderr,
            flush=True,
        )
    ran = [run for run, row in zip(runs, rows, strict=True) if row["status"] == "ok"]
    # the fullest autocast run without recomputation: its gradients grow as its activations go
    plain = [run for run in ran if run.recipe == "fp32-master" and run.recomputation == "none"] or ran
    timeline = step_timeline(plain[-1], device) if plain else None
    name = kernels.slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"
    record = {
        "device": name,
        "cluster": cluster.name,
        "runs": rows,
        "timeline": timeline,
        "seconds": time.perf_counter() - begin,
    }
    written = write(args.out, name, record)
    print("measured/predicted\n" + table(rows))
    print("written: " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
