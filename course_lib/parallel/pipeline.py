"""Pipeline parallelism: the model cut into stages, micro-batches flowing through them.

Stage s (a run of consecutive layers) lives on rank s. A batch is cut into m micro-batches; a
micro-batch's activation goes forward from stage to stage (send/recv), and its gradient comes
back the same way. Each rank holds 1/p of the model; only the activations at the cuts travel,
point to point.

The bubble. Rank s can only start once s micro-batches' forwards have reached it, and the last
backwards drain the same way, so each rank idles for p - 1 forward-plus-backward slots out of
m + p - 1: the bubble fraction is **(p - 1) / (m + p - 1)**. More micro-batches, smaller bubble.

The schedules (pure functions below: they return each rank's ordered list of actions, so a
schedule can be printed, checked and drawn without running anything):

- **GPipe**: all m forwards, then all m backwards. Simple; every rank keeps the activations of
  all m micro-batches until their backward: peak m.
- **1F1B**: rank s runs p - s - 1 warm-up forwards, then alternates one forward, one backward,
  then drains. The same bubble, but at most p - s micro-batches are in flight on rank s: the
  activation memory no longer grows with m.
- **Interleaved 1F1B** (Megatron-LM): each rank holds v smaller *virtual* stages (rank r holds
  stages r, r + p, r + 2p...), so a micro-batch crosses every rank v times. Each slot is v times
  shorter, so the bubble shrinks to **(p - 1) / (v·m + p - 1)**, for v times more messages. It
  needs m to be a multiple of p.

The executor runs a rank's actions in order: a forward stores its input and output until the
backward, a send is non-blocking (``isend``), a receive blocks. Because every schedule here is
checked (``check_schedule``) to complete when sends never block and receives wait for their
send, the run cannot deadlock. Each loss is divided by m, so the gradients are the average over
micro-batches: exactly the gradient of the whole batch.

Papers: GPipe, Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", NeurIPS 2019 (arXiv:1811.06965); 1F1B, Narayanan et al., "PipeDream: Generalized
Pipeline Parallelism for DNN Training", SOSP 2019, in its synchronous form (PipeDream-Flush:
Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021,
arXiv:2006.09503); the interleaved schedule, Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC 2021 (arXiv:2104.04473), section 2.2.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import KW_ONLY, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..checks import check_group, check_int, check_module
from ..distributed import comm, runtime
from ..errors import UserError
from .memory import live_tensor_bytes
from .split_backward import BackwardSplitter

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v")
SPLIT_BACKWARD = ("zb_h1", "zb_v", "dualpipe_v")
"""The schedules that split each backward into B (the input's gradient) and W (the weights')."""
V_SHAPED = ("zb_v", "dualpipe_v")
"""The schedules whose two chunks per rank sit in a V: rank r holds stages r and 2p - 1 - r."""
COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``F``/``B``/``W`` (compute), or a message (``SEND_F``, ``RECV_B``...).

    Args:
        kind: ``"F"`` or ``"B"`` (compute a forward or a backward), ``"W"`` (the weights' gradient,
            in the schedules that split the backward: there ``B`` is the input's gradient only),
            ``"SEND_F"``/``"RECV_F"`` (an activation to or from a neighbour), ``"SEND_B"``/``"RECV_B"``
            (a gradient).
        stage: the stage that computes, or for a message the stage that *receives* it.
        microbatch: which micro-batch.
        peer: for a send or a receive, the rank at the other end.
    """

    kind: str
    stage: int
    microbatch: int
    _: KW_ONLY
    peer: int | None = None  # the other rank, for sends and receives

    def __str__(self) -> str:
        arrow = (
            ""
            if self.peer is None
            else (f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}")
        )
        return f"{self.kind}{self.stage}.{self.microbatch}{arrow}"


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


def rank_of_stage(stage: int, pipeline_size: int, *, placement: str = "loop") -> int:
    """Which rank holds ``stage``.

    ``"loop"``: virtual stages go round the ranks, rank r holds stages r, r + p, r + 2p... (GPipe,
    1F1B, interleaved 1F1B, ZB-H1). ``"v"``: the stages go down the ranks and back up, rank r holds
    stages r and 2p - 1 - r (ZB-V, DualPipeV): the last rank computes the middle two stages back to
    back, and rank 0 holds the first and the last, so the loss is computed where the input entered.

    Args:
        stage: the stage's index, 0 to (pipeline ranks x chunks per rank) - 1.
        pipeline_size: p, the ranks of the pipeline.
        placement: ``"loop"`` or ``"v"`` (``placement_of(schedule)`` says which a schedule uses).
    """
    chunk, offset = divmod(stage, pipeline_size)
    if placement == "v" and chunk % 2:
        return pipeline_size - 1 - offset
    return offset


def stages_on_rank(
    rank: int, pipeline_size: int, *, virtual_stages: int = 1, placement: str = "loop"
) -> list[int]:
    """The stages ``rank`` holds, in order (``rank_of_stage`` asked of every stage).

    Args:
        rank: the rank of the pipeline.
        pipeline_size: p, the ranks of the pipeline.
        virtual_stages: v, stages per rank.
        placement: ``"loop"`` or ``"v"`` (``placement_of(schedule)``).
    """
    return [
        stage
        for stage in range(pipeline_size * virtual_stages)
        if rank_of_stage(stage, pipeline_size, placement=placement) == rank
    ]


def placement_of(schedule: str) -> str:
    """``"v"`` for the V-shaped schedules (ZB-V, DualPipeV), ``"loop"`` for the others.

    Args:
        schedule: one of ``SCHEDULES``.
    """
    return "v" if schedule in V_SHAPED else "loop"


def splits_backward(actions: dict[int, list[Action]] | list[Action]) -> bool:
    """True when a schedule runs W actions: its B computes only the input's gradient.

    Args:
        actions: a schedule ({rank: list}) or one rank's list.
    """
    lists = actions.values() if isinstance(actions, dict) else [actions]
    return any(a.kind == "W" for acts in lists for a in acts)


# -- the schedules as pure functions ------------------------------------------------------------


def check_schedule_arguments(
    schedule: str, pipeline_size: int, microbatches: int, *, virtual_stages: int = 1
) -> None:
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if pipeline_size < 1 or microbatches < 1 or virtual_stages < 1:
        raise UserError("pipeline size, micro-batches and virtual stages must all be at least 1")
    if schedule in V_SHAPED:
        if virtual_stages % 2:
            raise UserError(
                f"{schedule} places its stages in a V (down the ranks, then back up), which needs an even "
                f"number of chunks per rank, not {virtual_stages}: pass virtual_stages=2"
            )
        if virtual_stages != 2:
            raise UserError(f"{schedule} runs exactly 2 chunks per rank: pass virtual_stages=2")
    elif schedule != "interleaved_1f1b" and virtual_stages != 1:
        raise UserError(
            f"{schedule} runs one stage per rank: virtual stages need schedule interleaved_1f1b (or a V "
            "schedule, zb_v or dualpipe_v, with 2)"
        )
    if schedule == "dualpipe_v" and microbatches < 2 * pipeline_size:
        raise UserError(
            f"DualPipeV feeds micro-batches into both arms of the V at once and needs at least one per "
            f"stage: use at least 2p = {2 * pipeline_size} micro-batches, not {microbatches}"
        )
    if schedule == "interleaved_1f1b" and microbatches % pipeline_size:
        raise UserError(
            f"interleaved 1F1B sends micro-batches round the {pipeline_size} ranks in groups of "
            f"{pipeline_size}: use a number of micro-batches that is a multiple of {pipeline_size}, not "
            f"{microbatches}"
        )


def compute_order(
    schedule: str, pipeline_size: int, microbatches: int, *, virtual_stages: int = 1
) -> dict[int, list[Action]]:
    """Each rank's forwards and backwards, in the order it runs them (no communication yet).

    Args:
        schedule: one of ``SCHEDULES``: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, or the
            schedules that split the backward, ``"zb_h1"``, ``"zb_v"`` and ``"dualpipe_v"``.
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        virtual_stages: v, stages per rank (``"interleaved_1f1b"``: any; the V schedules: 2).
    """
    check_schedule_arguments(schedule, pipeline_size, microbatches, virtual_stages=virtual_stages)
    p, m, v = pipeline_size, microbatches, virtual_stages
    order = {}
    for rank in range(p):
        if schedule == "zb_h1":
            order[rank] = _zb_h1_order(rank, p, m)
        elif schedule == "zb_v":
            order[rank] = _zb_v_order(rank, p, m)
        elif schedule == "dualpipe_v":
            order[rank] = _dualpipe_v_order(rank, p, m)
        elif schedule == "gpipe":
            order[rank] = [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]
        elif schedule == "1f1b":
            warmup = min(p - rank - 1, m)
            actions = [Action("F", rank, i) for i in range(warmup)]
            for i in range(m - warmup):
                actions += [Action("F", rank, warmup + i), Action("B", rank, i)]
            actions += [Action("B", rank, i) for i in range(m - warmup, m)]
            order[rank] = actions
        else:
            order[rank] = _interleaved_order(rank, p, m, v)
    return order


def _interleaved_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: virtual micro-batch k visits chunk (k mod pv) // p."""
    total = m * v

    def forward(k: int) -> Action:
        chunk = (k % (p * v)) // p
        return Action("F", chunk * p + rank, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        chunk = v - 1 - (k % (p * v)) // p
        return Action("B", chunk * p + rank, (k // (p * v)) * p + k % p)

    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def _zb_h1_order(rank: int, p: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, section 3.1): 1F1B with each backward split into B and W, rank r
    putting off its first r W's. B alone goes back to the previous rank sooner than a whole
    backward would, so the warm-up and drain bubbles shrink by T_W each step; the W's put off
    fill the drain, where 1F1B's later ranks sat idle. At most p micro-batches wait for their W
    on any rank: 1F1B's peak on rank 0."""
    warmup = min(p - rank - 1, m)
    actions = [Action("F", rank, i) for i in range(warmup)]
    put_off: list[int] = []  # micro-batches whose B ran and whose W has not

    def backward(i: int) -> None:
        actions.append(Action("B", rank, i))
        put_off.append(i)
        if len(put_off) > rank:
            actions.append(Action("W", rank, put_off.pop(0)))

    for i in range(m - warmup):
        actions.append(Action("F", rank, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    actions += [Action("W", rank, i) for i in put_off]
    return actions


def _zb_v_order(rank: int, p: int, m: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V, rank r holding stage r (going
    down) and stage 2p - 1 - r (coming back). Warm up with the first chunk's forwards, then alternate
    F, B and W of both chunks; the drain runs the B's first and the W's after, so the W's fill what
    would be the bubble. With T_F = T_B = T_W the bubble is almost gone, at 1F1B's peak activation
    memory. Written as PyTorch's ``ScheduleZBVZeroBubble`` builds it: for m < 2p - 1 it plans
    2p - 1 micro-batches and leaves the missing ones out."""
    down, up = rank, 2 * p - 1 - rank
    planned = max(2 * p - 1, m)
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}
    actions: list[Action] = []

    def forward(stage: int) -> None:
        actions.append(Action("F", stage, forwards[stage]))
        forwards[stage] += 1

    def backward(stage: int, *, then_weights: bool) -> None:
        actions.append(Action("B", stage, backwards[stage]))
        if then_weights:
            actions.append(Action("W", stage, backwards[stage]))
        backwards[stage] += 1

    for _ in range(2 * (p - rank) - 1):
        forward(down)
    for _ in range(rank):
        forward(up)
        forward(down)
    for _ in range(p - rank):
        forward(up)
        backward(up, then_weights=True)
    while forwards[up] < forwards[down] or forwards[down] < planned:
        if forwards[down] < planned:
            forward(down)
        backward(down, then_weights=True)
        forward(up)
        backward(up, then_weights=True)
    weights = dict(backwards)  # the drain: B's now, their W's after
    for _ in range(rank):
        backward(down, then_weights=False)
        backward(up, then_weights=False)
    for _ in range(p - rank):
        backward(down, then_weights=False)
        actions.append(Action("W", down, weights[down]))
        weights[down] += 1
    actions += [Action("W", up, i) for i in range(weights[up], backwards[up])]
    actions += [Action("W", down, i) for i in range(weights[down], backwards[down])]
    return [a for a in actions if a.microbatch < m]


def _dualpipe_v_order(rank: int, p: int, m: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3, 2024; the V-shaped half of DualPipe, as PyTorch's
    ``ScheduleDualPipeV`` builds it): the V placement of ZB-V, but in the steady state each rank
    pairs the forward of one chunk with the whole backward of the other (``F`` then ``B`` and ``W``
    here). On a GPU the pair overlaps: one computes while the other's messages (an MoE layer's
    all-to-all) travel. On one CPU core they run one after the other, so what this course measures
    is the schedule's bubble, not that overlap. Only the warm-up and the drain split B from W."""
    down, up = rank, 2 * p - 1 - rank
    done = defaultdict(int)  # (kind, stage) -> micro-batches done
    put_off: list[tuple[int, int]] = []  # (stage, micro-batch) whose B ran and whose W has not
    actions: list[Action] = []

    def forward(stage: int) -> None:
        actions.append(Action("F", stage, done["F", stage]))
        done["F", stage] += 1

    def backward(stage: int, *, split: bool) -> None:
        i = done["B", stage]
        done["B", stage] += 1
        actions.append(Action("B", stage, i))
        if split:
            put_off.append((stage, i))
        else:  # the whole backward at once
            actions.append(Action("W", stage, i))

    def weights() -> None:
        if put_off:
            stage, i = put_off.pop(0)
            actions.append(Action("W", stage, i))

    for _ in range(2 * (p - rank - 1)):
        forward(down)
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    for _ in range(p - rank - 1):
        backward(up, split=True)
        weights()
        forward(up)
    for _ in range(m - 2 * p + rank + 1):  # the steady state: pairs of one chunk's F and the other's B
        forward(down)
        backward(up, split=False)
        forward(up)
        backward(down, split=False)
    for _ in range(p - rank - 1):
        backward(up, split=False)
        forward(up)
        backward(down, split=False)
    split = False
    for i in range(rank + 1):  # the drain: the second half of its B's leave their W for later
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(up, split=split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(down, split=split)
    for _ in range(p - rank - 1):
        weights()
        backward(down, split=split)
    while put_off:
        weights()
    return actions


def build_schedule(
    schedule: str, pipeline_size: int, microbatches: int, *, virtual_stages: int = 1
) -> dict[int, list[Action]]:
    """Each rank's complete list: compute actions with the sends and receives they need around them.

    A W needs no message: it uses what its B left on the same rank.

    Args:
        schedule: one of ``SCHEDULES``.
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        virtual_stages: v, stages per rank (``"interleaved_1f1b"``: any; the V schedules: 2).
    """
    order = compute_order(schedule, pipeline_size, microbatches, virtual_stages=virtual_stages)
    last = pipeline_size * virtual_stages - 1
    placement = placement_of(schedule)

    def rank_of(stage: int) -> int:
        return rank_of_stage(stage, pipeline_size, placement=placement)

    full = {}
    for rank, actions in order.items():
        steps = []
        for action in actions:
            s, i = action.stage, action.microbatch
            if action.kind == "F":
                if s > 0 and rank_of(s - 1) != rank:
                    steps.append(Action("RECV_F", s, i, peer=rank_of(s - 1)))
                steps.append(action)
                if s < last and rank_of(s + 1) != rank:
                    steps.append(Action("SEND_F", s + 1, i, peer=rank_of(s + 1)))
            elif action.kind == "B":
                if s < last and rank_of(s + 1) != rank:
                    steps.append(Action("RECV_B", s, i, peer=rank_of(s + 1)))
                steps.append(action)
                if s > 0 and rank_of(s - 1) != rank:
                    steps.append(Action("SEND_B", s - 1, i, peer=rank_of(s - 1)))
            else:
                steps.append(action)
        full[rank] = steps
    return full


def check_schedule(
    actions: dict[int, list[Action]],
    pipeline_size: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    placement: str = "loop",
) -> None:
    """Raise ``ValueError`` unless the schedule is complete, causal, matched and deadlock-free.

    Replays all ranks together with non-blocking sends and receives that wait for their send:
    every forward and backward of every (stage, micro-batch) exactly once, on the stage's rank,
    each forward before its backward, each input received (or produced locally) before use. A
    schedule that splits the backward runs a W for every B, after it and on the same rank.

    Args:
        actions: {rank: its list of actions}, as ``build_schedule`` returns (or a student writes).
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        virtual_stages: v, stages per rank.
        placement: where the stages live, ``"loop"`` or ``"v"`` (``placement_of(schedule)``).
    """
    stages = pipeline_size * virtual_stages
    kinds = COMPUTE if splits_backward(actions) else ("F", "B")
    expected = {(kind, s, i) for kind in kinds for s in range(stages) for i in range(microbatches)}
    seen = [
        (a.kind, a.stage, a.microbatch)
        for rank_actions in actions.values()
        for a in rank_actions
        if a.kind in COMPUTE
    ]
    if sorted(seen) != sorted(expected):
        every = "forward, backward (B) and weight gradient (W)" if "W" in kinds else "forward and backward"
        raise ValueError(f"the schedule does not run every {every} exactly once")

    def rank_of(stage: int) -> int:
        return rank_of_stage(stage, pipeline_size, placement=placement)

    for rank, rank_actions in actions.items():
        for action in rank_actions:
            if action.kind in COMPUTE and rank_of(action.stage) != rank:
                raise ValueError(
                    f"{action} is on rank {rank}, but stage {action.stage} lives on rank "
                    f"{rank_of(action.stage)}"
                )
    sent: set[tuple] = set()  # (kind, stage, microbatch, to rank)
    done: set[tuple] = set()
    available: set[tuple] = set()  # inputs a rank holds: ("F"|"B", stage, microbatch)
    position = {rank: 0 for rank in actions}
    while any(position[r] < len(actions[r]) for r in actions):
        progressed = False
        for rank, rank_actions in actions.items():
            while position[rank] < len(rank_actions):
                a = rank_actions[position[rank]]
                key = (a.stage, a.microbatch)
                if a.kind == "F":
                    ready = a.stage == 0 or ("F", *key) in available
                elif a.kind == "B":
                    ready = ("F", *key) in done and (a.stage == stages - 1 or ("B", *key) in available)
                elif a.kind == "W":
                    ready = ("B", *key) in done
                elif a.kind.startswith("RECV"):
                    ready = (a.kind[-1], a.stage, a.microbatch, rank) in sent
                else:  # a send needs what it sends to have been computed
                    ready = (
                        a.kind[-1],
                        a.stage - 1 if a.kind == "SEND_F" else a.stage + 1,
                        a.microbatch,
                    ) in done
                if not ready:
                    break
                if a.kind in ("F", "B"):
                    done.add((a.kind, *key))
                    neighbour = a.stage + 1 if a.kind == "F" else a.stage - 1
                    if 0 <= neighbour < stages and rank_of(neighbour) == rank:
                        available.add((a.kind, neighbour, a.microbatch))  # handed over locally
                elif a.kind == "W":
                    done.add((a.kind, *key))
                elif a.kind.startswith("SEND"):
                    if rank_of(a.stage) != a.peer:
                        raise ValueError(f"{a} on rank {rank} goes to the wrong rank")
                    sent.add((a.kind[-1], a.stage, a.microbatch, a.peer))
                else:
                    available.add((a.kind[-1], *key))
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(actions[r][position[r]]) for r in actions if position[r] < len(actions[r])}
            raise ValueError(f"deadlock: every rank waits ({stuck})")
    unmatched = sent - {
        (a.kind[-1], a.stage, a.microbatch, r)
        for r, acts in actions.items()
        for a in acts
        if a.kind.startswith("RECV")
    }
    if unmatched:
        raise ValueError(f"sends nobody receives: {sorted(unmatched)[:3]}")


# -- what the theory says ---------------------------------------------------------------------


def bubble_fraction_theory(
    pipeline_size: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
    forward_time: float = 1.0,
    backward_time: float | None = None,
    weight_time: float | None = None,
) -> float:
    """Idle share of each rank's step, what the course measures: idle / (idle + compute).

    For GPipe, 1F1B and interleaved 1F1B that is (p - 1) / (v·m + p - 1), whatever the times.
    Megatron-LM and most papers state the bubble relative to the ideal compute time instead,
    (p - 1) / (v·m) (``bubble_overhead_theory``); the two say the same thing, since
    fraction = overhead / (1 + overhead). For the schedules that split the backward, the idle
    time is ``bubble_time_theory``'s and the compute m·(T_F + T_B + T_W).

    Args:
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        virtual_stages: v, stages per rank (interleaved schedule).
        schedule: one of ``SCHEDULES``.
        forward_time: T_F, one micro-batch's forward through a rank's whole share of the model.
        backward_time: T_B, its backward (the whole of it; in a split schedule its B alone).
        weight_time: T_W, its W (only in a schedule that splits the backward).
    """
    p, m, v = pipeline_size, microbatches, virtual_stages
    if schedule not in SPLIT_BACKWARD:
        _check_times(schedule, weight_time)
        return (p - 1) / (v * m + p - 1)
    forward, backward, weight = _times(schedule, forward_time, backward_time, weight_time)
    enough = {"zb_h1": p, "zb_v": 2 * p - 1, "dualpipe_v": 2 * p}[schedule]
    if m < enough:
        raise UserError(
            f"{schedule}'s closed form assumes the steady state is reached, at least {enough} micro-batches "
            f"for p = {p} (got {m}): simulate_timeline gives the bubble of fewer"
        )
    idle = bubble_time_theory(
        schedule, p, forward_time=forward, backward_time=backward, weight_time=weight, virtual_stages=v
    )
    return idle / (idle + m * (forward + backward + weight))


def bubble_time_theory(
    schedule: str,
    pipeline_size: int,
    *,
    virtual_stages: int = 1,
    forward_time: float = 1.0,
    backward_time: float | None = None,
    weight_time: float | None = None,
) -> float:
    """The time each rank idles in one step (the papers' "bubble"), in the units of the times given.

    - GPipe, 1F1B: (p - 1)(T_F + T_B); interleaved 1F1B: that divided by v.
    - ZB-H1 (Qi et al. 2024, table 1): (p - 1)(T_F + T_B - T_W). A W only fills a gap as long as a
      forward, so for T_W > T_F it is (p - 1)(T_B); in all, (p - 1)(T_F + T_B - min(T_W, T_F)).
    - ZB-V and DualPipeV, with T_F = T_B = T_W, the times they were built for: (p - 1)·T_F / 2, the
      last rank's wait for the first micro-batch to come down p - 1 chunks of half a share each;
      nothing else idles. With other times their fixed orders are no longer the best, and
      ``simulate_timeline`` gives what they cost.

    All three hold once the steady state is reached: at least p micro-batches for ZB-H1, 2p - 1
    for ZB-V, 2p for DualPipeV (``bubble_fraction_theory`` refuses fewer).

    Args:
        schedule: one of ``SCHEDULES``.
        pipeline_size: p, the ranks of the pipeline.
        virtual_stages: v, stages per rank.
        forward_time: T_F, one micro-batch's forward through a rank's whole share of the model.
        backward_time: T_B, its backward (the whole of it; in a split schedule its B alone).
        weight_time: T_W, its W (only in a schedule that splits the backward).
    """
    forward, backward, weight = _times(schedule, forward_time, backward_time, weight_time)
    p = pipeline_size
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * (forward + backward)
    if schedule == "interleaved_1f1b":
        return (p - 1) * (forward + backward) / virtual_stages
    if schedule == "zb_h1":
        return (p - 1) * (forward + backward - min(weight, forward))
    if not forward == backward == weight:
        raise UserError(
            f"{schedule}'s bubble has a closed form only for T_F = T_B = T_W, the times its order was built "
            f"for (got {forward}, {backward}, {weight}): simulate_timeline gives it for any times"
        )
    return (p - 1) * forward / 2


def _check_times(schedule: str, weight_time: float | None) -> None:
    if weight_time is not None and schedule not in SPLIT_BACKWARD:
        _refuse_weight_time(schedule)


def _refuse_weight_time(schedule: str) -> None:
    """A W's time given to ``schedule`` (a name, or "this schedule"), which has no W."""
    raise UserError(
        f"weight_time is the time of a W, and {schedule} does not split the backward into B and W: give its "
        f"whole backward as backward_time, or choose a schedule that splits it ({', '.join(SPLIT_BACKWARD)})"
    )


def _times(schedule, forward_time, backward_time, weight_time) -> tuple[float, float, float]:
    """T_F, T_B and T_W with their defaults: a whole backward of 2 forwards, or B = W = 1 forward."""
    if schedule not in SCHEDULES:
        raise UserError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    _check_times(schedule, weight_time)
    split = schedule in SPLIT_BACKWARD
    backward = (1.0 if split else 2.0) * forward_time if backward_time is None else backward_time
    weight = (1.0 * forward_time if weight_time is None else weight_time) if split else 0.0
    return forward_time, backward, weight


def bubble_overhead_theory(pipeline_size: int, microbatches: int, *, virtual_stages: int = 1) -> float:
    """Idle time relative to the ideal compute time (Megatron-LM's form): (p - 1) / (v·m).

    Args:
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        virtual_stages: v, stages per rank (interleaved schedule).
    """
    return (pipeline_size - 1) / (virtual_stages * microbatches)


def peak_activations_theory(
    schedule: str, pipeline_size: int, microbatches: int, rank: int, *, virtual_stages: int = 1
) -> int:
    """Micro-batches whose activations a rank holds at most (counted per virtual stage).

    In the schedules that split the backward a micro-batch counts until its W (``peak_in_flight``).
    ZB-H1 keeps p on every rank, 1F1B's rank 0 peak, where 1F1B's later ranks hold fewer: what
    fills the bubble is W's whose micro-batches are still held. ZB-V keeps 2p chunks, each half a
    share: p shares again (the paper's "same memory as 1F1B"); DualPipeV keeps 2p + 1 (DeepSeek-V3's
    "PP + 1" for its 2p stages).

    Args:
        schedule: one of ``SCHEDULES``.
        pipeline_size: p, the ranks of the pipeline.
        microbatches: m, the pieces each batch is cut into.
        rank: which rank of the pipeline (rank 0 holds the most under 1F1B).
        virtual_stages: v, stages per rank.
    """
    p, m, v = pipeline_size, microbatches, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule == "zb_h1":
        return min(p, m)
    if schedule == "zb_v":  # fewer micro-batches than 2p - 1 leave the V part empty
        return min(2 * p, m + 1 + rank, 2 * m)
    if schedule == "dualpipe_v":
        return 2 * p + 1
    if m == p:
        return m * v
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)


def peak_in_flight(actions: list[Action]) -> int:
    """Count the forwards whose backward has not run yet, at the worst moment of a rank's list.

    In a schedule that splits the backward a micro-batch counts until its W: after B it still
    holds what W needs (each layer's input and output gradient), less than a whole activation.

    Args:
        actions: one rank's list of actions.
    """
    done = "W" if splits_backward(actions) else "B"  # a split backward frees the last of it at W
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1 if action.kind == done else 0
        peak = max(peak, live)
    return peak


def simulate_timeline(
    actions: dict[int, list[Action]],
    pipeline_size: int,
    *,
    forward_time: float = 1.0,
    backward_time: float | None = None,
    weight_time: float | None = None,
    message_time: float = 0.0,
    durations: dict[tuple[str, int, int], float] | None = None,
) -> dict[int, list[tuple[str, int, int, float, float]]]:
    """Start and end of every forward/backward if each takes the given time (messages free by default).

    Returns {rank: [(kind, stage, microbatch, start, end), ...]}, what ``plots.plot_timeline``
    draws and ``bubble_fraction`` measures.

    Args:
        actions: {rank: its list of actions}, as ``build_schedule`` returns.
        pipeline_size: p, the ranks of the pipeline.
        forward_time: how long one micro-batch's forward through one rank's share of the model
            takes. With v virtual stages a rank's share is cut into v chunks, each 1/v of it:
            that is where interleaving wins.
        backward_time: the same for the backward: the whole backward (default 2, about twice the
            forward), or, in a schedule that splits it, its B alone (default 1).
        weight_time: the same for a W, in a schedule that splits the backward (default 1: B and W
            about equal); a schedule without W's refuses it.
        message_time: how long a message takes from the end of the action that sends it to the
            start of the one on another rank that needs it (0: free, the papers' assumption).
        durations: {(kind, stage, microbatch): time} for the actions that take their own time
            instead (a measured step replayed: what its bubble would have been with no gaps
            between the actions).
    """
    split = splits_backward(actions)
    if weight_time is not None and not split:
        _refuse_weight_time("this schedule")
    if backward_time is None:
        backward_time = 1.0 if split else 2.0
    if weight_time is None:
        weight_time = 1.0
    finished: dict[tuple, float] = {}
    events: dict[int, list] = defaultdict(list)
    clock = {rank: 0.0 for rank in actions}
    pending = {rank: [a for a in acts if a.kind in COMPUTE] for rank, acts in actions.items()}
    rank_of = {(a.kind, a.stage, a.microbatch): rank for rank, acts in pending.items() for a in acts}
    stages = max(a.stage for acts in pending.values() for a in acts) + 1
    virtual_stages = stages // pipeline_size
    duration = {
        "F": forward_time / virtual_stages,
        "B": backward_time / virtual_stages,
        "W": weight_time / virtual_stages,
    }
    while any(pending.values()):
        progressed = False
        for rank, queue in pending.items():
            while queue:
                a = queue[0]
                needs = [("F", a.stage - 1, a.microbatch)] if a.kind == "F" and a.stage > 0 else []
                if a.kind == "B":
                    needs.append(("F", a.stage, a.microbatch))
                    if a.stage < stages - 1:
                        needs.append(("B", a.stage + 1, a.microbatch))
                if a.kind == "W":
                    needs.append(("B", a.stage, a.microbatch))
                if any(n not in finished for n in needs):
                    break
                start = max(
                    [
                        clock[rank],
                        *(finished[n] + (message_time if rank_of[n] != rank else 0.0) for n in needs),
                    ]
                )
                end = start + (durations or {}).get((a.kind, a.stage, a.microbatch), duration[a.kind])
                finished[(a.kind, a.stage, a.microbatch)] = clock[rank] = end
                events[rank].append((a.kind, a.stage, a.microbatch, start, end))
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("the schedule cannot complete (deadlock)")
    return dict(events)


def bubble_fraction(events: dict[int, list[tuple[str, int, int, float, float]]]) -> float:
    """Mean over ranks of the idle share of the step, from start and end times.

    Args:
        events: {rank: [(kind, stage, microbatch, start, end), ...]}, simulated
            (``simulate_timeline``) or measured (``PipelineStats.events``).
    """
    begin = min(e[3] for rank_events in events.values() for e in rank_events)
    end = max(e[4] for rank_events in events.values() for e in rank_events)
    busy = [sum(e[4] - e[3] for e in rank_events) for rank_events in events.values()]
    return sum(1 - b / (end - begin) for b in busy) / len(busy)


# -- the executor ---------------------------------------------------------------------------------


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


class PipelineExecutor:
    """Run one rank's share of a pipeline schedule with real sends and receives.

    Args:
        stages: {stage index: module} for the stages this rank holds (see ``rank_of_stage``).
        num_stages: the stages of the whole pipeline (ranks x virtual stages).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
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
        # The schedules with W actions run each stage's backward in two (split_backward.py).
        self.splitter = BackwardSplitter(list(stages.values())) if schedule in SPLIT_BACKWARD else None
        self.stages, self.num_stages, self.schedule = stages, num_stages, schedule
        self.microbatches, self.loss_fn = microbatches, loss_fn
        self.boundary_shape, self.dtype = tuple(boundary_shape), dtype
        self.measure_memory = measure_memory
        self.device = _device_of(stages.values(), group)
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
        input_chunks = inputs.chunk(m) if has_first else None
        target_chunks = targets.chunk(m) if has_last else None
        inbox = {}  # ("F" | "B", stage, microbatch) -> what that stage receives (activation or gradient)
        held = {}  # (stage, microbatch) -> (input, output, record of a split forward) kept for the backward
        waiting = {}  # (stage, microbatch) -> record of a split forward whose B ran and whose W has not
        outbox = {}  # ("F" | "B", receiving stage, microbatch) -> what to send
        in_flight, losses, stats = [], [], PipelineStats()
        held_bytes = 0
        kept, kept_bytes = {}, 0  # with measure_memory: (stage, microbatch) -> bytes its forward left alive
        with contextlib.ExitStack() as measuring:  # with measure_memory: ends the count even on an error
            live = None
            if self.measure_memory:
                stats.peak_kept_bytes = 0
                live = measuring.enter_context(live_tensor_bytes())
            receives = self._receives_in_order()
            posted = {}  # index of a RECV action -> (work handle, buffer the message lands in)
            started = time.perf_counter()
            stats.clock_start = started
            for index, action in enumerate(self.actions):
                posting = time.perf_counter()
                self._post_receives(receives, posted, done=index - 1)
                stats.posting_s += time.perf_counter() - posting
                s, i, direction = action.stage, action.microbatch, action.kind[-1]
                if action.kind.startswith("RECV"):
                    work, buffer = posted.pop(index)
                    begin = time.perf_counter()
                    work.wait()
                    inbox[(direction, s, i)] = buffer
                    stats.messages.append((action.kind, s, i, begin - started, time.perf_counter() - started))
                elif action.kind.startswith("SEND"):
                    message = outbox.pop((direction, s, i))
                    sent = time.perf_counter() - started
                    stats.messages.append((action.kind, s, i, sent, sent))
                    in_flight.append(
                        comm.isend(
                            message,
                            dst=self._global(action.peer),
                            group=self.group,
                            tag=self._tag(direction, s, i),
                        )
                    )
                    stats.posting_s += time.perf_counter() - started - sent
                elif action.kind == "F":
                    begin = time.perf_counter()
                    x = input_chunks[i] if s == 0 else inbox.pop(("F", s, i)).requires_grad_()
                    alive_before = live.now if live is not None else 0
                    record = None
                    if self.splitter is not None:
                        y, record = self.splitter.forward(self.stages[s], x)
                    else:
                        y = self.stages[s](x)
                    if s == last_stage:
                        y = (
                            self.loss_fn(y, target_chunks[i]) / m
                        )  # each micro-batch counts 1/m: the batch mean
                    if (
                        live is not None
                    ):  # what this forward left alive: kept for its backward, and its output
                        kept[(s, i)] = live.now - alive_before
                        kept_bytes += kept[(s, i)]
                        stats.peak_kept_bytes = max(stats.peak_kept_bytes, kept_bytes)
                    if s == last_stage:
                        losses.append(y.detach())
                    else:
                        self._deliver(("F", s + 1, i), y.detach(), inbox, outbox)
                    held[(s, i)] = (x, y, record)
                    held_bytes += sum(t.numel() * t.element_size() for t in (x, y))
                    stats.peak_activations = max(stats.peak_activations, len(held) + len(waiting))
                    stats.peak_activation_bytes = max(stats.peak_activation_bytes, held_bytes)
                    stats.events.append(("F", s, i, begin - started, time.perf_counter() - started))
                elif action.kind == "W":  # the weights' gradients, from what this micro-batch's B kept
                    begin = time.perf_counter()
                    self.splitter.backward_weights(waiting.pop((s, i)))
                    stats.events.append(("W", s, i, begin - started, time.perf_counter() - started))
                else:
                    begin = time.perf_counter()
                    x, y, record = held.pop((s, i))
                    held_bytes -= sum(t.numel() * t.element_size() for t in (x, y))
                    kept_bytes -= kept.pop((s, i), 0)
                    gradient = None if s == last_stage else inbox.pop(("B", s, i))  # from the next stage
                    if record is not None:  # B alone: the input's gradient now, the weights' at its W
                        input_grad = self.splitter.backward_input(record, y, gradient, x)
                        waiting[(s, i)] = record
                    else:  # the whole backward; on the last stage y is the loss, where backward starts
                        y.backward(gradient)
                        input_grad = x.grad if s > 0 else None
                    if s > 0:
                        self._deliver(("B", s - 1, i), input_grad, inbox, outbox)
                    stats.events.append(("B", s, i, begin - started, time.perf_counter() - started))
            for work in in_flight:
                work.wait()
        stats.step_time_s = time.perf_counter() - started
        self.stats = stats
        return torch.stack(losses).sum() if has_last else None

    def _deliver(self, key: tuple, tensor: torch.Tensor, inbox: dict, outbox: dict) -> None:
        """Hand a tensor to the stage that needs it: directly if it lives on this rank, else via a send."""
        local = rank_of_stage(key[1], self.pipeline_size, placement=self.placement) == self.rank
        (inbox if local else outbox)[key] = tensor
