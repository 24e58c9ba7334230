"""What a training step tells whoever listens: its phases, its loss, its update.

The step (``loop.py#train-step``) calls three things at fixed points and knows nothing of what
listens: ``phase(name)`` around each part of the step, ``loss(loss, step)`` once per micro-batch,
and ``updated(model, step)`` after the optimizer. ``StepCallbacks`` is what the course's
trainer listens with: the phases become the step's anatomy (``observe.anatomy``: how long the
data, forward, backward, agreement and optimizer took); a fault set on purpose
(``observe.faults``, ``COURSE_FAULT``) may poison the loss or corrupt the weights; every
``check_replicas`` steps the replicas' weights are compared (``observe.replicas``). Lightning's
``Callback`` and torchtitan's hooks split a loop the same way, so that the step reads as the
algorithm it is.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..checks import check_int
from ..observe import anatomy, faults, replicas
from . import wrappers


class StepCallbacks:
    """The course trainer's instruments around each step.

    Args:
        check_replicas: compare the replicas' weights every this many steps (0: never).
    """

    def __init__(self, *, check_replicas: int = 0):
        check_int("check_replicas", check_replicas, minimum=0)
        self.check_replicas = check_replicas

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A part of the step (``"data"``, ``"forward"``, ``"backward"``, ``"agree"``, ``"optimizer"``)."""
        return anatomy.phase(name)

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """A micro-batch's loss at ``step`` (optimizer steps done so far): what the step goes on with."""
        return faults.poisoned_loss(loss, step)

    def updated(self, model: nn.Module, step: int) -> None:
        """The optimizer updated ``model``; ``step`` steps were done before this one."""
        faults.corrupt_after(model, step)
        done = step + 1
        if self.check_replicas and done % self.check_replicas == 0:
            replicas.check_replicas(wrappers.unwrap(model), step=done)
