"""How a step's timelines are recorded: ``torch.profiler`` on every rank, its events read back.

``record_steps`` runs a few warm steps of any training step on every rank under the profiler
(CPU activities, and CUDA ones where there is a GPU, so the same code reads a GPU trace), each
step started right after a barrier, and turns each rank's events into a ``StepTimeline``: the
step's phases (``anatomy.phase``), the operators on the training thread, the collectives the
backend's threads or the GPU executed, and when each was issued. ``LoopProfiler`` does the same
inside a training loop (``--profile`` of the trainer); ``load`` reads a saved anatomy back.
The budget itself (what the parts are, and how they are cut) is ``anatomy.py``.

Cost: the profiler slows each operator by a few microseconds, so record only a few steps.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ..checks import check_int
from ..distributed import collective_check, comm, runtime
from ..errors import UserError
from .anatomy import PHASE_PREFIX, STEP_MARK, Anatomy, Collective, StepTimeline, union

COMMUNICATION_MARKERS = ("gloo:", "nccl", "Nccl")
"""Profiler events that are a collective or a message executing (a backend thread, a GPU kernel)."""


ISSUE_PREFIX = "c10d::"
"""Training-thread events that issue a collective (their order, rank by rank, is the collectives')."""


POINT_TO_POINT_EVENTS = ("gloo:send", "gloo:recv", "SendRecv", "nccl:send", "nccl:recv")


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """The profiler's native library prints its start and stop (and, without a GPU, a CUDA error)
    straight to file descriptor 2: silence that descriptor while it starts and stops."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Recorder:
    """Record the steps of a loop one by one (every rank, the same steps): what ``record_steps`` uses.

    ::

        recorder = Recorder()
        for _ in range(3):
            with recorder.step():
                train_one_step()
        result = recorder.finish()  # a collective: every rank gets every rank's budgets

    Args:
        trace_dir: also write each rank's Chrome/Perfetto trace there, ``rank<N>.json``.
    """

    def __init__(self, *, trace_dir: str | Path | None = None):
        from torch.profiler import ProfilerActivity, profile

        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.cuda = torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._calls_per_step: list[list[comm.CommRecord]] = []
        self._waited_ms: list[float] = []  # per step: the training thread waiting for a core
        self._log = comm.CommLog()
        self._unchecked = (
            collective_check.unchecked()
        )  # the cross-rank check would be a collective of its own
        self._unchecked.__enter__()
        self._log.__enter__()
        with _quiet_native_stderr():
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
        self._running = True

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One recorded step: every rank starts it together (a barrier), so they share one clock."""
        from torch.profiler import record_function

        runtime.barrier()
        if self.cuda:
            torch.cuda.synchronize()
        before = len(self._log.records)
        waited_before = waited_for_core_ns()
        with record_function(STEP_MARK):
            yield
            if self.cuda:
                torch.cuda.synchronize()
        self._calls_per_step.append(self._log.records[before:])
        self._waited_ms.append((waited_for_core_ns() - waited_before) / 1e6)

    def _stop(self) -> None:
        if self._running:
            self._running = False
            with _quiet_native_stderr():
                self._profiler.__exit__(None, None, None)
            self._log.__exit__(None, None, None)
            self._unchecked.__exit__(None, None, None)

    def finish(self, **conditions) -> Anatomy:
        """Stop recording; every rank's timelines and budgets (every rank must call it).

        Args:
            conditions: what the steps ran under, kept with the result (model, sizes...).
        """
        self._stop()
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self.trace_dir / f"rank{runtime.rank()}.json"))
        mine = _timelines(self._profiler.events(), self._calls_per_step, self._waited_ms, self.cuda)
        everyone = [mine]
        if runtime.world_size() > 1:
            everyone = [None] * runtime.world_size()
            dist.all_gather_object(everyone, mine)
        return Anatomy.of(
            everyone,
            {
                "ranks": runtime.world_size(),
                "steps_recorded": len(mine),
                "device": "cuda" if self.cuda else "cpu",
                "threads_per_rank": torch.get_num_threads(),
            }
            | conditions,
        )


class LoopProfiler:
    """``--profile`` for a training loop: record ``steps`` steps once ``warmup`` have run.

    Wrap every step of the loop in ``with profiler.step():`` (every rank, the same steps), and
    call ``finish()`` once ``complete`` (and at the end of the loop, for a run shorter than the
    steps asked for): the recorded steps' budgets go to ``folder/anatomy.json`` (rank 0) and
    each rank's trace beside it.

    Args:
        folder: where the traces and ``anatomy.json`` go.
        steps: steps to record.
        warmup: steps to let run first.
        conditions: what the steps ran under, kept in ``anatomy.json``.
    """

    def __init__(self, folder: str | Path, *, steps: int = 3, warmup: int = 2, **conditions):
        self.folder, self.steps, self.warmup, self.conditions = Path(folder), steps, warmup, conditions
        self.seen, self.recorder, self.result = 0, None, None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.recorder is None and self.result is None and self.seen == self.warmup:
            self.recorder = Recorder(trace_dir=self.folder)
        self.seen += 1
        if self.recorder is None:
            yield
            return
        with self.recorder.step():
            yield

    @property
    def complete(self) -> bool:
        """Every step asked for is recorded: time to ``finish()``."""
        return self.recorder is not None and len(self.recorder._calls_per_step) >= self.steps

    def finish(self) -> Anatomy | None:
        """Stop and write what was recorded (every rank). The anatomy if this call made it, else None."""
        if self.recorder is None:
            return None
        self.result = self.recorder.finish(**self.conditions)
        self.recorder = None
        if runtime.is_main():
            self.result.save(self.folder / "anatomy.json")
        return self.result


def record_steps(
    step: Callable[[], object],
    *,
    steps: int = 3,
    warmup: int = 2,
    trace_dir: str | Path | None = None,
) -> Anatomy:
    """Run ``step`` ``warmup`` times unrecorded, then ``steps`` times under the profiler; every rank.

    Returns every rank's timelines and budgets (a collective: every rank must call it, with the
    same ``steps``). The step should mark its parts with ``phase(...)``; time outside every
    phase and every operator is reported as unexplained.

    Args:
        step: one training step (forward, backward, optimizer step), the same on every rank.
        steps: steps recorded; the budget of the one of median length is the typical one.
        warmup: steps run first and not recorded (allocations, caches, bucket rebuilds settle).
        trace_dir: also write each rank's Chrome/Perfetto trace there, ``rank<N>.json``.
    """
    check_int("steps", steps, minimum=1)
    check_int("warmup", warmup, minimum=0)
    for _ in range(warmup):
        step()
    recorder = Recorder(trace_dir=trace_dir)
    try:
        for _ in range(steps):
            with recorder.step():
                step()
    finally:
        recorder._stop()
    return recorder.finish(warmup_steps=warmup)


def waited_for_core_ns() -> int:
    """How long this thread has been ready to run but waiting for a core, in ns, since it started.

    Linux keeps it per thread (the second number of ``/proc/thread-self/schedstat``: time on a
    run queue); where it does not (macOS, a kernel without schedstats), 0: no load is subtracted.
    """
    try:
        with open("/proc/thread-self/schedstat") as counters:
            return int(counters.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _is_communication(name: str) -> bool:
    return any(marker in name for marker in COMMUNICATION_MARKERS)


def _compute_and_transfers(inside: list, on_thread: list, cuda: bool) -> tuple[list, list]:
    """A step's events that compute, and those that move data: on a GPU its kernels (NCCL's are
    the transfers); on a CPU the training thread's ``aten::`` operations, and gloo's work."""
    if cuda:
        kernels = [e for e in inside if e.device_type.name == "CUDA"]
        return [e for e in kernels if not _is_communication(e.name)], [
            e for e in kernels if _is_communication(e.name)
        ]
    return [e for e in on_thread if e.name.startswith("aten::")], [
        e for e in inside if e.name.startswith("gloo:")
    ]


def _timelines(
    events, calls_per_step: list[list[comm.CommRecord]], waited_ms: list[float], cuda: bool
) -> list[StepTimeline]:
    """Cut the profiler's events into one timeline per recorded step (ms from each step's start)."""
    marks = sorted((e for e in events if e.name == STEP_MARK), key=lambda e: e.time_range.start)
    training_thread = marks[0].thread if marks else None
    timelines = []
    for index, mark in enumerate(marks):
        t0, t1 = mark.time_range.start, mark.time_range.end

        def ms(microseconds: float, t0: float = t0) -> float:
            return (microseconds - t0) / 1000

        inside = [e for e in events if e.time_range.end > t0 and e.time_range.start < t1]
        on_thread = [e for e in inside if e.thread == training_thread and e.device_type.name == "CPU"]
        computing, executing = _compute_and_transfers(inside, on_thread, cuda)
        compute = [(ms(e.time_range.start), ms(e.time_range.end)) for e in computing]
        issued = sorted(
            (e for e in on_thread if e.name.startswith(ISSUE_PREFIX) and "barrier" not in e.name),
            key=lambda e: e.time_range.start,
        )
        executing.sort(key=lambda e: e.time_range.start)
        records = (
            [r for r in calls_per_step[index] if r.op != "barrier"] if index < len(calls_per_step) else []
        )
        collectives = []
        for position, event in enumerate(executing):
            point_to_point = any(marker in event.name for marker in POINT_TO_POINT_EVENTS)
            issue = issued[position] if position < len(issued) else None
            key = None
            if not point_to_point:
                if len(records) == len(executing) and records[position].sequence >= 0:
                    key = (records[position].group_ranks, records[position].sequence)
                else:  # PyTorch's own wrappers: one group, collectives in the same order on every rank
                    key = ("by issue order", position)
            collectives.append(
                Collective(
                    name=event.name,
                    start_ms=max(0.0, ms(event.time_range.start)),
                    end_ms=min(ms(t1), ms(event.time_range.end)),
                    issued_ms=ms(issue.time_range.start) if issue is not None else None,
                    key=key,
                    point_to_point=point_to_point,
                    tensor_bytes=records[position].tensor_bytes if len(records) == len(executing) else None,
                    operation=records[position].op if len(records) == len(executing) else None,
                )
            )
        phases = [
            (e.name.removeprefix(PHASE_PREFIX), ms(e.time_range.start), ms(e.time_range.end))
            for e in on_thread
            if e.name.startswith(PHASE_PREFIX)
        ]
        host_busy = [
            (ms(e.time_range.start), ms(e.time_range.end))
            for e in on_thread
            if e.name.startswith(PHASE_PREFIX) or e.name.startswith(ISSUE_PREFIX)
        ]
        timelines.append(
            StepTimeline(
                rank=runtime.rank(),
                step_ms=ms(t1),
                compute=union([(max(0.0, a), min(ms(t1), b)) for a, b in compute]),
                collectives=collectives,
                phases=phases,
                host_busy=union(host_busy),
                waited_for_core_ms=waited_ms[index] if index < len(waited_ms) else 0.0,
            )
        )
    return timelines


def load(path: str | Path) -> Anatomy:
    """An anatomy as ``--profile DIR`` (or ``Anatomy.save``) wrote it, to read or draw again.

    Args:
        path: the ``anatomy.json`` file, or the folder that holds it.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "anatomy.json"  # the folder --profile wrote into
    if not path.is_file():
        raise UserError(
            f"{path} does not exist: an anatomy is the anatomy.json that --profile DIR writes into DIR "
            "(or Anatomy.save writes)"
        )
    try:
        record = json.loads(path.read_text())
        record["timelines"], record["conditions"]
    except (ValueError, KeyError, TypeError):
        raise UserError(
            f"{path} is not an anatomy (no recorded timelines in it): read the anatomy.json that "
            "--profile DIR writes into DIR"
        ) from None

    def as_tuple(value):  # JSON has no tuples: a collective's key and the intervals were ones
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value

    timelines = [
        [
            StepTimeline(
                rank=step["rank"],
                step_ms=step["step_ms"],
                compute=[tuple(span) for span in step["compute"]],
                collectives=[
                    Collective(**(collective | {"key": as_tuple(collective["key"])}))
                    for collective in step["collectives"]
                ],
                phases=[tuple(phase) for phase in step["phases"]],
                host_busy=[tuple(span) for span in step["host_busy"]],
                waited_for_core_ms=step.get("waited_for_core_ms", 0.0),  # absent before it was recorded
            )
            for step in steps
        ]
        for steps in record["timelines"]
    ]
    return Anatomy.of(timelines, record["conditions"])
