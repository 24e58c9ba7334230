"""Shared helpers: run the real command line on N processes, and small training configs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The instruments the tests rely on, installed into every process the launcher forks: each
# collective checked across its ranks (one line when they differ), faults on purpose, the recorder.
from course_lib.distributed import collective_check  # noqa: F401
from course_lib.observe import faults, flight_recorder  # noqa: F401

# No matplotlib backend is chosen for the processes the tests start: the notebook kernels must draw
# inline, as in JupyterLab (the library only makes Figures, which need none).
os.environ.pop("MPLBACKEND", None)

REPO = Path(__file__).resolve().parent.parent
# Every process the tests start (notebook kernels included) imports this checkout's course_lib,
# even when the virtual environment, shared between clones, was last installed from another one.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

# The students' edition (tools/student_edition.py) has no solutions and no keys: the tests that
# grade them are not collected there; test_student_edition.py grades the untouched exercises instead.
collect_ignore = (
    []
    if (REPO / "labs" / "lab1_ddp" / "solution.py").exists()
    else ["tools/test_labs.py", "tools/test_lab_grader_attacks.py"]
)


@dataclass
class RankOutcome:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh process: no inherited rank, Slurm or thread settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLURM_", "TORCHELASTIC_"))
        and key
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OMP_NUM_THREADS",
        )
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def start_ranks(
    args: list[str], nprocs: int, env: dict[str, str] | None = None, module: str = "course_lib.train"
) -> list[subprocess.Popen]:
    """Start ``python -m module args`` as ranks 0..nprocs-1 with the variables torchrun would set.

    As torchrun's agent does, this process listens at MASTER_PORT with the rendezvous store before
    any rank starts (held by the processes returned): a port only chosen here, for rank 0 to bind
    seconds later, could be taken by another test's process in between."""
    from course_lib.distributed import runtime
    from course_lib.distributed.launch import hosted_store, rendezvous_socket

    store, port = None, 0
    if nprocs > 1:
        listening = rendezvous_socket()
        port = listening.getsockname()[1]
        store = hosted_store(listening)  # served now: subprocesses fork and exec at once, no lock held
    processes = []
    for rank in range(nprocs):
        rank_env = clean_env(**(env or {}))
        if nprocs > 1:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nprocs),
                LOCAL_WORLD_SIZE=str(nprocs),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                **{runtime.STORE_HOSTED_VARIABLE: "1"},
            )
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=rank_env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        processes[-1].rendezvous_store = store  # served until finish(): see there
    return processes


def finish(processes: list[subprocess.Popen], timeout: float = 120) -> list[RankOutcome]:
    outcomes = []
    for rank, process in enumerate(processes):
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout} s") from None
        outcomes.append(RankOutcome(rank, process.returncode, stdout, stderr))
    for process in processes:
        # the store's thread ends with it: a later launch() in this process forks without it
        process.rendezvous_store = None
    return outcomes


def run_ranks(
    args: list[str],
    nprocs: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    module: str = "course_lib.train",
) -> list[RankOutcome]:
    return finish(start_ranks(args, nprocs, env, module), timeout)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from /proc), in the order it started them."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, each followed by its own (from /proc)."""
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def where_they_wait(pid: int) -> str:
    """What ``pid`` and every process under it are doing: each one's command line, then its Python
    threads' stacks (py-spy) or, without py-spy, the kernel function each thread sleeps in. A test
    whose processes hang appends this to its failure, so that the hang names its own cause."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    lines = []
    for process in [pid, *descendants(pid)]:
        try:
            command = Path(f"/proc/{process}/cmdline").read_text().replace("\0", " ").strip()
        except OSError:
            continue
        lines.append(f"--- process {process}: {command[:200]}")
        if spy:
            dump = subprocess.run(
                [spy, "dump", "--pid", str(process)], capture_output=True, text=True, timeout=60
            )
            lines.append((dump.stdout or dump.stderr).strip())
        else:
            for task in sorted(Path(f"/proc/{process}/task").glob("*")):
                try:
                    lines.append(f"thread {task.name}: {(task / 'wchan').read_text() or 'running'}")
                except OSError:
                    pass
    return "\n".join(lines)


def communicate_or_explain(process: subprocess.Popen, timeout: float) -> str:
    """``process.communicate(timeout)``'s output; on a timeout, fail with where every process of the
    tree waits (``where_they_wait``), then kill them all."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        explained = where_they_wait(process.pid)
        for child in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        output = process.communicate()[0]
        raise AssertionError(
            f"still running after {timeout:g} s:\n{output[-4000:]}\nwhere each process waits:\n{explained}"
        ) from None


def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m course_lib.tools.TOOL ARGS`` in a fresh process, as a user would type it."""
    return subprocess.run(
        [sys.executable, "-m", f"course_lib.tools.{tool}", *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def call_main(main, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """A command's ``main(argv)`` run in this process, its result as a subprocess's: the exit status
    (argparse's refusals exit: caught), stdout and stderr. A second of interpreter start-up less
    where the test is about the command's logic, not its process."""
    from course_lib.errors import EXIT_USER_ERROR, UserError

    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    except UserError as error:  # as checks.exit_with ends a command
        print(f"error: {error}", file=sys.stderr)
        status = EXIT_USER_ERROR
    shown = capsys.readouterr()
    return subprocess.CompletedProcess(argv, status, shown.out, shown.err)


def run_bench(*args: str) -> dict:
    """``python -m course_lib.tools.bench ARGS`` in a fresh process; the JSON it printed."""
    import json

    shown = run_tool("bench", *args)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


@pytest.fixture
def quick_args() -> list[str]:
    """A few steps of the digits CNN: enough to exercise every code path in about a second."""
    return [
        "--sharding",
        "ddp",
        "--epochs",
        "1",
        "--max-steps",
        "3",
        "--global-batch-size",
        "60",
        "--no-progress",
    ]


def checkpoint_weights(directory: Path) -> dict:
    """The model tensors of a DCP checkpoint folder (step-XXXXXXXX), read without a process group."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "weights.pt"
        dcp_to_torch_save(str(directory), str(target))
        return torch.load(target, weights_only=False)["model"]


def latest_weights(checkpoint_dir: Path) -> tuple[str, dict]:
    from course_lib.train.checkpoint import latest_checkpoint

    latest = latest_checkpoint(checkpoint_dir)
    assert latest is not None, f"no checkpoint in {checkpoint_dir}"
    return latest.name, checkpoint_weights(latest)


LONGEST_FIRST = (
    "test_slurm.py",  # worker-seconds in a full run on 2 cores with AVX-512: 223
    "test_browser_part2.py",  # 160 (notebooks 05-07)
    "test_labs.py",  # 144
    "test_slides.py",  # 142
    "test_browser_part4.py",  # 117 (notebooks 12-15)
    "test_browser.py",  # 115 (notebooks 00-04)
    "test_browser_part3.py",  # 109 (notebooks 08-11)
    "test_cli.py",  # 100
    "test_pipeline.py",  # 86
    "test_lab_grader_attacks.py",  # 75
    "test_preemption.py",  # 60
    "test_flags.py",  # 56
    "test_training_faults.py",  # 42
)
"""The files that take longest, started first (the others follow in collection order, each under 40 s):
``make test``'s two workers take a file each (``--dist loadfile``) in this order
(``--no-loadscope-reorder``: xdist would otherwise start the files with the most tests first), so
that neither is left with a long file when the other has finished."""


BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
"""A process that keeps one core busy: what another job on a shared machine does to the tests."""


def pytest_addoption(parser):
    parser.addoption(
        "--busy-cores",
        type=int,
        default=0,
        metavar="N",
        help="keep cores 0..N-1 busy with a Python loop pinned to each, for the whole run: which timing "
        "assertions survive a loaded machine (make test-under-load)",
    )


def pytest_configure(config):
    """With --busy-cores N, the controller (not each xdist worker) starts the busy loops."""
    cores = config.getoption("--busy-cores")
    if cores and not hasattr(config, "workerinput"):
        available = sorted(os.sched_getaffinity(0))
        config.busy_loops = [
            subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)]) for core in available[:cores]
        ]


def pytest_unconfigure(config):
    for loop in getattr(config, "busy_loops", []):
        loop.kill()
        loop.wait()


def pytest_report_header(config):
    cores = config.getoption("--busy-cores")
    return f"busy loops: {cores} core(s) kept busy beside the tests" if cores else None


def pytest_collection_modifyitems(config, items):
    """Cells of the notebooks (collected by nbval) carry the ``notebooks`` marker, so -m can select them;
    the longest files come first."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebooks)
    # stable: the order inside a file is kept
    items.sort(
        key=lambda item: (
            LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST)
        )
    )


def tiny_transformer(*, seq: int, d_model: int, heads: int, layers: int = 2, seed: int = 0):
    """A TinyTransformer (weights drawn from ``seed``) over the zen windows of ``seq`` characters:
    (model, inputs, targets)."""
    import torch

    from course_lib import data, models

    torch.manual_seed(seed)
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    model = models.TinyTransformer(
        len(vocabulary), d_model=d_model, n_heads=heads, n_layers=layers, max_seq_len=seq
    )
    return model, inputs, targets


def unexplained_beyond_load_share(anatomy: dict) -> float:
    """Of a step (an anatomy's summary, as a benchmark prints it), the unexplained share that the time
    its ranks waited for a core (another process holding it: the machine's load) does not account for."""
    return max(0.0, anatomy["unexplained_ms"] - anatomy["waited_for_core_ms"]) / anatomy["step_ms"]


def assert_accounted(anatomies: dict, variants) -> None:
    """Each variant's anatomy (a benchmark's JSON) adds up and leaves at most 10 % of the step unexplained
    beyond the time the machine's load took (``anatomy.Budget.unexplained_beyond_load_ms``)."""
    shares = (
        "compute_share",
        "exposed_communication_share",
        "idle_share",
        "host_overhead_share",
        "unexplained_share",
    )
    for variant in variants:
        anatomy = anatomies[variant]
        assert abs(sum(anatomy[share] for share in shares) - 1) < 1e-9, variant
        assert unexplained_beyond_load_share(anatomy) <= 0.10, (variant, anatomy)


def user_errors(attempts: dict) -> dict[str, str]:
    """Call each attempt; the message of the ``UserError`` each raised, by name (none: left out)."""
    from course_lib.errors import UserError

    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except UserError as error:
            errors[name] = str(error)
    return errors
