"""Run one Python function on N local processes, and get every rank's result back.

``torchrun`` is how real jobs start, but it needs a terminal and a script file. In a notebook
or a test we want to write a function and see it run on 4 processes right there:

>>> from course_lib.distributed.launch import launch
>>> def hello():
...     from course_lib.distributed import runtime
...     return runtime.rank() * 10
>>> launch(hello, nprocs=4)
[0, 10, 20, 30]

How it works, and why:

- *fork*, not spawn: a forked child already has the notebook's functions in memory, so
  nothing must be pickled or re-imported (spawn cannot pickle a function defined in a notebook).
- One CPU thread per child, set before the child runs any torch operation. A child forked from
  a parent that already used OpenMP threads hangs in its first multi-threaded op; one thread
  avoids that, and N processes on N cores should not each start N threads anyway.
- Each child gets the same environment variables torchrun would set (RANK, WORLD_SIZE,
  MASTER_ADDR=127.0.0.1, MASTER_PORT) and calls ``runtime.init()``, so the function runs
  through exactly the code path of a real job. As torchrun's agent does, the launcher itself
  listens at MASTER_PORT before any child starts and serves the rendezvous store there
  (``hosted_store``): a port only chosen here and bound later by rank 0 could be taken by
  another process in between.
- Results and exceptions come back through one pipe per child. When a rank fails, the others
  are stopped at once and its exception is raised here with the child's traceback attached;
  an error that only says "another rank died" is never shown in place of the real cause.
- Children end with ``os._exit`` after ``runtime.shutdown()``: no interpreter teardown, so
  no abort at exit.
- What the parent imported, every child has for free; what a child imports, it pays for on every
  launch. The first optimizer or DDP wrapper a process builds imports ``torch._dynamo`` (about
  a second of CPU), so the parent imports it once, before the first fork.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..checks import check_choice, check_int, check_number
from ..errors import PeerLeft, UserError
from . import environment, hooks, runtime

PROCESSES_PER_CORE_LIMIT = 8
"""More processes than this per CPU core would spend their time switching, not computing: refused."""

ROOT_CAUSE_GRACE_S = 2.0
"""After a first failure, how long to wait for the other ranks' reports to find the root cause."""


class ChildFailedError(RuntimeError):
    """A rank failed in a way that could not be re-raised as its own exception."""


def free_port() -> int:
    """A TCP port on the loopback interface that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rendezvous_socket() -> socket.socket:
    """A TCP socket listening on a free loopback port (``getsockname()[1]``): where ranks will meet.

    Listening from the start, the port cannot be taken by another process before the store serves
    it (``hosted_store``); a rank that connects early waits in the socket's backlog.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def hosted_store(listening: socket.socket, timeout_s: float = runtime.DEFAULT_TIMEOUT_S):
    """The rendezvous store, served on ``listening`` (a ``rendezvous_socket``, which it takes over).

    The ranks a launcher starts with ``runtime.STORE_HOSTED_VARIABLE=1`` and MASTER_PORT set to
    that socket's port all connect to it as clients. Keep the store until they have finished.
    Serving starts a thread: a launcher that forks its ranks forks them *before* (a child forked
    while that thread held a lock of the C library would wait on it forever).
    """
    import datetime

    import torch.distributed as dist

    port = listening.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listening.detach(),  # the store closes it when it is deleted
    )


def _send(connection, message) -> None:
    # Plain pickle copies tensors by value. The pipe's own pickler (once torch.multiprocessing is
    # imported) would pass them as shared-memory handles that die with this process.
    connection.send_bytes(pickle.dumps(message))


def _child(
    rank: int,
    nprocs: int,
    port: int,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    connection,
    backend: str,
    timeout_s: float,
    check_collectives: bool,
    run_id: str,
) -> None:
    import torch

    torch.set_num_threads(1)  # first torch call in the child: see the module docstring
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ[runtime.STORE_HOSTED_VARIABLE] = "1"  # the parent listens there: hosted_store
    os.environ[runtime.RUN_VARIABLE] = run_id
    os.environ[hooks.CHECK_COLLECTIVES] = "1" if check_collectives else "0"
    exit_code = 0
    try:
        runtime.init(backend=backend, timeout_s=timeout_s, num_threads=1)
        # Every rank connected before any starts: a function that makes no collective (one that
        # only checks its arguments) would otherwise let a fast rank exit while a slow one is still
        # connecting to it ("Connection closed by peer" in init).
        runtime.barrier()
        result = fn(*args, **kwargs)
        # before the launcher, which has every result, stops the processes still shutting down
        hooks.ending(hooks.FINISHED)
        try:
            _send(connection, ("ok", result))
        except Exception as error:  # the result could not be pickled
            _send(
                connection, ("error", None, f"rank {rank} returned a value that cannot be sent back: {error}")
            )
            exit_code = 1
    except BaseException as error:  # noqa: BLE001 (report everything, including KeyboardInterrupt)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        hooks.ending(f"stopped by an error: {type(error).__name__}: {first}")
        text = traceback.format_exc()
        try:
            _send(connection, ("error", error, text))
        except Exception:  # the exception itself is not picklable: send its text only
            _send(connection, ("error", None, text))
        exit_code = 1
    finally:
        runtime.shutdown()
        connection.close()
        runtime.flush_and_exit(exit_code)


def _stop(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 5
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join()


def _raise_failure(failures: dict[int, tuple[BaseException | None, str]], *, finished: list[int]) -> None:
    """Raise the failure that explains the others. A rank that waited for a peer that had gone is
    never the cause; where every failed rank only waited, and others returned, those returned
    without a collective the waiting ranks made: the program's mistake, named as one."""
    if finished and all(isinstance(error, PeerLeft) for error, _ in failures.values()):
        waiting, returned = ", ".join(map(str, sorted(failures))), ", ".join(map(str, finished))
        raise UserError(
            f"ranks waited in a collective that other ranks never made (waiting: {waiting}; returned "
            f"without it: {returned}): every rank must make the same collectives, in the same order "
            "(a collective inside a branch that one rank takes?)"
        )

    # Prefer a rank whose error is its own (or that died silently) over ranks that only saw a peer disappear.
    def is_root_cause(item):
        error = item[1][0]
        return error is None or not runtime.is_peer_failure(error)

    rank, (error, text) = sorted(failures.items(), key=lambda item: (not is_root_cause(item), item[0]))[0]
    others = sorted(set(failures) - {rank})
    context = f"raised on rank {rank}" + (f" (ranks {others} failed after it)" if others else "")
    if isinstance(error, Exception):
        error.add_note(f"{context}; the child's traceback:\n{text}")
        raise error
    raise ChildFailedError(f"{context}:\n{text}")


_told_about_sharing = False


def max_processes(cores: int | None = None) -> int:
    """The most local processes worth starting on ``cores`` CPU cores (default: this process's)."""
    return PROCESSES_PER_CORE_LIMIT * (cores or environment.usable_cpus())


def check_process_count(nprocs: int, cores: int | None = None) -> None:
    """Refuse a senseless number of processes; say once what sharing few cores means for the rest."""
    global _told_about_sharing

    cores = cores or environment.usable_cpus()
    limit = max_processes(cores)
    if nprocs > limit:
        raise UserError(
            f"{nprocs} processes on {cores} CPU core(s) would spend their time waiting for each other, not "
            f"computing: use at most {limit} here (the lesson is the same with fewer), or run on a bigger "
            "machine"
        )
    if nprocs > cores and not _told_about_sharing:
        _told_about_sharing = True
        print(
            f"note: {nprocs} processes share {cores} CPU core(s), one thread each: the results are exactly "
            f"those of {nprocs} separate machines, only the times are slower",
            file=sys.stderr,
            flush=True,
        )


def launch(
    fn: Callable,
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300,
    check_collectives: bool = True,
    collective_timeout_s: float | None = None,
    read_result: Callable[[bytes], Any] = pickle.loads,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` forked processes; return the results in rank order.

    Each process has joined a process group (``runtime.init``) before ``fn`` starts. If any rank
    raises, the others are stopped and the exception is raised here. If they do not all finish
    within ``timeout_s`` seconds, they are stopped and ``TimeoutError`` is raised. Every collective
    made through ``course_lib.distributed.comm`` first checks that all ranks make the same call with
    tensors of the same shape (``collective_check``, installed with ``comm``); a timing turns
    that off.

    Args:
        fn: the function every rank runs; define it at the top level of a module or a notebook
            (forked children inherit it). What it returns must pickle.
        nprocs: how many processes (ranks) to start on this machine.
        args: positional arguments passed to ``fn`` on every rank.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or ``"auto"``.
        timeout_s: how long the ranks may take, together, before they are stopped.
        check_collectives: check every collective's call across the ranks first (one small
            all-gather each): a mistake is named instead of aborting a process. Pass False to time.
        collective_timeout_s: how long one collective may wait for the other ranks before it
            fails on the ranks that wait (None: ``timeout_s``). Shorter than ``timeout_s``, the
            waiting ranks fail, and write their flight records (``flight_recorder``), before
            the launcher stops them all.
        read_result: how the launcher reads what a rank sends back (a pickle's bytes); a grader
            that runs a student's code passes a reader that rebuilds plain values only.
        kwargs: keyword arguments passed to ``fn`` on every rank.
    """
    _check_arguments(fn, nprocs, backend, timeout_s, collective_timeout_s)
    import torch._dynamo  # noqa: F401 (once here, not in every child: see the module docstring)

    context = multiprocessing.get_context("fork")
    # listening before any child starts; served once every child is forked (hosted_store)
    listening = rendezvous_socket()
    port = listening.getsockname()[1]
    # each launch a run of its own, unless the caller names one: records a later launch writes
    # into the same flight-recorder folder are told apart
    run_id = os.environ.get(runtime.RUN_VARIABLE) or f"launch-{os.getpid()}-{port}-{time.time_ns()}"
    processes, pending = [], {}  # pending: the receiving end of each rank's pipe -> its rank
    for rank in range(nprocs):
        receive_end, send_end = context.Pipe(duplex=False)
        child_args = (rank, nprocs, port, fn, args, kwargs, send_end, backend)
        process = context.Process(
            target=_child,
            name=f"rank{rank}",
            args=(*child_args, collective_timeout_s or timeout_s, check_collectives, run_id),
        )
        process.start()
        send_end.close()  # only the child writes; closing our copy lets us see EOF if it dies
        processes.append(process)
        pending[receive_end] = rank
    store = hosted_store(listening, collective_timeout_s or timeout_s)  # held until every child ended
    try:
        results, failures = _collect(processes, pending, timeout_s, read_result)
    finally:
        _stop(processes)
        for receive_end in pending:
            receive_end.close()
        del store
    if failures:
        _raise_failure(failures, finished=sorted(results))
    return [results[rank] for rank in range(nprocs)]


def _check_arguments(
    fn, nprocs: int, backend: str, timeout_s: float, collective_timeout_s: float | None
) -> None:
    """Refuse what ``launch`` cannot run, before any process starts."""
    if not callable(fn):
        raise UserError(f"fn must be a function to run on every rank, got {type(fn).__name__}")
    check_int("nprocs", nprocs, minimum=1)
    check_choice("backend", backend, ("gloo", "nccl", "auto"))
    check_number("timeout_s", timeout_s, above=0, maximum=runtime.MAX_TIMEOUT_S)
    if collective_timeout_s is not None:
        check_number("collective_timeout_s", collective_timeout_s, above=0, maximum=timeout_s)
    check_process_count(nprocs)
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "launch() was called from a process that already joined a process group; forked children would "
            "inherit its sockets. Call course_lib.distributed.runtime.shutdown() first, or restart the "
            "kernel."
        )


def _collect(processes: list, pending: dict, timeout_s: float, read_result=pickle.loads) -> tuple[dict, dict]:
    """Each rank's result or failure, as they arrive; after a failure the others get a moment more.

    Returns ({rank: result}, {rank: (exception or None, traceback text)}); ``pending`` keeps the
    ranks that never reported (the caller stops them).
    """
    results: dict[int, Any] = {}
    failures: dict[int, tuple[BaseException | None, str]] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        if failures:  # give the other ranks a moment to report, then stop them
            wait_s = min(ROOT_CAUSE_GRACE_S, deadline - time.monotonic())
        else:
            wait_s = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, wait_s))
        if not ready:
            if failures:  # the others are still running: their records first, then stop them
                hooks.hung(f"the launcher: rank {min(failures)} failed")
                break
            hooks.hung(f"the launcher: ranks {sorted(pending.values())} did not finish in {timeout_s} s")
            raise TimeoutError(
                f"ranks {sorted(pending.values())} of {len(processes)} did not finish within {timeout_s} s; "
                "they were stopped (a rank waiting in a collective that another rank never called?)"
            )
        for receive_end in ready:
            rank = pending.pop(receive_end)
            try:
                message = read_result(receive_end.recv_bytes())
            except pickle.UnpicklingError as error:
                message = ("error", None, f"rank {rank} sent back what cannot be read: {error}")
            except EOFError:
                processes[rank].join(5)
                message = (
                    "error",
                    None,
                    f"rank {rank} exited with code {processes[rank].exitcode} without reporting (killed, "
                    "or a crash in native code)",
                )
            receive_end.close()
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                failures[rank] = (message[1], message[2])
    return results, failures
