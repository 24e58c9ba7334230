"""Checks the Slurm job scripts run before they spend GPU time: ``python -m course_lib.tools.jobcheck``.

A job that will fail should fail in its first second, with one line that says what to change,
not after an hour in the queue and ten minutes of NCCL timeouts. ``slurm/common.sh`` runs:

``gpus``
    Does every process get a GPU of its own? From Slurm's variables in the batch shell
    (SLURM_GPUS_ON_NODE, SLURM_TASKS_PER_NODE, SLURM_GPUS_PER_TASK) and the processes each task
    starts (1 under ``srun``, ``--nproc-per-node`` under ``torchrun``): more processes than GPUs
    they can see means two processes share a GPU (NCCL refuses that) or a rank finds none.
``plugin``
    NCCL reaches a Slingshot network (CSCS Alps) only through the aws-ofi-nccl plugin. A pip
    virtual environment does not have it; a CSCS uenv (``--uenv=... --view=default``) or the
    container engine's ``aws_ofi_nccl`` hook provides it. With ``NCCL_NET="AWS Libfabric"`` NCCL
    stops at start-up when the plugin is missing: better to say so before starting anything. In a
    container the hook sets NCCL_NET itself, so the profile names the network it expects in
    ``COURSE_NCCL_NETWORK`` instead (``expected_network``).
``preflight``
    Run by every rank of a multi-node job (under ``srun`` or ``torchrun``) before training: one
    tiny all-reduce, checked for the right sum, with NCCL's own log switched on. NCCL writes
    ``NCCL INFO Using network AWS Libfabric`` (or ``Using network Socket`` when it fell back to
    TCP, tens of times slower); if the profile asked for a network and NCCL used another, the
    job stops with one line. On CPUs (gloo) only the sum is checked.

Every check prints ``error: <what to change>`` and exits 2 when it fails, like the training
command's own checks.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from .. import checks
from ..distributed import environment, runtime
from ..distributed.runtime import MAX_TIMEOUT_S
from ..errors import EXIT_CRASH, EXIT_USER_ERROR, RendezvousFailed, UserError

PLUGIN_SOURCES = ("uenv", "container", "none")
"""Where the aws-ofi-nccl plugin comes from: a CSCS uenv view, the container engine's hook, or nowhere."""

PLUGIN_LIBRARY = re.compile(r"^libnccl-net.*\.so(\.\d+)*$")
"""The plugin's file: NCCL loads ``libnccl-net.so`` (or ``libnccl-net-<NCCL_NET_PLUGIN>.so``)."""

EDF_HOOK = re.compile(r'^\s*com\.hooks\.aws_ofi_nccl\.enabled\s*=\s*"true"', re.MULTILINE)
"""The line of an EDF file that asks the container engine to inject the plugin."""

USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
"""What NCCL prints (NCCL_DEBUG=INFO) once it has chosen its network transport."""


# -- GPUs per process -----------------------------------------------------------------------------


def tasks_on_first_node(tasks_per_node: str) -> int:
    """The first count of Slurm's SLURM_TASKS_PER_NODE: ``"4(x2)"`` -> 4, ``"3,2"`` -> 3."""
    match = re.match(r"\s*(\d+)", tasks_per_node)
    if not match:
        raise UserError(
            f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}: Slurm sets it (e.g. 4(x2)); do not set it "
            "by hand"
        )
    return int(match.group(1))


def gpu_layout_problem(
    *,
    tasks_per_node: int,
    processes_per_task: int,
    gpus_on_node: int,
    gpus_per_task: int | None,
    needs_gpus: bool,
) -> str | None:
    """What is wrong with how the job's processes map onto its GPUs, or None when each has its own.

    Args:
        tasks_per_node: Slurm tasks on a node (``--ntasks-per-node``).
        processes_per_task: training processes each task starts (1 under ``srun``; torchrun's
            ``--nproc-per-node``).
        gpus_on_node: GPUs Slurm gave the job on a node (SLURM_GPUS_ON_NODE; 0 when none).
        gpus_per_task: ``--gpus-per-task`` when given (each task then sees only its own GPUs).
        needs_gpus: whether the cluster profile trains on GPUs (a job without any is a mistake).
    """
    if gpus_on_node == 0:
        if needs_gpus:
            return (
                "this job has no GPUs: request one per process, e.g. sbatch --gpus-per-task=1 "
                "(or --gpus-per-node=4 with --ntasks-per-node=4)"
            )
        return None
    if gpus_per_task:  # each task sees only its own GPUs: its processes share those
        seen, sharing = gpus_per_task, processes_per_task
        where = f"each task sees its {gpus_per_task} GPU(s) (--gpus-per-task={gpus_per_task})"
    else:  # every task sees all the node's GPUs
        seen, sharing = gpus_on_node, tasks_per_node * processes_per_task
        where = f"the node has {gpus_on_node} GPU(s)"
    if sharing > seen:
        return (
            f"{sharing} processes would share {seen} GPU(s) ({where}): ranks would find no GPU of their "
            f"own; start one process per GPU (--ntasks-per-node={gpus_on_node} with --gpus-per-task=1, "
            f"or torchrun --nproc-per-node equal to the GPUs) or request more GPUs"
        )
    return None


def gpu_layout_from_slurm(
    environ: Mapping[str, str], *, processes_per_task: int, needs_gpus: bool
) -> str | None:
    """``gpu_layout_problem`` for the job whose batch shell has these Slurm variables."""
    gpus_per_task = None
    if environ.get("SLURM_GPUS_PER_TASK", "").strip():  # "1", or "gpu:1" with a type
        count = {"SLURM_GPUS_PER_TASK": environ["SLURM_GPUS_PER_TASK"].split(":")[-1]}
        gpus_per_task = environment.int_variable(count, "SLURM_GPUS_PER_TASK") or None  # 0: none asked for
    on_node = {"SLURM_GPUS_ON_NODE": environ.get("SLURM_GPUS_ON_NODE", "").strip() or "0"}
    return gpu_layout_problem(
        tasks_per_node=tasks_on_first_node(environ.get("SLURM_TASKS_PER_NODE", "1")),
        processes_per_task=processes_per_task,
        gpus_on_node=environment.int_variable(on_node, "SLURM_GPUS_ON_NODE"),
        gpus_per_task=gpus_per_task,
        needs_gpus=needs_gpus,
    )


# -- the NCCL network plugin ---------------------------------------------------------------------


def find_plugin(library_path: str) -> Path | None:
    """The first aws-ofi-nccl library (``libnccl-net*.so``) in a LD_LIBRARY_PATH, or None."""
    for folder in filter(None, library_path.split(":")):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if PLUGIN_LIBRARY.match(name):
                return Path(folder) / name
    return None


def expected_network() -> str:
    """The network NCCL must use: NCCL_NET, or the profile's COURSE_NCCL_NETWORK when a container
    hook sets NCCL_NET itself (inside the container) and the profile leaves it alone ("": any)."""
    return os.environ.get("NCCL_NET") or os.environ.get("COURSE_NCCL_NETWORK", "")


def plugin_problem(*, source: str, nccl_net: str, library_path: str, edf: str) -> tuple[str | None, str]:
    """(what is wrong, or None; where the plugin comes from) for a profile that needs the plugin.

    Args:
        source: COURSE_NCCL_PLUGIN_FROM: ``uenv``, ``container`` or ``none``.
        nccl_net: NCCL_NET as the profile set it (empty: NCCL picks, and may fall back to TCP).
        library_path: LD_LIBRARY_PATH of the batch shell (a uenv view puts the plugin on it).
        edf: COURSE_EDF, the container engine's environment file (for ``container``).
    """
    if source not in PLUGIN_SOURCES:
        return f"COURSE_NCCL_PLUGIN_FROM={source!r}: choose one of {', '.join(PLUGIN_SOURCES)}", ""
    if source == "none" or not nccl_net:
        return (
            None,
            "not needed (NCCL_NET is not set)" if not nccl_net else "none (COURSE_NCCL_PLUGIN_FROM=none)",
        )
    if source == "uenv":
        found = find_plugin(library_path)
        if found is None:
            return (
                f"NCCL_NET={nccl_net!r} needs the aws-ofi-nccl plugin (libnccl-net.so), and no folder on "
                "LD_LIBRARY_PATH has it: submit with a uenv that provides it "
                "(sbatch --uenv=prgenv-gnu/<version> --view=default), or use the container engine "
                "(COURSE_NCCL_PLUGIN_FROM=container "
                "COURSE_EDF=<file.toml>)"
            ), ""
        return None, f"{found} (uenv)"
    if not edf:
        return (
            "COURSE_NCCL_PLUGIN_FROM=container needs COURSE_EDF, the container's environment file "
            "(start from slurm/clusters/alps-container.toml)"
        ), ""
    path = Path(edf)
    if not path.is_file():
        return f"COURSE_EDF={edf} does not exist: give the path of an EDF .toml file", ""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        return (
            f"COURSE_EDF={edf} is not UTF-8 text (byte {error.object[error.start]:#04x} at position "
            f"{error.start}): an EDF file is TOML, saved as UTF-8"
        ), ""
    if not EDF_HOOK.search(text):
        return (
            f'{edf} does not enable the plugin hook: add com.hooks.aws_ofi_nccl.enabled = "true" under '
            "[annotations] (see slurm/clusters/alps-container.toml)"
        ), ""
    return None, f"the container engine's aws_ofi_nccl hook ({edf})"


# -- the preflight all-reduce ---------------------------------------------------------------------


def nccl_network(log_text: str) -> str | None:
    """The network NCCL chose, from its NCCL_DEBUG=INFO log (None if the log does not say)."""
    found = USING_NETWORK.findall(log_text)
    return found[-1] if found else None


def network_problem(*, expected: str, used: dict[int, str | None]) -> str | None:
    """One line if some rank's NCCL did not use the ``expected`` network, else None.

    Args:
        expected: the network the profile asked for (NCCL_NET, e.g. ``"AWS Libfabric"``); empty: any.
        used: rank -> the network its NCCL log names (None: the log did not say).
    """
    if not expected:
        return None
    wrong = {rank: network for rank, network in sorted(used.items()) if network != expected}
    if not wrong:
        return None
    rank, network = next(iter(wrong.items()))
    return (
        f"NCCL on {len(wrong)} of {len(used)} ranks (rank {rank} first) used network "
        f"{network or 'unknown'!r}, not {expected!r}: the aws-ofi-nccl plugin was not loaded; "
        "check COURSE_NCCL_PLUGIN_FROM and the "
        "uenv view or container hook that provides it"
    )


def preflight(*, timeout_s: float) -> int:
    """Every rank: one all-reduce, its sum checked and, on NCCL, its network. Returns the exit status."""
    import torch
    import torch.distributed as dist

    log_dir = Path(tempfile.mkdtemp(prefix="course-preflight-"))
    # NCCL reads these when its first communicator is made: set them before init, keep the user's.
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    os.environ.setdefault("NCCL_DEBUG_FILE", str(log_dir / "nccl.%h.%p.log"))
    started = time.perf_counter()
    try:
        context = runtime.init(timeout_s=timeout_s)
        ones = torch.ones(1024, device=context.device)
        dist.all_reduce(ones)
        correct = bool(torch.all(ones == context.world_size))
        if context.device.type == "cuda":
            torch.cuda.synchronize()
    except UserError:
        raise
    except Exception as error:  # NCCL's start-up errors ("network AWS Libfabric not found") and timeouts
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
        print(
            f"error: the preflight all-reduce failed on rank {rank} ({first_line}): check the cluster "
            "profile's network settings (NCCL_NET and the plugin that provides it); nothing was trained",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    seconds = time.perf_counter() - started
    network = None
    if context.backend == "nccl":
        network = nccl_network("".join(p.read_text(errors="replace") for p in log_dir.glob("nccl.*.log")))
    results: list = [None] * context.world_size
    dist.all_gather_object(results, (correct, network, environment.node_name()))
    runtime.shutdown()
    if context.rank != 0:
        return 0 if all(ok for ok, _, _ in results) else EXIT_USER_ERROR
    nodes = len({node for _, _, node in results})
    wrong_sums = [rank for rank, (ok, _, _) in enumerate(results) if not ok]
    if wrong_sums:
        print(
            f"error: the preflight all-reduce gave a wrong sum on ranks {wrong_sums}: "
            "the network corrupts data",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    if context.backend != "nccl":
        print(
            f"preflight: {context.world_size} ranks on {nodes} node(s) all-reduced correctly "
            f"in {seconds:.1f} s over {context.backend} (the NCCL network check applies to GPUs only)"
        )
        return 0
    problem = network_problem(
        expected=expected_network(), used={rank: net for rank, (_, net, _) in enumerate(results)}
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(
        f"preflight: {context.world_size} ranks on {nodes} node(s) all-reduced correctly in {seconds:.1f} s; "
        f"NCCL uses network {results[0][1]!r}"
    )
    return 0


# -- the command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(
        prog="python -m course_lib.tools.jobcheck", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="check", required=True)
    gpus = sub.add_parser("gpus", help="does every process get a GPU of its own? (Slurm's variables)")
    gpus.add_argument(
        "--processes-per-task",
        type=checks.int_at_least(1),
        default=1,
        help="training processes each Slurm task starts (torchrun's --nproc-per-node)",
    )
    gpus.add_argument(
        "--needs-gpus", action="store_true", help="a job without GPUs is a mistake on this cluster"
    )
    sub.add_parser(
        "plugin", help="is NCCL's network plugin where the profile says? (COURSE_NCCL_PLUGIN_FROM)"
    )
    flight = sub.add_parser(
        "preflight", help="every rank: one all-reduce, its sum and NCCL's network checked"
    )
    flight.add_argument(
        "--timeout-s",
        type=checks.argument_type(checks.check_number, float, above=0, maximum=MAX_TIMEOUT_S),
        default=120,
        help="how long a rank may wait",
    )
    args = parser.parse_args(argv)
    try:
        if args.check == "gpus":
            problem = gpu_layout_from_slurm(
                os.environ, processes_per_task=args.processes_per_task, needs_gpus=args.needs_gpus
            )
            if problem is None:
                print(f"GPU layout OK: {os.environ.get('SLURM_GPUS_ON_NODE', '0')} GPU(s) a node")
        elif args.check == "plugin":
            problem, source = plugin_problem(
                source=os.environ.get("COURSE_NCCL_PLUGIN_FROM", "none"),
                nccl_net=expected_network(),
                library_path=os.environ.get("LD_LIBRARY_PATH", ""),
                edf=os.environ.get("COURSE_EDF", ""),
            )
            if problem is None:
                print(f"NCCL network plugin: {source}")
        else:
            return preflight(timeout_s=args.timeout_s)
    except UserError as error:
        problem = str(error)
    except RendezvousFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CRASH
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    checks.exit_with(main)
