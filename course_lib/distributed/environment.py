"""Who this process is, read from its launcher's variables: rank, world size, GPU, backend.

A distributed job is N copies of one program. Before they can exchange a single tensor, each
copy must learn four things: its *rank* (0 .. N-1), the *world size* N, the device it owns,
and where rank 0 listens so that all of them can meet (the *rendezvous*). Launchers say it in
different words:

==================  ==========================================================================
launcher            what the process finds in its environment
==================  ==========================================================================
``torchrun``        RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
``srun`` (Slurm)    SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID
``course_lib.distributed.launch``  the torchrun variables, set by the launcher for each forked child
nothing             a plain ``python train.py``: rank 0 of a world of 1
==================  ==========================================================================

``resolve_environment()`` turns any of these into one ``DistEnvironment`` (a pure function, so
it is easy to test); ``choose_backend`` picks the device and backend (a GPU means ``cuda`` +
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

Nothing here imports torch, nor talks to another process: the job scripts' checks
(``course_lib.tools.jobcheck``) use it before the training environment is known to work, and
``runtime.init`` joins the process group with what it finds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UserError

SLURM_PORT_BASE, SLURM_PORT_SPAN = 12000, 8000
"""MASTER_PORT for srun jobs is derived from the job id, so two jobs sharing a node do not collide.

The ports stay below Linux's ephemeral range (32768-60999, ``ip_local_port_range``), from which the
kernel picks the source port of every outgoing connection on the node: a port in that range can be
held, at any moment, by some program's connection. The job's preflight uses the next span
(``slurm/common.sh``: 20000-27999), and ``torchrun`` jobs meet on 29500-30500.
"""


@dataclass(frozen=True)
class DistEnvironment:
    """Who this process is, as read from the launcher's environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" (or course_lib.distributed.launch), "slurm", or "single"


LAUNCHER_VARIABLES = {
    "RANK": "torchrun and course_lib.distributed.launch set it; unset it to run one process",
    "WORLD_SIZE": "the number of processes; torchrun sets it (--nproc-per-node x --nnodes)",
    "LOCAL_RANK": "this process's number among its node's; torchrun sets it",
    "LOCAL_WORLD_SIZE": "the processes of this node; torchrun sets it",
    "MASTER_PORT": "a free TCP port on rank 0's host, 1024 to 65535 (or let torchrun pick: --standalone)",
    "SLURM_NTASKS": "srun sets it to the number of tasks (--ntasks); do not set it by hand",
    "SLURM_STEP_NUM_TASKS": "srun sets it to the tasks of this step; do not set it by hand",
    "SLURM_PROCID": "srun sets it to this task's number; do not set it by hand",
    "SLURM_LOCALID": "srun sets it to this task's number on its node; do not set it by hand",
    "SLURM_NNODES": "Slurm sets it to the job's node count (--nodes)",
    "SLURM_STEP_NUM_NODES": "srun sets it to the nodes of this step",
    "SLURM_JOB_ID": "Slurm sets it to the job's number",
    "SLURM_GPUS_ON_NODE": "Slurm sets it to the job's GPUs on a node (--gpus-per-node)",
    "SLURM_GPUS_PER_TASK": "Slurm sets it from --gpus-per-task, e.g. 1 or gpu:1",
}
"""What each launcher variable holds and who sets it: the second half of the message when one is wrong."""


MAX_PORT = 65535


def int_variable(
    environ: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int | None = None, default=None
) -> int:
    """An integer launcher variable in ``minimum .. maximum``, or one line that names it and the fix.

    Args:
        environ: the variables (``os.environ``).
        name: the variable.
        minimum: the smallest value that makes sense.
        maximum: the largest (None: no bound).
        default: the value when the variable is not set (None: it must be set).
    """
    if name not in environ and default is not None:
        return default
    value = environ[name].strip()
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        allowed = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
        raise UserError(
            f"environment variable {name}={environ[name]!r} is not a whole number {allowed}: "
            f"{LAUNCHER_VARIABLES.get(name, 'fix or unset it')}"
        )
    return number


def _address_variable(environ: Mapping[str, str], name: str) -> str:
    value = environ[name].strip()
    if not value or any(c.isspace() for c in value):
        raise UserError(
            f"environment variable {name}={environ[name]!r} is not a host name or address: set it to the "
            "name or IP address of rank 0's host (torchrun and Slurm jobs set it for you)"
        )
    return value


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


# #region who-am-i
def resolve_environment(*, environ: Mapping[str, str] | None = None) -> DistEnvironment:
    """Read rank, world size and rendezvous address from torchrun, srun, or nothing at all.

    Args:
        environ: the variables to read (None: this process's ``os.environ``); pass a dict to see
            what a launcher's variables mean without starting anything.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ:
        return _from_torchrun(environ)
    slurm = _from_srun(environ)
    if slurm is not None:
        return slurm
    return DistEnvironment(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=0,
        launcher="single",
    )


def _from_torchrun(environ: Mapping[str, str]) -> DistEnvironment:
    """torchrun's variables (or the launcher's, which are the same)."""
    if "WORLD_SIZE" not in environ:
        raise UserError(
            "RANK is set but WORLD_SIZE is not: launch with torchrun (which sets both), or set "
            "WORLD_SIZE to the number of processes"
        )
    world_size = int_variable(environ, "WORLD_SIZE", minimum=1)
    rank = int_variable(environ, "RANK", maximum=world_size - 1)
    local_world = int_variable(environ, "LOCAL_WORLD_SIZE", minimum=1, default=world_size)
    local_rank = int_variable(environ, "LOCAL_RANK", maximum=local_world - 1, default=0)
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
        master_addr=_address_variable(environ, "MASTER_ADDR") if "MASTER_ADDR" in environ else "127.0.0.1",
        master_port=int_variable(environ, "MASTER_PORT", minimum=1, maximum=MAX_PORT, default=0),
        launcher="torchrun",
    )


# #endregion who-am-i


def _from_srun(environ: Mapping[str, str]) -> DistEnvironment | None:
    """Slurm's variables under srun, or None outside a step of several tasks."""
    # srun starts one task per GPU. Inside a batch script *without* srun, SLURM_PROCID is 0 but
    # the step has a single task: then this is an ordinary single process.
    tasks_variable = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    if "SLURM_PROCID" in environ and tasks_variable in environ:
        world_size = int_variable(environ, tasks_variable, minimum=1)
    else:
        world_size = 1
    if world_size == 1:
        return None
    rank = int_variable(environ, "SLURM_PROCID", maximum=world_size - 1)
    nodes_variable = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in environ else "SLURM_NNODES"
    nodes = int_variable(environ, nodes_variable, minimum=1, maximum=world_size, default=1)
    local_world = max(1, world_size // nodes)
    local_rank = int_variable(environ, "SLURM_LOCALID", default=0)
    if "MASTER_ADDR" in environ:
        master_addr = _address_variable(environ, "MASTER_ADDR")
    elif "SLURM_STEP_NODELIST" in environ or "SLURM_JOB_NODELIST" in environ:
        master_addr = first_slurm_host(
            environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", ""))
        )
    else:
        raise UserError("under srun, neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: export MASTER_ADDR")
    if "MASTER_PORT" in environ:
        master_port = int_variable(environ, "MASTER_PORT", minimum=1, maximum=MAX_PORT)
    else:
        job_id = int_variable(environ, "SLURM_JOB_ID", default=0)
        master_port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return DistEnvironment(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world,
        master_addr=master_addr,
        master_port=master_port,
        launcher="slurm",
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
