"""The published-runs check: each unit converted with its authors' FLOP count, every row read, and the
summary's figures computed from the predictions; ``plan check-published`` prints and writes them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from course_lib.plan.specs import MODELS
from course_lib.tools import plan as plan_tool
from course_lib.tools.evidence import published

from conftest import call_main

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[dict]:
    with open(published.PUBLISHED_RUNS, newline="") as file:
        return list(csv.DictReader(file))


def test_korthikantis_mfu_converts_to_the_iteration_time_the_paper_states():
    """Korthikanti et al.'s 22B run: 41.5 % MFU, and table 5's 1.10 s an iteration of 4 x 2048 tokens
    on 8 GPUs."""
    (row,) = [row for row in _rows() if row["id"] == "k22-22b"]
    model = published._model(row)
    tokens_per_s_per_gpu = published.measured_tokens_per_s_per_gpu("mfu_korthikanti", 41.5, model, 2048)
    assert tokens_per_s_per_gpu == pytest.approx(4 * 2048 / 1.10 / 8, rel=0.01)


def test_the_megatron_counts_agree_with_each_other_and_with_the_planners():
    gpt = published._model(next(row for row in _rows() if row["id"] == "m21-1.7b"))
    s = 2048
    k22 = published._flops_per_token("mfu_korthikanti", gpt, s)
    # Megatron-Core's count reduces to Korthikanti's for multi-head attention and a 4h GELU MLP ...
    assert published._flops_per_token("tflops_per_gpu_megatron2024", gpt, s) == pytest.approx(k22)
    # ... and the 2021 count adds the forward that full recomputation repeats, except the logits'
    h, l = gpt.d_model, gpt.layers  # noqa: E741
    recomputed_forward = 24 * l * h * h * (1 + s / (6 * h))
    assert published._flops_per_token("tflops_per_gpu_megatron2021", gpt, s) == pytest.approx(
        k22 + recomputed_forward
    )
    # the planner's own count (6 per non-embedding parameter and 12·L·h·s) differs by the norms and biases
    for model in (gpt, MODELS["llama3-8b"], MODELS["llama3-70b"]):
        megatron = published._flops_per_token("tflops_per_gpu_megatron2024", model, 8192)
        assert model.flops_per_token(8192) == pytest.approx(megatron, rel=1e-3), model.name


def test_rows_are_read_as_their_stacks_ran_them():
    runs = {run.id: run for run in published.read_runs()}
    # torchtitan cuts a rank's local batch of 32 into as many micro-batches as pipeline ranks
    titan = runs["nx-tt-405b-3d-interleaved"]
    assert titan.layout.micro_batch == 4 and titan.global_batch // (8 * 4) == 8
    assert runs["tt-h100-8b-fsdp8-eager"].layout.micro_batch == 2  # no pipeline: the local batch
    # Megatron-Bridge's DDP runs the distributed optimizer; its GPT-OSS is the built-in, EP from extras
    oss = runs["nx-mbridge-gptoss-120b"]
    assert (oss.layout.sharding, oss.layout.expert, oss.model) == ("zero1", 8, MODELS["gpt-oss-120b"])
    assert oss.framework.grad_reduce_overlap and oss.framework.param_gather_overlap
    # a row without a cluster gets the built-in one of its GPU
    h200 = runs["nx-trainy-h200-8b"]
    assert h200.cluster == "h200-node" and h200.not_expressible is None


def test_every_row_is_read_and_the_expressible_ones_have_a_model_and_layout():
    rows, runs = _rows(), published.read_runs()
    assert [run.id for run in runs] == [row["id"] for row in rows]
    for row, run in zip(rows, runs, strict=True):
        assert run.measured > 0 and run.global_batch == int(row["global_batch"])
        if run.not_expressible is None:  # the file says so, or the planner states all its reasons now
            assert row["expressible"] == "yes" or published._unstated(row, run.framework) is None
            assert run.layout.gpus == int(row["gpus"]), run.id
            assert run.model.layers == int(row["layers"]) and run.model.d_model == int(row["d_model"])
        else:
            assert run.model is None and run.layout is None and run.not_expressible


def test_the_summary_counts_what_the_rows_say():
    checked = published.check(published.read_runs())
    result = published.summary(checked)
    expressible = [c for c in checked if c.run.not_expressible is None]
    assert result["rows"] == len(checked) and result["expressible"] == len(expressible)
    ratios = sorted(c.ratio for c in expressible)
    middle = len(ratios) // 2
    median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    assert result["median_ratio"] == pytest.approx(median)
    within = [c for c in expressible if 1 / 1.33 <= c.ratio <= 1.33]
    assert result["within_1_33"] == len(within) / len(expressible)
    assert result["false_does_not_fit"] == sum(c.prediction.problem is not None for c in expressible)
    for c in expressible:
        assert c.ratio == pytest.approx(c.prediction.tokens_per_s / c.run.layout.gpus / c.run.measured)


def test_the_command_prints_every_row_and_writes_the_summary(tmp_path, capsys):
    shown = call_main(plan_tool.main, ["check-published", "--json", str(tmp_path / "out.json")], capsys)
    assert shown.returncode == 0, shown.stderr
    written = json.loads((tmp_path / "out.json").read_text())
    summary = json.loads(shown.stdout.strip().splitlines()[-1])
    assert written["summary"] == summary
    assert [row["id"] for row in written["rows"]] == [row["id"] for row in _rows()]
    for row in written["rows"]:
        assert row["id"] in shown.stdout
        assert (row["ratio"] is None) == (row["not_expressible"] is not None)


def test_a_file_it_cannot_read_is_one_line_and_exit_2(tmp_path, capsys):
    rows = _rows()
    broken = tmp_path / "missing_column.csv"
    with open(broken, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[c for c in rows[0] if c != "seq_len"])
        writer.writeheader()
        writer.writerow({k: v for k, v in rows[0].items() if k != "seq_len"})
    bad_value = tmp_path / "bad_value.csv"
    with open(bad_value, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerow(rows[0] | {"gpus": "eight"} | {"dp": "eight"})
    for path, message in ((broken, "has no column seq_len"), (bad_value, "line 2 (tt-h100-8b-fsdp8-eager)")):
        shown = call_main(plan_tool.main, ["check-published", str(path)], capsys)
        assert shown.returncode == 2, shown.stdout
        assert message in shown.stderr and "Traceback" not in shown.stderr


def test_the_planner_against_the_published_runs_as_it_stands():
    """The targets: every run expressible, 90 % within 1.33x, a median ratio between 0.9 and 1.1,
    no run that ran predicted not to fit, memory within 10 % where published. Only the first is met;
    each other is held at what the planner reaches now, so that a change can only make it better:
    48 of 48 runs expressible, 88 % within 1.33x, median 1.07, memory within 10 % on 6 of the 9 runs
    that publish it (reserved bytes against the allocator's reserved peak), and two runs that ran
    called too big:
    NeMo's FP8 Llama 3 8B, whose gradients the Megatron profile keeps in fp32 (the run's
    configuration is not published), and Megatron-Bridge's GPT-OSS 120B at 4 sequences a
    micro-batch without recomputation (its recipe at that release is not pinned)."""
    checked = published.check(published.read_runs())
    result = published.summary(checked)
    assert result["expressible"] == result["rows"] == 48
    assert result["within_1_33"] >= 0.875
    assert 1.0 <= result["median_ratio"] <= 1.08
    too_big = [c.run.id for c in checked if c.prediction is not None and not c.prediction.fits]
    assert set(too_big) <= {"nx-nemo-llama3-8b-fp8", "nx-mbridge-gptoss-120b"}
    assert result["memory_within_10pct"] >= 6 / 9
    # what the README and lecture 9 say of it is this result
    share, median = f"{result['within_1_33']:.0%}".replace("%", " %"), f"{result['median_ratio']:.2f}"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Now all {result['rows']} are expressible, {share} within 1.33x, median {median}" in readme
    lecture = " ".join((ROOT / "slides" / "09-choosing-a-layout.md").read_text().split())
    assert f"Published runs: {share} of {result['expressible']} within 1.33×" in lecture


def test_each_publication_is_predicted_with_the_terms_fitted_on_the_others():
    from course_lib.plan import calibration
    from course_lib.plan.specs import CLUSTERS

    checked = published.check(published.read_runs())
    held_out = published.leave_one_source_out(checked)
    usable = [c for c in checked if c.prediction is not None and c.prediction.time]
    assert held_out["rows"] == len(usable) == sum(fold["runs"] for fold in held_out["by_source"].values())
    # one fold by hand: Megatron-LM 2021's runs, calibrated on every other publication's
    train = [c for c in usable if c.run.group != "megatron2021-a100"]
    columns, fixed = zip(*(calibration.parts(c.prediction, CLUSTERS[c.run.cluster]) for c in train))
    terms, _, _ = calibration.fit(list(columns), list(fixed), [published._step_seconds(c.run) for c in train])
    assert held_out["by_source"]["megatron2021-a100"]["products"] == pytest.approx(terms["products"])
    run = next(c for c in usable if c.run.id == "m21-1t")
    profile = calibration.CalibrationProfile("x", "y", terms)
    after = calibration.apply(run.prediction, profile, CLUSTERS[run.run.cluster])
    assert held_out["ratios"]["m21-1t"] == pytest.approx(
        after.tokens_per_s / run.run.layout.gpus / run.run.measured
    )


def test_lecture_9_says_how_fast_torchtitans_500_w_h100s_ran_their_products():
    """Notebook 14's arithmetic: the published step less what the planner predicts beside the
    products, over the products' FLOPs, against the planner's own products time."""
    from course_lib.plan import cost_model
    from course_lib.plan.frameworks import FRAMEWORKS
    from course_lib.plan.layout import Layout
    from course_lib.plan.specs import CLUSTERS

    llama, cluster = MODELS["llama3-8b"], CLUSTERS["h100-grand-teton"]
    job = Layout(data=8, sharding="fsdp", recomputation="selective", micro_batch=2)
    predicted = cost_model.predict(
        llama, cluster, job, seq_len=8192, global_batch=16, framework=FRAMEWORKS["torchtitan"]
    )
    flops = llama.flops_per_token(8192) * 16 * 8192 / 8
    published_step = 16 * 8192 / (8 * 5762)
    rest = predicted.time["total"] - predicted.time["compute"]
    implied = flops / (published_step - rest) / cluster.peak_flops
    modelled = flops / predicted.time["compute"] / cluster.peak_flops
    lecture = " ".join((ROOT / "slides" / "09-choosing-a-layout.md").read_text().split())
    assert (
        f"500 W H100s: a residual {implied:.0%} of the SXM peak, the planner says {modelled:.0%}"
    ).replace("%", " %") in lecture


@pytest.mark.parametrize(
    "change, message",
    [
        ({"measured_value": "0"}, "measured_value must be a finite number above 0, got 0.0"),
        ({"measured_value": "nan"}, "measured_value must be a finite number above 0, got nan"),
        ({"measured_value": "-3"}, "measured_value must be a finite number above 0, got -3.0"),
        ({"measured_memory_gib": "nan"}, "measured_memory_gib must be a finite number above 0, got nan"),
        ({"seq_len": "0"}, "seq_len must be a whole number, 1 or more, got 0"),
        ("cut", "line 2 is cut short: it has no"),
    ],
)
def test_a_measurement_that_is_none_is_refused_by_line(tmp_path, capsys, change, message):
    """A zero, NaN or negative measurement reached the fit's least squares (and PyTorch's own
    internal assert); a row cut short a TypeError: each is one line naming the row."""
    rows = _rows()
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerow(rows[0] if change == "cut" else rows[0] | change)
        writer.writerow(rows[1])
    if change == "cut":
        lines = path.read_text().splitlines()
        path.write_text("\n".join([lines[0], ",".join(lines[1].split(",")[:6]), lines[2]]) + "\n")
    shown = call_main(plan_tool.main, ["check-published", str(path)], capsys)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert message in shown.stderr


def test_a_single_publication_is_checked_with_none_held_out(tmp_path, capsys):
    rows = [row for row in _rows() if row["group"] == _rows()[0]["group"]]
    path = tmp_path / "one.csv"
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shown = call_main(plan_tool.main, ["check-published", str(path)], capsys)
    assert shown.returncode == 0, shown.stderr
    assert "none held out (fewer than two publications with a prediction)" in shown.stdout
