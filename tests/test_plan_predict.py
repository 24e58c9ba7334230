"""Layouts by name, and ``plan predict``: a layout's printed name reads back to the same layout,
a name that does not parse names the part, and ``plan predict`` gives each row of a CSV the
prediction ``cost_model.predict`` makes, or the reason it cannot run."""

from __future__ import annotations

import json
import random

import pytest

from course_lib.errors import UserError
from course_lib.parallel import pipeline
from course_lib.plan import planner, specs
from course_lib.plan.cost_model import predict
from course_lib.plan.layout import Layout
from course_lib.tools import plan as plan_tool

from conftest import call_main


@pytest.mark.parametrize("model, gpus", [("llama3-8b", 64), ("mixtral-8x7b", 48)])
def test_every_layout_the_planner_considers_reads_back_from_its_name(model, gpus):
    layouts = planner.candidate_layouts(specs.MODELS[model], specs.CLUSTERS["alps"], gpus=gpus)
    assert len(layouts) > 1000
    for layout in layouts:
        assert Layout.from_name(layout.name()) == layout, layout.name()


def test_every_field_of_a_random_layout_survives_its_name():
    """A property over random layouts, every field drawn: the name keeps the precision, ``no-sp``,
    ``no-loss-parallel`` and a schedule or attention that only a default would hide."""
    from course_lib.parallel import memory, recompute
    from course_lib.plan import layout as layout_module

    draw = random.Random(56)
    choices = {
        "sharding": memory.SHARDINGS, "recomputation": recompute.POLICIES,
        "schedule": pipeline.WHOLE_BACKWARD, "precision": layout_module.PRECISIONS,
        "context_attention": layout_module.CONTEXT_ATTENTION, "sequence_parallel": (True, False),
        "loss_parallel": (True, False),
    }  # fmt: skip
    checked = 0
    while checked < 2000:
        fields = {axis: draw.choice((1, 2, 3, 4, 8)) for axis in ("data", "pipeline", "context", "tensor")}
        fields |= {name: draw.choice(values) for name, values in choices.items()}
        fields |= {"expert": draw.choice((1, 2)), "recompute_every": draw.choice((1, 2, 3))}
        fields |= {"micro_batch": draw.choice((1, 2, 5)), "virtual_stages": draw.choice((1, 2))}
        try:
            layout = Layout(**fields)
        except UserError:
            continue
        assert Layout.from_name(layout.name()) == layout, layout.name()
        checked += 1
    assert Layout.from_name(Layout(data=8, precision="fp32").name()).precision == "fp32"


def test_the_words_a_name_leaves_out_can_be_given():
    layout = Layout.from_name("c2.d4 zero1 ulysses fp32 no-sp no-loss-parallel mb2")
    assert layout == Layout(
        data=4, context=2, sharding="zero1", context_attention="ulysses", precision="fp32",
        sequence_parallel=False, loss_parallel=False, micro_batch=2,
    )  # fmt: skip
    assert Layout.from_name("single") == Layout()
    assert Layout.from_name("p4 ddp interleaved_1f1bx2").virtual_stages == 2


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "an empty layout"),
        ("d8.x2 fsdp", "'x2' is not an axis and its degree"),
        ("d0 fsdp", "'d0' is not an axis and its degree"),
        ("d8.d2 fsdp", "'d2' sets the data a second time"),
        ("d8 fsdp ddp", "'ddp' sets the sharding a second time"),
        ("d8 fsdp sel", "'sel' is none of a sharding"),
        ("p2 ddp 1f1bx2", "virtual_stages 2 needs schedule='interleaved_1f1b'"),  # read, then refused
    ],
)
def test_a_name_that_does_not_parse_names_the_part(name, message):
    with pytest.raises(UserError) as raised:
        Layout.from_name(name)
    assert message in str(raised.value)


def _predict_command(tmp_path, capsys, csv_text: str, *args: str):
    (tmp_path / "layouts.csv").write_text(csv_text)
    argv = [
        "predict",
        "--layouts",
        str(tmp_path / "layouts.csv"),
        "--json",
        str(tmp_path / "out.json"),
        *args,
    ]
    return call_main(plan_tool.main, argv, capsys)


def test_plan_predict_writes_the_cost_models_prediction_for_each_row(tmp_path, capsys):
    rows = [
        ("d8 fsdp sac mb2", 8192, 16, "llama3-8b"),  # torchtitan's table 1 job: fits
        ("d8.t8 fsdp mb24", 8192, 192, "llama3-8b"),  # predicted not to fit
        ("d3 fsdp", 8192, 16, "llama3-8b"),  # cannot be cut: refused without a time
        ("d4.p2 ddp 1f1b mb2", 4096, 32, "llama3-70b"),
    ]
    text = "layout,seq_len,global_batch,model\n" + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in rows)
    shown = _predict_command(tmp_path, capsys, text, "--cluster", "h100-grand-teton")
    assert shown.returncode == 0, shown.stderr
    written = json.loads((tmp_path / "out.json").read_text())
    assert [row["layout"] for row in written] == [name for name, *_ in rows]
    cluster = specs.CLUSTERS["h100-grand-teton"]
    for row, (name, seq_len, batch, model) in zip(written, rows, strict=True):
        expected = predict(
            specs.MODELS[model], cluster, Layout.from_name(name), seq_len=seq_len, global_batch=batch
        )
        assert row["fits"] == expected.fits and row.get("refused") == expected.problem
        if expected.time:
            assert row["step_s"] == pytest.approx(expected.time["total"])
            assert row["tokens_per_s_per_gpu"] == pytest.approx(expected.tokens_per_s / expected.layout.gpus)
            assert row["memory_gib"] == pytest.approx(expected.memory["total"] / 2**30)
        else:
            assert "step_s" not in row and "does not split" in row["refused"]
    assert not written[1]["fits"] and "needs" in written[1]["refused"]


@pytest.mark.parametrize(
    "csv_text, args, message",
    [
        ("layout,seq_len\nd8 fsdp,8192\n", ("--model", "llama3-8b"), "has no column global_batch"),
        ("layout,seq_len,global_batch\nd8 fsdp sel,8192,16\n", ("--model", "llama3-8b"), "'sel' is none of"),
        ("layout,seq_len,global_batch\nd8 fsdp,8192,16\n", (), "line 2: no model column and no --model"),
        ("layout,seq_len,global_batch\nd8 fsdp,long,16\n", ("--model", "llama3-8b"), "must be whole numbers"),
    ],
)
def test_plan_predict_refuses_a_bad_file_in_one_line(tmp_path, capsys, csv_text, args, message):
    shown = _predict_command(tmp_path, capsys, csv_text, "--cluster", "alps", *args)
    assert shown.returncode == 2 and message in shown.stderr and "Traceback" not in shown.stderr
    assert not (tmp_path / "out.json").exists()


def test_the_h200_runs_predicted_each_with_its_own_stack_all_fit(tmp_path, capsys):
    """``plan predict`` on the committed H200 runs: each row's ``framework`` and ``compiled``, each
    model's config.json read from the CSV's folder; every run that ran fits, and each row's
    reserved peak is the one ``plan check-gpu-runs`` holds against the measurement."""
    from course_lib.tools.evidence import gpu_runs

    source = gpu_runs.RUNS_CSV
    argv = [
        "predict",
        "--layouts",
        str(source),
        "--cluster",
        "h200-node",
        "--json",
        str(tmp_path / "out.json"),
    ]
    shown = call_main(plan_tool.main, argv, capsys)
    assert shown.returncode == 0, shown.stderr
    written = json.loads((tmp_path / "out.json").read_text())
    checked = gpu_runs.check(gpu_runs.read_runs(), specs.CLUSTERS["h200-node"])
    assert [row["framework"] for row in written] == [c.run.framework.name for c in checked]
    assert all(row["fits"] for row in written)
    for row, c in zip(written, checked, strict=True):
        assert row["reserved_gib"] == pytest.approx(c.prediction.peak.reserved / 2**30)
        assert row["peak_phase"] == c.prediction.peak.phase
