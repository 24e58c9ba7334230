"""launch: results in rank order, the real exception back, no rank left running."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.distributed import runtime
from course_lib.distributed.launch import ChildFailedError, launch
from course_lib.errors import UserError


def _sum_of_ranks(offset):
    value = torch.tensor([float(runtime.rank() + offset)])
    dist.all_reduce(value)
    return runtime.rank(), value.item(), torch.get_num_threads()


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(nprocs):
    torch.randn(300, 300) @ torch.randn(300, 300)  # the parent has used threads: children must not hang
    results = launch(_sum_of_ranks, nprocs, 10)
    expected_sum = sum(range(nprocs)) + 10 * nprocs
    assert results == [(rank, expected_sum, 1) for rank in range(nprocs)]


def _master_port_is_taken() -> bool:
    """Whether this rank could bind MASTER_PORT (it must not: the launcher listens there)."""
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError:
            return True
    return False


def test_the_launcher_holds_the_rendezvous_port_from_before_the_first_rank_starts():
    """No rank binds MASTER_PORT after the launcher chose it (another process could take it in between,
    and a rank would fail with "already in use"): the launcher listens there before forking, and
    serves the store once every rank is forked (a store thread running during a fork can deadlock
    the child on a lock the C library held)."""
    for _ in range(20):  # rounds of rendezvous on fresh ports: none may hang or lose its port
        assert launch(_master_port_is_taken, 4) == [True] * 4


def _fails_on_rank_two():
    if runtime.rank() == 2:
        raise ValueError("bad value on rank two")
    dist.barrier()  # the others wait here, then see rank 2 vanish


def test_the_failing_ranks_exception_is_raised_not_its_peers():
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad value on rank two") as caught:
        launch(_fails_on_rank_two, 3)
    assert "raised on rank 2" in caught.value.__notes__[0]
    assert "_fails_on_rank_two" in caught.value.__notes__[0]  # the child's traceback is attached
    assert time.monotonic() - started < 30


def _dies_silently():
    if runtime.rank() == 1:
        os._exit(7)
    dist.barrier()


def test_a_rank_that_dies_without_a_word_is_reported_with_its_exit_code():
    with pytest.raises(ChildFailedError, match="rank 1 exited with code 7"):
        launch(_dies_silently, 2)


def _sleeps():
    time.sleep(60)


def test_timeout_stops_every_rank():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 2 s"):
        launch(_sleeps, 2, timeout_s=2)
    assert time.monotonic() - started < 15


def _returns_a_lambda():
    return lambda: None


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(ChildFailedError, match="cannot be sent back"):
        launch(_returns_a_lambda, 2)


def test_refuses_to_fork_from_a_process_group_member():
    runtime.init()
    try:
        with pytest.raises(RuntimeError, match="already joined a process group"):
            launch(_sum_of_ranks, 2, 0)
    finally:
        runtime.shutdown()
    assert launch(_sum_of_ranks, 2, 0)[0][0] == 0  # and works again afterwards


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: launch(_sum_of_ranks, 0, 0), "nprocs must be a whole number, 1 or more, got 0"),
        (lambda: launch(_sum_of_ranks, "2", 0), "nprocs must be a whole number, got '2'"),
        (lambda: launch("_sum_of_ranks", 2, 0), "fn must be a function to run on every rank, got str"),
        (
            lambda: launch(_sum_of_ranks, 2, 0, backend="mpi"),
            "unknown backend 'mpi': choose one of gloo, nccl, auto",
        ),
        (
            lambda: launch(_sum_of_ranks, 2, 0, timeout_s=float("nan")),
            "timeout_s must be a finite number above 0",
        ),
        (lambda: launch(_sum_of_ranks, 2, 0, timeout_s=-5), "timeout_s must be a finite number above 0"),
    ],
    ids=["zero", "text", "not-a-function", "backend", "nan-timeout", "negative-timeout"],
)
def test_bad_arguments_are_refused_before_any_process_starts(call, message):
    from course_lib.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        call()


def test_too_many_processes_for_the_machine_are_refused_and_sharing_is_explained(capsys):
    from course_lib.distributed import launch as launcher
    from course_lib.errors import UserError

    with pytest.raises(
        UserError,
        match=r"17 processes on 2 CPU core\(s\) would spend their time waiting .* use at "
        r"most 16 here",
    ):
        launcher.check_process_count(17, cores=2)
    launcher._told_about_sharing = False
    launcher.check_process_count(4, cores=1)
    launcher.check_process_count(4, cores=1)
    told = capsys.readouterr().err
    assert told.count("note: 4 processes share 1 CPU core(s)") == 1  # said once, not at every launch
    assert "the results are exactly those of 4 separate machines" in told


PLAIN_SCRIPT = """
import sys

import torch

from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch


def shapes_differ():
    tensor = torch.ones(2 + runtime.rank())  # rank 0: 2 elements, rank 1: 3
    comm.all_reduce(tensor)
    return tensor.tolist()


if __name__ == "__main__":
    assert "course_lib.observe" not in sys.modules  # nothing but launch and comm imported
    try:
        print(launch(shapes_differ, 2))
    except Exception as error:  # noqa: BLE001 - what the script's user sees
        print(f"refused: {error}")
"""


def test_a_plain_script_through_launch_gets_the_cross_rank_check_without_importing_it(tmp_path):
    """Only ``launch`` and ``comm`` imported: an all-reduce whose tensors differ in shape across
    ranks is refused on every rank with what each called, never a wrong result on one of them."""
    import subprocess
    import sys

    from conftest import REPO, clean_env

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "the ranks made different calls" in done.stdout, done.stdout
    assert "rank 0: all_reduce of float32 (2,); rank 1: all_reduce of float32 (3,)" in done.stdout


TORCHRUN_SCRIPT = """
import torch

from course_lib.distributed import comm, runtime

runtime.init(backend="gloo")
tensor = torch.ones(2 + runtime.rank())
try:
    comm.all_reduce(tensor)
    print(f"rank {runtime.rank()} got {tensor.tolist()}")
except Exception as error:  # noqa: BLE001 - what the script's user sees
    print(f"rank {runtime.rank()} refused: {error}")
runtime.shutdown()
"""


def test_a_plain_script_under_torchrun_gets_the_cross_rank_check_on_every_rank(tmp_path):
    """No ``launch``, no setting: under torchrun on CPU (gloo) the check is on wherever ``comm``
    is, and every rank refuses the all-reduce instead of one of them computing a wrong sum."""
    import subprocess
    import sys

    from conftest import REPO, clean_env

    script = tmp_path / "plain_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=180)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"rank {rank} refused: comm: the ranks made different calls" in done.stdout, done.stdout
    assert " got " not in done.stdout


def _killed_inside_a_collective():
    import signal

    from course_lib.distributed import comm

    if runtime.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(3))


def test_a_peer_killed_in_a_collective_is_the_cause_never_the_programs_mistake():
    """Rank 0 only sees its peer gone; the launcher names the killed rank, and no UserError (exit 2:
    an input mistake) blames the program."""
    with pytest.raises(ChildFailedError, match="rank 1 exited with code -9") as raised:
        launch(_killed_inside_a_collective, 2, timeout_s=60)
    assert not isinstance(raised.value, UserError)
