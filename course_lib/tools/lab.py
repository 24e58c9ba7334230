"""The lab in one command (``make lab``): one process, then DDP on 2, then FSDP on 2.

Each run is a real job launched the way it would be on a cluster: the single process with
``python -m course_lib.train``, the others with ``torchrun`` (CPU and gloo here, GPUs and NCCL
on a cluster, same code). All three use the same global batch and seed, so they train the same
model: here, on one CPU with the same sums, to the same accuracy; on GPUs, within run-to-run
noise (NCCL and cuDNN add in another order). Only the time per epoch should differ. The lab then
prints a comparison table and writes under ``results/``:

- ``lab-single.jsonl``, ``lab-ddp.jsonl``, ``lab-fsdp.jsonl``: one JSON line per epoch;
- ``lab_summary.json``: the table as data;
- ``strong_scaling.png``: time per epoch and speedup against processes, with the ideal lines.

The default model (35k parameters on 8x8 digits) computes so little that communication eats most
of what a second process gives: expect DDP on 2 processes to gain little (a tenth of a second
per epoch, where run-to-run noise is as large as the effect) and FSDP, which also gathers the
weights every step, to be *slower* than one process, and ask why. Every rank
computes with one thread by default, the way a cluster gives each rank a device of its own: two
processes then have twice the compute of one, and what they lose is communication.
``--share-cores`` is the other lesson: each run gets the whole machine, its cores split between
its ranks (one process with every core as threads against two with half each), which measures
how well PyTorch's threads use the cores as much as the communication. A heavier workload::

    python -m course_lib.tools.lab --dataset synthetic --model cifar_cnn --epochs 3 --lr 0.001
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from .. import checks
from ..data import DATASETS
from ..distributed import environment
from ..models import IMAGE_MODELS
from ..plan.scaling import add_speedup, format_table, read_metrics, summarize
from .plots import plot_study

RUNS = (("single", 1), ("ddp", 2), ("fsdp", 2))
LARGEST_RUN = max(nprocs for _, nprocs in RUNS)
QUICK_GLOBAL_BATCH = 480
SAME_MODEL_TOLERANCE = 1e-2  # relative spread of the final validation losses


def command_for(sharding: str, nprocs: int, train_args: list[str]) -> list[str]:
    train = ["-m", "course_lib.train", "--sharding", sharding, *train_args]
    if nprocs == 1:
        return [sys.executable, *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        *train,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.lab",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dataset", choices=DATASETS, default="digits")
    parser.add_argument("--model", choices=IMAGE_MODELS, default="digits_cnn")
    parser.add_argument("--epochs", type=checks.int_at_least(1), default=10)
    parser.add_argument(
        "--global-batch-size",
        type=checks.int_at_least(1),
        default=256,
        help=f"summed over the ranks of a run: a multiple of {LARGEST_RUN}",
    )
    parser.add_argument(
        "--lr",
        type=checks.learning_rate,
        default=0.01,
    )
    threads = parser.add_mutually_exclusive_group()
    threads.add_argument(
        "--threads-per-process",
        type=checks.int_at_least(1, environment.usable_cpus()),
        default=1,
        help="CPU threads per rank: 1 gives each rank a worker of its own, like one GPU per rank",
    )
    threads.add_argument(
        "--share-cores",
        action="store_true",
        help="give every run the whole machine, its cores split between its ranks (one process gets "
        "them all as threads)",
    )
    parser.add_argument("--results-dir", type=checks.folder_to_write, default="results")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"2 epochs at global batch {QUICK_GLOBAL_BATCH} (2 steps each on digits): checks the "
        "whole lab in seconds (used by the tests)",
    )
    args = parser.parse_args(argv)
    if args.global_batch_size % LARGEST_RUN:
        parser.error(
            f"argument --global-batch-size: must be a multiple of {LARGEST_RUN} (the DDP and FSDP runs split "
            f"it over {LARGEST_RUN} processes), got {args.global_batch_size}"
        )

    results = args.results_dir
    results.mkdir(parents=True, exist_ok=True)
    global_batch = QUICK_GLOBAL_BATCH if args.quick else args.global_batch_size
    train_args = [
        "--dataset",
        args.dataset,
        "--model",
        args.model,
        "--global-batch-size",
        str(global_batch),
        "--lr",
        str(args.lr),
        "--epochs",
        str(2 if args.quick else args.epochs),
    ]
    if args.quick or not sys.stdout.isatty():
        train_args.append("--no-progress")

    rows = []
    for sharding, nprocs in RUNS:
        metrics = results / f"lab-{sharding}.jsonl"
        metrics.unlink(missing_ok=True)
        command = command_for(sharding, nprocs, [*train_args, "--metrics", str(metrics)])
        print(f"\n=== {sharding} on {nprocs} process(es): {shlex.join(command)}", flush=True)
        # Set for every run, so that torchrun does not choose (and warn about it).
        threads = (
            max(1, environment.usable_cpus() // nprocs) if args.share_cores else args.threads_per_process
        )
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        finished = subprocess.run(command, env=env)
        if finished.returncode != 0:
            print(
                f"\nlab: the {sharding} run failed with exit status {finished.returncode} (its error is "
                "above); fix it and run `make lab` again",
                file=sys.stderr,
            )
            return finished.returncode
        rows.append(summarize(sharding, read_metrics(metrics)))

    add_speedup(rows, rows[0]["time_per_epoch_s"], baseline=f"{rows[0]['run']} (one process, no wrapper)")
    print("\n" + format_table(rows))
    (results / "lab_summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot = results / "strong_scaling.png"
    plot_study(
        rows,
        path=plot,
        panels=("time_per_epoch_s", "speedup"),
        title=f"{args.model} on {args.dataset}, global batch {rows[0]['global_batch_size']}",
    )
    print(f"\nwrote {results}/lab-*.jsonl, {results}/lab_summary.json and {plot}")
    losses = [row["val_loss"] for row in rows]
    spread = (max(losses) - min(losses)) / min(losses)
    if spread < SAME_MODEL_TOLERANCE:
        print(
            f"All runs trained the same model: validation losses agree within {spread:.1e} (relative). Sums "
            "taken in another order round differently, so the last digits may differ."
        )
    else:
        print(
            f"warning: validation losses differ by {spread:.1%} between runs; with the same global batch and "
            "seed they should agree to rounding"
        )
    return 0


if __name__ == "__main__":
    checks.exit_with(main)
