"""Exercise: lab 7: a strong-scaling study, explained with a model fitted to your own runs.

After running the study (locally: ``python -m course_lib.tools.study submit --local --gpus 1 2 3 4
--dataset digits --model digits_cnn --global-batch-size 96``; on the cluster: ``... submit --gpus 1 2
4 8 16 --wait``, then ``collect``) and measuring the network (``python -m course_lib.tools.bench allreduce >
results/allreduce.json``; on the cluster, ``slurm/network_check.sbatch``), fill in the functions
marked TODO in exercise.py, check them (the grading suite checks them on tables made from the model,
and your answers against your own measurements):

    python -m course_lib.tools.labs check lab7_scaling

then run them on your results; the last lines it prints are your ``[measured]`` block for answers.toml:

    python labs/lab7_scaling/exercise.py results/scaling/scaling.csv results/allreduce.json --model digits_cnn
"""

from __future__ import annotations

import sys

import torch

from course_lib.plan import scaling


def speedup_and_efficiency(seconds: dict[int, float]) -> dict[int, tuple[float, float]]:
    """For each number of GPUs N: (speedup T(1)/T(N), parallel efficiency speedup / N)."""
    # TODO: strong scaling compares each run with the one-GPU run of the same work: the speedup is how many times faster, the efficiency how much of the ideal N-fold speedup that is; one entry per N, the one-GPU run included
    raise NotImplementedError(
        "TODO: strong scaling compares each run with the one-GPU run of the same work: the speedup is how many times faster, the efficiency how much of the ideal N-fold speedup that is; one entry per N, the one-GPU run included"
    )


def karp_flatt_metric(speedups: dict[int, float]) -> dict[int, float]:
    """For each N > 1, the serial fraction the measured speedup implies: e = (1/S - 1/N) / (1 - 1/N).

    Amdahl's serial fraction would give the same e at every N; communication gives an e that
    changes with N (Karp and Flatt, 1990).
    """
    # TODO: Amdahl's law gives S from e and N; solve it for e and apply it at each N above 1 (N = 1 tells nothing)
    raise NotImplementedError(
        "TODO: Amdahl's law gives S from e and N; solve it for e and apply it at each N above 1 (N = 1 tells nothing)"
    )


def communication_seconds(
    processes: int, *, alpha_s: float, beta_bytes_per_s: float, gradient_bytes: float, all_reduces: float
) -> float:
    """T_comm(N): ``all_reduces`` ring all-reduces of every gradient, each as the alpha-beta model says."""
    # TODO: a ring all-reduce sends 2(N-1) messages, each paying the latency alpha and carrying 1/N of the bytes at the rate beta; one process sends nothing
    raise NotImplementedError(
        "TODO: a ring all-reduce sends 2(N-1) messages, each paying the latency alpha and carrying 1/N of the bytes at the rate beta; one process sends nothing"
    )


def fit_compute_and_fixed(
    seconds: dict[int, float], communication: dict[int, float], *, cores: int | None = None
) -> tuple[float, float]:
    """(T_compute, T_fixed) of T(N) = T_compute/N + T_comm(N) + T_fixed, fitted to ``seconds``.

    ``cores``: the cores N processes shared (a laptop), where the compute divides by min(N, cores),
    not N; None on a cluster, where each rank has a device of its own."""
    # TODO: once T_comm(N) is predicted, what is left of each measured time is a straight line in the compute's share 1/N (1/min(N, cores) on shared cores), whose slope and intercept are the two unknowns; fit it by least squares over every N (with two runs it goes through both)
    raise NotImplementedError(
        "TODO: once T_comm(N) is predicted, what is left of each measured time is a straight line in the compute's share 1/N (1/min(N, cores) on shared cores), whose slope and intercept are the two unknowns; fit it by least squares over every N (with two runs it goes through both)"
    )


def fit_with_communication_scale(
    seconds: dict[int, float], communication: dict[int, float], *, cores: int | None = None
) -> tuple[float, float, float]:
    """(T_compute, k, T_fixed) of T(N) = T_compute/N + k T_comm(N) + T_fixed, fitted to ``seconds``.

    k is the missing term when trusting the predicted T_comm gives a negative T_compute: how many
    of the micro-benchmark's all-reduces one all-reduce inside training costs. Needs three N.
    ``cores`` as in ``fit_compute_and_fixed``.
    """
    if len(seconds) < 3:
        raise ValueError(f"three unknowns need runs at three numbers of processes, got {sorted(seconds)}")
    # TODO: three unknowns, linear in each: one row [1/N, T_comm(N), 1] per run and the measured time on the right; the least-squares solution of that system (torch.linalg.lstsq, in float64) is the three terms
    raise NotImplementedError(
        "TODO: three unknowns, linear in each: one row [1/N, T_comm(N), 1] per run and the measured time on the right; the least-squares solution of that system (torch.linalg.lstsq, in float64) is the three terms"
    )


def _measured(csv_path: str, allreduce_path: str, model: str, sharding: str, cores: int | None) -> dict:
    """Your measurements, as the ``[measured]`` block of answers.toml holds them."""
    import json
    from pathlib import Path

    from course_lib import models
    from course_lib.tools.study import read_csv

    for path, made_by in (
        (csv_path, "python -m course_lib.tools.study collect"),
        (allreduce_path, "python -m course_lib.tools.bench allreduce --output results/allreduce.json"),
    ):
        if not Path(path).is_file():
            raise SystemExit(f"error: {path} does not exist: make it with `{made_by}`")
    if model not in models.IMAGE_MODELS:
        raise SystemExit(
            f"error: --model {model} is not one of the course's models: {', '.join(models.IMAGE_MODELS)}"
        )
    rows = [row for row in read_csv(csv_path) if row["sharding"] == sharding]
    if not rows:
        raise SystemExit(f"{csv_path} has no {sharding} run: run the study with --shardings {sharding}")
    sweep = json.loads(open(allreduce_path).read())
    fit = sweep.get("fit_by_regime") or sweep["fit"]
    parameters = sum(p.numel() for p in models.build_model(model).parameters())
    first = rows[0]
    steps = round(first["samples_per_s"] * first["time_per_epoch_s"] / first["global_batch_size"])
    return {
        "sharding": sharding,
        **({} if cores is None else {"cores": cores}),
        "seconds_per_epoch": {str(int(row["world_size"])): row["time_per_epoch_s"] for row in rows},
        "alpha_us": fit["latency_us"],
        "beta_gbps": fit["bandwidth_gbps"],
        "gradient_bytes": 4 * parameters,  # fp32 gradients
        "all_reduces_per_epoch": steps,  # one all-reduce of every gradient per step
    }


def explain(measured: dict) -> dict:
    """The model fitted to ``measured``: T_comm at each N, T_compute, T_fixed, and a prediction at 8."""
    seconds = {int(n): t for n, t in measured["seconds_per_epoch"].items()}
    link = dict(
        alpha_s=measured["alpha_us"] * 1e-6,
        beta_bytes_per_s=measured["beta_gbps"] * 1e9,
        gradient_bytes=measured["gradient_bytes"],
        all_reduces=measured["all_reduces_per_epoch"],
    )
    communication = {n: communication_seconds(n, **link) for n in (*seconds, 8)}
    measured_communication = {n: communication[n] for n in seconds}
    cores = measured.get("cores")
    compute, fixed = fit_compute_and_fixed(seconds, measured_communication, cores=cores)
    model = {
        "seconds": seconds,
        "communication": communication,
        "plain_compute_s": compute,
        "plain_fixed_s": fixed,
    }
    if len(seconds) >= 3:
        compute, scale, fixed = fit_with_communication_scale(seconds, measured_communication, cores=cores)
        model |= {
            "fitted_compute_s": compute,
            "communication_scale": scale,
            "fitted_fixed_s": fixed,
            "predicted_seconds_at_8": compute * scaling.compute_share(8, cores=cores)
            + scale * communication[8]
            + fixed,
        }
    if len(seconds) >= 4:  # a residual to tell the terms' uncertainty from
        model["standard_errors"] = scaling.strong_scaling_standard_errors(
            seconds, measured_communication, cores=cores
        )
    return model


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="your study, your network, and the model fitted to them")
    parser.add_argument("scaling_csv", help="results/scaling/scaling.csv, written by `study collect`")
    parser.add_argument("allreduce_json", help="the JSON `bench allreduce` printed (or the network check's)")
    parser.add_argument("--model", default="resnet18", help="the model the study trained")
    parser.add_argument("--sharding", default="ddp", help="which sharding's runs to fit")
    parser.add_argument(
        "--cores",
        type=int,
        default=None,
        help="the cores the runs' processes shared (a local study: this machine's); leave it out on a "
        "cluster, where each rank has a device of its own",
    )
    args = parser.parse_args(sys.argv[1:])
    if args.cores is not None and args.cores < 1:
        parser.error(f"--cores must be 1 or more, got {args.cores}")
    measured = _measured(args.scaling_csv, args.allreduce_json, args.model, args.sharding, args.cores)
    model = explain(measured)
    table = speedup_and_efficiency(model["seconds"])
    karp_flatt = karp_flatt_metric({n: s for n, (s, _) in table.items()}) if 1 in table else {}
    print(
        f"speedup and efficiency against {args.sharding}-1, this sharding's own one-process run (the study's "
        "table takes them against single-1, one process without a wrapper)"
    )
    for n, seconds in sorted(model["seconds"].items()):
        line = f"N = {n:>2}: {seconds:8.3f} s/epoch, T_comm {model['communication'][n]:7.3f} s"
        if n in table:
            line += f", speedup {table[n][0]:.2f}, efficiency {table[n][1]:.0%}"
        if n in karp_flatt:
            line += f", Karp-Flatt {karp_flatt[n]:.3f}"
        print(line)
    print(
        f"fit with T_comm as predicted: T_compute {model['plain_compute_s']:.3f} s, "
        f"T_fixed {model['plain_fixed_s']:.3f} s"
        + (" (a negative compute time: the model lacks a term)" if model["plain_compute_s"] < 0 else "")
    )
    if "communication_scale" in model:
        print(
            f"fit with the communication's scale: T_compute {model['fitted_compute_s']:.3f} s, "
            f"k {model['communication_scale']:.2f}, T_fixed {model['fitted_fixed_s']:.3f} s; "
            f"predicted at N = 8: {model['predicted_seconds_at_8']:.3f} s/epoch"
        )
    if "standard_errors" in model:
        compute_se, scale_se, fixed_se = model["standard_errors"]
        print(
            f"standard errors: T_compute {compute_se:.3f} s, k {scale_se:.2f}, T_fixed {fixed_se:.3f} s "
            "(a term within two of its errors of 0 is not told apart from none)"
        )
    else:
        print(
            "the fit's standard errors need runs at four numbers of processes: run the study with "
            "--gpus 1 2 3 4 (a global batch they divide)"
        )
    print("\n# paste into answers.toml, after your answers:\n[measured]")
    for key, value in measured.items():
        if isinstance(value, dict):
            value = "{" + ", ".join(f'"{n}" = {t!r}' for n, t in value.items()) + "}"
        elif isinstance(value, str):
            value = f'"{value}"'
        print(f"{key} = {value}")
