"""Where instruments plug in: the collectives and the processes call hooks they never import.

The transport (``comm``, ``runtime``, ``launch``) is the lesson. Checking it, recording it and
breaking it on purpose are instruments, and they live one layer up, in ``course_lib.observe``.
PyTorch keeps them apart the same way: its collectives call the checks of
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and its flight recorder, and no algorithm mentions either.
An instrument registers itself when its module is imported::

    import course_lib.distributed.collective_check  # now every collective is checked across the ranks

Two kinds of hook, each a class whose methods do nothing until a subclass says otherwise:

- ``CollectiveHook``, told about every collective that ``comm`` makes: before it goes out
  (``intercept`` may skip it, as a fault does; ``issued`` may refuse it, as the cross-rank check
  does), when it completed, and when it failed.
- ``ProcessHook``, told when a process starts (``runtime.init``, before the process group exists),
  when it ends (``runtime.shutdown``, and ``launch`` once the function returned or raised), and
  when the launcher is about to stop ranks that hang.

``launch`` forks its processes, so they inherit the hooks of the process that called it.

Cost: one loop over a short list per collective; nothing at all when no instrument is imported.
"""

from __future__ import annotations

CHECK_COLLECTIVES = "COURSE_CHECK_COLLECTIVES"
"""1: an installed cross-rank check (``course_lib.distributed.collective_check``) checks every
collective before it goes out; 0: it does not; unset: it does with gloo, not with NCCL
(``launch`` sets it: 1 unless told not to)."""


class CollectiveHook:
    """Told about every collective. ``order`` places it among the others: lower runs first.

    ``call`` is a ``calls.Call``: the operation, its ``CommRecord`` (sequence number, group's
    ranks), the group, the tensor the ranks must agree on, and ``notes`` for the hook's own use.
    This module stays free of torch (and of ``comm``): the jobs' checks import the instruments
    on machines where torch may not work yet."""

    order = 50

    def intercept(self, op: str, sequence: int) -> bool:
        """Whether the call is made at all (False: as if the line that makes it had not run).

        ``sequence`` is the number it will have on its group (-1 for point to point)."""
        return True

    def substitute(self, op: str, sequence: int, tensor, group):
        """The tensor and group an all-reduce really uses (a fault may change them)."""
        return tensor, group

    def issued(self, call) -> None:
        """The call is about to go out; raising here refuses it (the failure is reported too)."""

    def completed(self, call) -> None:
        """The call completed (for an asynchronous one: its ``wait()`` returned)."""

    def failed(self, call, error: BaseException) -> None:
        """The call (or its wait) raised ``error``."""


class ProcessHook:
    """Told about this process's life."""

    order = 50

    def started(self, *, rank: int, world_size: int) -> None:
        """``runtime.init`` is about to make the process group."""

    def ending(self, reason: str) -> None:
        """The program ended here (``reason`` says how): the last moment to write what it knows."""

    def stopped(self) -> None:
        """``runtime.shutdown``: the process group is about to go."""

    def hung(self, reason: str) -> None:
        """In the launcher: the ranks are about to be stopped because they hang."""


collective_hooks: list[CollectiveHook] = []
process_hooks: list[ProcessHook] = []


def register(hook: CollectiveHook | ProcessHook) -> None:
    """Add ``hook`` to its list, in ``order``; a second hook of the same class replaces the first.

    Args:
        hook: a ``CollectiveHook`` or a ``ProcessHook``.
    """
    if isinstance(hook, CollectiveHook):
        hooks: list = collective_hooks
    elif isinstance(hook, ProcessHook):
        hooks = process_hooks
    else:
        raise TypeError(f"a hook is a CollectiveHook or a ProcessHook, got {type(hook).__name__}")
    hooks[:] = sorted([h for h in hooks if type(h) is not type(hook)] + [hook], key=lambda h: h.order)


def substituted(op: str, sequence: int, tensor, group):
    """The tensor and group a collective really uses, once every hook had its say (a fault on
    purpose may send the wrong size, or call on the wrong group)."""
    for hook in collective_hooks:
        tensor, group = hook.substitute(op, sequence, tensor, group)
    return tensor, group


def started(*, rank: int, world_size: int) -> None:
    for hook in process_hooks:
        hook.started(rank=rank, world_size=world_size)


FINISHED = "finished: the program ended here"
"""The reason a rank gives ``ending`` when its program returned: any other reason is a failure."""


def ending(reason: str) -> None:
    for hook in process_hooks:
        hook.ending(reason)


def stopped() -> None:
    for hook in process_hooks:
        hook.stopped()


def hung(reason: str) -> None:
    for hook in process_hooks:
        hook.hung(reason)
