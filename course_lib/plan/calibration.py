"""Calibrate the planner from a few measured runs: fit what its formulas cannot know.

The formulas know *what* a step does (the products, the bytes, the schedule); how fast a given
machine and stack do each part, they take from datasheets and records. A few runs measured on
the machine say more. Each measured step time T is written as the predicted parts, each scaled by
a free term:

    T ≈ M + products · P + inside_node · C_in + between_nodes · C_out
        + pipeline_per_microbatch · K + step_overhead

M: the memory-bound operations and the optimizer step, as predicted (they scale with the
products in every layout, so no run could tell a factor on them from one on P); P: the
products' seconds (matmuls, attention, their recomputation, the bubble they leave); C_in, C_out:
the exposed communication on links inside a node and between nodes (one factor a link class,
its latency and bandwidth together); K: the micro-batches a pipelined step sends (0 without a
pipeline); the last term a constant per step (the host, the data loader, the launches the model
does not count). The terms are fitted by least squares on log time (Gauss-Newton from a linear
start), each with its uncertainty from the fit's Jacobian, and every run's residual is reported.
A term no run exercises keeps its prior (1, or 0 seconds) and is said to be unfitted.

Memory: the ratio of each measured peak to the predicted one, averaged in log space, is the
allocator's fragmentation (``memory_factor``); a run that ran out of memory checks it.

The cost: a handful of runs (at least one more than the terms fitted). The result is a profile
(``CalibrationProfile``, a JSON file) that ``predict`` applies to any layout of that cluster and
stack (``calibrate``/``apply``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from .cost_model import Prediction, predict
from .frameworks import Framework
from .layout import Layout
from .network_model import link_of
from .specs import GIB, ClusterSpec, ModelSpec

TERMS = (
    "products",
    "inside_node",
    "between_nodes",
    "pipeline_per_microbatch",
    "step_overhead",
)
"""The free terms, in the order of the columns of ``parts``."""

PRIORS = {name: (0.0 if name in ("pipeline_per_microbatch", "step_overhead") else 1.0) for name in TERMS}
"""What an unfitted term is: the formula as it is (a factor 1, or no seconds added)."""

COMMUNICATION = {
    "tensor (exposed)": "tensor",
    "context (exposed)": "context",
    "data (exposed)": ("data", "context"),
    "pipeline sends (exposed)": "pipeline",
    "expert (exposed)": "data",
}
"""Each exposed-communication part of a prediction, and the axis whose link it runs on."""


def _link_term(part: str, layout: Layout, cluster: ClusterSpec) -> str:
    """The term that scales one exposed-communication part: its axis's link, inside or between nodes."""
    inside = link_of(COMMUNICATION[part], layout, cluster) == cluster.inside_node
    return "inside_node" if inside else "between_nodes"


def parts(prediction: Prediction, cluster: ClusterSpec) -> tuple[list[float], float]:
    """A prediction's seconds in the columns of ``TERMS`` (the last two: micro-batches sent, and 1),
    and the seconds no term scales (the memory-bound work).

    Args:
        prediction: ``cost_model.predict``'s, uncalibrated.
        cluster: the cluster it was predicted on (whose links tell inside from between nodes).
    """
    time, layout = prediction.time, prediction.layout
    columns = dict.fromkeys(TERMS, 0.0)
    columns["products"] = time["compute"] + time["recomputation"] + time["pipeline bubble"]
    for part in COMMUNICATION:
        columns[_link_term(part, layout, cluster)] += time[part]
    columns["pipeline_per_microbatch"] = float(prediction.microbatches) if layout.pipeline > 1 else 0.0
    columns["step_overhead"] = 1.0
    fixed = (
        time["memory-bound operations"] + time["optimizer step"] + time["casts and copies"]
        + time["host (dispatching operations)"]
    )  # fmt: skip
    return [columns[name] for name in TERMS], fixed


@dataclass
class CalibrationProfile:
    """What ``calibrate`` fitted for one cluster and stack.

    Args:
        cluster: the cluster's name.
        framework: the stack's profile name.
        terms: each term's value (``TERMS``).
        uncertainty: each fitted term's standard error (None: not fitted, its prior kept).
        memory_factor: measured peak memory over predicted (1: none measured).
        runs: how many runs it was fitted on.
        rms_log_residual: the fit's root-mean-square residual in log time.
    """

    cluster: str
    framework: str
    terms: dict[str, float] = field(default_factory=lambda: dict(PRIORS))
    uncertainty: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(TERMS))
    memory_factor: float = 1.0
    runs: int = 0
    rms_log_residual: float = 0.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CalibrationProfile:
        """A profile ``save`` wrote; a file that is not one is named, with what it lacks."""
        try:
            content = json.loads(Path(path).read_text())
            profile = cls(**content)
        except (OSError, ValueError, TypeError) as error:
            raise UserError(
                f"{path} is not a calibration profile ({error}): write one with plan calibrate"
            ) from error
        missing = [name for name in TERMS if name not in profile.terms]
        if missing:
            raise UserError(
                f"{path} lacks the terms {', '.join(missing)}: write it again with plan calibrate"
            )
        return profile


def fit(
    columns: list[list[float]], fixed: list[float], seconds: list[float]
) -> tuple[dict, dict, list[float]]:
    """Least squares on log time: (terms, uncertainties, each run's log residual).

    Args:
        columns: each run's ``parts``.
        fixed: each run's seconds that no term scales.
        seconds: each run's measured step time.
    """
    active = [j for j in range(len(TERMS)) if any(row[j] for row in columns)]
    if len(seconds) <= len(active):
        raise UserError(
            f"{len(seconds)} runs cannot fit {len(active)} terms ({', '.join(TERMS[j] for j in active)}): "
            f"measure at least {len(active) + 1}"
        )
    x = torch.tensor([[row[j] for j in active] for row in columns], dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    offset = torch.tensor(fixed, dtype=torch.float64)
    theta = torch.linalg.lstsq(x / t[:, None], (1 - offset / t)[:, None]).solution[:, 0]
    theta = theta.clamp(min=1e-9)
    for _ in range(50):  # Gauss-Newton on r = log(x·θ) - log t
        predicted = x @ theta + offset
        residual = torch.log(predicted) - torch.log(t)
        jacobian = x / predicted[:, None]
        step = torch.linalg.lstsq(jacobian, -residual[:, None]).solution[:, 0]
        theta = (theta + step).clamp(min=1e-9)
        if step.abs().max() < 1e-10 * (1 + theta.abs().max()):
            break
    residual = torch.log(x @ theta + offset) - torch.log(t)
    jacobian = x / (x @ theta + offset)[:, None]
    variance = float(residual @ residual) / (len(seconds) - len(active))
    covariance = variance * torch.linalg.pinv(jacobian.T @ jacobian)
    terms, errors = dict(PRIORS), dict.fromkeys(TERMS)
    for index, j in enumerate(active):
        terms[TERMS[j]] = float(theta[index])
        errors[TERMS[j]] = math.sqrt(max(0.0, float(covariance[index, index])))
    return terms, errors, [float(r) for r in residual]


def apply(prediction: Prediction, profile: CalibrationProfile, cluster: ClusterSpec) -> Prediction:
    """``prediction`` with the profile's terms: its time parts scaled and the fitted seconds added
    (named apart in the breakdown), its memory scaled by the fragmentation, throughput and MFU
    recomputed and the fit re-checked against the GPU's memory.

    Args:
        prediction: ``cost_model.predict``'s, uncalibrated.
        profile: ``calibrate``'s.
        cluster: the cluster both are for.
    """
    if not prediction.time:
        return prediction
    terms, time = profile.terms, dict(prediction.time)
    for part in ("compute", "recomputation", "pipeline bubble"):
        time[part] *= terms["products"]
    for part in COMMUNICATION:
        time[part] *= terms[_link_term(part, prediction.layout, cluster)]
    pipelined = prediction.layout.pipeline > 1
    time["pipeline per micro-batch (calibrated)"] = (
        terms["pipeline_per_microbatch"] * prediction.microbatches * pipelined
    )
    time["step overhead (calibrated)"] = terms["step_overhead"]
    time.pop("total")
    time["total"] = sum(time.values())
    memory = {name: value * profile.memory_factor for name, value in prediction.memory.items()}
    result = dataclasses.replace(prediction, time=time, memory=memory)
    result.tokens_per_s = prediction.tokens_per_s * prediction.time["total"] / time["total"]
    result.mfu = prediction.mfu * prediction.time["total"] / time["total"]
    if result.problem is None and memory["total"] > cluster.gpu_memory_bytes:
        needed, usable = memory["total"] / 1e9, cluster.gpu_memory_bytes / 1e9
        result.problem = f"needs {needed:.0f} GB per GPU of {usable:.0f} (calibrated)"
    return result


@dataclass(frozen=True)
class MeasuredRun:
    """One run measured on the cluster being calibrated.

    Args:
        model: its shapes.
        layout: its layout.
        seq_len: tokens per sequence.
        global_batch: sequences per step.
        tokens_per_s_per_gpu: what it measured (None where it ran out of memory).
        peak_memory_gib: its fullest GPU's peak memory (None: not measured).
        status: ``"ok"``, or ``"oom"`` where it ran out of memory.
    """

    model: ModelSpec
    layout: Layout
    seq_len: int
    global_batch: int
    tokens_per_s_per_gpu: float | None
    peak_memory_gib: float | None = None
    status: str = "ok"


def calibrate(
    runs: list[MeasuredRun], cluster: ClusterSpec, framework: Framework
) -> tuple[CalibrationProfile, list[dict]]:
    """Fit the free terms to ``runs``: the profile, and one row per run (predicted before and after,
    measured, the log residual).

    Args:
        runs: the measured runs (at least one more that ran than the terms they exercise).
        cluster: the cluster they ran on.
        framework: the stack that ran them.
    """
    ran = [run for run in runs if run.status == "ok"]
    predictions = [
        predict(run.model, cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch,
                framework=framework)
        for run in ran
    ]  # fmt: skip
    refused = [(run, p.problem) for run, p in zip(ran, predictions, strict=True) if not p.time]
    if refused:
        run, problem = refused[0]
        raise UserError(
            f"the run {run.layout.name()} cannot be predicted ({problem}): drop it or fix its layout"
        )
    columns, fixed = zip(*(parts(p, cluster) for p in predictions))
    seconds = [run.global_batch * run.seq_len / (run.tokens_per_s_per_gpu * run.layout.gpus) for run in ran]
    terms, errors, residuals = fit(list(columns), list(fixed), seconds)
    memories = [
        math.log(run.peak_memory_gib * GIB / p.memory["total"])
        for run, p in zip(ran, predictions, strict=True)
        if run.peak_memory_gib
    ]
    profile = CalibrationProfile(
        cluster.name, framework.name, terms, errors,
        memory_factor=math.exp(sum(memories) / len(memories)) if memories else 1.0,
        runs=len(ran), rms_log_residual=math.sqrt(sum(r * r for r in residuals) / len(residuals)),
    )  # fmt: skip
    rows = []
    for run, p, residual, measured in zip(ran, predictions, residuals, seconds, strict=True):
        after = apply(p, profile, cluster)
        rows.append({
            "layout": run.layout.name(), "measured_step_s": measured, "predicted_step_s": p.time["total"],
            "calibrated_step_s": after.time["total"], "log_residual": residual,
        })  # fmt: skip
    for run in runs:
        if run.status == "oom":
            p = predict(run.model, cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch,
                        framework=framework)  # fmt: skip
            after = apply(p, profile, cluster)
            rows.append({"layout": run.layout.name(), "status": "oom", "predicted_to_fit": after.fits})
    return profile, rows
