"""The model cut into stages, and one rank's schedule run with real sends and receives.

``split_model`` cuts a sequence of layers into stages (refusing a weight tied across two of
them); ``PipelineExecutor`` runs this rank's list of actions in order: a forward keeps its input
and output until the backward, a send is non-blocking (``isend``), a receive blocks. Each loss is
divided by m, so the gradients are the average over micro-batches: exactly those of the whole
batch. ``PipelineStats`` is what one step did: its timeline, its messages, the activations held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...checks import check_group, check_int, check_module
from ...distributed import comm, runtime
from ...errors import UserError
from .actions import (
    SPLIT_BACKWARD,
    Action,
    placement_of,
    rank_of_stage,
    stages_on_rank,
)
from .schedules import build_schedule
from .tracing import PipelineStats, StepTracer
from .zero_bubble import BackwardSplitter

# -- cutting the model ------------------------------------------------------------------------


def split_model(
    layers: nn.Sequential | list[nn.Module], num_stages: int, *, cut_points: list[int] | None = None
) -> list[nn.Sequential]:
    """Cut a sequence of layers into ``num_stages`` stages.

    Args:
        layers: the model as a sequence (an ``nn.Sequential`` or a list of modules).
        num_stages: how many stages (pipeline ranks x virtual stages per rank).
        cut_points: the index of the first layer of every stage but the first (e.g. [3, 6]); by
            default the layers are shared out evenly, earlier stages taking one more when it does
            not divide.
    """
    layers = list(layers)
    if num_stages < 1:
        raise UserError(f"the number of stages must be at least 1, got {num_stages}")
    if num_stages > len(layers):
        raise UserError(
            f"cannot cut {len(layers)} layers into {num_stages} stages: every stage needs at least one "
            f"layer; use at most {len(layers)} stages (pipeline degree x virtual stages)"
        )
    if cut_points is None:
        base, extra = divmod(len(layers), num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        cut_points = [sum(sizes[:s]) for s in range(1, num_stages)]
    bounds = [0, *cut_points, len(layers)]
    if len(cut_points) != num_stages - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise UserError(
            f"cut points {cut_points} must be {num_stages - 1} increasing layer indices between 1 and "
            f"{len(layers) - 1}"
        )
    stages = [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    _check_no_tie_across_stages(stages)
    return stages


def _device_of(stages, group) -> torch.device:
    """Where this rank's stages compute: their first parameter's or buffer's device, or, for stages
    that hold neither (an activation, a reshape), the device the backend communicates from."""
    for stage in stages:
        for tensor in (*stage.parameters(), *stage.buffers()):
            return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_no_tie_across_stages(stages: list[nn.Sequential]) -> None:
    """Each rank keeps only its stage, so a weight tied across two stages would train as two weights."""
    stage_of: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            first = stage_of.setdefault(id(param), index)
            if first != index:
                raise UserError(
                    f"a weight is tied between stage {first} and stage {index} (here as {name}): each "
                    "pipeline rank keeps one copy of its own stage, so the two would train apart; build the "
                    "model untied (tie_embeddings=False), or cut so that both uses are in one stage"
                )


# -- running one rank's schedule ---------------------------------------------------------------


@dataclass
class _Step:
    """What one ``step`` carries from action to action on this rank."""

    inputs: tuple | None  # the micro-batches, on the first stage's rank
    targets: tuple | None  # their targets, on the last stage's rank
    inbox: dict = field(default_factory=dict)  # ("F" | "B", stage, microbatch) -> what that stage receives
    outbox: dict = field(default_factory=dict)  # ("F" | "B", receiving stage, microbatch) -> what to send
    held: dict = field(default_factory=dict)  # (stage, microbatch) -> (input, output, split record)
    waiting: dict = field(default_factory=dict)  # (stage, microbatch) -> a split record whose W is to come
    in_flight: list = field(default_factory=list)  # sends not yet known to be complete
    losses: list = field(default_factory=list)


class PipelineExecutor:
    """Run one rank's share of a pipeline schedule with real sends and receives.

    Args:
        stages: {stage index: module} for the stages this rank holds (see ``rank_of_stage``).
        num_stages: the stages of the whole pipeline (ranks x virtual stages).
        schedule: one of ``actions.SCHEDULES`` (GPipe, 1F1B, interleaved, and the split backward's
            ZB-H1, ZB-V and DualPipeV).
        microbatches: m, the pieces each batch is cut into.
        loss_fn: ``loss_fn(outputs, targets)`` on the last stage; each micro-batch's loss is
            divided by m, so the gradients are those of the whole batch.
        boundary_shape: the shape of one micro-batch's activation between stages, e.g.
            (micro_batch, seq, d_model); receives allocate it.
        group: the pipeline's ranks, in stage order (default: all).
        dtype: the dtype of the activations sent between stages.
        measure_memory: count what every forward leaves alive for its backward
            (``memory.live_tensor_bytes``; slow, for lessons and tests) into
            ``stats.peak_kept_bytes``.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        num_stages: int,
        schedule: str,
        microbatches: int,
        loss_fn,
        boundary_shape: tuple[int, ...],
        *,
        group=None,
        dtype: torch.dtype = torch.float32,
        measure_memory: bool = False,
    ):
        if not isinstance(stages, dict) or not stages:
            raise UserError(
                "stages must be a non-empty dict {stage index: module} of the stages this rank holds (see "
                f"rank_of_stage), got {type(stages).__name__}"
            )
        for index, stage in stages.items():
            check_module(f"stages[{index}]", stage)
        check_int("num_stages", num_stages, minimum=1)
        check_int("microbatches", microbatches, minimum=1)
        if not callable(loss_fn):
            raise UserError(
                f"loss_fn must be a function (outputs, targets) -> loss, got {type(loss_fn).__name__}"
            )
        if not all(isinstance(size, int) and size >= 1 for size in boundary_shape):
            raise UserError(
                "boundary_shape must be positive whole numbers, e.g. (micro_batch, seq, d_model), got "
                f"{tuple(boundary_shape)}"
            )
        check_group("group", group)
        self.group = group
        self.pipeline_size = runtime.world_size(group=group)
        self.rank = runtime.rank(group=group)
        if num_stages % self.pipeline_size:
            raise UserError(f"{num_stages} stages do not go round {self.pipeline_size} pipeline ranks evenly")
        self.virtual_stages = num_stages // self.pipeline_size
        self.actions = build_schedule(
            schedule, self.pipeline_size, microbatches, virtual_stages=self.virtual_stages
        )[self.rank]
        self.placement = placement_of(schedule)
        expected = set(
            stages_on_rank(
                self.rank, self.pipeline_size, virtual_stages=self.virtual_stages, placement=self.placement
            )
        )
        if set(stages) != expected:
            where = " (a V: rank r holds stages r and 2p - 1 - r)" if self.placement == "v" else ""
            raise UserError(
                f"rank {self.rank} must hold stages {sorted(expected)}{where} under {schedule}, got "
                f"{sorted(stages)}"
            )
        # The schedules with W actions run each stage's backward in two (zero_bubble.py).
        self.splitter = BackwardSplitter(list(stages.values())) if schedule in SPLIT_BACKWARD else None
        self.stages, self.num_stages, self.schedule = stages, num_stages, schedule
        self.microbatches, self.loss_fn = microbatches, loss_fn
        self.boundary_shape, self.dtype = tuple(boundary_shape), dtype
        self.measure_memory = measure_memory
        self.device = _device_of(stages.values(), group)
        self.tracer = StepTracer  # makes each step's tracer: replace it to record otherwise
        self.stats = PipelineStats()

    def _global(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank) if self.group is not None else pipeline_rank

    def _tag(self, direction: str, receiving_stage: int, microbatch: int) -> int:
        """One tag per message, so a receive can only match the send meant for it."""
        return (receiving_stage * self.microbatches + microbatch) * 2 + (direction == "B")

    def _receives_in_order(self) -> list[tuple[int, int]]:
        """(index of each RECV action, index of the last SEND before it to the same peer, or -1)."""
        receives, last_send = [], {}
        for index, action in enumerate(self.actions):
            if action.kind.startswith("SEND"):
                last_send[action.peer] = index
            elif action.kind.startswith("RECV"):
                receives.append((index, last_send.get(action.peer, -1)))
        return receives

    def _post_receives(self, receives: list[tuple[int, int]], posted: dict, *, done: int) -> None:
        """Post every receive that may start now, long before the schedule reaches it.

        A receive may start once every earlier send of this rank to the same peer has started
        (``done`` is the index of the last action carried out). So between any two ranks the
        messages still start in the schedule's order: NCCL matches a pair's sends and receives in
        the order they are posted (gloo by tag). A message its sender sends early then lands while
        this rank computes; posted only when the schedule reaches it, the transfer would wait for
        that moment and add to the bubble.
        """
        while receives and receives[0][1] <= done:
            index, _ = receives.pop(0)
            action = self.actions[index]
            direction, stage, microbatch = action.kind[-1], action.stage, action.microbatch
            buffer = torch.empty(self.boundary_shape, dtype=self.dtype, device=self.device)
            work = comm.irecv(
                buffer,
                src=self._global(action.peer),
                group=self.group,
                tag=self._tag(direction, stage, microbatch),
            )
            posted[index] = (work, buffer)

    # #region run-a-schedule
    def step(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One forward and backward of the whole batch; returns the mean loss on the last stage's rank.

        The first stage's rank needs ``inputs``, the last stage's rank ``targets``; gradients are
        accumulated into the stages' parameters (call ``optimizer.step()`` after).
        """
        m, last_stage = self.microbatches, self.num_stages - 1
        has_first, has_last = 0 in self.stages, last_stage in self.stages
        # Both ends check, so that neither waits for the other after a mistake.
        for needed, tensor, name in ((has_first, inputs, "inputs"), (has_last, targets, "targets")):
            if needed and tensor is None:
                raise UserError(
                    f"this rank holds the {'first' if name == 'inputs' else 'last'} stage: pass {name}"
                )
            if needed and tensor.shape[0] % m:
                raise UserError(
                    f"a batch of {tensor.shape[0]} samples does not split into {m} equal micro-batches: use "
                    f"a batch size that is a multiple of {m}"
                )
        run = _Step(
            inputs=inputs.chunk(m) if has_first else None,
            targets=targets.chunk(m) if has_last else None,
        )
        trace = self.tracer(measure_memory=self.measure_memory)  # what the step did: tracing.py
        receives = self._receives_in_order()
        posted = {}  # index of a RECV action -> (work handle, buffer the message lands in)
        do = {"F": self._forward, "B": self._backward, "W": self._backward_weights}
        with trace:
            for index, action in enumerate(self.actions):
                with trace.posting():
                    self._post_receives(receives, posted, done=index - 1)
                with trace.action(action, run):
                    if action.kind.startswith("RECV"):
                        self._receive(run, action, *posted.pop(index))
                    elif action.kind.startswith("SEND"):
                        self._send(run, action)
                    else:
                        do[action.kind](run, action)
            for work in run.in_flight:
                work.wait()
        self.stats = trace.stats
        return torch.stack(run.losses).sum() if has_last else None

    def _receive(self, run: _Step, action: Action, work, buffer: torch.Tensor) -> None:
        """Wait for a message this rank posted the receive of; it becomes the stage's input."""
        work.wait()
        run.inbox[(action.kind[-1], action.stage, action.microbatch)] = buffer

    def _send(self, run: _Step, action: Action) -> None:
        """Start sending what a compute action left for another rank; never wait for it here."""
        direction, s, i = action.kind[-1], action.stage, action.microbatch
        message = run.outbox.pop((direction, s, i))
        run.in_flight.append(
            comm.isend(
                message, dst=self._global(action.peer), group=self.group, tag=self._tag(direction, s, i)
            )
        )

    def _forward(self, run: _Step, action: Action) -> None:
        """A stage's forward of one micro-batch: keep its input and output for the backward."""
        s, i, last_stage = action.stage, action.microbatch, self.num_stages - 1
        x = run.inputs[i] if s == 0 else run.inbox.pop(("F", s, i)).requires_grad_()
        record = None
        if self.splitter is not None:
            y, record = self.splitter.forward(self.stages[s], x)
        else:
            y = self.stages[s](x)
        if s == last_stage:  # each micro-batch counts 1/m: the batch mean
            y = self.loss_fn(y, run.targets[i]) / self.microbatches
            run.losses.append(y.detach())
        else:
            self._check_boundary(s, y)
            self._deliver(("F", s + 1, i), y.detach(), run.inbox, run.outbox)
        run.held[(s, i)] = (x, y, record)

    def _backward(self, run: _Step, action: Action) -> None:
        """A stage's backward of one micro-batch (B alone, in a schedule that splits it)."""
        s, i = action.stage, action.microbatch
        x, y, record = run.held.pop((s, i))
        gradient = None if s == self.num_stages - 1 else run.inbox.pop(("B", s, i))  # from the next stage
        if not y.requires_grad:  # nothing to differentiate: a first stage without weights (a ReLU, a reshape)
            input_grad = torch.zeros_like(x) if s > 0 else None
            if record is not None:
                run.waiting[(s, i)] = record  # its W has nothing to do
        elif record is not None:  # B alone: the input's gradient now, the weights' at its W
            input_grad = self.splitter.backward_input(record, y, gradient, x)
            run.waiting[(s, i)] = record
        else:  # the whole backward; on the last stage y is the loss, where backward starts
            y.backward(gradient)
            input_grad = x.grad if s > 0 else None
        if s > 0:
            self._deliver(("B", s - 1, i), input_grad, run.inbox, run.outbox)

    def _backward_weights(self, run: _Step, action: Action) -> None:
        """W: the weights' gradients, from what this micro-batch's B kept."""
        self.splitter.backward_weights(run.waiting.pop((action.stage, action.microbatch)))

    # #endregion run-a-schedule

    def _check_boundary(self, stage: int, output) -> None:
        """A stage's output is sent into a buffer of ``boundary_shape`` and ``dtype`` the next stage
        posted: a message of another size would abort the receiving process inside the transport."""
        if not isinstance(output, torch.Tensor):
            raise UserError(
                f"stage {stage} returned a {type(output).__name__}, not a tensor: a pipeline sends one "
                "tensor between stages; cut the model after a layer that returns one tensor"
            )
        if tuple(output.shape) != self.boundary_shape or output.dtype != self.dtype:
            raise UserError(
                f"stage {stage}'s output is {tuple(output.shape)} of {output.dtype}, but the next stage "
                f"receives into boundary_shape={self.boundary_shape} of {self.dtype}: cut the model where "
                "every boundary carries one shape (between blocks of the same width), or pass the "
                "boundary's real shape"
            )

    def _deliver(self, key: tuple, tensor: torch.Tensor, inbox: dict, outbox: dict) -> None:
        """Hand a tensor to the stage that needs it: directly if it lives on this rank, else via a send."""
        local = rank_of_stage(key[1], self.pipeline_size, placement=self.placement) == self.rank
        (inbox if local else outbox)[key] = tensor
