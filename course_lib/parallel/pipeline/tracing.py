"""What one pipeline step did on one rank: its actions on a clock, its messages, its memory.

The executor (``executor.py``) runs a schedule and reports each action to a tracer; this file
holds the tracer that measures (``StepTracer``) and what it measures (``PipelineStats``), so that
the schedule's run reads without its instruments. The measurements are what the lessons compare
with the theory: the bubble (``bubble_fraction``, the events of every rank on one clock), the
micro-batches held at once (``peak_activations``, against ``peak_activations_theory``), and, with
``measure_memory``, the bytes the held forwards keep alive (``memory.live_tensor_bytes``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from ..memory import live_tensor_bytes
from .actions import Action


@dataclass
class PipelineStats:
    """What one ``step`` did on this rank."""

    peak_activations: int = 0  # forwards (per virtual stage) whose activations were held at once
    peak_activation_bytes: int = 0  # bytes of stage inputs and outputs held for backward, at most
    # With ``measure_memory``: the most bytes the held forwards kept alive at once (everything autograd
    # and recomputation keep for backward, and each forward's output), as ``memory.live_tensor_bytes``
    # counts them; None without it.
    peak_kept_bytes: int | None = None
    events: list = field(default_factory=list)  # (kind, stage, microbatch, start, end) in seconds
    # (SEND_F | SEND_B, receiving stage, microbatch, issued, issued) and (RECV_F | RECV_B, stage,
    # microbatch, began waiting, received): when each message left and arrived, in seconds
    messages: list = field(default_factory=list)
    # Seconds spent handing messages to the backend (posting receives, starting sends): time between
    # actions that the schedule counts as free. On a CPU, gloo's thread holds a connection's lock
    # while it moves data, and waits for a core the computing threads hold: a post can take ms.
    posting_s: float = 0.0
    step_time_s: float = 0.0
    # time.perf_counter() when the step began; the events are seconds after it. On one machine every
    # process reads the same monotonic clock, so the ranks' events can be put on one time line.
    clock_start: float = 0.0

    @property
    def bubble_fraction(self) -> float:
        """Share of this rank's own step it spent not computing (waiting for its neighbours).

        Each rank's step ends when its own last action does, so a rank that finishes early (the
        last stage, whose last backward comes first) counts less idle time than the theory's
        common window does; ``bubble_fraction(events)`` over every rank's events measures that one.
        """
        busy = sum(end - start for *_, start, end in self.events)
        return 1 - busy / self.step_time_s


def on_one_clock(stats_by_rank: dict[int, PipelineStats]) -> dict[int, list]:
    """Every rank's events of one step on one time line, in seconds since the first rank began.

    Each rank measures its events from its own start; on one machine all processes read the same
    monotonic clock, so shifting each by its ``clock_start`` lines them up (what a picture of the
    step and the bubble over a window common to all ranks need).

    Args:
        stats_by_rank: {rank: that rank's ``PipelineStats`` of the same step}.
    """
    first = min(stats.clock_start for stats in stats_by_rank.values())
    return {
        rank: [
            (kind, stage, microbatch, stats.clock_start - first + start, stats.clock_start - first + end)
            for kind, stage, microbatch, start, end in stats.events
        ]
        for rank, stats in stats_by_rank.items()
    }


def message_latencies(stats_by_rank: dict[int, PipelineStats]) -> list[float]:
    """How long each message of one step took, from its send to its arrival, where the receiver was
    already waiting for it (otherwise its arrival time is unknown), in seconds, on one clock.

    The theory counts messages as free; inside a step a message also waits for its sender's and
    receiver's cores (on a CPU, the communication thread shares them with the computing ones).

    Args:
        stats_by_rank: {rank: that rank's ``PipelineStats`` of the same step}.
    """
    first = min(stats.clock_start for stats in stats_by_rank.values())
    sent, received = {}, []
    for stats in stats_by_rank.values():
        shift = stats.clock_start - first
        for kind, stage, microbatch, start, end in stats.messages:
            key = (kind[-1], stage, microbatch)
            if kind.startswith("SEND"):
                sent[key] = shift + start
            else:
                received.append((key, shift + start, shift + end))
    return [end - sent[key] for key, began, end in received if key in sent and began <= sent[key]]


class StepTracer:
    """Measures one ``step`` of an executor into a ``PipelineStats``, action by action.

    >>> trace = StepTracer(measure_memory=False)
    >>> with trace:                       # the step's clock (and memory count) start and stop
    ...     with trace.posting(): ...     # handing receives to the backend
    ...     with trace.action(action, run): ...   # one action of the schedule

    Args:
        measure_memory: count, with ``memory.live_tensor_bytes``, what each forward leaves alive
            until its backward (slow: for lessons and tests).
    """

    def __init__(self, *, measure_memory: bool = False):
        self.stats = PipelineStats(peak_kept_bytes=0 if measure_memory else None)
        self.measure_memory = measure_memory
        self._live: live_tensor_bytes | None = None
        self._kept: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> bytes its forward kept
        self._kept_bytes, self._started = 0, 0.0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StepTracer:
        if self.measure_memory:
            self._live = self._stack.enter_context(live_tensor_bytes())
        self._started = self.stats.clock_start = time.perf_counter()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._stack.close()  # the memory count ends even on an error
        if kind is None:
            self.stats.step_time_s = time.perf_counter() - self._started

    def _clock(self) -> float:
        return time.perf_counter() - self._started

    @contextlib.contextmanager
    def posting(self):
        """Time spent posting receives: between actions, where the schedule counts nothing."""
        begin = time.perf_counter()
        yield
        self.stats.posting_s += time.perf_counter() - begin

    @contextlib.contextmanager
    def action(self, action: Action, run):
        """One action: a compute span, a message's wait or start, and what the held forwards keep."""
        begin, key = self._clock(), (action.stage, action.microbatch)
        alive_before = self._live.now if self._live is not None else 0
        if action.kind == "B":
            self._kept_bytes -= self._kept.pop(key, 0)
        yield
        end, stats = self._clock(), self.stats
        if action.kind.startswith("SEND"):  # a send is started, never waited for: it leaves now
            stats.messages.append((action.kind, *key, begin, begin))
            stats.posting_s += end - begin
        elif action.kind.startswith("RECV"):
            stats.messages.append((action.kind, *key, begin, end))
        else:
            stats.events.append((action.kind, *key, begin, end))
        if action.kind == "F" and self._live is not None:  # kept for its backward, and its output
            self._kept[key] = self._live.now - alive_before
            self._kept_bytes += self._kept[key]
            stats.peak_kept_bytes = max(stats.peak_kept_bytes, self._kept_bytes)
        held_bytes = sum(t.numel() * t.element_size() for x, y, _ in run.held.values() for t in (x, y))
        stats.peak_activations = max(stats.peak_activations, len(run.held) + len(run.waiting))
        stats.peak_activation_bytes = max(stats.peak_activation_bytes, held_bytes)
