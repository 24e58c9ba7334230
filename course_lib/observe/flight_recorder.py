"""Which rank hung, and where: a flight recorder of the collectives every rank made.

A hung job shows nothing: every rank waits in a collective, or one rank does something else, and
the log stops. The question is always the same: which rank did not arrive, and what was it
doing instead? A flight recorder answers it. Each rank keeps its last K collectives in a ring
buffer (cheap: one small record per call), each with its number on its process group (the
same on every rank: the n-th collective of a group must be the same call everywhere), the
operation, the tensor's shape and dtype, the group's ranks, whether it completed, its times, and
the line of Python that made it. When something goes wrong, every rank writes its buffer to a
folder, and ``tools.diagnose`` reads them side by side: the rank that never reached collective
#n, ranks that made different calls at the same #n, a rank that left no record.

When a rank writes (``dump``):

- a collective fails (gloo's or NCCL's timeout, a peer that went away): that rank writes, and
  asks all the others to (a request file in the folder, which a watcher thread on each rank
  polls, as PyTorch's recorder asks through its store), so that the rank stuck elsewhere (in a
  loop, asleep, in another collective) says where it is too: its main thread's stack;
- the process receives ``SIGUSR2`` (``kill -USR2 PID``, or ``scancel --signal=USR2`` on Slurm);
- the program calls ``dump(reason)``.

On GPUs, PyTorch keeps the same record inside ProcessGroupNCCL (every NCCL call, also those the
course's ``comm`` does not make, e.g. FSDP2's). ``start`` switches it on before the process group
exists: ``TORCH_FR_BUFFER_SIZE`` (entries kept), ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` (dump
when the watchdog sees a timeout) and ``TORCH_FR_DUMP_TEMP_FILE`` (the files' prefix, in the same
folder), and ``tools.diagnose`` reads those dumps too (PyTorch's own reader is
``python -m torch.distributed.flight_recorder.fr_trace``).

Cost: one record per collective and one walk up the caller's frames, a few microseconds beside a
collective's tens of microseconds at least; off unless ``start`` is called (``--flight-recorder
DIR`` on the trainer, or ``COURSE_FLIGHT_RECORDER=DIR``, which ``runtime.init`` reads). Importing
this module installs it into the collectives' and the processes' hooks
(``course_lib.distributed.hooks``): the collectives report to it without knowing it.

Reference: PyTorch's flight recorder (docs: "Flight Recorder for Debugging Stuck Jobs";
``torch.distributed.flight_recorder``), which this lesson follows in what it records.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from ..distributed import hooks
from ..distributed.runtime import RUN_VARIABLE
from ..errors import UserError

FOLDER_VARIABLE = "COURSE_FLIGHT_RECORDER"
"""The folder every rank writes its record to; set, ``runtime.init`` starts the recorder."""
FORMAT = "course-flight-recorder/1"
REQUEST = "DUMP_REQUESTED"
"""The file a rank writes to ask every other rank of the folder to dump: JSON of the reason, the
run it is for and when it was written. A rank answers only a request of its own run written
after it started: a request left in a reused folder by a failed run is not this run's."""
DEFAULT_CAPACITY = 256
PYTORCH_PREFIX = "nccl_trace_rank_"
"""PyTorch's dumps in the folder: this prefix and the rank (a pickle, read by ``tools.diagnose``)."""
POLL_S = 0.2
ANSWER_WAIT_S = 5.0
"""How long a rank whose collective failed waits for the others' records before it goes on to
fail: a launcher kills the rest once one exits, and a loaded machine can take seconds to run a
watcher that polls every ``POLL_S``. It ends as soon as every rank has written."""


@dataclass
class Entry:
    """One collective as this rank made it."""

    sequence: int  # its number on its group, from 0, the same on every rank (-1: point to point)
    op: str
    group_ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    issued_s: float  # time.time() when called
    completed_s: float | None = None  # None: not completed (still waiting, or failed)
    caller: str = ""  # "file.py:123 in function", the first frame outside the course's comm
    peer: int | None = None  # point to point: the other rank

    @property
    def state(self) -> str:
        return "completed" if self.completed_s is not None else "issued"


class Recorder:
    """The last ``capacity`` collectives of this process, oldest first.

    Args:
        folder: where ``dump`` writes ``rank-<r>.json`` (created if missing).
        capacity: how many entries are kept (older ones are forgotten).
        rank: this process's global rank.
        world_size: the ranks of the job.
        run_id: a name every rank of the run shares.
    """

    def __init__(self, folder: Path, *, capacity: int, rank: int, world_size: int, run_id: str):
        self.folder, self.rank, self.world_size, self.run_id = Path(folder), rank, world_size, run_id
        self.started_s = time.time()  # a later run's ranks start after this run's records are written
        self.entries: collections.deque[Entry] = collections.deque(maxlen=capacity)
        self.dumped: str | None = None  # the reason of the dump this rank wrote, if any
        self.replicas = None  # a function giving this rank's parameter fingerprints (watch_replicas)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None  # the thread that answers dump requests

    def issue(self, op: str, *, sequence: int, group_ranks, shape, dtype, peer: int | None = None) -> Entry:
        entry = Entry(
            sequence=sequence,
            op=op,
            group_ranks=tuple(group_ranks),
            shape=tuple(shape),
            dtype=str(dtype).removeprefix("torch."),
            issued_s=time.time(),
            caller=_caller(),
            peer=peer,
        )
        with self._lock:
            self.entries.append(entry)
        return entry

    def dump(self, reason: str) -> Path:
        """Write this rank's record (once: the first reason is kept), atomically; return its path."""
        path = self.folder / f"rank-{self.rank}.json"
        with self._lock:
            if self.dumped is not None:
                return path
            self.dumped = reason
            record = {
                "format": FORMAT,
                "run_id": self.run_id,
                "rank": self.rank,
                "world_size": self.world_size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "reason": reason,
                "started_s": self.started_s,
                "written_s": time.time(),
                "where": _main_thread_stack(),
                "entries": [asdict(e) | {"state": e.state} for e in self.entries],
            }
            if self.replicas is not None:  # a data-parallel replica: its weights' fingerprints too
                record["replicas"] = self.replicas()
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(partial, path)  # a reader sees the whole record or none
        return path

    def request_everyone(self, reason: str) -> None:
        """Ask every rank of this run that records into this folder to dump (each one's watcher sees
        the file)."""
        request_dumps(self.folder, f"rank {self.rank}: {reason}", run_id=self.run_id, since_s=self.started_s)

    def wait_for_answers(self, timeout_s: float = ANSWER_WAIT_S) -> None:
        """Wait until every rank's record is in the folder, or ``timeout_s`` (a dead rank never writes)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all((self.folder / f"rank-{rank}.json").exists() for rank in range(self.world_size)):
                return
            time.sleep(POLL_S / 4)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.dumped is None:
                asked = current_request(self.folder, run_id=self.run_id, since_s=self.started_s)
                if asked is not None:
                    self.dump(f"asked by {asked}")

    def stop(self) -> None:
        """Stop the watcher and let go of the model: a recorder that outlived the process group while
        holding the DDP model (through ``replicas``) made the interpreter abort at exit."""
        self._stop.set()
        self.replicas = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()


def current_request(folder: Path, *, run_id: str, since_s: float) -> str | None:
    """The reason of the dump request in ``folder`` if it is for ``run_id`` (or for whichever run
    is recording) and was written at or after ``since_s``; None otherwise (none, another run's, or
    a leftover of an earlier run under the same id, such as torchrun's default "none")."""
    try:
        request = json.loads((folder / REQUEST).read_text())
        reason, asked_run, written_s = request["reason"], request["run_id"], float(request["written_s"])
    except (OSError, ValueError, TypeError, KeyError):  # none, half a file, or not one of ours
        return None
    if asked_run not in (None, run_id) or written_s < since_s:
        return None
    return str(reason)


def request_dumps(
    folder: str | os.PathLike, reason: str, *, run_id: str | None = None, since_s: float | None = None
) -> None:
    """Ask every rank recording into ``folder`` to write its record. A request already there for
    the same run, written since ``since_s``, stays (its reason came first); anything else there
    is replaced.

    Args:
        folder: the recorders' folder.
        reason: who asks, and why.
        run_id: the run whose ranks are asked (None: whichever run is recording now).
        since_s: when the asking rank started (None: replace whatever is there: the launcher asks
            once, after its ranks started).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if since_s is not None and current_request(folder, run_id=run_id, since_s=since_s) is not None:
        return
    partial = folder / f"{REQUEST}.{os.getpid()}.partial"
    partial.write_text(json.dumps({"reason": reason, "run_id": run_id, "written_s": time.time()}) + "\n")
    os.replace(partial, folder / REQUEST)


_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    """This process's recorder, or None when none was started."""
    return _recorder


def start(
    folder: str | os.PathLike,
    *,
    rank: int,
    world_size: int,
    capacity: int = DEFAULT_CAPACITY,
    run_id: str | None = None,
) -> Recorder:
    """Record this process's collectives from now on, for a dump into ``folder``.

    Call it before the process group exists (``runtime.init`` does, when
    ``COURSE_FLIGHT_RECORDER`` is set), so that on GPUs PyTorch's own recorder is on too.

    Args:
        folder: where every rank writes ``rank-<r>.json`` (and PyTorch ``nccl_trace_rank_<r>``).
        rank: this process's global rank.
        world_size: the ranks of the job.
        capacity: collectives kept per rank (the last ones).
        run_id: a name every rank of the run shares (None: ``COURSE_RUN_ID``, torchrun's run id or
            Slurm's job id, else "unnamed").
    """
    global _recorder
    if capacity < 1:
        raise UserError(f"the flight recorder's capacity must be at least 1 entry, got {capacity}")
    folder = Path(folder).resolve()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"the flight recorder's folder {folder} is a file: give a folder")
    folder.mkdir(parents=True, exist_ok=True)
    if _recorder is not None:
        _recorder.stop()
    run_id = run_id or next(
        (os.environ[v] for v in (RUN_VARIABLE, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID") if os.environ.get(v)),
        "unnamed",
    )
    _recorder = Recorder(folder, capacity=capacity, rank=rank, world_size=world_size, run_id=run_id)
    # PyTorch's recorder inside ProcessGroupNCCL, read when the NCCL process group is made.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(max(capacity, 2000)))
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / PYTORCH_PREFIX))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _recorder._watcher = threading.Thread(target=_recorder._watch, name="flight-recorder", daemon=True)
    _recorder._watcher.start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, lambda signum, frame: dump("SIGUSR2"))
    return _recorder


def stop() -> None:
    """Stop recording (the entries are forgotten)."""
    global _recorder
    if _recorder is not None:
        _recorder.stop()
    _recorder = None


def watch_replicas(fingerprints) -> None:
    """Write this rank's parameter fingerprints into its record too, so that ``diagnose`` compares replicas.

    Args:
        fingerprints: a function returning {parameter name: hash} (``replicas.fingerprints``).
    """
    if _recorder is not None:
        _recorder.replicas = fingerprints


def dump(reason: str) -> Path | None:
    """Write this rank's record now, if a recorder runs; return its path.

    Args:
        reason: why, in a few words (it heads the record).
    """
    return None if _recorder is None else _recorder.dump(reason)


def failed(error: BaseException) -> None:
    """A collective raised: write this rank's record and ask every other rank for theirs."""
    if _recorder is None:
        return
    reason = f"a collective failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    _recorder.dump(reason)
    _recorder.request_everyone(reason)
    _recorder.wait_for_answers()


_COMM_FILES = (
    os.path.join("course_lib", "distributed", "comm.py"),
    os.path.join("course_lib", "distributed", "p2p.py"),
    os.path.join("course_lib", "distributed", "calls.py"),
    os.path.join("course_lib", "distributed", "hooks.py"),
    os.path.join("course_lib", "observe", "flight_recorder.py"),
    # calls.issue runs through torch.compiler.disable's wrapper: a frame of torch's, not the caller's
    os.path.join("torch", "_dynamo", "eval_frame.py"),
)
_PLUMBING = (
    *_COMM_FILES,
    os.path.join("course_lib", "observe", "faults.py"),
    os.path.join("course_lib", "distributed", "collective_check.py"),
    "threading.py",
)
"""Frames a stack leaves out: the collectives' own, the instruments', a thread's wait."""


def _caller() -> str:
    """The first frame outside the course's collectives: the line of the lesson or script that called."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(_COMM_FILES):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _short(filename: str) -> str:
    """A path without the machine's folders: from the package or script on ("a notebook cell" for one)."""
    if "ipykernel_" in filename:
        return "a notebook cell"
    parts = Path(filename).parts
    for anchor in ("course_lib", "labs", "notebooks", "slurm", "tests"):
        if anchor in parts:
            return str(Path(*parts[parts.index(anchor) :]))
    return Path(filename).name


def _main_thread_stack() -> list[str]:
    """Where the main thread is now, innermost last, as "file:line in function"."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [
        f"{_short(summary.filename)}:{summary.lineno} in {summary.name}"
        for summary in traceback.extract_stack(frame)
        if not summary.filename.endswith(_PLUMBING)
    ]


class RecordCollectives(hooks.CollectiveHook):
    """Each collective into the recorder, if one runs: issued, then completed or failed."""

    order = 10  # before the cross-rank check, so that a call it refuses is in the record

    def issued(self, call) -> None:
        if _recorder is not None:
            call.notes[self] = _recorder.issue(
                call.op,
                sequence=call.record.sequence,
                group_ranks=call.record.group_ranks,
                shape=() if call.tensor is None else call.tensor.shape,
                dtype="" if call.tensor is None else call.tensor.dtype,
                peer=call.peer,
            )

    def completed(self, call) -> None:
        entry = call.notes.get(self)
        if entry is not None:
            entry.completed_s = time.time()

    def failed(self, call, error: BaseException) -> None:
        failed(error)


class RecordProcess(hooks.ProcessHook):
    """Start with the process (``COURSE_FLIGHT_RECORDER`` set), write at its end, answer a hang."""

    order = 10

    def started(self, *, rank: int, world_size: int) -> None:
        folder = os.environ.get(FOLDER_VARIABLE)
        if folder:  # before the process group: on GPUs, PyTorch's own recorder reads its variables there
            start(folder, rank=rank, world_size=world_size)

    def ending(self, reason: str) -> None:
        dump(reason)  # a rank that ends while others wait says so: the last collective it made

    def stopped(self) -> None:
        stop()

    def hung(self, reason: str) -> None:
        """In the launcher, before it stops hung ranks: ask each for its record, wait a moment."""
        folder = os.environ.get(FOLDER_VARIABLE)
        if folder:
            request_dumps(folder, reason)
            time.sleep(5 * POLL_S)


hooks.register(RecordCollectives())
hooks.register(RecordProcess())
