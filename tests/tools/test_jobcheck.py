"""jobcheck: what the Slurm jobs check before they spend GPU time, and the network benchmark."""

from __future__ import annotations

import json

import pytest

from course_lib.tools import bench, jobcheck

from conftest import REPO, run_tool


@pytest.mark.parametrize(
    "tasks, per_task, gpus, gpus_per_task, problem",
    [
        (4, 1, 4, 1, None),  # srun --ntasks-per-node=4 --gpus-per-task=1 (CSCS's advice)
        (4, 1, 4, None, None),  # srun --ntasks-per-node=4 --gpus-per-node=4
        (1, 4, 4, None, None),  # one torchrun a node, 4 workers, --gpus-per-node=4
        (2, 1, 4, None, None),  # fewer processes than GPUs: idle GPUs, but no rank without one
        (8, 1, 4, None, "8 processes would share 4 GPU(s) (the node has 4 GPU(s))"),
        (1, 4, 2, None, "4 processes would share 2 GPU(s) (the node has 2 GPU(s))"),
        (1, 4, 1, 1, "4 processes would share 1 GPU(s) (each task sees its 1 GPU(s) (--gpus-per-task=1))"),
        (4, 1, 0, None, "this job has no GPUs: request one per process, e.g. sbatch --gpus-per-task=1"),
    ],
)
def test_every_process_needs_a_gpu_of_its_own(tasks, per_task, gpus, gpus_per_task, problem):
    found = jobcheck.gpu_layout_problem(
        tasks_per_node=tasks,
        processes_per_task=per_task,
        gpus_on_node=gpus,
        gpus_per_task=gpus_per_task,
        needs_gpus=True,
    )
    assert found == problem if problem is None else problem in found


def test_the_layout_is_read_from_slurms_variables():
    environ = {"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_GPUS_ON_NODE": "4"}
    assert "8 processes would share 4 GPU(s)" in jobcheck.gpu_layout_from_slurm(
        environ, processes_per_task=1, needs_gpus=True
    )
    environ = {"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_TASK": "1"}
    assert jobcheck.gpu_layout_from_slurm(environ, processes_per_task=1, needs_gpus=True) is None
    # a CPU cluster whose profile does not need GPUs
    assert jobcheck.gpu_layout_from_slurm({}, processes_per_task=1, needs_gpus=False) is None


def test_the_plugin_is_found_on_a_uenvs_library_path_or_named_by_the_container_hook(tmp_path):
    view = tmp_path / "view" / "lib"
    view.mkdir(parents=True)
    options = dict(source="uenv", nccl_net="AWS Libfabric", edf="")
    problem, _ = jobcheck.plugin_problem(library_path=f"/nonexistent:{view}", **options)
    assert (
        "needs the aws-ofi-nccl plugin (libnccl-net.so), and no folder on LD_LIBRARY_PATH has it" in problem
    )
    (view / "libnccl-net.so").write_bytes(b"")
    problem, source = jobcheck.plugin_problem(library_path=f"/nonexistent:{view}", **options)
    assert problem is None and source == f"{view / 'libnccl-net.so'} (uenv)"

    edf = tmp_path / "course.toml"
    edf.write_text('image = "x"\n[annotations]\ncom.hooks.aws_ofi_nccl.enabled = "true"\n')
    options = dict(source="container", nccl_net="AWS Libfabric", library_path="")
    assert jobcheck.plugin_problem(edf=str(edf), **options)[0] is None
    assert "needs COURSE_EDF" in jobcheck.plugin_problem(edf="", **options)[0]
    assert "does not exist" in jobcheck.plugin_problem(edf=str(tmp_path / "nothing.toml"), **options)[0]
    edf.write_text('image = "x"\n')
    assert "does not enable the plugin hook" in jobcheck.plugin_problem(edf=str(edf), **options)[0]
    edf.write_bytes('image = "café"\n'.encode("latin-1"))
    assert "is not UTF-8 text (byte 0xe9" in jobcheck.plugin_problem(edf=str(edf), **options)[0]
    # the course's own example enables it
    example = REPO / "slurm" / "clusters" / "alps-container.toml"
    assert jobcheck.plugin_problem(edf=str(example), **options)[0] is None
    assert (
        "choose one of uenv, container, none"
        in jobcheck.plugin_problem(source="pip", nccl_net="AWS Libfabric", library_path="", edf="")[0]
    )
    # no plugin needed when the profile does not ask NCCL for one
    assert jobcheck.plugin_problem(source="uenv", nccl_net="", library_path="", edf="")[0] is None


NCCL_LOG = """nid006352:34610:34631 [0] NCCL INFO NCCL version 2.27.5+cuda12.9
nid006352:34610:34631 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v9)
nid006352:34610:34631 [0] NCCL INFO Using network {network}
nid006352:34610:34631 [0] NCCL INFO ncclCommInitRankConfig comm 0x1 rank 0 nranks 8
"""


def test_the_preflight_reads_which_network_nccl_chose():
    assert jobcheck.nccl_network(NCCL_LOG.format(network="AWS Libfabric")) == "AWS Libfabric"
    assert jobcheck.nccl_network(NCCL_LOG.format(network="Socket")) == "Socket"
    assert jobcheck.nccl_network("NCCL INFO Bootstrap: no network line") is None
    used = {0: "AWS Libfabric", 1: "Socket", 2: "Socket", 3: None}
    problem = jobcheck.network_problem(expected="AWS Libfabric", used=used)
    assert "NCCL on 3 of 4 ranks (rank 1 first) used network 'Socket', not 'AWS Libfabric'" in problem
    assert jobcheck.network_problem(expected="AWS Libfabric", used={0: "AWS Libfabric"}) is None
    assert jobcheck.network_problem(expected="", used={0: "Socket"}) is None  # nothing was asked for


def test_jobcheck_outside_a_job_passes_on_a_cpu_profile_and_names_the_fix_otherwise(monkeypatch, capsys):
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    assert jobcheck.main(["gpus"]) == 0
    assert jobcheck.main(["gpus", "--needs-gpus"]) == 2
    assert "error: this job has no GPUs" in capsys.readouterr().err
    monkeypatch.setenv("COURSE_NCCL_PLUGIN_FROM", "uenv")
    monkeypatch.setenv("NCCL_NET", "AWS Libfabric")
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    assert jobcheck.main(["plugin"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line


def test_the_sweep_sizes_and_the_verdict():
    assert bench.allreduce_sizes(min_bytes=8, max_bytes=2**20) == [8 * 4**k for k in range(9)] + [2**20]
    assert bench.allreduce_sizes(min_bytes=6, max_bytes=100, factor=2) == [8, 16, 32, 64, 100]
    healthy, line = bench.network_verdict(busbw_gbps=21.0, expected_gbps=25)
    assert healthy and line == "network OK: bus bandwidth 21.00 GB/s is 84% of the link's 25 GB/s"
    healthy, line = bench.network_verdict(busbw_gbps=1.2, expected_gbps=25)
    assert not healthy and line.startswith(
        "network SLOW: bus bandwidth 1.20 GB/s is 5% of the link's 25 GB/s"
    )


@pytest.mark.slow
@pytest.mark.timing
def test_bench_allreduce_measures_the_local_network_and_its_alpha_beta_model(tmp_path):
    shown = run_tool(
        "bench",
        "allreduce",
        "--world-size",
        "2",
        "--max-mb",
        "1",
        "--iterations",
        "5",
        "--output",
        str(tmp_path / "sweep.json"),
        "--plot",
        str(tmp_path / "sweep.png"),
    )
    assert shown.returncode == 0, shown.stderr
    result = json.loads(shown.stdout)
    assert json.loads((tmp_path / "sweep.json").read_text()) == result
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (result["backend"], result["world_size"], result["all_correct"]) == ("gloo", 2, True)
    rows = result["rows"]
    assert [row["bytes"] for row in rows] == bench.allreduce_sizes(min_bytes=8, max_bytes=2**20)
    for row in rows:
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(N-1)/N = 1 at N = 2
    assert result["fit"]["latency_us"] > 0 and result["fit"]["bandwidth_gbps"] > 0
    # a bus bandwidth far below the link's speed is a failing verdict, with the line that says so
    slow = run_tool("bench", "allreduce", "--max-mb", "0.01", "--iterations", "2", "--expect-gbps", "1000")
    assert slow.returncode == 1 and "network SLOW: bus bandwidth" in slow.stderr


def test_no_profile_sets_more_threads_than_the_cores_a_process_was_given():
    """Threads per process come from common.sh (a task's cores over its processes); a profile that
    fixed them (the old OMP_NUM_THREADS=16 on tasks of 8 cores) would oversubscribe. Only the test
    cluster, whose advertised cores are not real, pins one thread."""
    for profile in (REPO / "slurm" / "clusters").glob("*.sh"):
        sets_threads = "OMP_NUM_THREADS" in profile.read_text()
        assert sets_threads == (profile.stem == "local"), profile.name
    common = (REPO / "slurm" / "common.sh").read_text()
    assert "cores / per_task" in common
