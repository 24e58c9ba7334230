"""The strong-scaling study, end to end: plan the runs, submit them, collect them, plot them.

::

    python -m course_lib.tools.study submit --gpus 1 2 4 8 16 --shardings ddp fsdp --wait   # Slurm
    python -m course_lib.tools.study submit --local --gpus 1 2                                # a laptop
    python -m course_lib.tools.study collect     # table + scaling.csv; says which runs failed
    python -m course_lib.tools.study plot        # scaling.png

``submit`` writes ``study.json`` (the plan: one run per sharding and size, its job id, where its
metrics go) into the results folder; with Slurm each run is ``slurm/scaling_run.sbatch`` with
nodes = ceil(N / GPUs per node). ``collect`` reads every run's metrics, tolerating failed and
missing runs (it lists them), and writes ``scaling.csv``; ``plot`` draws time per epoch (log-log,
with the ideal 1/N), speedup, parallel efficiency, validation accuracy and peak memory per GPU.
What the numbers mean is the lesson ``course_lib.plan.scaling``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import checks
from ..data import DATASETS
from ..distributed import environment
from ..errors import EXIT_USER_ERROR, UserError
from ..models import IMAGE_MODELS
from ..plan.scaling import add_speedup, format_table, read_metrics, summarize
from ..train.config import TrainConfig, validate_config
from . import REPOSITORY
from .plots import plot_study

# -- the study: plan, submit, collect, plot -----------------------------------------------------

STUDY_FILE, CSV_FILE, PLOT_FILE = "study.json", "scaling.csv", "scaling.png"


@dataclass
class PlannedRun:
    name: str
    sharding: str
    world_size: int
    nodes: int
    tasks_per_node: int
    job_id: str | None = None  # Slurm job id, "local", or None if never started
    problem: str | None = None  # why it could not be submitted

    def metrics_path(self, results: Path) -> Path:
        return results / f"{self.name}.jsonl"


BASELINE = "single-1"
"""The run every speedup is taken against: one process, no wrapper, the best serial run."""


def plan_runs(gpus: list[int], shardings: list[str], gpus_per_node: int) -> list[PlannedRun]:
    """The baseline (``single-1``), then one run per sharding and size; N GPUs fill
    ceil(N / gpus_per_node) nodes."""
    runs = [PlannedRun(BASELINE, "single", 1, 1, 1)]
    for sharding in shardings:
        for n in sorted(set(gpus)):
            nodes = math.ceil(n / gpus_per_node)
            if n > gpus_per_node and n % gpus_per_node:
                raise ValueError(
                    f"{n} GPUs do not fill whole nodes of {gpus_per_node}: choose multiples of "
                    f"{gpus_per_node} above one node"
                )
            runs.append(PlannedRun(f"{sharding}-{n}", sharding, n, nodes, n // nodes))
    return runs


def _save_plan(results: Path, runs: list[PlannedRun], settings: dict[str, Any]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / STUDY_FILE).write_text(
        json.dumps({"settings": settings, "runs": [asdict(r) for r in runs]}, indent=2)
    )


def load_plan(results: Path) -> tuple[list[PlannedRun], dict[str, Any]]:
    path = results / STUDY_FILE
    if not path.is_file():
        raise UserError(
            f"{path} does not exist: run `python -m course_lib.tools.study submit --results {results}` first"
        )
    try:
        study = json.loads(path.read_text())
        return [PlannedRun(**run) for run in study["runs"]], study["settings"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise UserError(
            f"{path} is not a study's plan ({type(error).__name__}: {error}): submit the study again"
        ) from None


def _training_environment(results: Path, run: PlannedRun, settings: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "COURSE_SHARDING": run.sharding,
            "COURSE_RUN_NAME": run.name,
            "COURSE_RESULTS": str(results),
            "COURSE_DATASET": settings["dataset"],
            "COURSE_MODEL": settings["model"],
            "COURSE_EPOCHS": str(settings["epochs"]),
            "COURSE_GLOBAL_BATCH": str(settings["global_batch_size"]),
        }
    )
    if settings.get("data_dir"):
        env["COURSE_DATA_DIR"] = settings["data_dir"]
    return env


def submit_slurm(
    results: Path, runs: list[PlannedRun], settings: dict[str, Any], sbatch_args: list[str]
) -> None:
    """``sbatch`` one job per run; a rejected submission is recorded, not fatal."""
    for run in runs:
        command = [
            "sbatch",
            "--parsable",
            f"--nodes={run.nodes}",
            f"--ntasks-per-node={run.tasks_per_node}",
            "--gpus-per-task=1",
            f"--job-name=scaling-{run.name}",
            f"--output={results}/{run.name}-%j.out",
            *sbatch_args,
            str(REPOSITORY / "slurm" / "scaling_run.sbatch"),
        ]
        done = subprocess.run(
            command,
            cwd=REPOSITORY,
            env=_training_environment(results, run, settings),
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            run.job_id = done.stdout.strip().split(";")[0]
            print(f"submitted {run.name}: job {run.job_id}")
        else:
            run.problem = (
                done.stderr.strip().splitlines()[-1]
                if done.stderr.strip()
                else f"sbatch exit {done.returncode}"
            )
            print(f"could not submit {run.name}: {run.problem}", file=sys.stderr)


def wait_for_jobs(runs: list[PlannedRun], poll_s: float = 2.0) -> None:
    """Block until none of the runs' jobs is pending or running (requeued jobs are waited for too)."""
    jobs = [run.job_id for run in runs if run.job_id and run.job_id != "local"]
    while jobs:
        queued = subprocess.run(
            ["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)], capture_output=True, text=True
        )
        if not queued.stdout.strip() and queued.returncode == 0:
            return
        time.sleep(poll_s)


def _training_config(run: PlannedRun, args: argparse.Namespace):
    """The ``TrainConfig`` a local run of the study trains with (what its command line says)."""
    return TrainConfig(
        sharding=run.sharding,
        dataset=args.dataset,
        model=args.model,
        epochs=args.epochs,
        global_batch_size=args.global_batch_size,
        data_dir=str(args.data_dir or "data"),
    )


def run_locally(
    results: Path, runs: list[PlannedRun], settings: dict[str, Any], *, share_cores: bool = False
) -> None:
    """The same study without Slurm: each size in turn on this machine (torchrun for N > 1).

    Args:
        results: the study's folder.
        runs: the runs ``plan_runs`` chose.
        settings: dataset, model, epochs, global batch (and data_dir) of every run.
        share_cores: give every run all the cores, split between its ranks, instead of one thread
            per rank (a cluster's one device per rank); it then measures threads as well as
            communication.
    """
    for run in runs:
        env = _training_environment(results, run, settings)
        flags = [
            "--sharding",
            run.sharding,
            "--dataset",
            settings["dataset"],
            "--model",
            settings["model"],
            "--epochs",
            str(settings["epochs"]),
            "--global-batch-size",
            str(settings["global_batch_size"]),
            "--metrics",
            str(run.metrics_path(results)),
            "--no-progress",
        ]
        if settings.get("data_dir"):
            flags += ["--data-dir", settings["data_dir"]]
        if run.world_size == 1:
            command = [sys.executable, "-m", "course_lib.train", *flags]
        else:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            command = [
                torchrun,
                "--standalone",
                f"--nproc-per-node={run.world_size}",
                "-m",
                "course_lib.train",
                *flags,
            ]
        threads = max(1, environment.usable_cpus() // run.world_size) if share_cores else 1
        env["OMP_NUM_THREADS"] = str(threads)
        print(f"running {run.name} here...", flush=True)
        run.metrics_path(results).unlink(missing_ok=True)
        with open(results / f"{run.name}-local.out", "w") as log:
            status = subprocess.run(
                command, cwd=REPOSITORY, env=env, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        (results / f"{run.name}.status").write_text(f"{status}\n")
        run.job_id = "local"


def collect(results: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows (with speedup and efficiency against the baseline run, ``single-1``; without it, against
    each sharding's smallest run) and the failed runs.

    Args:
        results: the study's folder (where ``submit`` wrote ``study.json`` and the runs' metrics).
    """
    runs, settings = load_plan(results)
    rows, failed = [], []
    for run in runs:
        metrics = run.metrics_path(results)
        try:
            records = read_metrics(metrics) if metrics.is_file() else []
        except UserError as error:
            failed.append(f"{run.name}: {error}")
            continue
        if run.problem or not records or len(records) < settings["epochs"]:
            status_file = results / f"{run.name}.status"
            status = status_file.read_text().strip() if status_file.is_file() else "no status"
            reason = run.problem or (
                f"{len(records)} of {settings['epochs']} epochs in {metrics.name}"
                if records
                else f"no metrics (exit status: {status}; see {run.name}-*.out)"
            )
            failed.append(f"{run.name}: {reason}")
            continue
        row = summarize(run.name, records)
        row["peak_mem_kind"] = records[-1].get("peak_mem_kind", "")
        rows.append(row)
    baseline = next((row for row in rows if row["run"] == BASELINE), None)
    if baseline is not None:
        add_speedup(rows, baseline["time_per_epoch_s"], baseline=f"{BASELINE} (one process, no wrapper)")
    else:  # a study without its baseline (failed, or planned before it had one)
        for sharding in sorted({row["sharding"] for row in rows}):
            mine = sorted(
                (row for row in rows if row["sharding"] == sharding), key=lambda row: row["world_size"]
            )
            base = mine[0]  # against the smallest run, scaled as if it had been perfect down to one process
            add_speedup(mine, base["time_per_epoch_s"] * base["world_size"])
    rows.sort(key=lambda row: (row["run"] != BASELINE, row["sharding"], row["world_size"]))
    return rows, failed


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    columns = [
        "run",
        "sharding",
        "world_size",
        "global_batch_size",
        "epochs",
        "time_per_epoch_s",
        "samples_per_s",
        "speedup",
        "efficiency",
        "baseline",
        "val_acc",
        "val_loss",
        "model_state_mb",
        "peak_mem_mb",
        "peak_mem_kind",
    ]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``scaling.csv`` that ``collect`` wrote, with numbers as numbers.

    Args:
        path: the CSV file.
    """
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    for number, row in enumerate(rows, 2):  # line 1 holds the column names
        for key, value in row.items():
            if key in ("run", "sharding", "peak_mem_kind", "baseline"):
                continue
            try:
                row[key] = float(value)
            except (TypeError, ValueError):
                raise UserError(
                    f"{path}, line {number}: column {key} holds {value!r}, not a number: run `python -m "
                    "course_lib.tools.study collect` again to rewrite it from the runs' metrics"
                ) from None
        row["world_size"] = int(row["world_size"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser, sub = build_parser()
    args = parser.parse_args(argv)
    parser = sub.choices[args.command]  # later mistakes are reported as this subcommand's
    _check_arguments(parser, args)
    if args.command == "submit":
        return _submit(parser, args)
    try:
        return _collect_or_plot(args)
    except UserError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The command and its three subcommands: submit, collect, plot."""
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.study", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser(
        "submit",
        help="run the study: on Slurm (default) or here (--local)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    submit.add_argument(
        "--results", type=checks.folder_to_write, default=Path("results/scaling"), help="the study's folder"
    )
    for command in [
        sub.add_parser("collect", help="table, scaling.csv, failed runs"),
        sub.add_parser("plot", help="scaling.png from scaling.csv"),
    ]:
        command.add_argument(
            "--results",
            type=checks.folder_to_read,
            default=Path("results/scaling"),
            help="the study's folder",
        )
    submit.add_argument(
        "--gpus",
        type=checks.int_at_least(1),
        nargs="+",
        default=[1, 2, 4, 8],
        help="sizes to run (and single-1, one process without a wrapper: every speedup's baseline)",
    )
    submit.add_argument("--shardings", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    submit.add_argument("--gpus-per-node", type=checks.int_at_least(1), default=4)
    submit.add_argument("--local", action="store_true", help="no Slurm: run each size here with torchrun")
    submit.add_argument("--wait", action="store_true", help="return when every job has ended")
    submit.add_argument(
        "--share-cores",
        action="store_true",
        help="with --local: every run gets all the cores, split between its ranks (default: one thread "
        "per rank, as a cluster gives each rank its own device)",
    )
    submit.add_argument("--dataset", choices=DATASETS, default=os.environ.get("COURSE_DATASET", "cifar10"))
    submit.add_argument("--data-dir", type=checks.folder_to_read, default=os.environ.get("COURSE_DATA_DIR"))
    submit.add_argument("--model", choices=IMAGE_MODELS, default=os.environ.get("COURSE_MODEL", "resnet18"))
    submit.add_argument(
        "--epochs",
        type=checks.int_at_least(1),
        default=3,
        help="the first epoch (warm-up) is left out of the timing",
    )
    submit.add_argument(
        "--global-batch-size",
        type=checks.int_at_least(1),
        default=256,
        help="the same at every size: strong scaling",
    )
    submit.add_argument(
        "--sbatch-arg", action="append", default=[], help="passed to sbatch, e.g. --sbatch-arg=--account=x"
    )
    return parser, sub


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone: flags that go together, and a study folder that exists."""
    if args.command == "submit":
        if args.share_cores and not args.local:
            parser.error("argument --share-cores: only with --local (on Slurm each rank has its own GPU)")
        if not args.local and shutil.which("sbatch") is None:
            parser.error(
                "sbatch was not found: submit from a Slurm cluster's login node, or run the study on this "
                "machine with --local"
            )
        uneven = [n for n in args.gpus if args.global_batch_size % n]
        if uneven:
            parser.error(
                f"argument --global-batch-size: {args.global_batch_size} does not divide over {uneven} "
                f"processes; choose a multiple of every size in --gpus, e.g. {math.lcm(*args.gpus) * 32}"
            )
    elif not args.results.is_dir():
        parser.error(
            f"argument --results: {args.results} does not exist: run `python -m course_lib.tools.study "
            f"submit --results {args.results}` first"
        )


def _submit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Plan the runs, check them, start them (Slurm or here), and say which failed."""
    try:
        runs = plan_runs(args.gpus, args.shardings, args.gpus_per_node)
    except ValueError as error:
        parser.error(f"argument --gpus: {error}")
    if args.local:  # every run checked as the training command will check it, before the first starts
        try:
            for run in runs:
                validate_config(_training_config(run, args), run.world_size)
        except UserError as error:
            parser.error(f"{run.name}: {error}")
    settings = {
        "dataset": args.dataset,
        "model": args.model,
        "epochs": args.epochs,
        "data_dir": args.data_dir,
        "global_batch_size": args.global_batch_size,
        "where": "local" if args.local else "slurm",
    }
    if args.local:
        settings["threads_per_rank"] = "cores / ranks" if args.share_cores else 1
    args.results = args.results.resolve()
    args.results.mkdir(parents=True, exist_ok=True)
    if args.local:
        run_locally(args.results, runs, settings, share_cores=args.share_cores)
    else:
        submit_slurm(args.results, runs, settings, args.sbatch_arg)
    _save_plan(args.results, runs, settings)
    refused = [run for run in runs if run.problem]
    if refused:
        print(f"error: {len(refused)} of {len(runs)} runs could not be submitted", file=sys.stderr)
        return 1
    if args.wait and not args.local:
        wait_for_jobs(runs)
    if args.local:
        failed = collect(args.results)[1]
        for problem in failed:
            print(f"failed: {problem}", file=sys.stderr)
        if failed:
            print(
                f"error: {len(failed)} of {len(runs)} runs failed (their logs are in {args.results})",
                file=sys.stderr,
            )
            return 1
    return 0


def _collect_or_plot(args: argparse.Namespace) -> int:
    if args.command == "collect":
        rows, failed = collect(args.results)
        if rows:
            print(format_table(rows))
            print(f"wrote {write_csv(rows, args.results / CSV_FILE)}")
        for problem in failed:
            print(f"failed or missing: {problem}", file=sys.stderr)
        return 0 if rows else 1
    rows = (
        read_csv(args.results / CSV_FILE) if (args.results / CSV_FILE).is_file() else collect(args.results)[0]
    )
    if not rows:
        print("error: no finished run to plot: run collect to see why", file=sys.stderr)
        return 1
    plot_study(rows, path=args.results / PLOT_FILE)
    print(f"wrote {args.results / PLOT_FILE}")
    return 0


if __name__ == "__main__":
    checks.exit_with(main)
