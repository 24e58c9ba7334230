"""The benchmark command: every benchmark answers --help, reports each variant's anatomy, and profiles.

The benchmarks' measurements themselves are checked beside the lessons they measure
(``tests/parallel/``); here, the command as a package: its entry point, its anatomies, ``--profile``.
"""

from __future__ import annotations

import json

import pytest

from course_lib.tools import bench

from conftest import run_bench, run_tool

BENCHMARKS = (
    "ddp",
    "fsdp",
    "memory",
    "pipeline",
    "tp",
    "sp",
    "cp",
    "attention",
    "ep",
    "recompute",
    "compile",
    "float8",
    "checkpoint",
    "allreduce",
)
SHARES = (
    "compute_share",
    "exposed_communication_share",
    "idle_share",
    "host_overhead_share",
    "unexplained_share",
)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_answers_help(name, capsys):
    with pytest.raises(SystemExit) as done:
        bench.main([name, "--help"])
    assert done.value.code == 0
    # a sweep has no step to record, compiled code is profiled by torch.compile's own tools, the
    # float8 runs are about their losses, and a checkpoint's cost is its pause, not a step's parts
    assert ("--profile" in capsys.readouterr().out) == (
        name not in ("allreduce", "compile", "float8", "checkpoint")
    )


@pytest.fixture(scope="module")
def profiled_ddp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile") / "ddp"
    result = run_bench(*"ddp --width 96 --layers 3 --steps 2 --warmup 1 --profile".split(), str(folder))
    return result, folder


def test_a_benchmark_reports_its_variants_anatomies_side_by_side(profiled_ddp):
    result, _ = profiled_ddp
    for variant in ("course", "torch"):
        anatomy = result[variant]
        assert sum(anatomy[share] for share in SHARES) == pytest.approx(1.0)
        assert anatomy["unexplained_share"] <= 0.10
        assert len(anatomy["per_rank"]) == 2 and anatomy["conditions"]["ranks"] == 2


def test_profile_leaves_each_variants_traces_and_the_result(profiled_ddp):
    result, folder = profiled_ddp
    assert json.loads((folder / "anatomy.json").read_text()) == result
    for variant in ("course", "torch"):
        for rank in (0, 1):
            trace = json.loads((folder / variant / f"rank{rank}.json").read_text())
            assert trace["traceEvents"]


def test_profile_naming_a_file_is_refused_in_one_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    shown = run_tool("bench", "fsdp", "--profile", str(a_file))
    assert shown.returncode == 2
    [line] = shown.stderr.strip().splitlines()
    assert "argument --profile" in line and "is a file, but a folder is expected" in line


def _sweep_through_a_transport_that_corrupts():
    """The all-reduce benchmark with gloo's all-reduce corrupting one element of every fifth call on
    rank 0, as LL128 did between some GH200 nodes now and then."""
    import torch.distributed as dist

    from course_lib.tools.bench import allreduce

    calls = {"n": 0}
    real = dist.all_reduce

    def corrupting(tensor, *args, **kwargs):
        result = real(tensor, *args, **kwargs)
        calls["n"] += 1
        if dist.get_rank() == 0 and calls["n"] % 5 == 0 and tensor.numel() > 1:
            tensor.view(-1)[0] += 1.0
        return result

    dist.all_reduce = corrupting
    try:
        return allreduce.allreduce_benchmark(sizes=[64, 4096], iterations=3, warmup=1)
    finally:
        dist.all_reduce = real


def test_the_network_check_counts_wrong_values_not_only_speed():
    from course_lib.distributed.launch import launch

    result = launch(_sweep_through_a_transport_that_corrupts, 2)[0]
    assert result["all_correct"] is False
    assert sum(row["wrong"] for row in result["rows"]) > 0
    assert all(row["correct"] == (row["wrong"] == 0) for row in result["rows"])
