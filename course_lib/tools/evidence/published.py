"""The planner held against published GPU runs: each run's layout predicted beside what it measured.

The runs (``published_gpu_runs.csv`` beside this file, one row a run, each with its source at a
commit) come from torchtitan's benchmarks, Megatron-LM's 2021 paper, Korthikanti et al. 2022 and
Megatron-Core's 2024 weak-scaling table. Each states its speed in its own unit, and
``measured_tokens_per_s_per_gpu`` turns each back into tokens per second per GPU with the FLOP count
*its authors* used, so that nothing of the planner's own count enters the measured side:

- ``tokens_per_s_per_gpu`` (torchtitan): as it is;
- ``tflops_per_gpu_megatron2021`` (Narayanan et al., arXiv:2104.04473, appendix): achieved
  TFLOP/s per GPU counted as 96·B·s·l·h²·(1 + s/6h + V/16lh) an iteration, which includes the
  forward that full recomputation repeats;
- ``tflops_per_gpu_megatron2024`` (Megatron-LM's ``num_floating_point_operations``):
  12·B·s·l·h²·[(1 + g/a + s/h)·(a·d_head/h) + (f/h)·k·(3/2 with SwiGLU) + V/2lh], no recomputation;
- ``mfu_korthikanti`` (Korthikanti et al., arXiv:2205.05198, section 6): MFU in percent of the
  A100's 312 TFLOP/s with 72·B·s·l·h²·(1 + s/6h + V/12lh) an iteration.

Each run is predicted with its stack's profile (``frameworks``), read from its ``group`` and
``extras``: torchtitan's (async TP where the row says so), Megatron-LM's as of 2021 and 2022
(gradients all-reduced after the backward), Megatron-Core's of 2024 with its overlap flags on.
``--framework NAME`` predicts every row with one profile instead, to see what the profiles change.

A row is read as its stack ran it, each reading with its source: torchtitan's local batch cut into
as many micro-batches as pipeline ranks (``TORCHTITAN_MICROBATCHES``), Megatron-Bridge's "DDP"
with the distributed optimizer (``DISTRIBUTED_OPTIMIZER``), the expert degree from the row's
``extras``, a model its name makes a built-in one (GPT-OSS's head size and sliding windows), and a
cluster for a row that names only its GPU (``HARDWARE_CLUSTERS``).

A row is *expressible* when the CSV says the planner can state it (its ``assumed`` column says
what was assumed, its ``expressible`` column why not) and the planner accepts its model, cluster
and layout. For each expressible row, ``check`` predicts the layout (``cost_model.predict``) and
reports the ratio predicted / measured throughput (above 1: the planner is optimistic), the
largest terms of the predicted step, and predicted beside published memory where a run
published it. ``summary`` gives the figures the planner is held to: the share of expressible
rows within 1.33x, the median ratio, and runs that ran but are predicted not to fit.

``python -m course_lib.tools.plan check-published [FILE] --json OUT`` prints the table and the
summary.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ...checks import check_choice, check_int, check_number, read_csv_rows
from ...errors import UserError
from ...plan import calibration, cost_model
from ...plan.cost_model import Prediction, predict
from ...plan.frameworks import FRAMEWORKS, MEGATRON_PROFILE, TORCHTITAN_PROFILE, Framework
from ...plan.layout import PRECISIONS, Layout
from ...plan.specs import CLUSTERS, GIB, MODELS, ModelSpec

PUBLISHED_RUNS = Path(__file__).with_name("published_gpu_runs.csv")
"""The published runs the planner is checked against, each with its source."""

PUBLISHED_COLUMNS = (
    "id", "group", "source", "model", "planner_model", "hardware", "layers", "d_model", "heads",
    "kv_heads", "ffn", "vocab", "arch", "cluster", "gpus", "dp", "tp", "pp", "cp", "vp", "sharding",
    "micro_batch", "global_batch", "seq_len", "precision", "recomputation", "sequence_parallel",
    "loss_parallel", "measured_kind", "measured_value", "measured_memory_gib", "expressible", "assumed",
    "extras",
)  # fmt: skip
"""The columns ``read_runs`` reads; the file may have more (the hardware in words, the extras)."""

A100_PEAK_FLOPS = 312e12
"""The A100's dense bf16 peak (NVIDIA's datasheet), Korthikanti et al.'s denominator of MFU."""

WITHIN = 1.33
"""A prediction within this factor of the measurement either way counts as right."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run as the planner reads it.

    Args:
        id: the row's id.
        group: the publication it belongs to (``torchtitan-h100``, ``megatron2021-a100``...).
        source: where it was published (a file at a commit, a table).
        model: its shapes.
        cluster: the name of its cluster in ``specs.CLUSTERS``.
        layout: its layout.
        seq_len: tokens per sequence.
        global_batch: sequences per step.
        measured: the published tokens per second per GPU (converted: see the module docstring).
        measured_memory_gib: the published memory of the fullest GPU, GiB (None: not published).
        not_expressible: why the planner cannot state this run (None: it can).
        framework: its stack's profile (``framework_of``).
    """

    id: str
    group: str
    source: str
    model: ModelSpec | None
    cluster: str
    layout: Layout | None
    seq_len: int
    global_batch: int
    measured: float
    measured_memory_gib: float | None
    not_expressible: str | None
    framework: Framework


MEGATRON_2021 = "NVIDIA/Megatron-LM@b83477a3e8b4525dfb870e84f13ef631a9091e51:megatron/training.py"
"""Megatron-LM as Narayanan et al. ran it: ``train_step`` all-reduces the gradients after
``forward_backward_func`` returns ("All-reduce if needed", the local DDP), not beside the backward."""


DISTRIBUTED_OPTIMIZER = {
    "mbridge": "NVIDIA-NeMo/Megatron-Bridge@07b4a5837b4a9d24e91520ce3930529bbeede6f9:"
    "src/megatron/bridge/recipes/gpt_oss/gpt_oss.py",
}
"""Groups whose "FSDP = 0" (plain DDP as their tables say) runs Megatron's distributed optimizer, the
Adam state sharded over the data ranks (ZeRO-1): the recipe's ``DistributedDataParallelConfig``
sets ``use_distributed_optimizer=True``."""


def framework_of(group: str, extras: str) -> Framework:
    """The profile of the stack that made a run, from its ``group`` and ``extras`` columns, with
    the routing its MoE layers used where the row states it (``_routing``).

    Args:
        group: the run's group (``torchtitan-h100``, ``megatron2021-a100``, ``mcore2024-h100``...).
        extras: what else the row says of the run (``async TP``, ``comm overlap``, ``grouped GEMM``...).
    """
    said = [piece.strip().lower() for piece in extras.replace("+", ";").split(";")]
    if group.startswith("torchtitan"):  # "async TP", "torch.compile" as a row's own items ("unstated" is not)
        profile = TORCHTITAN_PROFILE.with_(
            tensor_overlap=any(piece.startswith(("async tp", "asynctp")) for piece in said),
            compiled=any(piece.startswith(("torch.compile", "compile")) for piece in said),
            fp8_all_gather=any("float8 all-gather" in piece for piece in said),
        )
    elif group.startswith(("megatron2021", "korthikanti2022")):
        profile = MEGATRON_PROFILE.with_(grad_reduce_overlap=False)
    elif group.startswith(tuple(DISTRIBUTED_OPTIMIZER)):  # the recipe's DDP config overlaps both
        profile = MEGATRON_PROFILE.with_(param_gather_overlap=True, grad_reduce_overlap=True)
    else:
        overlap = any("comm overlap" in piece for piece in said)
        profile = MEGATRON_PROFILE.with_(
            tensor_overlap=overlap, param_gather_overlap=overlap, grad_reduce_overlap=overlap
        )
    return profile.with_(**_routing(said))


def _routing(said: list[str]) -> dict:
    """The MoE routing a row states: ``grouped GEMM`` or ``expert loop`` (how a rank's experts
    multiply), ``routing forced even`` (a benchmark's router made to deal the tokens out evenly:
    imbalance 1, stated, not assumed) or ``expert imbalance X`` (a measured one)."""
    routing = {}
    if any("grouped gemm" in piece for piece in said):
        routing["grouped_experts"] = True
    if any("expert loop" in piece for piece in said):
        routing["grouped_experts"] = False
    if any("routing forced even" in piece for piece in said):
        routing["expert_imbalance"] = 1.0
    for found in (IMBALANCE.search(piece) for piece in said):
        if found:
            routing["expert_imbalance"] = float(found[1])
    return routing


IMBALANCE = re.compile(r"expert imbalance (\d+(?:\.\d+)?)")


def _flops_per_token(kind: str, model: ModelSpec, seq_len: int) -> float:
    """The FLOPs per token that a publication counted (see the module docstring), or 0 for tokens."""
    l, h, s, v = model.layers, model.d_model, seq_len, model.vocab  # noqa: E741 (the papers' letters)
    if kind == "tflops_per_gpu_megatron2021":
        return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    if kind == "mfu_korthikanti":
        return 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    if kind == "tflops_per_gpu_megatron2024":
        attention = (1 + model.kv_heads / model.heads + s / h) * (model.heads * model.head_dim / h)
        mlp = model.ffn_hidden / h * model.top_k * (1.5 if model.gated_mlp else 1.0)
        return 12 * l * h * h * (attention + mlp + v / (2 * l * h))
    return 0.0


MEASURED_KINDS = (
    "tokens_per_s_per_gpu",
    "tflops_per_gpu_megatron2021",
    "tflops_per_gpu_megatron2024",
    "mfu_korthikanti",
)


def measured_tokens_per_s_per_gpu(kind: str, value: float, model: ModelSpec, seq_len: int) -> float:
    """A published speed in tokens per second per GPU, with its authors' FLOP count.

    Args:
        kind: the unit, one of ``MEASURED_KINDS``.
        value: the published number in that unit.
        model: the run's shapes.
        seq_len: its tokens per sequence.
    """
    check_choice("measured_kind", kind, MEASURED_KINDS)
    if kind == "tokens_per_s_per_gpu":
        return value
    if kind == "mfu_korthikanti":
        return value / 100 * A100_PEAK_FLOPS / _flops_per_token(kind, model, seq_len)
    return value * 1e12 / _flops_per_token(kind, model, seq_len)


def _built_in_model(row: dict) -> str | None:
    """The built-in model a row names: its ``planner_model``, or its ``model`` in words where that
    is a built-in's name ("GPT-OSS 120B" is ``gpt-oss-120b``)."""
    if row["planner_model"]:
        return row["planner_model"]
    name = "-".join(row["model"].lower().split())
    return name if name in MODELS else None


def _model(row: dict) -> ModelSpec:
    """The row's shapes: a built-in model's by name, else from its columns (``arch`` gpt: LayerNorm,
    biases, a GELU MLP, learned positions and the output projection tied to the embedding, as
    Megatron-LM's GPT has them unless ``--untie-embeddings-and-output-weights``; llama: RMSNorm,
    SwiGLU)."""
    built_in = _built_in_model(row)
    if built_in:
        return MODELS[built_in]
    gpt = row["arch"] == "gpt"
    return ModelSpec(
        row["id"], int(row["layers"]), int(row["d_model"]), int(row["heads"]), int(row["kv_heads"]),
        int(row["ffn"]), int(row["vocab"]), gated_mlp=not gpt, norm="layer" if gpt else "rms", bias=gpt,
        position_embeddings=int(row["seq_len"]) if gpt else 0, source=row["source"], tied_embeddings=gpt,
    )  # fmt: skip


EVERY_KTH_BLOCK = re.compile(r"recomputation: full on every (\d+)\w* block")
"""A row's reason that its recomputation is full on every k-th block only (torchtitan's "selective
layer" checkpointing), which ``Layout.recompute_every`` states."""


EXPERT_DEGREE = re.compile(r"\bEP (\d+)")
"""A row's expert-parallel degree, which its ``extras`` state ("EP 8")."""

TORCHTITAN_MICROBATCHES = (
    "pytorch/torchtitan@680647378f15fba3437413b2ce25b6b3ce3c920a:torchtitan/parallelisms/pipelining_utils.py"
)
"""torchtitan's ``build_pipeline_schedule``: unless told (``pipeline_parallel_microbatches``), a
rank's local batch is cut into as many micro-batches as there are pipeline ranks."""


def _micro_batch(row: dict, pipeline: int) -> int:
    """Sequences per micro-batch. torchtitan's rows state the local batch, which a pipeline cuts into
    ``pipeline`` micro-batches (``TORCHTITAN_MICROBATCHES``); the other rows state the micro-batch."""
    stated = int(row["micro_batch"])
    if row["group"].startswith("torchtitan") and pipeline > 1:
        if stated % pipeline:
            raise ValueError(f"a local batch of {stated} that {pipeline} pipeline ranks cannot cut evenly")
        return stated // pipeline
    return stated


def _sharding(row: dict) -> str:
    """The row's sharding, read as its stack runs it (``DISTRIBUTED_OPTIMIZER``)."""
    if row["sharding"] == "ddp" and row["group"].startswith(tuple(DISTRIBUTED_OPTIMIZER)):
        return "zero1"
    return row["sharding"]


def _layout(row: dict) -> Layout:
    pipeline, virtual = int(row["pp"]), int(row["vp"])
    expert = EXPERT_DEGREE.search(row["extras"] or "")
    every = EVERY_KTH_BLOCK.search(row["assumed"] or "")
    recomputation = (
        {"recomputation": "full", "recompute_every": int(every[1])}
        if every
        else {"recomputation": row["recomputation"]}
    )
    return Layout(
        data=int(row["dp"]), pipeline=pipeline, context=int(row["cp"]), tensor=int(row["tp"]),
        sharding=_sharding(row), **recomputation,
        schedule="interleaved_1f1b" if virtual > 1 else "1f1b", virtual_stages=virtual,
        micro_batch=_micro_batch(row, pipeline), precision=row["precision"],
        expert=int(expert[1]) if expert else 1,
        sequence_parallel=row["sequence_parallel"] == "1", loss_parallel=row["loss_parallel"] == "1",
    )  # fmt: skip


def read_runs(*, path: Path = PUBLISHED_RUNS, framework: str | None = None) -> list[PublishedRun]:
    """Every row of a published-runs CSV, read as the planner states it.

    Args:
        path: a CSV with the columns of ``PUBLISHED_COLUMNS`` (more are ignored).
        framework: predict every row with this profile (``frameworks.FRAMEWORKS``); None: each
            with its own stack's (``framework_of``).
    """
    if framework is not None:
        check_choice("framework", framework, tuple(FRAMEWORKS))
    runs = []
    for number, row in read_csv_rows(path, what="published runs", columns=PUBLISHED_COLUMNS):
        try:
            profile = FRAMEWORKS[framework] if framework else framework_of(row["group"], row["extras"])
            runs.append(_run(row, profile))
        except (ValueError, KeyError, UserError) as error:
            raise UserError(f"{path}, line {number} ({row.get('id')}): cannot read {error}") from error
    return runs


HARDWARE_CLUSTERS = (("H200", "h200-node"),)
"""The built-in cluster of a row whose ``cluster`` is empty, by the GPU its ``hardware`` names."""

MODEL_REASONS = ("model:", "alternating sliding-window", "attention sinks")
"""Reasons a built-in model answers: its own head size, its sliding-window layers, and attention
sinks (one learned logit per head: no FLOPs worth counting), each stated in its ``source``."""


def _cluster(row: dict) -> str:
    """The row's cluster: its ``cluster`` column, or the built-in one of its ``hardware``'s GPU."""
    if row["cluster"]:
        return row["cluster"]
    words = row["hardware"].split()
    return next((name for gpu, name in HARDWARE_CLUSTERS if gpu in words), "")


def _unstated(row: dict, framework: Framework) -> str | None:
    """What the planner cannot state of a row, or None: the file's reasons (``assumed``, where
    ``expressible`` is not yes) less those it states now: a precision it has (fp8), full
    recomputation of every k-th block, FSDP's parameters kept gathered under a pipeline where
    the run's stack does so, hardware a built-in cluster describes, and a model a built-in one
    states (``MODEL_REASONS``)."""
    if row["expressible"] == "yes":
        return None
    reasons = [reason.strip() for reason in (row["assumed"] or "").split(";") if reason.strip()]
    if row["precision"] in PRECISIONS:
        reasons = [reason for reason in reasons if not reason.lower().startswith("precision:")]
    reasons = [reason for reason in reasons if not EVERY_KTH_BLOCK.search(reason)]  # Layout.recompute_every
    if framework.gathered_under_pipeline:
        reasons = [reason for reason in reasons if "reshard_after_forward=false" not in reason.lower()]
    if _cluster(row) in CLUSTERS:
        reasons = [reason for reason in reasons if not reason.lower().startswith("hardware:")]
    if _built_in_model(row):
        reasons = [reason for reason in reasons if not reason.lower().startswith(MODEL_REASONS)]
    if not reasons and not row["assumed"]:
        return "the file says the planner cannot state it"
    return "; ".join(reasons) or None


def _run(row: dict, framework: Framework) -> PublishedRun:
    model, layout, why = None, None, _unstated(row, framework)
    seq_len, global_batch = int(row["seq_len"]), int(row["global_batch"])
    check_int("seq_len", seq_len, minimum=1)
    check_int("global_batch", global_batch, minimum=1)
    cluster = _cluster(row)
    if not why and cluster not in CLUSTERS:
        why = f"no cluster {cluster!r} in the planner"
    elif not why:
        try:
            model, layout = _model(row), _layout(row)
        except UserError as error:
            why = str(error)
    if layout is not None:  # a layout that cannot be cut as the row states its batch is not a run to check
        problem = cost_model.check(
            model, layout, gpus=layout.gpus, seq_len=seq_len, global_batch=global_batch
        )
        if problem:
            model, layout, why = None, None, f"{problem} (as the row states its batch)"
    kind, value = row["measured_kind"], float(row["measured_value"])
    check_number("measured_value", value, above=0)  # a zero, NaN or negative speed is no measurement
    measured = measured_tokens_per_s_per_gpu(kind, value, model or _model(row), seq_len)
    memory = float(row["measured_memory_gib"]) if row["measured_memory_gib"] else None
    if memory is not None:
        check_number("measured_memory_gib", memory, above=0)
    return PublishedRun(
        row["id"], row["group"], row["source"], model, cluster, layout, seq_len, global_batch,
        measured, memory, why, framework,
    )  # fmt: skip


@dataclass
class Checked:
    """One run predicted: ``ratio`` is predicted over measured tokens/s per GPU (above 1: optimistic)."""

    run: PublishedRun
    prediction: Prediction | None
    predicted: float = 0.0
    ratio: float | None = None
    memory_ratio: float | None = None

    def largest_terms(self, *, count: int = 3) -> list[tuple[str, float]]:
        """The predicted step's largest parts, in seconds.

        Args:
            count: how many parts, largest first.
        """
        if self.prediction is None:
            return []
        parts = [(k, v) for k, v in self.prediction.time.items() if k != "total" and v > 0]
        return sorted(parts, key=lambda part: -part[1])[:count]


def check(runs: list[PublishedRun]) -> list[Checked]:
    """Each expressible run's layout predicted on its cluster, beside what it measured.

    Args:
        runs: ``read_runs``'s rows.
    """
    checked = []
    for run in runs:
        if run.not_expressible:
            checked.append(Checked(run, None))
            continue
        prediction = predict(
            run.model,
            CLUSTERS[run.cluster],
            run.layout,
            seq_len=run.seq_len,
            global_batch=run.global_batch,
            framework=run.framework,
        )
        result = Checked(run, prediction)
        if prediction.time:  # refused layouts (a shape that does not split) have no time
            result.predicted = prediction.tokens_per_s / run.layout.gpus
            result.ratio = result.predicted / run.measured
        if run.measured_memory_gib and prediction.memory:
            result.memory_ratio = prediction.peak.reserved / GIB / run.measured_memory_gib
        checked.append(result)
    return checked


def summary(checked: list[Checked]) -> dict:
    """The figures the planner is held to, over the expressible rows.

    ``within_1_33``: the share whose ratio lies within 1/1.33 and 1.33; ``median_ratio``;
    ``false_does_not_fit``: runs that ran but are predicted not to fit (or refused);
    ``memory_within_10pct``: the share of runs with published memory predicted within 10 %.

    Args:
        checked: ``check``'s rows.
    """
    expressible = [c for c in checked if not c.run.not_expressible]
    ratios = [c.ratio for c in expressible if c.ratio is not None]
    memories = [c.memory_ratio for c in expressible if c.memory_ratio is not None]
    return {
        "rows": len(checked),
        "expressible": len(expressible),
        **_score(ratios, of=len(expressible)),
        "false_does_not_fit": sum(not c.prediction.fits for c in expressible),
        "memory_rows": len(memories),
        "memory_within_10pct": sum(abs(m - 1) <= 0.10 for m in memories) / len(memories)
        if memories
        else None,
    }


def _score(ratios: list[float], *, of: int | None = None) -> dict:
    """``within_1_33``, the share of ``of`` rows (a row without a ratio counts as a miss; None:
    the ratios) predicted within 1.33x either way, and ``median_ratio``."""
    of = len(ratios) if of is None else of
    return {
        "within_1_33": sum(1 / WITHIN <= r <= WITHIN for r in ratios) / of if of else 0,
        "median_ratio": statistics.median(ratios) if ratios else None,
    }


def _step_seconds(run: PublishedRun) -> float:
    """The measured step time of a run, from its tokens per second per GPU."""
    return run.global_batch * run.seq_len / (run.measured * run.layout.gpus)


def leave_one_source_out(checked: list[Checked]) -> dict:
    """Each publication predicted with the calibration fitted on all the others.

    For each group of runs (one publication: torchtitan's H100 benchmarks, Megatron-LM's 2021
    paper...), ``calibration.fit`` fits the free terms to every other group's runs, and this group's
    predictions are calibrated with them: how well a few runs elsewhere teach the planner a stack
    it has not seen. Returns the summary's figures over every held-out prediction, and per group.

    Args:
        checked: ``check``'s rows (each run predicted with its stack's profile).
    """
    usable = [c for c in checked if c.prediction is not None and c.prediction.time]
    ratios, by_group = {}, {}
    groups = sorted({c.run.group for c in usable})
    if len(groups) < 2:  # one publication: no other to calibrate it on
        return {"rows": 0, **_score([]), "by_source": {}, "ratios": {}}
    for group in groups:
        train = [c for c in usable if c.run.group != group]
        columns, fixed = zip(*(calibration.parts(c.prediction, CLUSTERS[c.run.cluster])
                               for c in train))  # fmt: skip
        terms, errors, _ = calibration.fit(list(columns), list(fixed), [_step_seconds(c.run) for c in train])
        profile = calibration.CalibrationProfile("(published)", "(each run's)", terms, errors)
        held = []
        for c in usable:
            if c.run.group == group:
                after = calibration.apply(c.prediction, profile, CLUSTERS[c.run.cluster])
                ratios[c.run.id] = after.tokens_per_s / c.run.layout.gpus / c.run.measured
                held.append(ratios[c.run.id])
        by_group[group] = {"runs": len(held), **_score(held), "products": terms["products"]}
    return {
        "rows": len(ratios),
        **_score(list(ratios.values())),
        "by_source": by_group,
        "ratios": ratios,
    }


def table(checked: list[Checked]) -> str:
    """One line a run: measured, predicted, ratio, memory, and the largest predicted terms.

    Args:
        checked: ``check``'s rows.
    """
    lines = [
        f"{'run':<30} {'layout':<34} {'measured':>9} {'predicted':>9} {'ratio':>6} {'GiB pub/pred':>13}  "
        "largest predicted terms (s)"
    ]
    for c in checked:
        run = c.run
        if run.not_expressible:
            lines.append(f"{run.id:<30} not expressible: {run.not_expressible}")
            continue
        memory = (
            f"{run.measured_memory_gib:.1f}/{c.prediction.peak.reserved / GIB:.1f}"
            if run.measured_memory_gib and c.prediction.memory
            else ""
        )
        problem = f"  [{c.prediction.problem}]" if c.prediction.problem else ""
        terms = ", ".join(f"{name} {seconds:.2f}" for name, seconds in c.largest_terms())
        ratio = f"{c.ratio:.2f}" if c.ratio is not None else "-"
        lines.append(
            f"{run.id:<30} {run.layout.name():<34} {run.measured:>9,.0f} {c.predicted:>9,.0f} {ratio:>6} "
            f"{memory:>13}  {terms}{problem}"
        )
    return "\n".join(lines)


def record(c: Checked) -> dict:
    """One checked run as JSON.

    Args:
        c: one of ``check``'s rows.
    """
    run = c.run
    return {
        "id": run.id,
        "source": run.source,
        "not_expressible": run.not_expressible,
        "layout": run.layout.name() if run.layout else None,
        "framework": run.framework.name,
        "measured_tokens_per_s_per_gpu": run.measured,
        "predicted_tokens_per_s_per_gpu": c.predicted if c.prediction else None,
        "ratio": c.ratio,
        "measured_memory_gib": run.measured_memory_gib,
        "predicted_memory_gib": c.prediction.peak.reserved / GIB
        if c.prediction and c.prediction.memory
        else None,
        "problem": c.prediction.problem if c.prediction else None,
        "time_s": c.prediction.time if c.prediction else None,
    }
