"""Choose a layout before you launch: every layout of a job predicted, the ones that fit ranked.

``python -m course_lib.tools.plan --model llama3-8b --cluster alps --gpus 64 --seq-len 8192
--global-batch-tokens 4M`` predicts memory per GPU, step time, tokens/s and MFU for every layout
``planner.candidate_layouts`` lists, prints the fastest that fit with their memory and time
broken down, and for the layouts that do not fit, the one reason each (grouped). ``--json FILE``
writes every prediction.

``--model course-transformer --cluster this-machine`` plans the course's own transformer on
this machine (calibrated first), and ``--run`` then trains the first layout that the course's
``plan.parallelize`` runs on local processes, and prints predicted beside measured.
``--validate`` holds the same formulas against this machine instead
(``plan_validation``): it calibrates, runs a sweep of small layouts of the course's transformer
on local processes, and prints predicted beside measured.

The figures are ``cost_model``'s: formulas measured exactly on this machine's processes
(memory, bytes) and an alpha-beta and FLOP-rate time model whose link and FLOP figures come
from the cluster's profile (its ``source`` says where from, and which are assumptions).

``plan check-published`` holds the planner against published GPU runs, ``plan check-gpu-runs``
against runs measured on one GPU with their allocator's peaks (``gpu_runs``), ``plan predict``
predicts the layouts of a CSV and ``plan calibrate`` fits its free terms to measured runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

from .. import checks, data
from ..distributed.launch import check_process_count, launch
from ..errors import UserError
from ..plan import calibration, from_files
from ..plan.cost_model import Prediction, predict
from ..plan.frameworks import FRAMEWORKS, Framework
from ..plan.layout import CONTEXT_ATTENTION, Layout
from ..plan.planner import check_job_size, plan
from ..plan.specs import CLUSTERS, GB, GIB, MODELS, ClusterSpec, ModelSpec
from .evidence import gpu_runs, published
from .evidence.plan_validation import (
    SWEEP,
    calibrate,
    course_layout,
    machine,
    measure_layout,
    predict_beside,
    table,
    validate,
)

SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def token_count(text: str) -> int:
    """``4M`` -> 4·2^20: the binary multiples batch sizes are quoted in (4M tokens = 512 x 8192)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KkMmGg]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: write e.g. 4M, 512K or 1048576")
    tokens = int(match.group(1)) * SUFFIXES[match.group(2).upper()]
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a step trains on 1 token or more")
    return tokens


def _gb(value: float) -> str:
    return f"{value / GB:.1f}" if value >= 0.05 * GB or value == 0 else f"{value / GB:.1e}"


def row(rank: int, prediction: Prediction, gpus: int) -> str:
    memory, time = prediction.memory, prediction.time
    states = memory["parameters"] + memory["gradients"] + memory["optimizer"]
    exposed = sum(v for k, v in time.items() if "exposed" in k)
    memory_bound = time["memory-bound operations"] + time["optimizer step"] + time["casts and copies"]
    return (
        f"{rank:>3}  {prediction.layout.name():<44} {_gb(memory['total']):>6} {_gb(states):>6} "
        f"{_gb(memory['activations']):>6}  {time['total']:>7.3f} {prediction.tokens_per_s / gpus:>9,.0f} "
        f"{prediction.mfu:>6.1%}  {time['compute']:>7.3f} {memory_bound:>7.3f} {time['recomputation']:>6.3f} "
        f"{time['pipeline bubble']:>6.3f} {exposed:>7.3f}"
    )


HEADER = (
    "  #  layout                                       GB/GPU states   acts   step s  tok/s/GPU    MFU  "
    "compute  memory recomp bubble exposed"
)
LOCAL_MODEL, LOCAL_CLUSTER = "course-transformer", "this-machine"


def model_named(name: str) -> ModelSpec:
    """A built-in model by name, or the model a ``config.json`` describes."""
    return from_files.model_named(name, others=(LOCAL_MODEL,))


def cluster_named(name: str) -> ClusterSpec:
    """A built-in cluster by name, or the cluster a TOML or JSON file describes."""
    return from_files.cluster_named(name, others=(LOCAL_CLUSTER,))


def breakdown(prediction: Prediction) -> str:
    memory = ", ".join(f"{k} {_gb(v)}" for k, v in prediction.memory.items() if k != "total")
    time = ", ".join(f"{k} {v:.3f}" for k, v in prediction.time.items() if k != "total" and v)
    sent = ", ".join(f"{k} {_gb(v)}" for k, v in prediction.traffic.items() if v)
    return f"  memory GB: {memory}\n  time s: {time}\n  sent per GPU per step, GB: {sent or 'nothing'}"


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.tools.plan``: the layouts of a job, ranked by predicted throughput;
    ``plan predict`` and ``plan check-published`` (``SUBCOMMANDS``): given layouts, published runs."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        help=f"one of {', '.join([*sorted(MODELS), LOCAL_MODEL])}, or a Hugging Face config.json "
        "(plan.from_files)",
    )
    parser.add_argument(
        "--cluster",
        help=f"one of {', '.join([*sorted(CLUSTERS), LOCAL_CLUSTER])}, or a TOML or JSON file of its fields "
        "(plan.from_files)",
    )
    parser.add_argument("--gpus", type=checks.int_at_least(1), help="GPUs of the job")
    parser.add_argument(
        "--seq-len",
        type=checks.int_at_least(1),
        default=None,
        help=f"tokens per sequence (default 8192; {SWEEP.seq_len} for {LOCAL_MODEL})",
    )
    parser.add_argument(
        "--global-batch-tokens",
        type=token_count,
        default=None,
        help="tokens per optimizer step (K, M, G: binary multiples; 4M = 4,194,304; default 4M, "
        f"{SWEEP.seq_len * SWEEP.global_batch} for {LOCAL_MODEL})",
    )
    parser.add_argument(
        "--context-attention",
        choices=[*CONTEXT_ATTENTION, "both"],
        default="both",
        help="how the layouts with a context degree attend across its ranks: ring attention, Ulysses' "
        "all-to-alls (their heads must divide by tensor x context), or both, ranked together",
    )
    parser.add_argument("--top", type=checks.int_at_least(1), default=10, help="layouts to show")
    parser.add_argument("--json", type=checks.json_to_write, default=None, help="write every prediction here")
    _add_stack_arguments(parser)
    parser.add_argument(
        "--validate",
        action="store_true",
        help="calibrate on this machine, run small layouts on local processes, compare with the predictions",
    )
    parser.add_argument(
        "--run",
        action="store_true",
        help=f"train the first layout here and print predicted beside measured (--model {LOCAL_MODEL} "
        f"--cluster {LOCAL_CLUSTER})",
    )
    args = parser.parse_args(argv)
    if args.validate:
        # --validate plans its own small layouts on this machine: a job's flags would be ignored
        ignored = [
            f"--{name.replace('_', '-')}"
            for name in VALIDATE_IGNORES
            if getattr(args, name) != parser.get_default(name)
        ]
        if ignored:
            parser.error(
                "--validate checks the planner on its own small layouts here and takes none of "
                f"{', '.join(ignored)}: run it alone (with --json to keep its figures), or leave "
                "--validate out to plan a job"
            )
        return _validate(args)
    missing = [flag for flag in ("model", "cluster", "gpus") if getattr(args, flag) is None]
    if missing:
        print(
            f"error: name the job: {', '.join('--' + flag for flag in missing)} (or --validate to check the "
            "planner on this machine)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.run and (args.model, args.cluster) != (LOCAL_MODEL, LOCAL_CLUSTER):
            raise UserError(
                f"--run trains on this machine's processes: use --model {LOCAL_MODEL} "
                f"--cluster {LOCAL_CLUSTER}"
            )
        local = args.model == LOCAL_MODEL  # the course's transformer trains on a short text, on CPUs
        if args.seq_len is None:
            args.seq_len = SWEEP.seq_len if local else 8192
        if args.global_batch_tokens is None:
            args.global_batch_tokens = SWEEP.seq_len * SWEEP.global_batch if local else 4 * 2**20
        if local:
            data.check_window(args.seq_len)
        check_job_size(gpus=args.gpus, global_batch_tokens=args.global_batch_tokens)
        if args.global_batch_tokens % args.seq_len:
            raise UserError(
                f"--global-batch-tokens {args.global_batch_tokens:,} is not a whole number of sequences of "
                f"--seq-len {args.seq_len}: use a multiple of {args.seq_len}"
            )
        global_batch = args.global_batch_tokens // args.seq_len
        sweep, template = None, Layout()
        methods = CONTEXT_ATTENTION if args.context_attention == "both" else (args.context_attention,)
        if LOCAL_CLUSTER == args.cluster or LOCAL_MODEL == args.model:
            sweep = dataclasses.replace(SWEEP, seq_len=args.seq_len, global_batch=global_batch)
            if args.model == LOCAL_MODEL:  # as the course runs it: fp32
                template = course_layout(template, sweep).with_(micro_batch=1)
            if args.run:
                check_process_count(args.gpus)
        model = sweep.spec() if args.model == LOCAL_MODEL else model_named(args.model)
        if args.cluster == LOCAL_CLUSTER:
            print("calibrating this machine...", file=sys.stderr, flush=True)
            cluster = machine(calibrate(launch, sweep))
        else:
            cluster = cluster_named(args.cluster)
        fitting, rejected = plan(
            model, cluster, gpus=args.gpus, seq_len=args.seq_len, global_batch=global_batch,
            template=template, context_attention=methods, framework=_stack(args),
            profile=_profile_for(args.profile, cluster, _stack(args)),
        )  # fmt: skip
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"{model.name}: {model.parameters() / 1e9:.3g} B parameters ({model.active_parameters() / 1e9:.3g} B "
        f"active), {model.flops_per_token(args.seq_len) / 1e9:.3g} GFLOP per token; {args.gpus} GPUs of "
        f"{cluster.name}, {cluster.gpu_memory_bytes / GB:.0f} GB each; {global_batch} sequences of "
        f"{args.seq_len} tokens per step"
    )
    print(f"shapes: {model.source}\ncluster: {cluster.source}\n")
    if fitting:
        print(f"{len(fitting)} layouts fit; the {min(args.top, len(fitting))} fastest:")
        print(HEADER)
        for rank, prediction in enumerate(fitting[: args.top], start=1):
            print(row(rank, prediction, args.gpus))
        print(f"\nthe first, {fitting[0].layout.name()}:\n{breakdown(fitting[0])}")
    else:
        print("no layout fits: more GPUs, a shorter sequence or a smaller batch per step")
    reasons = collections.Counter(_reason_kind(p.problem) for p in rejected)
    print(f"\n{len(rejected)} layouts rejected, by reason:")
    for kind, count in reasons.most_common():
        example = next(p for p in rejected if _reason_kind(p.problem) == kind)
        print(f"  {count:>5}  {kind}: e.g. {example.layout.name()}: {example.problem}")
    if args.run:
        _run_first(fitting, sweep, model, cluster)
    if args.json:
        records = [_record(p) for p in fitting + rejected]
        args.json.write_text(json.dumps(records, indent=1) + "\n")
        print(f"\nevery prediction: {args.json}", file=sys.stderr)
    return 0


def _add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """``--framework`` and ``--profile``: the stack the layouts run on, and its calibration."""
    parser.add_argument(
        "--framework",
        choices=sorted(FRAMEWORKS),
        default="course",
        help="the training stack: what it keeps and overlaps (course_lib/plan/frameworks.py)",
    )
    parser.add_argument(
        "--profile", type=checks.json_to_read, default=None, help="a calibration profile (plan calibrate)"
    )
    parser.add_argument(
        "--expert-imbalance",
        type=checks.argument_type(checks.check_number, float, minimum=1.0, maximum=MAX_EXPERT_IMBALANCE),
        default=1.0,
        help="the busiest expert's load over the mean (1: even, the best case; bench balance measures it): "
        "a mixture of experts' step waits for its busiest expert and rank",
    )


MAX_EXPERT_IMBALANCE = 1024.0
"""No expert takes more than all the tokens: the busiest load over the mean is at most E, and no
model has 1024 experts a layer."""


def _stack(args) -> Framework:
    """The stack ``--framework`` names, with ``--expert-imbalance``."""
    return FRAMEWORKS[args.framework].with_(expert_imbalance=args.expert_imbalance)


LAYOUT_COLUMNS = ("layout", "seq_len", "global_batch")
"""The columns ``plan predict`` reads from its CSV (``model`` is optional)."""


def predict_layouts(argv: list[str]) -> int:
    """``plan predict --layouts FILE --json OUT``: given layouts predicted, one JSON row each."""
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.plan predict",
        description="Predict the layouts of a CSV (columns layout, seq_len, global_batch, optional model, "
        "framework and compiled; a layout as the planner prints it, read by Layout.from_name; a model's "
        "config.json by a path from the CSV's folder) and write one JSON row per layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--layouts", type=checks.file_to_read, required=True, help="the CSV of layouts")
    parser.add_argument("--json", type=checks.json_to_write, required=True, help="where the rows go")
    parser.add_argument("--model", help="the model of rows without a model column: a name or a config.json")
    parser.add_argument("--cluster", required=True, help="a built-in cluster's name, or a TOML or JSON file")
    _add_stack_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cluster = cluster_named(args.cluster)
        framework = _stack(args)
        profile = _profile_for(args.profile, cluster, framework)
        rows = [
            _predicted_row(row, number, args.model, cluster, framework, profile, folder=args.layouts.parent)
            for number, row in checks.read_csv_rows(args.layouts, what="layouts", columns=LAYOUT_COLUMNS)
        ]
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    for row in rows:
        shown = (
            row.get("refused")
            or f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {row['allocated_gib']:.1f} GiB "
            f"allocated at its {row['peak_phase']}, {row['reserved_gib']:.1f} reserved"
        )
        print(f"{row['layout']:<44} {shown}")
    print(f"{len(rows)} layouts predicted: {args.json}", file=sys.stderr)
    return 0


def _predicted_row(
    row: dict,
    number: int,
    default_model: str | None,
    cluster: ClusterSpec,
    framework: Framework,
    profile: calibration.CalibrationProfile | None = None,
    *,
    folder: Path = Path("."),
) -> dict:
    """One layout of the CSV predicted, as a JSON row (``refused`` with the reason where it cannot run).

    A row may name its own stack (``framework``, ``compiled`` yes or no), and a model's config by a
    path from the CSV's ``folder``.
    """
    name = row.get("model") or default_model
    if not name:
        raise UserError(f"line {number}: no model column and no --model: name the model")
    name = gpu_runs.beside(name, folder)
    framework = gpu_runs.row_stack(row, number, framework)
    seq_len, global_batch = gpu_runs.row_shape(row, number)
    layout = Layout.from_name(row["layout"])
    prediction = predict(
        model_named(name), cluster, layout, seq_len=seq_len, global_batch=global_batch, framework=framework
    )
    if profile is not None:
        prediction = calibration.apply(prediction, profile, cluster)
    result = {"layout": layout.name(), "model": name, "seq_len": seq_len, "global_batch": global_batch}
    result["framework"] = framework.name
    result["fits"] = prediction.fits
    if prediction.note:
        result["note"] = prediction.note
    if prediction.problem:
        result["refused"] = prediction.problem
    if prediction.time:  # a layout that cannot be cut has no time
        result |= {
            "memory_gib": prediction.memory["total"] / GIB,
            "allocated_gib": prediction.peak.allocated / GIB,
            "reserved_gib": prediction.peak.reserved / GIB,
            "peak_phase": prediction.peak.phase,
            "tokens_per_s_per_gpu": prediction.tokens_per_s / layout.gpus,
            "step_s": prediction.time["total"],
            "mfu": prediction.mfu,
            "time_s": prediction.time,
            "memory_bytes": prediction.memory,
        }
    return result


def _ratio(value: float | None) -> str:
    """A median ratio, or a dash where no row gave one."""
    return "-" if value is None else f"{value:.2f}"


def check_published(argv: list[str]) -> int:
    """``plan check-published [FILE] --json OUT``: every published run predicted beside its measurement."""
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.plan check-published",
        description=published.__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "file",
        nargs="?",
        type=checks.file_to_read,
        default=published.PUBLISHED_RUNS,
        help="a CSV of published runs, with the columns of course_lib/tools/evidence/published_gpu_runs.csv",
    )
    parser.add_argument(
        "--json", type=checks.json_to_write, default=None, help="write every row and the summary here"
    )
    parser.add_argument(
        "--framework",
        choices=sorted(FRAMEWORKS),
        default=None,
        help="predict every run with this stack's profile (default: each with its own stack's)",
    )
    args = parser.parse_args(argv)
    try:
        checked = published.check(published.read_runs(path=args.file, framework=args.framework))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = published.summary(checked)
    held_out = published.leave_one_source_out(checked)
    print(published.table(checked))
    print(
        f"\n{result['expressible']} of {result['rows']} runs expressible; {result['within_1_33']:.0%} of "
        f"them predicted within {published.WITHIN}x, median predicted/measured "
        f"{_ratio(result['median_ratio'])}; "
        f"{result['false_does_not_fit']} that ran predicted not to fit"
    )
    folds = ", ".join(
        f"{group} {fold['within_1_33']:.0%} (median {_ratio(fold['median_ratio'])})"
        for group, fold in held_out["by_source"].items()
    )
    print(
        f"each publication calibrated on the others: {held_out['within_1_33']:.0%} within "
        f"{published.WITHIN}x, median {_ratio(held_out['median_ratio'])}; {folds}"
        if folds
        else "each publication calibrated on the others: none held out (fewer than two publications "
        "with a prediction)"
    )
    result["leave_one_source_out"] = {
        key: held_out[key] for key in ("within_1_33", "median_ratio", "by_source")
    }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(
            json.dumps({"summary": result, "rows": [published.record(c) for c in checked]}, indent=1) + "\n"
        )
        print(f"every row: {args.json}", file=sys.stderr)
    return 0


def _profile_for(path, cluster: ClusterSpec, framework: Framework) -> calibration.CalibrationProfile | None:
    """The calibration profile at ``path`` (None: none), refused if it was fitted elsewhere."""
    if path is None:
        return None
    profile = calibration.CalibrationProfile.load(path)
    if (profile.cluster, profile.framework) != (cluster.name, framework.name):
        raise UserError(
            f"{path} was calibrated on {profile.cluster} with {profile.framework}, not {cluster.name} with "
            f"{framework.name}: pass --cluster {profile.cluster} --framework {profile.framework}, or "
            "calibrate again"
        )
    return profile


RUN_COLUMNS = ("layout", "seq_len", "global_batch", "tokens_per_s_per_gpu", "peak_memory_gib", "status")
"""The columns ``plan calibrate`` reads from its CSV of measured runs (``model``, ``cluster`` optional)."""


def calibrate_runs(argv: list[str]) -> int:
    """``plan calibrate --runs FILE --out PROFILE``: the planner's free terms fitted to measured runs."""
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.plan calibrate",
        description="Fit the planner's free terms (the products' speed, each link class's, a cost per "
        "pipelined micro-batch, one per step, the reserved memory's factor), each shrunk toward its prior, "
        "to runs measured on one cluster; print each with its uncertainty, every run's residual and the "
        "leave-one-out error, and write a profile that plan and plan predict take with --profile.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--runs",
        type=checks.file_to_read,
        required=True,
        help="a CSV: layout, seq_len, global_batch, tokens_per_s_per_gpu, peak_memory_gib (may be empty), "
        "status (ok or oom), optional model and cluster",
    )
    parser.add_argument("--out", type=checks.file_to_write, required=True, help="the profile to write (JSON)")
    parser.add_argument("--model", help="the model of rows without a model column: a name or a config.json")
    parser.add_argument("--cluster", required=True, help="a built-in cluster's name, or a TOML or JSON file")
    parser.add_argument(
        "--framework", choices=sorted(FRAMEWORKS), default="course", help="the stack that ran them"
    )
    args = parser.parse_args(argv)
    try:
        cluster = cluster_named(args.cluster)
        runs = [
            _measured_run(row, number, args.model, cluster)
            for number, row in checks.read_csv_rows(args.runs, what="measured runs", columns=RUN_COLUMNS)
        ]
        profile, rows = calibration.calibrate(runs, cluster, FRAMEWORKS[args.framework])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    profile.save(args.out)
    print(f"{profile.runs} runs on {cluster.name} ({profile.framework}); fitted terms, ± one standard error:")
    for name in calibration.TERMS:
        error = profile.uncertainty[name]
        shown = (
            f"{profile.terms[name]:.4g} ± {error:.2g}"
            if error is not None
            else "not fitted: no run exercises it"
        )
        print(f"  {name:<26} {shown}")
    print(f"  {'memory_factor':<26} {profile.memory_factor:.3f} (measured peak over predicted)")
    print(f"\n{'layout':<36} {'measured s':>10} {'predicted':>10} {'calibrated':>10} {'residual':>9}")
    for row in rows:
        if row.get("status") == "oom":
            verdict = (
                "predicted not to fit: consistent" if not row["predicted_to_fit"] else "predicted to fit"
            )
            print(f"{row['layout']:<36} out of memory; {verdict}")
            continue
        print(
            f"{row['layout']:<36} {row['measured_step_s']:>10.3f} {row['predicted_step_s']:>10.3f} "
            f"{row['calibrated_step_s']:>10.3f} {row['log_residual']:>+9.3f}"
        )
    held_out = f"{profile.leave_one_out:.3f}" if profile.leave_one_out is not None else "- (one run)"
    print(
        f"RMS log residual {profile.rms_log_residual:.3f}; each run predicted by the profile fitted on the "
        f"others (leave-one-out): RMS log error {held_out}; profile: {args.out}"
    )
    return 0


def _measured_run(row: dict, number: int, default_model: str | None, cluster: ClusterSpec):
    """One row of a calibration CSV as a ``calibration.MeasuredRun``."""
    if row.get("cluster") and row["cluster"] != cluster.name:
        raise UserError(
            f"line {number}: a run on {row['cluster']!r}, not {cluster.name!r}: calibrate one cluster at a "
            "time"
        )
    name = row.get("model") or default_model
    if not name:
        raise UserError(f"line {number}: no model column and no --model: name the model")
    status = checks.check_choice(f"line {number}: status", row["status"], ("ok", "oom"))
    try:
        seq_len, global_batch = int(row["seq_len"]), int(row["global_batch"])
        speed = float(row["tokens_per_s_per_gpu"]) if status == "ok" else None
        memory = float(row["peak_memory_gib"]) if row["peak_memory_gib"] else None
    except ValueError as error:
        raise UserError(
            f"line {number}: {error} (seq_len, global_batch: whole numbers; speeds: numbers)"
        ) from error
    if speed is not None:
        checks.check_number(f"line {number}: tokens_per_s_per_gpu", speed, above=0)
    if memory is not None:
        checks.check_number(f"line {number}: peak_memory_gib", memory, above=0)
    checks.check_int(f"line {number}: seq_len", seq_len, minimum=1)
    checks.check_int(f"line {number}: global_batch", global_batch, minimum=1)
    return calibration.MeasuredRun(
        model_named(name), Layout.from_name(row["layout"]), seq_len, global_batch, speed, memory, status
    )


VALIDATE_IGNORES = (
    "model", "cluster", "gpus", "seq_len", "global_batch_tokens", "context_attention", "top", "run",
    "framework", "profile",
)  # fmt: skip
"""The flags of a job that ``--validate``, which lays out its own, would ignore."""

SUBCOMMANDS = {
    "check-published": check_published,
    "check-gpu-runs": gpu_runs.main,
    "predict": predict_layouts,
    "calibrate": calibrate_runs,
}
"""What ``plan`` does besides ranking a job's layouts, named by its first argument."""


def _validate(args) -> int:
    print(
        "calibrating on this machine, then running each layout on local processes...",
        file=sys.stderr,
        flush=True,
    )
    result = validate(launch)
    calibration = result["calibration"]
    print(
        f"this machine: all-reduce alpha {calibration['latency_s'] * 1e6:.0f} us, beta "
        f"{calibration['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; one core's matmuls "
        f"{calibration['matmul_flops'] / 1e9:.1f} GFLOP/s; norms and activation functions "
        f"{calibration['memory_bandwidth'] / 1e9:.1f} GB/s, the optimizer step "
        f"{calibration['optimizer_bandwidth'] / 1e9:.1f} GB/s; the host "
        f"{calibration['host_seconds_per_operation'] * 1e6:.1f} us per operation dispatched "
        "(measured again beside each layout)\n"
    )
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nevery figure: {args.json}", file=sys.stderr)
    return 0


def runnable_here(layout: Layout) -> bool:
    """Whether ``plan.parallelize`` and the validation's training loop run this layout."""
    if layout.expert > 1 or layout.virtual_stages > 1:
        return False
    if layout.pipeline > 1 and (layout.sharding != "ddp" or (layout.tensor > 1 and layout.sequence_parallel)):
        return False
    return True


def _run_first(fitting: list[Prediction], sweep, model, cluster) -> None:
    chosen = next((p.layout for p in fitting if runnable_here(p.layout)), None)
    if chosen is None:
        print("\nnone of the layouts that fit runs on the course's training loop here", file=sys.stderr)
        return
    # Predicted again as the course's loop runs it: without a pipeline, a replica's batch at once.
    ran = course_layout(chosen, sweep)
    first = predict(model, cluster, ran, seq_len=sweep.seq_len, global_batch=sweep.global_batch)
    print(f"\nrunning {chosen.name()} on {chosen.gpus} local processes...", file=sys.stderr, flush=True)
    measured = launch(measure_layout, chosen.gpus, chosen, sweep, check_collectives=False)[0]
    if cluster.name == "this machine":
        # calibrated here: predicted again with the speed measured beside the run and the
        # operations the run dispatched, as plan --validate does
        link = {
            "latency_s": cluster.inside_node.latency_s,
            "bandwidth_bytes_per_s": cluster.inside_node.bandwidth,
            "cores": cluster.gpus_per_node,
        }
        _, first = predict_beside(measured, chosen, link, sweep)
    states = first.peak.model_states
    print(f"\n{chosen.name()}, the first the course's loop runs here: predicted -> measured")
    for what, predicted, got, unit in (
        ("model states", states, measured["model_state_bytes"], "bytes"),
        ("activations", first.peak.activations_kept, measured["activation_bytes"], "bytes"),
        ("sent per step", sum(first.traffic.values()), measured["sent_bytes"], "bytes"),
        ("step", first.time["total"] * 1e3, measured["step_s"] * 1e3, "ms"),
    ):
        print(f"  {what:<14} {predicted:>14,.1f} -> {got:>14,.1f} {unit}  (x{got / predicted:.3f})")


def _reason_kind(problem: str) -> str:
    return "does not fit in memory" if problem.startswith("needs ") else problem


def _record(prediction: Prediction) -> dict:
    from dataclasses import asdict

    return {
        "layout": asdict(prediction.layout),
        "name": prediction.layout.name(),
        "problem": prediction.problem,
        "memory_bytes": prediction.memory,
        "time_s": prediction.time,
        "sent_bytes": prediction.traffic,
        "tokens_per_s": prediction.tokens_per_s,
        "mfu": prediction.mfu,
    }


if __name__ == "__main__":
    checks.exit_with(main)
