"""Faults on purpose: one rank misbehaves the way ranks of real jobs do, so that you see the signs.

A hang on a cluster costs hours because it shows nothing: every rank waits, the log stops. Here
a fault is made on purpose, on laptop processes, and the flight recorder (``flight_recorder``)
and ``tools.diagnose`` show what it looks like from the outside. Set ``COURSE_FAULT`` (the
launcher's processes and ``torchrun``'s workers inherit it) to ``KIND:RANK:AT`` (RANK ``all``:
every rank, as a mistake in the program itself would):

==================  =================================================================
kind                what rank RANK does
==================  =================================================================
skip-collective     does not make its collective number AT (on the group where it is #AT)
wrong-size          makes its all-reduce number AT with half the elements
wrong-group         makes its all-reduce number AT on every rank's group instead of its own
                    (a group built from the wrong ranks, or the wrong group passed)
hang                stops before its collective number AT and never comes back
                    (a deadlock in the program, an endless loop, a lock never released)
kill                dies (SIGKILL) before its collective number AT: nothing is written
slow                sleeps AT seconds before every collective: a straggler
nan                 its loss is NaN at training step AT (a bad sample, an overflow)
corrupt             one of its weights changes after training step AT (a silent data
                    corruption: a flipped bit in a GPU's memory)
seed                seeds its data sampler with AT instead of the run's seed
no-set-epoch        does not call ``sampler.set_epoch`` from epoch AT on (epochs count from 0)
==================  =================================================================

The first six act in ``comm``; the last four in the trainer (``course_lib.train.loop``), which
reads them through ``poisoned_loss``, ``corrupt_after``, ``sampler_seed`` and ``skips_set_epoch``.

Importing this module installs it into the collectives' hooks (``course_lib.distributed.hooks``):
``comm`` then asks it before each call (``at_collective``, ``resized``, ``regrouped``), without
knowing what it is; with no fault set, nothing is checked but one variable. The peers see each
fault only through what the transport does: a wait until the timeout, an error, or (without
the course's check of every call) a wrong result.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..checks import MAX_SEED
from ..distributed import hooks
from ..errors import UserError

if TYPE_CHECKING:  # torch is imported where a fault needs it: runtime (and the jobs' checks) import this
    import torch

VARIABLE = "COURSE_FAULT"
KINDS = (
    "skip-collective",
    "wrong-size",
    "wrong-group",
    "hang",
    "kill",
    "slow",
    "nan",
    "corrupt",
    "seed",
    "no-set-epoch",
)


AT_MEANS = {
    "skip-collective": "the collective it strikes, from 0",
    "wrong-size": "the collective it strikes, from 0",
    "wrong-group": "the collective it strikes, from 0",
    "hang": "the collective it strikes, from 0",
    "kill": "the collective it strikes, from 0",
    "slow": "the seconds each collective is late",
    "nan": "the step whose loss it makes NaN",
    "corrupt": "the step after which it changes a weight",
    "seed": "the data sampler's seed",
    "no-set-epoch": "the first epoch without set_epoch",
}
"""What AT is, for each kind."""
MAX_SLOW_S = 60.0
"""The most a ``slow`` fault delays each collective: beyond it the run never ends in practice."""


@dataclass(frozen=True)
class Fault:
    """One fault: which, on which rank (-1: every rank), where (a collective's number, seconds...)."""

    kind: str
    rank: int
    at: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}:{self.at:g}"


def parse(text: str) -> Fault:
    """Read ``KIND:RANK:AT`` (RANK a number or ``all``); refuse anything else in one line.

    Args:
        text: the variable's value, e.g. ``"skip-collective:1:5"``.
    """
    parts = text.strip().split(":")
    if len(parts) == 3 and parts[1] == "all":  # every rank: a mistake in the program, not in one rank
        parts[1] = "-1"
    usage = (
        f"{VARIABLE}={text!r}: write KIND:RANK:AT with KIND one of {', '.join(KINDS)}, "
        "e.g. skip-collective:1:5"
    )
    if len(parts) != 3 or parts[0] not in KINDS:
        raise UserError(usage)
    try:
        rank, at = int(parts[1]), float(parts[2])
    except ValueError:
        raise UserError(usage) from None
    if rank < -1 or not math.isfinite(at) or at < 0:
        raise UserError(f"{usage} (RANK and AT are at least 0, and AT is finite)")
    kind = parts[0]
    if kind == "slow":
        if at > MAX_SLOW_S:
            raise UserError(
                f"{VARIABLE}={text!r}: a slowdown of {at:g} s a collective never lets the run end: give at "
                f"most {MAX_SLOW_S:g} s (a straggler is a fraction of a second late)"
            )
    elif at != int(at):
        raise UserError(f"{VARIABLE}={text!r}: AT of {kind} counts {AT_MEANS[kind]}: give a whole number")
    elif kind == "seed" and at > MAX_SEED:
        raise UserError(f"{VARIABLE}={text!r}: a seed is at most {MAX_SEED} (what the generator takes)")
    return Fault(kind, rank, at)


def check_environment(world_size: int) -> Fault | None:
    """``COURSE_FAULT`` read and held to the job before any process starts or meets: malformed, or
    naming a rank the job does not have, it is one line, not a fault that silently never fires.

    Args:
        world_size: the ranks of the job.
    """
    text = os.environ.get(VARIABLE, "")
    if not text:
        return None
    fault = parse(text)
    if fault.rank >= world_size:
        raise UserError(
            f"{VARIABLE}={text!r} names rank {fault.rank}, but the job has {world_size} rank"
            f"{'s' if world_size > 1 else ''} (0 to {world_size - 1}): name one of them, or all"
        )
    return fault


_fault: Fault | None = None
_read = False
_fired: set[str] = set()


def current() -> Fault | None:
    """The fault ``COURSE_FAULT`` names for this process's rank, or None (read once)."""
    global _fault, _read
    if not _read:
        text = os.environ.get(VARIABLE, "")
        _fault = parse(text) if text else None
        _read = True
    return _fault


def reset() -> None:
    """Read ``COURSE_FAULT`` again at the next call (tests change it)."""
    global _read, _fault
    _read, _fault = False, None
    _fired.clear()


def _for_me() -> Fault | None:
    """The fault, if it is set for this rank (or for every rank)."""
    fault = current()
    return fault if fault is not None and fault.rank in (-1, _my_rank()) else None


def active() -> bool:
    """Whether a fault is set for this rank (one look at the environment)."""
    return _for_me() is not None


def _my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def at_collective(op: str, sequence: int) -> bool:
    """Whether this rank makes its collective number ``sequence`` (``comm`` asks before every call).

    False when the fault skips it (the collective is not made and takes no number); sleeps first
    for ``slow``, never returns for ``hang``, ends the process for ``kill``.

    Args:
        op: the collective's name.
        sequence: the number it will have on its group (-1 for point to point).
    """
    fault = _for_me()
    if fault is None:
        return True
    if fault.kind == "slow":
        time.sleep(fault.at)
        return True
    if sequence != int(fault.at) or fault.kind in _fired or fault.kind in ("wrong-size", "wrong-group"):
        return True
    _fired.add(fault.kind)
    if fault.kind == "skip-collective":
        return False
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        forever = threading.Event()
        while not forever.wait(3600):  # asleep in Python: the recorder's watcher still runs
            pass
    return True


def resized(op: str, sequence: int, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor an all-reduce sends: half of it under a ``wrong-size`` fault at this number.

    Args:
        op: the collective's name.
        sequence: the number the call will have on its group.
        tensor: what it would send.
    """
    fault = _mine("wrong-size")
    if fault is None or op != "all_reduce" or sequence != int(fault.at) or "wrong-size" in _fired:
        return tensor
    _fired.add("wrong-size")
    return tensor.reshape(-1)[: max(1, tensor.numel() // 2)]


def _mine(kind: str) -> Fault | None:
    fault = _for_me()
    return fault if fault is not None and fault.kind == kind else None


def poisoned_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    """The loss, NaN on this rank at step AT under a ``nan`` fault.

    Args:
        loss: this rank's loss.
        step: the training step (its number over the run, from 0).
    """
    fault = _mine("nan")
    return loss * float("nan") if fault is not None and step == int(fault.at) else loss


def corrupt_after(model: torch.nn.Module, step: int) -> None:
    """Under a ``corrupt`` fault, after step AT: change one weight of this rank's replica.

    Args:
        model: this rank's replica.
        step: the step just taken (its number over the run, from 0).
    """
    fault = _mine("corrupt")
    if fault is not None and step == int(fault.at):
        import torch

        with torch.no_grad():
            first = next(model.parameters())
            first.view(-1)[0] += 1e-3  # small: the loss does not show it; the replicas' check does


def sampler_seed(seed: int) -> int:
    """The data sampler's seed on this rank: AT under a ``seed`` fault, else ``seed``.

    Args:
        seed: the run's seed.
    """
    fault = _mine("seed")
    return int(fault.at) if fault is not None else seed


def skips_set_epoch(epoch: int) -> bool:
    """Whether this rank leaves out ``sampler.set_epoch`` at ``epoch`` (a ``no-set-epoch`` fault).

    Args:
        epoch: the epoch about to start, from 0.
    """
    fault = _mine("no-set-epoch")
    return fault is not None and epoch >= int(fault.at)


def regrouped(op: str, sequence: int, group):
    """The group an all-reduce goes to: every rank's (the world) under a ``wrong-group`` fault at this number.

    Args:
        op: the collective's name.
        sequence: the number the call will have on ``group``.
        group: the group it was given (None: the world already).
    """
    fault = _mine("wrong-group")
    if (
        fault is None
        or op != "all_reduce"
        or group is None
        or sequence != int(fault.at)
        or "wrong-group" in _fired
    ):
        return group
    _fired.add("wrong-group")
    return None


class FaultAtCollectives(hooks.CollectiveHook):
    """The six faults that act in the collectives, asked before each call."""

    order = 0  # first: a skipped or hung call is never recorded nor checked

    def intercept(self, op: str, sequence: int) -> bool:
        return not active() or at_collective(op, sequence)

    def substitute(self, op: str, sequence: int, tensor, group):
        if not active():
            return tensor, group
        return resized(op, sequence, tensor), regrouped(op, sequence, group)


class FaultPerProcess(hooks.ProcessHook):
    def started(self, *, rank: int, world_size: int) -> None:
        reset()  # a forked process reads COURSE_FAULT afresh, with its own rank
        check_environment(world_size)  # every rank refuses it alike, before the process group


hooks.register(FaultAtCollectives())
hooks.register(FaultPerProcess())
