"""How a process learns who it is: rank, world size, device, backend.

A distributed job is N copies of one program. Before they can exchange a single tensor, each
copy must learn four things: its *rank* (0 .. N-1), the *world size* N, the device it owns,
and where rank 0 listens so that all of them can meet (the *rendezvous*). Launchers say it in
different words:

==================  ==========================================================================
launcher            what the process finds in its environment
==================  ==========================================================================
``torchrun``        RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
``srun`` (Slurm)    SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID
``course_lib.launch``  the torchrun variables, set by the launcher for each forked child
nothing             a plain ``python train.py``: rank 0 of a world of 1
==================  ==========================================================================

``resolve_environment()`` turns any of these into one ``DistEnvironment`` (a pure function, so
it is easy to test); ``init()`` then picks the device and backend (a GPU means ``cuda`` +
``nccl``, otherwise ``cpu`` + ``gloo``) and joins the process group.

Which GPU is mine? Clusters hand GPUs to processes in three common ways, and one rule,
``gpu_index = local_rank % visible_gpus`` (``gpu_for_process``), serves all of them:

===============================================  ==============  ===============================
layout                                           GPUs a process  its GPU
                                                 sees
===============================================  ==============  ===============================
``srun --gpus-per-task=1`` (CSCS's advice)       1, its own      index 0 = ``local_rank % 1``
``srun --gpus-per-node=4``, 4 tasks a node       all 4           index ``local_rank``
one ``torchrun`` a node, 4 workers               all 4           index ``local_rank``
===============================================  ==============  ===============================

Slurm's ``--gpus-per-task`` hides the other GPUs of the node (CUDA_VISIBLE_DEVICES holds one),
so a process with LOCAL_RANK=3 sees a single GPU, numbered 0: "device = local rank" would ask
for a GPU that does not exist. Taking the rank modulo the visible count never does; a layout
that gives two processes of one node the same GPU (more processes than GPUs) is refused before
any GPU work by the job scripts' check (``course_lib.tools.jobcheck gpus``). Under ``torchrun`` inside a
Slurm job both sets of variables are present and torchrun's win: every torchrun child inherits
``SLURM_PROCID=0`` from its parent, so trusting Slurm there would give every child rank 0.

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
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UserError

DEFAULT_TIMEOUT_S = 300
"""How long a collective waits for a missing rank before failing (instead of hanging forever)."""

MAX_TIMEOUT_S = 24 * 3600
"""A rank that waits longer than a day for another is not waiting for anything that will come."""

SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 40000
"""MASTER_PORT for srun jobs is derived from the job id, so two jobs sharing a node do not collide."""


@dataclass(frozen=True)
class DistEnvironment:
    """Who this process is, as read from the launcher's environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" (or course_lib.launch), "slurm", or "single"


@dataclass(frozen=True)
class Context:
    """The process after ``init()``: its place in the world and the device it computes on."""

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


_context: Context | None = None


def _int_variable(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``nid[001234-001237,001240]`` gives ``nid001234``.

    Slurm compresses node lists; rank 0 runs on the first node, so that is where everyone meets.
    """
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if not match or not match.group(0):
        raise UserError(
            f"cannot read the Slurm node list {nodelist!r}: set MASTER_ADDR to the first node's name"
        )
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def resolve_environment(*, environ: Mapping[str, str] | None = None) -> DistEnvironment:
    """Read rank, world size and rendezvous address from torchrun, srun, or nothing at all.

    Args:
        environ: the variables to read (None: this process's ``os.environ``); pass a dict to see
            what a launcher's variables mean without starting anything.
    """
    environ = os.environ if environ is None else environ

    if "RANK" in environ:
        if "WORLD_SIZE" not in environ:
            raise UserError(
                "RANK is set but WORLD_SIZE is not: launch with torchrun (which sets both), or set "
                "WORLD_SIZE to the number of processes"
            )
        rank, world_size = _int_variable(environ, "RANK"), _int_variable(environ, "WORLD_SIZE")
        local_rank = _int_variable(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
        local_world = (
            _int_variable(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
        )
        if not 0 <= rank < world_size:
            raise UserError(f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")
        if world_size > 1 and ("MASTER_ADDR" not in environ or "MASTER_PORT" not in environ):
            raise UserError(
                "MASTER_ADDR and MASTER_PORT must be set when WORLD_SIZE > 1: launch with torchrun, or "
                "export the address and a free port of rank 0's host"
            )
        return DistEnvironment(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world,
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ.get("MASTER_PORT", "0")),
            launcher="torchrun",
        )

    # srun starts one task per GPU. Inside a batch script *without* srun, SLURM_PROCID is 0 but
    # the step has a single task: then this is an ordinary single process.
    step_tasks = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    if "SLURM_PROCID" in environ and step_tasks is not None and int(step_tasks) > 1:
        world_size = int(step_tasks)
        rank = _int_variable(environ, "SLURM_PROCID")
        local_rank = _int_variable(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
        nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")))
        if "MASTER_ADDR" in environ:
            master_addr = environ["MASTER_ADDR"]
        elif "SLURM_STEP_NODELIST" in environ or "SLURM_JOB_NODELIST" in environ:
            master_addr = first_slurm_host(
                environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
            )
        else:
            raise UserError(
                "under srun, neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: export MASTER_ADDR"
            )
        if "MASTER_PORT" in environ:
            master_port = _int_variable(environ, "MASTER_PORT")
        else:
            job_id = int(environ.get("SLURM_JOB_ID", "0"))
            master_port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
        return DistEnvironment(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=max(1, world_size // max(1, nodes)),
            master_addr=master_addr,
            master_port=master_port,
            launcher="slurm",
        )

    return DistEnvironment(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=0,
        launcher="single",
    )


def node_name() -> str:
    """The node this process runs on: Slurm's name for it (SLURMD_NODENAME), else the host's.

    Slurm's name tells apart the simulated nodes of a test cluster, which share one host.
    """
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def usable_cpus() -> int:
    """CPU cores this process may run on (respects Slurm's and taskset's CPU masks)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def cpu_threads_per_rank(local_world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """Threads for one rank's CPU work: OMP_NUM_THREADS if set (torchrun sets it to 1), else a fair share."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    return max(1, usable_cpus() // local_world_size)


def gpu_for_process(*, local_rank: int, visible_gpus: int) -> int:
    """The index, among the GPUs this process sees, of the one it computes on: ``local_rank % visible_gpus``.

    Args:
        local_rank: this process's rank among the processes of its node (LOCAL_RANK, SLURM_LOCALID).
        visible_gpus: how many GPUs this process sees (``torch.cuda.device_count()``, which honours
            CUDA_VISIBLE_DEVICES: 1 under ``--gpus-per-task=1``, 4 under ``--gpus-per-node=4``).
    """
    if visible_gpus < 1:
        raise UserError(
            "this process sees no GPU: request GPUs from Slurm (--gpus-per-task=1), or use --backend gloo"
        )
    if local_rank < 0:
        raise UserError(f"LOCAL_RANK={local_rank} is negative: it counts a node's processes from 0")
    return local_rank % visible_gpus


def choose_backend(requested: str, cuda_available: bool) -> tuple[str, str]:
    """Return (backend, device type): NCCL on GPUs, gloo on CPUs.

    Args:
        requested: ``"auto"`` (NCCL where CUDA is, else gloo), ``"nccl"`` or ``"gloo"``.
        cuda_available: whether this process sees a GPU (``torch.cuda.is_available()``).
    """
    if requested == "auto":
        return ("nccl", "cuda") if cuda_available else ("gloo", "cpu")
    if requested == "nccl":
        if not cuda_available:
            raise UserError(
                "backend nccl needs a GPU but torch sees none: use --backend gloo (or auto) on a CPU "
                "machine, or request GPUs from Slurm (--gpus-per-task=1)"
            )
        return "nccl", "cuda"
    if requested == "gloo":
        return "gloo", "cpu"
    raise UserError(f"unknown backend {requested!r}: choose auto, nccl or gloo")


def _rendezvous_store(env: DistEnvironment, timeout: datetime.timedelta):
    """The key-value store where the ranks meet: each writes its address, reads everyone else's.

    Rank 0 hosts it at MASTER_ADDR:MASTER_PORT, except under torchrun, whose agent already hosts
    one there. A torchrun restart (``--max-restarts``) meets in that *same* agent store, where the
    dead attempt's addresses are still written: a prefix per attempt (TORCHELASTIC_RESTART_COUNT)
    keeps the new ranks from connecting to processes that no longer exist.
    """
    import torch.distributed as dist

    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0 and not agent_hosts_it,
        timeout=timeout,
    )
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init(
    *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, num_threads: int | None = None
) -> Context:
    """Join the process group described by the environment and return this process's ``Context``.

    Safe to call twice: the second call returns the context of the first.

    Args:
        backend: ``"auto"`` (NCCL where CUDA is, else gloo), ``"nccl"`` or ``"gloo"``.
        timeout_s: how long a collective may wait for the other ranks before it fails.
        num_threads: CPU threads for this process's torch operations (None: OMP_NUM_THREADS if set,
            otherwise this node's cores shared evenly between its ranks, so two ranks on two cores
            do not fight over them).
    """
    global _context
    if _context is not None:
        return _context

    from .checks import check_int, check_number

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
    _context = Context(
        rank=env.rank,
        local_rank=env.local_rank,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        device=device,
        backend=backend,
        launcher=env.launcher,
    )
    return _context


def context() -> Context:
    """The context of the ``init()`` call of this process."""
    if _context is None:
        raise RuntimeError("course_lib.runtime.init() has not been called in this process")
    return _context


def shutdown() -> None:
    """Leave the process group cleanly, so that the interpreter never aborts at exit.

    Call it after the models, optimizers and DDP/FSDP wrappers are out of scope (return from
    the function that owned them first): ``gc.collect()`` then frees them while the process
    group still exists, which is the order gloo needs.
    """
    global _context
    gc.collect()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _context = None


def is_peer_failure(error: BaseException) -> bool:
    """True for the error a rank sees when *another* rank died or stopped answering."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text
        for marker in (
            "Connection reset by peer",
            "Connection closed by peer",
            "Broken pipe",
            "Timed out",
            "timed out",
        )
    )


# -- who am I: one way to ask, everywhere -------------------------------------------------------


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


def is_main(*, group=None) -> bool:
    """True on the first rank of ``group`` (rank 0 of the world by default): the one that prints and saves.

    Args:
        group: a process group, or None for every rank.
    """
    return rank(group=group) == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only: N identical lines teach nothing."""
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
