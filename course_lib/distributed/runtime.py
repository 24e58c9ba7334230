"""How a process learns who it is: rank, world size, device, backend.

A distributed job is N copies of one program. Before they can exchange a single tensor, each
copy must learn its *rank*, the *world size* N, the device it owns, and where rank 0 listens so
that all of them can meet (the *rendezvous*). Each launcher (torchrun, srun, this course's
``launch``, or none) says it in its own variables: ``environment.py`` reads them all.

``environment.resolve_environment()`` turns them into one ``DistEnvironment``;
``init()`` then picks the device and backend (a GPU means ``cuda`` + ``nccl``, otherwise ``cpu``
+ ``gloo``; ``environment.choose_backend``, with the GPU of each process chosen by
``environment.gpu_for_process``) and joins the process group.

``shutdown()`` is the other half. A finished gloo job can abort at interpreter exit
("terminate called without an active exception") when gloo's worker threads free objects that
still hold Python state. Collecting garbage *before* destroying the process group removes
that race, so every entry point ends with ``shutdown()`` after its models and optimizers are
out of scope.

Cost: the rendezvous is one TCP connection to rank 0 per process (milliseconds on a laptop,
seconds across a cluster), paid once per job.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass

from ..checks import check_int, check_number
from ..errors import PeerLeft, RendezvousFailed, UserError
from . import hooks
from .environment import (
    DistEnvironment,
    choose_backend,
    cpu_threads_per_rank,
    gpu_for_process,
    resolve_environment,
)

RUN_VARIABLE = "COURSE_RUN_ID"
"""A name every rank of one run shares (the launcher sets it; instruments write it into their records)."""

STORE_HOSTED_VARIABLE = "COURSE_STORE_HOSTED"
"""Set to 1 by a launcher that already listens at MASTER_ADDR:MASTER_PORT with the rendezvous store
(this course's ``launch``, as torchrun's agent does): every rank, rank 0 too, connects to it. A
launcher that only *chose* a free port and left rank 0 to bind it later could lose that port to
any other process in between (measured: once in a suite of a thousand launches on two cores)."""


DEFAULT_TIMEOUT_S = 300
"""How long a collective waits for a missing rank before failing (instead of hanging forever)."""


MAX_TIMEOUT_S = 24 * 3600
"""A rank that waits longer than a day for another is not waiting for anything that will come."""


@dataclass(frozen=True)
class ProcessInfo:
    """This process after ``init()``: its place in the world and the device it computes on."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device  # noqa: F821 (torch is imported lazily)
    backend: str
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_process: ProcessInfo | None = None


def _rendezvous_store(env: DistEnvironment, timeout: datetime.timedelta):
    """The key-value store where the ranks meet: each writes its address, reads everyone else's.

    Rank 0 hosts it at MASTER_ADDR:MASTER_PORT, except under torchrun, whose agent already hosts
    one there, and under this course's ``launch``, which hosts it in the parent
    (``STORE_HOSTED_VARIABLE``). A torchrun restart (``--max-restarts``) meets in that *same*
    agent store, where the dead attempt's addresses are still written: a prefix per attempt
    (TORCHELASTIC_RESTART_COUNT) keeps the new ranks from connecting to processes that no longer exist.
    """
    import torch.distributed as dist

    agent_hosts_it = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        or os.environ.get(STORE_HOSTED_VARIABLE) == "1"
    )
    hosts = env.rank == 0 and not agent_hosts_it
    if not hosts and not agent_hosts_it:
        _wait_until_listening(env, timeout)
    try:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=hosts, timeout=timeout
        )
    except (dist.DistError, RuntimeError) as error:
        where = f"{env.master_addr}:{env.master_port}"
        if "EADDRINUSE" in str(error) or "address already in use" in str(error):
            raise UserError(
                f"MASTER_PORT {env.master_port} is already in use on {env.master_addr} (another job, or an "
                "earlier run that has not ended yet): choose another MASTER_PORT, or let torchrun pick a "
                "free one (--standalone)"
            ) from None
        if hosts and "waiting for clients" in str(error):
            # Slurm's variables say how many tasks the job has; only srun starts them
            srun = (
                f": under Slurm only srun starts the ranks, and SLURM_NTASKS={env.world_size} without srun "
                "(a batch script that runs python itself) leaves rank 0 alone: run it as srun python ..., "
                "or unset SLURM_NTASKS to run one process"
                if env.launcher == "slurm"
                else ""
            )
            raise RendezvousFailed(
                f"rank 0 waited {timeout.total_seconds():g} s at {where} for all {env.world_size} ranks to "
                "join, and some never came: they did not start (see their logs), or they look for rank 0 "
                f"at another MASTER_ADDR or MASTER_PORT{srun}"
            ) from None
        raise
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _wait_until_listening(env: DistEnvironment, timeout: datetime.timedelta) -> None:
    """Wait, with plain sockets, until rank 0 listens at MASTER_ADDR:MASTER_PORT, or say it never did.

    c10d would wait too, but it reports a rank 0 that never comes with pages of C++ frames; the
    cause fits in one line. Each try connects from a port other than MASTER_PORT: on loopback, a
    connection whose source port happens to be its destination port connects to itself, and
    would hold the very port rank 0 is about to listen on.
    """
    import socket
    import time

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            env.master_addr, env.master_port, type=socket.SOCK_STREAM
        )[0]
    except socket.gaierror as error:
        raise UserError(
            f"MASTER_ADDR {env.master_addr!r} is not a host this machine knows ({error.strerror}): set it to "
            "rank 0's host name or address"
        ) from None
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        with socket.socket(family, kind, proto) as probe:
            probe.settimeout(1.0)
            try:
                probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
                if probe.getsockname()[1] != env.master_port:
                    probe.connect(address)
                    return
            except OSError:
                pass
        if time.monotonic() >= deadline:
            raise RendezvousFailed(
                f"rank {env.rank} could not reach rank 0 at {env.master_addr}:{env.master_port} within "
                f"{timeout.total_seconds():g} s: rank 0 did not start (see its log), or MASTER_ADDR and "
                "MASTER_PORT do not name its host and port"
            )
        time.sleep(0.1)


def init(
    *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, num_threads: int | None = None
) -> ProcessInfo:
    """Join the process group described by the environment and return this process's ``ProcessInfo``.

    Safe to call twice: the second call returns the context of the first.

    Args:
        backend: ``"auto"`` (NCCL where CUDA is, else gloo), ``"nccl"`` or ``"gloo"``.
        timeout_s: how long a collective may wait for the other ranks before it fails.
        num_threads: CPU threads for this process's torch operations (None: OMP_NUM_THREADS if set,
            otherwise this node's cores shared evenly between its ranks, so two ranks on two cores
            do not fight over them).
    """
    global _process
    if _process is not None:
        return _process

    check_number("timeout_s", timeout_s, above=0, maximum=MAX_TIMEOUT_S)
    if num_threads is not None:
        check_int("num_threads", num_threads, minimum=1)
    env = resolve_environment()
    import torch
    import torch.distributed as dist

    backend, device_type = choose_backend(backend, torch.cuda.is_available())
    if device_type == "cuda":
        index = gpu_for_process(local_rank=env.local_rank, visible_gpus=torch.cuda.device_count())
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(num_threads or cpu_threads_per_rank(env.local_world_size))

    hooks.started(rank=env.rank, world_size=env.world_size)  # instruments, before the process group
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if env.world_size == 1:
            # A world of one needs no network: an in-memory store is enough, and DDP/FSDP still work.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                store=_rendezvous_store(env, timeout),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
                device_id=device if device_type == "cuda" else None,
            )
    _process = ProcessInfo(
        rank=env.rank,
        local_rank=env.local_rank,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        device=device,
        backend=backend,
        launcher=env.launcher,
    )
    return _process


def process_info() -> ProcessInfo:
    """What the ``init()`` call of this process found: its rank, world size, device and backend."""
    if _process is None:
        raise RuntimeError("course_lib.distributed.runtime.init() has not been called in this process")
    return _process


def shutdown(*, leave_group: bool = True) -> None:
    """Leave the process group cleanly, so that the interpreter never aborts at exit.

    Call it after the models, optimizers and DDP/FSDP wrappers are out of scope (return from
    the function that owned them first): ``gc.collect()`` then frees them while the process
    group still exists, which is the order gloo needs.

    Args:
        leave_group: destroy the process group (a run that ended well); False after an error,
            when the peers may be gone and the process ends at once (``flush_and_exit``).
    """
    global _process
    # A rank that ends while others wait says so: its record shows the last collective it made.
    hooks.ending(hooks.FINISHED)
    hooks.stopped()
    gc.collect()
    import torch.distributed as dist

    if leave_group and dist.is_initialized():
        dist.destroy_process_group()
    _process = None


PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
"""What the transport says when the rank at the other end has already exited."""


def is_peer_failure(error: BaseException) -> bool:
    """True for the error a rank sees when *another* rank died or stopped answering."""
    import torch.distributed as dist

    if isinstance(error, (dist.DistError, PeerLeft)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in (*PEER_GONE, "Timed out", "timed out")
    )


def rank(*, group=None) -> int:
    """This process's rank in ``group`` (the whole world by default); 0 before any process group exists.

    Args:
        group: a process group this rank belongs to (``dist.new_group``, ``mesh.get_group()``), or
            None for every rank.
    """
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(*, group=None) -> int:
    """How many ranks ``group`` has (the whole world by default); 1 before any process group exists.

    Args:
        group: a process group, or None for every rank.
    """
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def ring_neighbours(*, group=None) -> tuple[int, int]:
    """(the global rank after this one in ``group``'s order, the one before it): a ring's neighbours.

    Point-to-point messages name their peer by its global rank, whatever group they go through.

    Args:
        group: a process group, or None for every rank.
    """
    import torch.distributed as dist

    size, me = world_size(group=group), rank(group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    return ranks[(me + 1) % size], ranks[(me - 1) % size]


def is_main(*, group=None) -> bool:
    """True on the first rank of ``group`` (rank 0 of the world by default): the one that prints and saves.

    Args:
        group: a process group, or None for every rank.
    """
    return rank(group=group) == 0


def from_rank0(value):
    """Rank 0's ``value``, on every rank of the world (every rank must call this; any picklable value).

    For decisions one rank takes for all (a run's id, an error met while writing a file), so
    that every rank then does the same thing.

    Args:
        value: what this rank has; only rank 0's is kept.
    """
    import torch.distributed as dist

    if world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only: N identical lines teach nothing.

    Args:
        args: what ``print`` takes.
        kwargs: ``print``'s keyword arguments (``flush`` is True unless given).
    """
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def barrier(*, group=None) -> None:
    """Wait until every rank of ``group`` (default: all) arrives here; a no-op in a world of one.

    Args:
        group: a process group, or None for every rank.
    """
    import torch.distributed as dist

    if world_size(group=group) > 1:
        dist.barrier(group)


def flush_and_exit(code: int) -> None:
    """End the process at once with ``code``, after flushing output (used by forked children)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
