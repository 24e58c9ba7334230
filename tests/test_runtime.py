"""runtime: every launcher's environment resolves to the right rank, world and rendezvous."""

import pytest

from course_lib.distributed import environment, runtime
from course_lib.distributed.environment import choose_backend, first_slurm_host, resolve_environment
from course_lib.distributed.launch import launch
from course_lib.errors import UserError


def test_plain_process_is_rank_zero_of_one():
    env = resolve_environment(environ={})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "single")


def test_torchrun_variables():
    env = resolve_environment(
        environ={
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 8, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("node7", 29500, "torchrun")


def test_srun_one_task_per_gpu():
    env = resolve_environment(
        environ={
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "nid[001234-001235]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.master_addr == "nid001234"
    assert env.master_port == environment.SLURM_PORT_BASE + 123456 % environment.SLURM_PORT_SPAN
    assert env.launcher == "slurm"


def _shell_port(script: str, pattern: str, job_id: int) -> int:
    """The port a job script computes in shell arithmetic, for one job id."""
    import re
    import subprocess
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "slurm" / script).read_text()
    expression = re.search(pattern, text).group(1)
    printed = subprocess.run(
        ["bash", "-c", f"SLURM_JOB_ID={job_id}; echo $(( {expression} ))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(printed.stdout)


@pytest.mark.parametrize("job_id", [0, 1, 6, 7999, 8000, 123456, 2**31 - 1])
def test_the_ports_a_job_derives_from_its_id_are_distinct_and_below_the_ephemeral_range(job_id):
    """Linux hands out source ports of outgoing connections from 32768 up: a port there may be taken."""
    training = resolve_environment(
        environ={
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "n1",
            "SLURM_JOB_ID": str(job_id),
        }
    ).master_port
    preflight = _shell_port("common.sh", r"MASTER_PORT=\$\(\((.+?)\)\) ", job_id)
    torchrun = _shell_port("torchrun_per_node.sbatch", r"port=\$\(\((.+?)\)\)", job_id)
    ports = [training, preflight, torchrun, torchrun + 1]
    assert all(1024 <= port < 32768 for port in ports), ports
    assert len(set(ports)) == len(ports), ports


def test_srun_respects_explicit_master():
    env = resolve_environment(
        environ={
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "a,b",
            "MASTER_ADDR": "login1",
            "MASTER_PORT": "1234",
        }
    )
    assert (env.master_addr, env.master_port) == ("login1", 1234)


def test_torchrun_inside_slurm_wins_over_inherited_procid():
    # Every torchrun child inherits SLURM_PROCID=0 from the batch step; RANK must win.
    env = resolve_environment(
        environ={
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_JOB_NODELIST": "n1",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "29400",
        }
    )
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")


def test_batch_script_without_srun_is_a_single_process():
    env = resolve_environment(
        environ={
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "1",
            "SLURM_JOB_NODELIST": "n1",
        }
    )
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


def test_rank_without_world_size_names_the_fix():
    with pytest.raises(UserError, match="RANK is set but WORLD_SIZE is not: launch with torchrun"):
        resolve_environment(environ={"RANK": "0"})


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "nid[1-2]"}

# (the launcher's variables, with one of them wrong; what the one line must say)
MALFORMED = [
    (
        TORCHRUN | {"RANK": "2"},
        "RANK='2' is not a whole number from 0 to 1: torchrun and course_lib.distributed.launch",
    ),
    (TORCHRUN | {"RANK": "zero"}, "RANK='zero' is not a whole number from 0 to 1"),
    (
        TORCHRUN | {"WORLD_SIZE": "0"},
        "WORLD_SIZE='0' is not a whole number 1 or more: the number of processes",
    ),
    (TORCHRUN | {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number 1 or more"),
    (TORCHRUN | {"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not a whole number from 0 to 1"),
    (TORCHRUN | {"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x' is not a whole number 1 or more"),
    (
        TORCHRUN | {"MASTER_PORT": "http"},
        "MASTER_PORT='http' is not a whole number from 1 to 65535: a free TCP",
    ),
    (TORCHRUN | {"MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a whole number from 1 to 65535"),
    (TORCHRUN | {"MASTER_PORT": "0"}, "MASTER_PORT='0' is not a whole number from 1 to 65535"),
    (
        TORCHRUN | {"MASTER_ADDR": ""},
        "MASTER_ADDR='' is not a host name or address: set it to the name or IP",
    ),
    (SRUN | {"SLURM_NTASKS": "four"}, "SLURM_NTASKS='four' is not a whole number 1 or more: srun sets it"),
    (SRUN | {"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS='0' is not a whole number 1 or more"),
    (SRUN | {"SLURM_PROCID": "4"}, "SLURM_PROCID='4' is not a whole number from 0 to 3: srun sets it"),
    (SRUN | {"SLURM_PROCID": "first"}, "SLURM_PROCID='first' is not a whole number from 0 to 3"),
    (SRUN | {"SLURM_LOCALID": "-2"}, "SLURM_LOCALID='-2' is not a whole number 0 or more"),
    (SRUN | {"SLURM_NNODES": "9"}, "SLURM_NNODES='9' is not a whole number from 1 to 4: Slurm sets it"),
    (SRUN | {"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not a whole number 0 or more: Slurm sets it"),
    (SRUN | {"MASTER_PORT": "-5"}, "MASTER_PORT='-5' is not a whole number from 1 to 65535"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not: launch with torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT must be set when WORLD_SIZE > 1"),
]


@pytest.mark.parametrize("environ, message", MALFORMED, ids=[m.split(" is ")[0] for _, m in MALFORMED])
def test_a_malformed_launcher_variable_is_named_with_its_fix(environ, message):
    with pytest.raises(UserError) as refused:
        resolve_environment(environ=environ)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("nid001234", "nid001234"),
        ("nid[001234-001237,001240]", "nid001234"),
        ("node[7,9]", "node7"),
        ("a1,b2", "a1"),
        ("gpu-[03-04]", "gpu-03"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_backend_choice():
    assert choose_backend("auto", cuda_available=False) == ("gloo", "cpu")
    assert choose_backend("auto", cuda_available=True) == ("nccl", "cuda")
    assert choose_backend("gloo", cuda_available=True) == ("gloo", "cpu")
    with pytest.raises(UserError, match="backend nccl needs a GPU but torch sees none: use --backend gloo"):
        choose_backend("nccl", cuda_available=False)


def test_init_single_process_then_shutdown():
    process = runtime.init()
    try:
        where = (process.rank, process.world_size, process.backend, process.device.type)
        assert where == (0, 1, "gloo", "cpu")
        assert runtime.init() is process  # idempotent
        assert runtime.process_info() is process and runtime.is_main()
        runtime.barrier()
    finally:
        runtime.shutdown()
    with pytest.raises(RuntimeError, match="has not been called"):
        runtime.process_info()


def _who_am_i():
    runtime.print0(f"hello from rank {runtime.rank()}")
    process = runtime.process_info()
    return process.rank, process.world_size, process.local_rank, process.backend


def test_print0_and_context_on_three_ranks(capfd):
    results = launch(_who_am_i, 3)
    assert results == [(0, 3, 0, "gloo"), (1, 3, 1, "gloo"), (2, 3, 2, "gloo")]
    out = capfd.readouterr().out
    assert out.count("hello from rank") == 1 and "hello from rank 0" in out


def test_cpu_threads_follow_omp_num_threads_or_share_the_cores():
    assert environment.cpu_threads_per_rank(4, {"OMP_NUM_THREADS": "3"}) == 3
    assert environment.cpu_threads_per_rank(1, {}) == environment.usable_cpus()
    assert environment.cpu_threads_per_rank(10_000, {}) == 1


@pytest.mark.parametrize(
    "layout, local_rank, visible_gpus, gpu",
    [
        # srun --gpus-per-task=1: every task sees only its own GPU, numbered 0
        ("gpus-per-task", 0, 1, 0),
        ("gpus-per-task", 3, 1, 0),
        # srun --gpus-per-node=4 with 4 tasks a node: every task sees all four
        ("gpus-per-node", 0, 4, 0),
        ("gpus-per-node", 3, 4, 3),
        # one torchrun a node starting 4 workers: LOCAL_RANK 0..3, all four GPUs visible
        ("torchrun", 2, 4, 2),
        # a second node's local ranks start again at 0
        ("gpus-per-node, node 2", 1, 4, 1),
    ],
)
def test_each_process_gets_the_gpu_of_its_layout(layout, local_rank, visible_gpus, gpu):
    assert environment.gpu_for_process(local_rank=local_rank, visible_gpus=visible_gpus) == gpu


def test_a_process_that_sees_no_gpu_is_told_how_to_get_one():
    with pytest.raises(UserError, match=r"sees no GPU: request GPUs from Slurm \(--gpus-per-task=1\)"):
        environment.gpu_for_process(local_rank=0, visible_gpus=0)


def _train_as(rank: int, port: int, *extra: str):
    from conftest import run_ranks

    env = {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    args = [
        "--sharding",
        "ddp",
        "--epochs",
        "1",
        "--max-steps",
        "1",
        "--no-progress",
        "--timeout",
        "3",
        *extra,
    ]
    [outcome] = run_ranks(args, 1, env=env, timeout=60)
    return outcome


def test_a_port_already_in_use_is_named_in_one_line():
    import socket

    from course_lib.distributed.launch import free_port

    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        outcome = _train_as(0, port)
    assert outcome.returncode == 2, outcome.stderr
    assert outcome.stderr.strip().splitlines() == [
        f"error: MASTER_PORT {port} is already in use on 127.0.0.1 (another job, or an earlier run that has "
        "not ended yet): choose another MASTER_PORT, or let torchrun pick a free one (--standalone)"
    ]


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_never_meet_say_so_in_one_line(rank):
    from course_lib.distributed.launch import free_port

    outcome = _train_as(rank, free_port())  # the other rank never starts
    assert outcome.returncode == 1, outcome.stderr
    [line] = outcome.stderr.strip().splitlines()
    expected = (
        "rank 0 waited 3 s at 127.0.0.1:" if rank == 0 else "rank 1 could not reach rank 0 at 127.0.0.1:"
    )
    assert line.startswith(f"error: {expected}"), line


@pytest.mark.parametrize(
    "variables, message",
    [
        (SRUN | {"SLURM_PROCID": "4"}, "SLURM_PROCID='4' is not a whole number from 0 to 3"),
        (TORCHRUN | {"RANK": "one"}, "RANK='one' is not a whole number from 0 to 1"),
    ],
    ids=["SLURM_PROCID", "RANK"],
)
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "real run"])
def test_the_command_names_a_malformed_launcher_variable_whatever_rank_it_thinks_it_is(
    variables, message, dry_run
):
    from conftest import run_ranks

    args = ["--epochs", "1", "--max-steps", "1", "--no-progress", *(["--dry-run"] if dry_run else [])]
    [outcome] = run_ranks(args, 1, env=variables, timeout=60)
    assert outcome.returncode == 2, outcome.stderr
    [line] = outcome.stderr.strip().splitlines()
    assert line.startswith("error: environment variable ") and message in line


def test_a_master_addr_no_one_knows_is_named_by_the_rank_that_looks_for_it():
    from conftest import run_ranks

    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "nowhere.invalid", "MASTER_PORT": "29400"}
    args = ["--sharding", "ddp", "--epochs", "1", "--max-steps", "1", "--no-progress", "--timeout", "3"]
    [outcome] = run_ranks(args, 1, env=env, timeout=60)
    assert outcome.returncode == 2, outcome.stderr
    [line] = outcome.stderr.strip().splitlines()
    assert line.startswith("error: MASTER_ADDR 'nowhere.invalid' is not a host this machine knows (")


def test_slurms_task_count_without_srun_names_srun():
    """A batch script that runs python itself: Slurm says the job has 2 tasks, but nothing started
    the other; rank 0's line names srun."""
    from course_lib.distributed.launch import free_port

    from conftest import run_ranks

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    args = ["--sharding", "ddp", "--epochs", "1", "--max-steps", "1", "--no-progress", "--timeout", "3"]
    [outcome] = run_ranks(args, 1, env=env, timeout=60)
    assert outcome.returncode == 1, outcome.stderr
    [line] = outcome.stderr.strip().splitlines()
    assert (
        line.startswith("error: rank 0 waited 3 s at 127.0.0.1:") and "only srun starts the ranks" in line
    ), line
