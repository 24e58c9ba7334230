"""Calibration: known terms recovered from runs the model itself made (with noise), each within its
stated uncertainty; the profile file taken back by plan and plan predict; every bad input one line
and exit 2."""

from __future__ import annotations

import csv
import dataclasses
import itertools
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
    "contention": 1.5,
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
        memory = 1.1 * prediction.peak.reserved / 2**30
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
    assert profile.memory_factor == pytest.approx(1.1, rel=0.005)  # shrunk a little toward 1
    assert profile.rms_log_residual == pytest.approx(0.02, abs=0.01)
    assert len(rows) == len(LAYOUTS)
    for row in rows:
        assert abs(math.log(row["calibrated_step_s"] / row["measured_step_s"])) < 0.08


def test_without_noise_each_term_is_the_truth_as_far_as_the_runs_pin_it():
    """Runs that agree exactly pin a term they say much of (the products: within 2 %); a term they
    say little of (the links between nodes, a small part of these steps) stays nearer its prior, and
    its uncertainty says so: every term within three standard errors of the truth."""
    profile, _ = calibration.calibrate(_measured(noise=0.0), CLUSTER, STACK)
    assert profile.terms["products"] == pytest.approx(TRUTH["products"], rel=0.02)
    for name, true in TRUTH.items():
        assert abs(profile.terms[name] - true) <= 3 * profile.uncertainty[name] + 1e-3, name


def test_a_term_no_run_exercises_keeps_its_prior_and_a_few_runs_move_a_term_part_way():
    unpipelined = [run for run in _measured(noise=0.01) if run.layout.pipeline == 1]
    profile, _ = calibration.calibrate(unpipelined, CLUSTER, STACK)
    assert profile.uncertainty["pipeline_per_microbatch"] is None
    assert profile.terms["pipeline_per_microbatch"] == 0.0
    few, _ = calibration.calibrate(unpipelined[:2], CLUSTER, STACK)
    assert 1.0 < few.terms["products"] < profile.terms["products"]
    assert few.leave_one_out is not None and few.runs == 2
    with pytest.raises(UserError, match="no run that ran to calibrate on"):
        calibration.calibrate([], CLUSTER, STACK)


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
        ("none ran", "no run that ran to calibrate on: all 2 runs ran out of memory"),
        ("column", "has no column tokens_per_s_per_gpu"),
        ("cluster", "a run on 'alps', not 'h100-node': calibrate one cluster at a time"),
        ("status", "unknown line 2: status 'crashed': choose one of ok, oom"),
        ("pasted", "run 2 (d8 fsdp) repeats run 1 to the last digit: a measurement given twice"),
        ("negative peak", "line 2: peak_memory_gib must be a finite number above 0, got -40.0"),
        ("nan peak", "line 2: peak_memory_gib must be a finite number above 0, got nan"),
        ("nan speed", "line 2: tokens_per_s_per_gpu must be a finite number above 0, got nan"),
        ("cut short", "line 3 is cut short: it has no status, model"),
    ],
)
def test_bad_calibration_input_is_one_line_and_exit_2(case, message, tmp_path, capsys):
    runs = _measured(noise=0.02)
    path = tmp_path / "runs.csv"
    if case == "none ran":
        _write_runs(path, [dataclasses.replace(run, status="oom") for run in runs[:2]])
    elif case == "column":
        _write_runs(path, runs, drop="tokens_per_s_per_gpu")
    elif case == "cluster":
        _write_runs(path, runs, extra={"cluster": "alps"})
    elif case == "pasted":
        _write_runs(path, [dataclasses.replace(runs[0], layout=Layout(data=8))] * 8)
    elif case == "status":
        _write_runs(path, runs)
        path.write_text(path.read_text().replace(",ok,", ",crashed,", 1))
    else:
        _write_runs(path, runs)
        lines = path.read_text().splitlines()
        field = {"negative peak": (4, "-40"), "nan peak": (4, "nan"), "nan speed": (3, "nan")}.get(case)
        if field:
            cells = lines[1].split(",")
            cells[field[0]] = field[1]
            lines[1] = ",".join(cells)
        else:  # a row cut short
            lines[2] = ",".join(lines[2].split(",")[:5])
        path.write_text("\n".join(lines) + "\n")
    shown = call_main(
        plan_tool.main,
        ["calibrate", "--runs", str(path), "--cluster", "h100-node", "--out", str(tmp_path / "p.json")],
        capsys,
    )
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert message in shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1


def _held_out_error(profile, runs, cluster, framework=STACK) -> tuple[float, float]:
    """RMS log error of ``runs`` predicted uncalibrated and with ``profile``."""
    plain = calibrated = 0.0
    for run in runs:
        p = predict(run.model, cluster, run.layout, seq_len=run.seq_len, global_batch=run.global_batch,
                    framework=run.framework or framework)  # fmt: skip
        seconds = run.global_batch * run.seq_len / (run.tokens_per_s_per_gpu * run.layout.gpus)
        plain += math.log(p.time["total"] / seconds) ** 2
        calibrated += math.log(calibration.apply(p, profile, cluster).time["total"] / seconds) ** 2
    return math.sqrt(plain / len(runs)), math.sqrt(calibrated / len(runs))


@pytest.mark.parametrize("k", [2, 4, 6])
def test_a_profile_fitted_on_k_noisy_runs_predicts_the_others_better_than_none(k):
    """Runs the model made with known terms and 5 % noise: fitted on any k of them, the profile
    predicts the other 13 - k better than the uncalibrated planner, split after split."""
    runs = _measured(noise=0.05, seed=3)
    for seed in range(5):
        chosen = set(random.Random(seed).sample(range(len(runs)), k))
        profile, _ = calibration.calibrate([runs[i] for i in chosen], CLUSTER, STACK)
        plain, calibrated = _held_out_error(
            profile, [r for i, r in enumerate(runs) if i not in chosen], CLUSTER
        )
        assert calibrated < plain, (k, seed, plain, calibrated)


def _h200_runs(recipe: str) -> list[calibration.MeasuredRun]:
    from course_lib.tools.evidence import gpu_runs

    return [
        calibration.MeasuredRun(run.model, run.layout, run.seq_len, run.global_batch, run.tokens_per_s,
                                run.reserved_gib, run.status, framework=run.framework)
        for run in gpu_runs.read_runs() if run.framework.name == recipe
    ]  # fmt: skip


@pytest.mark.parametrize("recipe", ["fp32-master", "torchtitan"])
def test_on_the_h200_runs_k_of_them_predict_the_rest_no_worse_and_every_fitted_run_fits(recipe):
    """The committed H200 runs of one recipe: for every k, the profiles fitted on k of them (up to
    12 subsets each) predict the others no worse on average than the uncalibrated planner, no
    subset more than 0.035 in log worse (the priors bound what a few runs can do), and each
    profile calls every run it was fitted on one that fits (the 8B at 8K tokens, 138 GiB of the
    card's 140, among them)."""
    from course_lib.plan.frameworks import FRAMEWORKS

    h200, runs = CLUSTERS["h200-node"], _h200_runs(recipe)
    for k in range(1, len(runs)):
        subsets = list(itertools.combinations(range(len(runs)), k))
        random.Random(0).shuffle(subsets)
        gains = []
        for subset in subsets[:12]:
            profile, rows = calibration.calibrate([runs[i] for i in subset], h200, FRAMEWORKS[recipe])
            assert all(row["fits"] for row in rows), (k, subset)
            rest = [run for i, run in enumerate(runs) if i not in subset]
            plain, calibrated = _held_out_error(profile, rest, h200)
            gains.append(plain - calibrated)
            assert calibrated - plain < 0.035, (k, subset)
        assert sum(gains) / len(gains) >= 0, (k, gains)


def test_a_term_is_not_extrapolated_far_beyond_the_runs_that_fixed_it():
    """Fitted on steps of 0.2 to 0.9 s of products, a step of a hundredth of that keeps the
    products' prior, and says so."""
    from course_lib.plan.frameworks import FRAMEWORKS

    h200, runs = CLUSTERS["h200-node"], _h200_runs("fp32-master")
    profile, _ = calibration.calibrate(runs, h200, FRAMEWORKS["fp32-master"])
    assert profile.terms["products"] != 1.0
    tiny = predict(
        runs[0].model, h200, runs[0].layout, seq_len=256, global_batch=1, framework=FRAMEWORKS["fp32-master"]
    )
    after = calibration.apply(tiny, profile, h200)
    assert after.time["compute"] == tiny.time["compute"]
    assert "calibration's products not applied: beyond the runs that fixed it" in after.note
    inside = predict(
        runs[0].model, h200, runs[0].layout, seq_len=8192, global_batch=1, framework=FRAMEWORKS["fp32-master"]
    )
    assert calibration.apply(inside, profile, h200).time["compute"] == pytest.approx(
        inside.time["compute"] * profile.terms["products"]
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"terms": {"products": None}}, "terms.products must be a number, got None"),
        ({"terms": {"products": "fast"}}, "terms.products must be a number, got 'fast'"),
        ({"terms": {"products": float("nan")}}, "terms.products must be a finite number at least 0, got nan"),
        (
            {"terms": {"contention": -1.0}},
            "terms.contention must be a finite number at least 0, got -1.0",
        ),
        (
            {"terms": {"step_overhead": float("inf")}},
            "terms.step_overhead must be a finite number, got inf",
        ),
        ({"memory_factor": float("nan")}, "memory_factor must be a finite number above 0, got nan"),
        ({"uncertainty": {"products": -0.1}}, "uncertainty.products must be a finite number at least 0"),
    ],
)
def test_a_profile_with_a_term_no_fit_gives_is_refused_at_the_door(change, message, tmp_path):
    """A null, a string, a NaN or a negative term would price every layout wrongly (a layout that
    "fits" at "nan GiB", a negative step time) without a word: refused when the file is read."""
    profile = calibration.CalibrationProfile("h100-node", "course")
    content = dataclasses.asdict(profile)
    for key, value in change.items():
        content[key] = content[key] | value if isinstance(value, dict) else value
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(content))  # json writes NaN as the literal NaN, which it reads back
    with pytest.raises(UserError, match="must be"):
        calibration.CalibrationProfile.load(path)
    try:
        calibration.CalibrationProfile.load(path)
    except UserError as error:
        assert message in str(error)


def test_a_spreadsheets_csv_with_a_byte_order_mark_reads_as_the_plain_one(tmp_path, capsys):
    runs = _measured(noise=0.02)
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    _write_runs(plain, runs)
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    outputs = []
    for path in (plain, marked):
        out = tmp_path / f"{path.stem}.json"
        shown = call_main(
            plan_tool.main,
            ["calibrate", "--runs", str(path), "--cluster", "h100-node", "--out", str(out)],
            capsys,
        )
        assert shown.returncode == 0, shown.stderr
        outputs.append(json.loads(out.read_text()))
    assert outputs[0] == outputs[1]


def test_fitted_seconds_that_would_make_a_step_negative_are_refused_not_priced():
    profile = calibration.CalibrationProfile("h100-node", "course")
    profile.terms["step_overhead"] = -1e6  # a correction fitted on runs nothing like this one
    cluster = CLUSTERS["h100-node"]
    prediction = predict(MODELS["llama3-8b"], cluster, Layout(data=8), seq_len=4096, global_batch=8)
    with pytest.raises(UserError, match=r"takes the step of d8 fsdp to -1e\+06 s"):
        calibration.apply(prediction, profile, cluster)
