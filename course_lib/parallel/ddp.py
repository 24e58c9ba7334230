"""Data parallelism (DDP), written out: every rank a full replica, gradients averaged each step.

The idea. Each of N ranks holds the whole model and computes the gradient of its own slice of
the global batch. Averaging those N gradients gives exactly the gradient of the whole batch, so
after ``optimizer.step()`` every replica holds the same new weights, as if one process had done
all the work. Three things make it correct:

1. The replicas start equal: on wrap, rank 0's parameters and buffers are broadcast to all.
2. The gradients are averaged: an all-reduce (sum) divided by N, after every backward.
3. Every rank runs the same collectives in the same order (here: buckets in a fixed order),
   or the ranks deadlock.

The cost. Memory: a full copy of parameters, gradients and optimizer state on every rank, plus
one flat buffer per bucket. Traffic: one all-reduce of all gradients per step, 2(N-1)/N · 4Ψ bytes
sent per rank for Ψ fp32 parameters (see ``course_lib.distributed.comm``).

Three ways to schedule that all-reduce, from slowest to fastest (``sync=``):

- ``naive``: after backward, one all-reduce per parameter. Many small messages: each pays the
  network's latency, and nothing overlaps with computation.
- ``bucketed``: after backward, gradients are packed into buckets of about ``bucket_mb``
  megabytes and each bucket is reduced in one message. Fewer, larger messages. The buckets are
  PyTorch's (``make_buckets``): a bucket closes once it reaches the cap, and the first one is
  capped at 1 MB by default, so its gradients, the first ready, do not wait for 25 MB of others.
  (PyTorch reduces everything in one bucket in the very first step, then rebuilds the buckets in
  the order the gradients arrived; for a model that runs its layers in the order it defines them
  those are the buckets built here from the start.)
- ``overlapped`` (the default, what PyTorch does): buckets are filled in the order gradients
  become ready during backward (the last layers first) and each is all-reduced *asynchronously*
  as soon as it is full, while backward goes on computing the earlier layers' gradients. At the
  end of backward we only wait for what is still in flight.

A post-accumulate-grad hook on each parameter tells us when its gradient is ready; a callback
queued on the autograd engine runs once at the end of backward to finish the step, so the
training loop needs no extra call (just like ``torch.nn.parallel.DistributedDataParallel``).

Memory traffic matters as much as network traffic here. Once a gradient has been copied into
its bucket, ``param.grad`` is made a *view* of that slice of the bucket (PyTorch's
``gradient_as_bucket_view=True``): dividing the reduced bucket by N in place then averages every
gradient in it, and nothing is copied back out.

``no_sync()``: backward passes inside it only accumulate gradients locally; the next backward
outside it reduces the accumulated sum (gradient accumulation without extra traffic).

Paper: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020 (arXiv:2006.15704): buckets, overlap, ``no_sync`` and unused parameters as PyTorch's
``DistributedDataParallel`` does them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_choice, check_flag, check_group, check_module, check_number
from ..distributed import comm, runtime
from ..errors import UserError
from .claims import DATA_PARALLEL_WRAPPER, claim_module

SYNC_MODES = ("naive", "bucketed", "overlapped")
DEFAULT_BUCKET_MB = 25.0  # PyTorch's default bucket_cap_mb
DEFAULT_FIRST_BUCKET_MB = 1.0  # and its first bucket's (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one all-reduce."""

    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat: the gradients are copied in, reduced, and copied back out
    ready: set[int] = field(default_factory=set)  # ids of parameters whose gradient is in the buffer
    work: object = None  # the in-flight all-reduce

    def slices(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its view into the flat buffer."""
        start = 0
        for param in self.params:
            yield param, self.buffer[start : start + param.numel()].view_as(param)
            start += param.numel()


def make_buckets(
    params: list[nn.Parameter], bucket_mb: float, *, first_bucket_mb: float | None = None
) -> list[list[nn.Parameter]]:
    """Group parameters into buckets the way PyTorch's reducer does, in the order backward makes them.

    Walking the parameters from the last to the first (backward computes the last layers'
    gradients first), each one is *added* to the current bucket, and the bucket is closed once it
    *reaches* the cap, so a bucket holds at least ``bucket_mb`` MB but for the last one, and a
    large parameter closes its bucket at once. Parameters of another dtype fill buckets of their
    own (a bucket is one flat buffer). This is ``torch.distributed._compute_bucket_assignment_by_size``.

    Args:
        params: the parameters whose gradients are all-reduced, in the model's order.
        bucket_mb: the cap, in megabytes (2**20 bytes), at which a bucket is closed.
        first_bucket_mb: a smaller cap for the first bucket (None: ``bucket_mb``). PyTorch's DDP
            uses 1 MB by default: the first gradients then leave after a short wait instead of
            waiting for 25 MB of them.
    """
    caps = [first_bucket_mb * 2**20] if first_bucket_mb is not None else []
    caps.append(bucket_mb * 2**20)
    buckets: list[list[nn.Parameter]] = []
    # one bucket filling per (dtype, device): its parameters, its bytes, which cap applies to it
    open_buckets: dict[tuple, tuple[list[nn.Parameter], float, int]] = {}
    for param in reversed(params):
        kind = (param.dtype, param.device)
        current, size, cap = open_buckets.get(kind, ([], 0.0, 0))
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= caps[cap]:
            buckets.append(current)
            current, size, cap = [], 0.0, min(cap + 1, len(caps) - 1)
        open_buckets[kind] = (current, size, cap)
    buckets += [current for current, _, _ in open_buckets.values() if current]
    return buckets


def check_same_model_everywhere(module: nn.Module, group) -> None:
    """All ranks compare parameter names and shapes, and all raise the same error if they differ."""
    signature = [
        (name, f"shape {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}")
        for name, p in module.named_parameters()
    ]
    everyone = [None] * runtime.world_size(group=group)
    dist.all_gather_object(everyone, signature, group=group)
    ours = dict(everyone[0])
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        theirs = dict(theirs)
        for name in [*ours, *(n for n in theirs if n not in ours)]:  # rank 0's order first
            if ours.get(name) != theirs.get(name):
                raise UserError(
                    f"parameter {name!r} has {ours.get(name, 'no entry')} on rank 0 but "
                    f"{theirs.get(name, 'no entry')} on rank {rank}: every rank must build the same model "
                    "(same code, same arguments) before wrapping it"
                )
        raise UserError(
            f"rank {rank} lists its parameters in another order than rank 0: build the same model everywhere"
        )


def first_rank(*, group=None) -> int:
    """The global rank of the first rank of ``group`` (the whole world by default)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def start_as_replicas(module: nn.Module, *, group=None) -> None:
    """Make every rank of ``group`` hold the first rank's parameters and buffers.

    Replicas that start equal stay equal: they apply the same averaged gradient. The model's
    shapes are compared first, so a rank that built another model fails with a clear message
    instead of a broadcast of mismatched tensors.
    """
    check_same_model_everywhere(module, group)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            comm.broadcast(tensor.data, src=first_rank(group=group), group=group)


class EndOfBackward:
    """Run ``callback`` once when the current backward pass ends, however many hooks ask for it.

    A gradient hook only sees one parameter; finishing the step (waiting for the last all-reduce,
    reducing what is left) needs to know that backward is over. The autograd engine runs queued
    callbacks once, after the whole graph: the first hook of a backward queues one.

    Args:
        callback: what to run, without arguments, once the backward pass has finished.
    """

    def __init__(self, callback):
        self.callback = callback
        self.queued = False

    def request(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False  # first: the next backward must queue again even if the callback fails
        self.callback()


class GradientSyncSwitch:
    """``no_sync()`` for the course's data-parallel wrappers: DDP here, ZeRO (``zero.py``) and FSDP
    (``fsdp.py``) through ``flat_sharded.FlatShardedMixin``.

    Backward passes inside the block keep their (full, local) gradients without communicating;
    the next backward outside it reduces their sum: gradient accumulation without extra traffic.
    """

    require_gradient_sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.require_gradient_sync
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = previous


# #region data-parallel
class DataParallel(GradientSyncSwitch, nn.Module):
    """Wrap ``module`` so that its gradients are averaged over the process group after each backward.

    Args:
        module: the model; every rank must build the same one (rank 0's weights are broadcast).
        bucket_mb: the size at which a bucket is closed and all-reduced, in MB (``make_buckets``);
            None: PyTorch's defaults, 1 MB for the first bucket and 25 MB for the others. A value
            given applies to every bucket, as PyTorch's ``bucket_cap_mb`` does.
        sync: ``"overlapped"`` (buckets reduced during backward), ``"bucketed"`` (after backward)
            or ``"naive"`` (one all-reduce per parameter, after backward).
        broadcast_buffers: send rank 0's buffers (running statistics) to every rank before each
            forward, as PyTorch's DDP does by default.
        find_unused_parameters: allow parameters that get no gradient in a step (a branch not
            taken), whose bucket would otherwise wait forever: they count as zero, after one
            small all-reduce per step of which are unused on *every* rank (those keep no
            gradient). It turns overlap off: a rank cannot know during backward which gradients
            will never come (``_fill_unused_gradients``, after the reading region).
        group: the data-parallel process group (None: every rank), e.g. one dimension of a mesh.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_mb: float | None = None,
        sync: str = "overlapped",
        broadcast_buffers: bool = False,
        find_unused_parameters: bool = False,
        group=None,
    ):
        super().__init__()
        check_module("module", module)
        if bucket_mb is not None:
            check_number("bucket_mb (the size of one all-reduce message, in MB)", bucket_mb, above=0)
        check_choice("sync", sync, SYNC_MODES)
        check_flag("broadcast_buffers", broadcast_buffers)
        check_flag("find_unused_parameters", find_unused_parameters)
        check_group("group", group)
        claim_module(module, "DataParallel", family=DATA_PARALLEL_WRAPPER)
        self.module = module
        self.sync, self.bucket_mb, self.group = sync, bucket_mb, group
        self.broadcast_buffers, self.find_unused_parameters = broadcast_buffers, find_unused_parameters
        self.world_size = runtime.world_size(group=group)
        self.overlap = sync == "overlapped" and not find_unused_parameters
        self._sync_this_backward = True
        self._end_of_backward = EndOfBackward(self._finish_backward)
        self._fired: set[int] = set()  # parameters whose gradient hook ran in this backward
        start_as_replicas(module, group=group)

        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [
            Bucket(
                group_params,
                torch.zeros(
                    sum(p.numel() for p in group_params),
                    dtype=group_params[0].dtype,
                    device=group_params[0].device,
                ),
            )
            for group_params in make_buckets(
                params,
                bucket_mb if bucket_mb is not None else DEFAULT_BUCKET_MB,
                first_bucket_mb=None if bucket_mb is not None else DEFAULT_FIRST_BUCKET_MB,
            )
        ]
        self._slot = {id(p): (bucket, view) for bucket in self.buckets for p, view in bucket.slices()}
        self._next_to_launch = 0
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            for buffer in self.module.buffers():
                comm.broadcast(buffer.data, src=first_rank(group=self.group), group=self.group)
        # Like PyTorch, whether this step's backward communicates is decided when its forward runs.
        self._sync_this_backward = self.require_gradient_sync
        return self.module(*args, **kwargs)

    # -- backward: hooks, buckets, the final callback ----------------------------------------
    def _gradient_ready(self, param: nn.Parameter) -> None:
        if not self._end_of_backward.queued and self._sync_this_backward != self.require_gradient_sync:
            raise UserError(
                "a backward ran on the other side of a no_sync() block than its forward: keep the forward "
                "and the backward of a micro-step inside the same `with model.no_sync():` block"
            )
        self._end_of_backward.request()
        if self._sync_this_backward:
            self._fired.add(id(param))
        if not (self._sync_this_backward and self.overlap):
            return
        bucket, view = self._slot[id(param)]
        self._move_into_bucket(param, view)
        bucket.ready.add(id(param))
        self._launch_ready_buckets()

    @staticmethod
    def _move_into_bucket(param: nn.Parameter, view: torch.Tensor) -> None:
        """Copy the gradient into its bucket slice, and make that slice the gradient from now on."""
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    # #region launch-buckets
    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order: every rank must issue its all-reduces in the same order.
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.work = comm.all_reduce(bucket.buffer, op="sum", group=self.group, async_op=True)
            self._next_to_launch += 1

    # #endregion launch-buckets

    def _finish_backward(self) -> None:
        """Runs once at the end of every backward (queued on the autograd engine by the first hook)."""
        if not self._sync_this_backward:
            return
        try:
            globally_used = self._fill_unused_gradients()
            if self.sync == "naive":
                for bucket in self.buckets:
                    for param in bucket.params:
                        comm.all_reduce(param.grad, op="sum", group=self.group)
                        param.grad.div_(self.world_size)
            else:
                for bucket in self.buckets:
                    if self.overlap:  # launched during backward: wait, while later buckets still fly
                        bucket.work.wait()
                    else:
                        for param, view in bucket.slices():
                            self._move_into_bucket(param, view)
                        comm.all_reduce(bucket.buffer, op="sum", group=self.group)
                    bucket.buffer.div_(self.world_size)  # the gradients are views of it: now averaged
            if globally_used is not None:  # a parameter no rank used keeps no gradient, as in PyTorch
                for bucket in self.buckets:
                    for param in bucket.params:
                        if not globally_used[id(param)]:
                            param.grad = None
        finally:
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = None
            self._next_to_launch = 0
            self._fired.clear()

    # #endregion data-parallel

    # -- find_unused_parameters: gradients a skipped branch never made ----------------------
    def _unused(self) -> list[nn.Parameter]:
        """Parameters whose gradient hook did not run in this backward: a branch the forward skipped
        (their ``.grad`` may still hold the zeros ``zero_grad(set_to_none=False)`` kept)."""
        return [p for bucket in self.buckets for p in bucket.params if id(p) not in self._fired]

    def _check_all_used(self) -> None:
        unused = {id(p) for p in self._unused()}
        if unused and not self.find_unused_parameters:
            names = [name for name, p in self.module.named_parameters() if id(p) in unused]
            raise UserError(
                f"parameters {names[:5]} received no gradient in this backward, so their bucket can never be "
                "reduced: pass find_unused_parameters=True to DataParallel, or use them in forward"
            )

    def _fill_unused_gradients(self) -> dict[int, bool] | None:
        """Give locally unused parameters zero gradients; return which are used on some rank (or None)."""
        if not self.find_unused_parameters:
            self._check_all_used()
            return None
        params = [p for bucket in self.buckets for p in bucket.params]
        fired = [id(p) in self._fired for p in params]
        used = torch.tensor(fired, dtype=torch.int32, device=params[0].device)
        comm.all_reduce(used, op="max", group=self.group)
        had_none = set()
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                had_none.add(id(param))
        # used on some rank, or holding a gradient already (kept zeros, earlier micro-steps): reduced
        return {id(p): bool(flag) or id(p) not in had_none for p, flag in zip(params, used.tolist())}
