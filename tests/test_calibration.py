"""Calibration: known terms recovered from runs the model itself made (with noise), each within its
stated uncertainty; the profile file taken back by plan and plan predict; every bad input one line
and exit 2."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest

from course_lib.errors import UserError
from course_lib.plan import calibration
from course_lib.plan.cost_model import predict
from course_lib.plan.frameworks import COURSE_PROFILE
from course_lib.plan.layout import Layout
from course_lib.plan.specs import CLUSTERS, MODELS
from course_lib.tools import plan as plan_tool

from conftest import call_main

CLUSTER, MODEL = CLUSTERS["h100-node"], MODELS["llama3-8b"]
# gradients reduced after the backward: the data axis's exposure between nodes is then large enough to fit
STACK = COURSE_PROFILE.with_(grad_reduce_overlap=False)
TRUTH = {
    "products": 1.4,
    "inside_node": 1.3,
    "between_nodes": 1.6,
    "pipeline_per_microbatch": 0.004,
    "step_overhead": 0.05,
}
LAYOUTS = [
    Layout(data=d, tensor=t, pipeline=p, micro_batch=mb, sharding=sharding, sequence_parallel=t > 1)
    for d, t, p, mb, sharding in [
        (8, 1, 1, 1, "fsdp"), (4, 2, 1, 1, "fsdp"), (2, 4, 1, 2, "zero1"), (16, 1, 1, 1, "ddp"),
        (8, 2, 1, 1, "zero1"), (4, 2, 2, 1, "ddp"), (2, 8, 2, 1, "ddp"), (8, 4, 1, 1, "fsdp"),
        (16, 2, 1, 2, "zero2"), (4, 4, 2, 2, "ddp"), (32, 1, 1, 1, "ddp"), (8, 8, 1, 1, "ddp"),
        (2, 2, 4, 1, "ddp"),
    ]
]  # fmt: skip


def _measured(*, noise: float, seed: int = 1) -> list[calibration.MeasuredRun]:
    """The layouts' step times as the model says with ``TRUTH``'s terms, times log-normal noise."""
    rng, runs = random.Random(seed), []
    for layout in LAYOUTS:
        prediction = predict(MODEL, CLUSTER, layout, seq_len=8192, global_batch=64, framework=STACK)
        columns, fixed = calibration.parts(prediction, CLUSTER)
        seconds = (fixed + sum(TRUTH[name] * c for name, c in zip(calibration.TERMS, columns))) * math.exp(
            rng.gauss(0, noise)
        )
        memory = 1.1 * prediction.memory["total"] / 2**30
        runs.append(
            calibration.MeasuredRun(MODEL, layout, 8192, 64, 64 * 8192 / (seconds * layout.gpus), memory)
        )
    return runs


def test_known_terms_are_recovered_within_their_uncertainty():
    profile, rows = calibration.calibrate(_measured(noise=0.02), CLUSTER, STACK)
    for name, true in TRUTH.items():
        error = profile.uncertainty[name]
        assert error is not None, name
        assert abs(profile.terms[name] - true) <= 3 * error + 1e-3, (name, profile.terms[name], error)
    assert profile.terms["products"] == pytest.approx(1.4, rel=0.05)
    assert profile.memory_factor == pytest.approx(1.1)
    assert profile.rms_log_residual == pytest.approx(0.02, abs=0.01)
    assert len(rows) == len(LAYOUTS)
    for row in rows:
        assert abs(math.log(row["calibrated_step_s"] / row["measured_step_s"])) < 0.08


def test_without_noise_the_terms_are_exact():
    profile, _ = calibration.calibrate(_measured(noise=0.0), CLUSTER, STACK)
    for name, true in TRUTH.items():
        assert profile.terms[name] == pytest.approx(true, rel=1e-4, abs=1e-6), name


def test_a_term_no_run_exercises_keeps_its_prior_and_too_few_runs_are_refused():
    unpipelined = [run for run in _measured(noise=0.01) if run.layout.pipeline == 1]
    profile, _ = calibration.calibrate(unpipelined, CLUSTER, STACK)
    assert profile.uncertainty["pipeline_per_microbatch"] is None
    assert profile.terms["pipeline_per_microbatch"] == 0.0
    with pytest.raises(
        UserError,
        match=r"3 runs cannot fit 3 terms \(products, inside_node, step_overhead\): measure at least 4",
    ):
        calibration.calibrate(unpipelined[:3], CLUSTER, STACK)


def _write_runs(path, runs, *, extra: dict | None = None, drop: str = "") -> None:
    columns = [c for c in ("layout", "seq_len", "global_batch", "tokens_per_s_per_gpu", "peak_memory_gib",
                           "status", "model", *(extra or {})) if c != drop]  # fmt: skip
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        for run in runs:
            row = {
                "layout": run.layout.name(), "seq_len": run.seq_len, "global_batch": run.global_batch,
                "tokens_per_s_per_gpu": run.tokens_per_s_per_gpu, "peak_memory_gib": "", "status": run.status,
                "model": "llama3-8b", **(extra or {}),
            }  # fmt: skip
            writer.writerow({key: value for key, value in row.items() if key in columns})


def test_the_command_fits_prints_and_writes_a_profile_that_predict_and_plan_take(tmp_path, capsys):
    runs = _measured(noise=0.02)
    _write_runs(tmp_path / "runs.csv", runs)
    out = tmp_path / "profile.json"
    base = ["--runs", str(tmp_path / "runs.csv"), "--cluster", "h100-node", "--out", str(out)]
    shown = call_main(plan_tool.main, ["calibrate", *base], capsys)
    assert shown.returncode == 0, shown.stderr
    assert "products" in shown.stdout and "±" in shown.stdout and "RMS log residual" in shown.stdout
    profile = calibration.CalibrationProfile.load(out)
    assert (profile.cluster, profile.framework, profile.runs) == ("h100-node", "course", len(runs))
    layouts = tmp_path / "layouts.csv"
    layouts.write_text("layout,seq_len,global_batch,model\nd8 fsdp,8192,64,llama3-8b\n")
    predict_args = ["predict", "--layouts", str(layouts), "--cluster", "h100-node", "--json"]
    plain = call_main(plan_tool.main, [*predict_args, str(tmp_path / "plain.json")], capsys)
    calibrated = call_main(
        plan_tool.main, [*predict_args, str(tmp_path / "cal.json"), "--profile", str(out)], capsys
    )
    assert plain.returncode == calibrated.returncode == 0, calibrated.stderr
    (before,), (after,) = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "cal"))
    assert after["step_s"] > before["step_s"]  # this profile's products run at 1/1.4 of the model's speed
    assert "step overhead (calibrated)" in after["time_s"]
    ranked = call_main(
        plan_tool.main,
        [
            "--model",
            "llama3-8b",
            "--cluster",
            "h100-node",
            "--gpus",
            "8",
            "--top",
            "1",
            "--profile",
            str(out),
        ],
        capsys,
    )
    assert ranked.returncode == 0, ranked.stderr
    elsewhere = call_main(
        plan_tool.main,
        ["--model", "llama3-8b", "--cluster", "alps", "--gpus", "8", "--profile", str(out)],
        capsys,
    )
    assert (
        elsewhere.returncode == 2 and "was calibrated on h100-node with course, not alps" in elsewhere.stderr
    )


@pytest.mark.parametrize(
    "case, message",
    [
        ("few", "cannot fit"),
        ("column", "has no column tokens_per_s_per_gpu"),
        ("cluster", "a run on 'alps', not 'h100-node': calibrate one cluster at a time"),
        ("status", "unknown line 2: status 'crashed': choose one of ok, oom"),
    ],
)
def test_bad_calibration_input_is_one_line_and_exit_2(case, message, tmp_path, capsys):
    runs = _measured(noise=0.02)
    path = tmp_path / "runs.csv"
    if case == "few":
        _write_runs(path, runs[:2])
    elif case == "column":
        _write_runs(path, runs, drop="tokens_per_s_per_gpu")
    elif case == "cluster":
        _write_runs(path, runs, extra={"cluster": "alps"})
    else:
        _write_runs(path, runs)
        path.write_text(path.read_text().replace(",ok,", ",crashed,", 1))
    shown = call_main(
        plan_tool.main,
        ["calibrate", "--runs", str(path), "--cluster", "h100-node", "--out", str(tmp_path / "p.json")],
        capsys,
    )
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert message in shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1
