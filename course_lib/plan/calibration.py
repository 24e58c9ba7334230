"""Calibrate the planner from a few measured runs: fit what its formulas cannot know.

The formulas know *what* a step does (the products, the bytes, the schedule); how fast a given
machine and stack do each part, they take from datasheets and records. A few runs measured on
the machine say more. Each measured step time T is written as the predicted parts, each scaled by
a free term:

    T ≈ M + products · P + inside_node · C_in + between_nodes · C_out + contention · X
        + pipeline_per_microbatch · K + step_overhead

M: the memory-bound operations and the optimizer step, as predicted (they scale with the
products in every layout, so no run could tell a factor on them from one on P); P: the
products' seconds (matmuls, attention, their recomputation, the bubble they leave); C_in, C_out:
the exposed communication on links inside a node and between nodes (one factor a link class,
its latency and bandwidth together); X: what the communication that overlaps the compute costs
it (``network_model.contention_seconds``: the multiprocessors NCCL's kernels hold); K: the
micro-batches a pipelined step sends (0 without a
pipeline); the last term a constant per step (the host, the data loader, the launches the model
does not count).

Each term has a prior, the formula as it is (a factor 1, or no seconds added), and a width, how
far a term may plausibly sit from it (``PRIOR_WIDTH``); the terms are the most probable ones
given the runs and the priors (least squares on log time with the priors as extra rows: Gauss-Newton
from the prior), each with its uncertainty from the fit's curvature. So a handful of runs moves a
term only as far as they agree on, a term no run exercises stays at its prior (and is said to be
unfitted), and one run's noise cannot carry every prediction far the other way. The profile
reports every run's residual and the **leave-one-out** error: each run predicted by the profile
fitted on the others, what a new run may expect. A term is not **extrapolated**: a prediction
whose part of that term lies far outside the runs that fixed it (``EXTRAPOLATION``) keeps the
term's prior, and says so.

Memory: the ratio of each measured reserved peak to the predicted one, averaged in log space and
shrunk toward 1 the same way, scales the reserved prediction (the allocator's fragmentation and
pools are what the formula knows least); whether a layout fits is decided as ``cost_model`` decides
it, the allocated peak against the card.

The cost: a handful of runs (one is enough to move a term; each more narrows it). The result is a profile
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

from ..checks import check_int, check_number
from ..errors import UserError
from .cost_model import Prediction, memory_verdict, predict
from .frameworks import Framework
from .layout import Layout
from .memory_phases import MemoryPeak, reserved_on_the_card
from .network_model import link_of
from .specs import GIB, ClusterSpec, ModelSpec

TERMS = (
    "products",
    "inside_node",
    "between_nodes",
    "contention",
    "pipeline_per_microbatch",
    "step_overhead",
)
"""The free terms, in the order of the columns of ``parts``."""

PRIORS = {name: (0.0 if name in ("pipeline_per_microbatch", "step_overhead") else 1.0) for name in TERMS}
"""What an unfitted term is: the formula as it is (a factor 1, or no seconds added)."""

PRIOR_WIDTH = {
    "products": 0.3,
    "inside_node": 0.5,
    "between_nodes": 0.5,
    "contention": 1.0,
    "pipeline_per_microbatch": 0.01,
    "step_overhead": 0.05,
}
"""How far each term may plausibly lie from its prior, one standard deviation: the factors in their
own units (the products: the planner against the published runs is within 1.33x on 88 % of them;
the links, whose latencies are assumptions, wider), the seconds as a share of the runs' median step."""

RUN_NOISE = 0.05
"""The spread of a run's log step time about any set of terms (one standard deviation): what the
uncalibrated planner's error is on the committed H200 runs (``plan check-gpu-runs``: measured over
predicted 0.92 to 1.06), fitted to them, an assumption elsewhere."""

MEMORY_PRIOR_WIDTH = 0.10
"""How far the reserved peak's factor may plausibly lie from 1, in log (the H200 runs: within 10 %)."""

EXTRAPOLATION = 3.0
"""A fitted term applies to a prediction whose part of it is within this factor of the parts of
the runs that fixed it; beyond, the prior. A choice, not a measurement: a term's error on the
H200 runs does not drift over their 6x range of step times, and nothing is known past it."""

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
    columns["contention"] = time["communication contention"]
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
        leave_one_out: the root-mean-square log error of each run predicted by the profile
            fitted on the others (None: fewer than two runs).
        fitted_range: each fitted term's smallest and largest part (seconds, uncalibrated) over
            the runs that fixed it (``EXTRAPOLATION``).
    """

    cluster: str
    framework: str
    terms: dict[str, float] = field(default_factory=lambda: dict(PRIORS))
    uncertainty: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(TERMS))
    memory_factor: float = 1.0
    runs: int = 0
    rms_log_residual: float = 0.0
    leave_one_out: float | None = None
    fitted_range: dict[str, list[float]] = field(default_factory=dict)

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
        if not isinstance(profile.terms, dict) or not isinstance(profile.uncertainty, dict):
            raise UserError(
                f"{path}: terms and uncertainty must be tables: write it again with plan calibrate"
            )
        missing = [name for name in TERMS if name not in profile.terms]
        if missing:
            raise UserError(
                f"{path} lacks the terms {', '.join(missing)}: write it again with plan calibrate"
            )
        # a null, a string, a NaN or a negative term would price every layout wrongly, without a word
        for name in TERMS:  # a factor is at least 0; seconds a fit adds may be a correction below 0
            check_number(f"{path}: terms.{name}", profile.terms[name], minimum=0 if PRIORS[name] else None)
            if profile.uncertainty.get(name) is not None:
                check_number(f"{path}: uncertainty.{name}", profile.uncertainty[name], minimum=0)
        check_number(f"{path}: memory_factor", profile.memory_factor, above=0)
        check_int(f"{path}: runs", profile.runs, minimum=0)
        return profile


def fit(
    columns: list[list[float]], fixed: list[float], seconds: list[float]
) -> tuple[dict, dict, list[float]]:
    """The most probable terms given the runs and the priors: (terms, uncertainties, each run's
    log residual).

    Least squares on r_i = log(x_i·θ + fixed_i) - log t_i, each over ``RUN_NOISE``, beside one row a
    term exercised, (θ_j - prior_j) / width_j; Gauss-Newton from the priors.

    Args:
        columns: each run's ``parts``.
        fixed: each run's seconds that no term scales.
        seconds: each run's measured step time.
    """
    if not seconds:
        raise UserError("no run that ran to calibrate on: measure at least one")
    active = [j for j in range(len(TERMS)) if any(row[j] for row in columns)]
    step = sorted(seconds)[len(seconds) // 2]
    prior = torch.tensor([PRIORS[TERMS[j]] for j in active], dtype=torch.float64)
    width = torch.tensor(
        [PRIOR_WIDTH[TERMS[j]] * (step if PRIORS[TERMS[j]] == 0.0 else 1.0) for j in active],
        dtype=torch.float64,
    )
    x = torch.tensor([[row[j] for j in active] for row in columns], dtype=torch.float64)
    t, offset = torch.tensor(seconds, dtype=torch.float64), torch.tensor(fixed, dtype=torch.float64)
    theta = prior.clone()
    for _ in range(100):
        predicted = (x @ theta + offset).clamp(min=1e-12)
        residual = torch.cat([(predicted.log() - t.log()) / RUN_NOISE, (theta - prior) / width])
        jacobian = torch.cat([x / predicted[:, None] / RUN_NOISE, torch.diag(1 / width)])
        change = torch.linalg.lstsq(jacobian, -residual[:, None]).solution[:, 0]
        theta = theta + change
        if change.abs().max() < 1e-12 * (1 + theta.abs().max()):
            break
    predicted = x @ theta + offset
    jacobian = torch.cat([x / predicted[:, None] / RUN_NOISE, torch.diag(1 / width)])
    covariance = torch.linalg.pinv(jacobian.T @ jacobian)
    terms, errors = dict(PRIORS), dict.fromkeys(TERMS)
    for index, j in enumerate(active):
        terms[TERMS[j]] = float(theta[index])
        errors[TERMS[j]] = math.sqrt(max(0.0, float(covariance[index, index])))
    return terms, errors, [float(r) for r in predicted.log() - t.log()]


def leave_one_out(columns: list[list[float]], fixed: list[float], seconds: list[float]) -> list[float] | None:
    """Each run's log error when predicted by the terms fitted on the other runs (None: one run)."""
    if len(seconds) < 2:
        return None
    errors = []
    for held in range(len(seconds)):
        keep = [i for i in range(len(seconds)) if i != held]
        terms, _, _ = fit([columns[i] for i in keep], [fixed[i] for i in keep], [seconds[i] for i in keep])
        guess = fixed[held] + sum(terms[name] * c for name, c in zip(TERMS, columns[held], strict=True))
        errors.append(math.log(guess / seconds[held]))
    return errors


def apply(prediction: Prediction, profile: CalibrationProfile, cluster: ClusterSpec) -> Prediction:
    """``prediction`` with the profile's terms: its time parts scaled and the fitted seconds added
    (named apart in the breakdown), a term whose part lies beyond ``EXTRAPOLATION`` of the runs
    that fixed it left at its prior (said in ``note``), the reserved peak scaled by the memory
    factor, throughput and MFU recomputed and the fit decided again.

    Args:
        prediction: ``cost_model.predict``'s, uncalibrated.
        profile: ``calibrate``'s.
        cluster: the cluster both are for.
    """
    if not prediction.time:
        return prediction
    terms, outside = dict(profile.terms), []
    for name, value in zip(TERMS, parts(prediction, cluster)[0], strict=True):
        low, high = profile.fitted_range.get(name, (0.0, math.inf))
        if value and not low / EXTRAPOLATION <= value <= high * EXTRAPOLATION:
            terms[name] = PRIORS[name]
            outside.append(name)
    time = dict(prediction.time)
    for part in ("compute", "recomputation", "pipeline bubble"):
        time[part] *= terms["products"]
    for part in COMMUNICATION:
        time[part] *= terms[_link_term(part, prediction.layout, cluster)]
    time["communication contention"] *= terms["contention"]
    pipelined = prediction.layout.pipeline > 1
    time["pipeline per micro-batch (calibrated)"] = (
        terms["pipeline_per_microbatch"] * prediction.microbatches * pipelined
    )
    time["step overhead (calibrated)"] = terms["step_overhead"]
    time.pop("total")
    time["total"] = sum(time.values())
    if not time["total"] > 0:  # seconds subtracted beyond the step: the profile cannot be for this run
        raise UserError(
            f"the calibration profile takes the step of {prediction.layout.name()} to {time['total']:.3g} s: "
            f"its fitted seconds ({terms['step_overhead']:.3g} s a step) lie far outside the runs it was "
            "fitted on; calibrate on runs like this one"
        )
    result = dataclasses.replace(prediction, time=time)
    result.tokens_per_s = prediction.tokens_per_s * prediction.time["total"] / time["total"]
    result.mfu = prediction.mfu * prediction.time["total"] / time["total"]
    if prediction.peak is not None:
        result.peak = _scaled_reserved(prediction.peak, profile.memory_factor, cluster)
        result.memory = result.peak.parts
        result.problem, result.note = memory_verdict(result.peak, cluster)
    if outside:
        result.note = "; ".join(
            filter(
                None,
                [
                    result.note,
                    f"calibration's {', '.join(outside)} not applied: beyond the runs that fixed it",
                ],
            )
        )
    return result


def _scaled_reserved(peak: MemoryPeak, factor: float, cluster: ClusterSpec) -> MemoryPeak:
    """``peak`` with its reserved bytes times ``factor``, the difference counted as fragmentation,
    reserved at most what the device has left where the allocated peak fits."""
    parts = dict(peak.parts)
    natural = parts["total"] - parts["CUDA context"] - parts["NCCL buffers"]
    parts["allocator fragmentation"] += natural * (factor - 1)
    parts["total"] = sum(value for name, value in parts.items() if name != "total")
    reserved = reserved_on_the_card(natural * factor, allocated=peak.allocated, parts=parts, cluster=cluster)
    return dataclasses.replace(peak, parts=parts, reserved=reserved)


@dataclass(frozen=True)
class MeasuredRun:
    """One run measured on the cluster being calibrated.

    Args:
        model: its shapes.
        layout: its layout.
        seq_len: tokens per sequence.
        global_batch: sequences per step.
        tokens_per_s_per_gpu: what it measured (None where it ran out of memory).
        peak_memory_gib: its fullest GPU's reserved peak (None: not measured).
        status: ``"ok"``, or ``"oom"`` where it ran out of memory.
        framework: the stack's profile as this run used it (None: ``calibrate``'s), such as a
            compiled variant.
    """

    model: ModelSpec
    layout: Layout
    seq_len: int
    global_batch: int
    tokens_per_s_per_gpu: float | None
    peak_memory_gib: float | None = None
    status: str = "ok"
    framework: Framework | None = None


def _check_identifiable(runs: list[MeasuredRun], ran: list[MeasuredRun]) -> None:
    """Refuse what cannot fix a term: no run that ran, or one run given twice (a measurement pasted
    eight times would be counted as eight, and its terms reported known to the last digit)."""
    if not ran:
        raise UserError(
            f"no run that ran to calibrate on: all {len(runs)} runs ran out of memory, their times unknown; "
            "the time terms need at least one run that ran (status ok, with its tokens_per_s_per_gpu)"
        )
    seen: dict[tuple, int] = {}
    for index, run in enumerate(runs, start=1):
        key = (run.model.name, run.layout, run.seq_len, run.global_batch, run.tokens_per_s_per_gpu,
               run.peak_memory_gib, run.status)  # fmt: skip
        if key in seen:
            raise UserError(
                f"run {index} ({run.layout.name()}) repeats run {seen[key]} to the last digit: a measurement "
                "given twice is one measurement; give each run once (repeat runs differ in their times)"
            )
        seen[key] = index


def calibrate(
    runs: list[MeasuredRun], cluster: ClusterSpec, framework: Framework
) -> tuple[CalibrationProfile, list[dict]]:
    """Fit the free terms to ``runs``: the profile, and one row per run (predicted before and after,
    measured, the log residual; for a run that ran out of memory, whether it is predicted to fit).

    Args:
        runs: the measured runs (at least one that ran).
        cluster: the cluster they ran on.
        framework: the stack that ran them.
    """

    def predicted(run: MeasuredRun) -> Prediction:
        return predict(
            run.model, cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch,
            framework=run.framework or framework,
        )  # fmt: skip

    ran = [run for run in runs if run.status == "ok"]
    _check_identifiable(runs, ran)
    predictions = [predicted(run) for run in ran]
    refused = [(run, p.problem) for run, p in zip(ran, predictions, strict=True) if not p.time]
    if refused:
        run, problem = refused[0]
        raise UserError(
            f"the run {run.layout.name()} cannot be predicted ({problem}): drop it or fix its layout"
        )
    columns, fixed = (
        (list(c) for c in zip(*(parts(p, cluster) for p in predictions), strict=True)) if ran else ([], [])
    )
    seconds = [run.global_batch * run.seq_len / (run.tokens_per_s_per_gpu * run.layout.gpus) for run in ran]
    terms, errors, residuals = fit(columns, fixed, seconds)
    held_out = leave_one_out(columns, fixed, seconds)
    memories = [
        math.log(run.peak_memory_gib * GIB / p.peak.reserved)
        for run, p in zip(ran, predictions, strict=True)
        if run.peak_memory_gib
    ]
    # shrunk toward 1 as the time terms are: each run's log ratio with RUN_NOISE, the prior MEMORY_PRIOR_WIDTH
    shrink = (RUN_NOISE / MEMORY_PRIOR_WIDTH) ** 2
    profile = CalibrationProfile(
        cluster.name, framework.name, terms, errors,
        memory_factor=math.exp(sum(memories) / (len(memories) + shrink)),
        runs=len(ran), rms_log_residual=math.sqrt(sum(r * r for r in residuals) / len(residuals)),
        leave_one_out=math.sqrt(sum(e * e for e in held_out) / len(held_out)) if held_out else None,
        fitted_range={
            name: [min(v for v in values if v), max(values)]
            for name, values in zip(TERMS, zip(*columns, strict=True), strict=True)
            if errors[name] is not None
        },
    )  # fmt: skip
    rows = []
    for run, p, residual, measured in zip(ran, predictions, residuals, seconds, strict=True):
        after = apply(p, profile, cluster)
        rows.append({
            "layout": run.layout.name(), "measured_step_s": measured, "predicted_step_s": p.time["total"],
            "calibrated_step_s": after.time["total"], "log_residual": residual, "fits": after.fits,
        })  # fmt: skip
    for run in runs:
        if run.status == "oom":
            after = apply(predicted(run), profile, cluster)
            rows.append({"layout": run.layout.name(), "status": "oom", "predicted_to_fit": after.fits})
    return profile, rows
