"""Each rank's schedule as a list of actions, and the checker that replays them all together.

``compute_order`` gives each rank's forwards and backwards in the order it runs them (one
function per schedule, in ``ORDERS``); ``build_schedule`` adds the sends and receives around them;
``check_schedule`` replays every rank at once, with sends that never block and receives that wait
for their send, and refuses a schedule that misses an action, runs a backward before its
forward, or deadlocks. A schedule it accepts cannot hang the executor.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import (
    COMPUTE,
    Action,
    check_schedule_arguments,
    placement_of,
    rank_of_stage,
    splits_backward,
)
from .zero_bubble import dualpipe_v_order, zb_h1_order, zb_v_order


# #region schedules
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
    order_of_rank = ORDERS[schedule]
    return {
        rank: order_of_rank(rank, pipeline_size, microbatches, virtual_stages)
        for rank in range(pipeline_size)
    }


def _gpipe_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """GPipe: every forward, then every backward."""
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def _one_f_one_b_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    """1F1B: p - rank - 1 warm-up forwards, then one forward and one backward in turn, then drain."""
    warmup = min(p - rank - 1, m)
    actions = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", rank, warmup + i), Action("B", rank, i)]
    return actions + [Action("B", rank, i) for i in range(m - warmup, m)]


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


ORDERS = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved_1f1b": _interleaved_order,
    "zb_h1": zb_h1_order,
    "zb_v": zb_v_order,
    "dualpipe_v": dualpipe_v_order,
}
"""Each schedule's order of one rank's forwards and backwards: ``order(rank, p, m, v)``."""


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


# #endregion schedules


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

    def rank_of(stage: int) -> int:
        return rank_of_stage(stage, pipeline_size, placement=placement)

    _check_every_action_once(actions, stages, microbatches)
    for rank, rank_actions in actions.items():
        for action in rank_actions:
            if action.kind in COMPUTE and rank_of(action.stage) != rank:
                raise ValueError(
                    f"{action} is on rank {rank}, but stage {action.stage} lives on rank "
                    f"{rank_of(action.stage)}"
                )
    sent = _replay(actions, stages, rank_of)
    unmatched = sent - {
        (a.kind[-1], a.stage, a.microbatch, r)
        for r, acts in actions.items()
        for a in acts
        if a.kind.startswith("RECV")
    }
    if unmatched:
        raise ValueError(f"sends nobody receives: {sorted(unmatched)[:3]}")


def _check_every_action_once(actions: dict[int, list[Action]], stages: int, microbatches: int) -> None:
    """Every forward and backward (and W, where the backward is split) of every (stage, micro-batch), once."""
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


def _ready(action: Action, rank: int, stages: int, done: set, available: set, sent: set) -> bool:
    """Whether ``action`` can run now on ``rank``: what it computes from, or receives, is there."""
    key = (action.stage, action.microbatch)
    if action.kind == "F":
        return action.stage == 0 or ("F", *key) in available
    if action.kind == "B":
        return ("F", *key) in done and (action.stage == stages - 1 or ("B", *key) in available)
    if action.kind == "W":
        return ("B", *key) in done
    if action.kind.startswith("RECV"):
        return (action.kind[-1], *key, rank) in sent
    # a send needs what it sends to have been computed
    source = action.stage - 1 if action.kind == "SEND_F" else action.stage + 1
    return (action.kind[-1], source, action.microbatch) in done


def _replay(actions: dict[int, list[Action]], stages: int, rank_of: Callable[[int], int]) -> set[tuple]:
    """Run every rank's list together, sends never blocking and receives waiting for their send;
    raise on a deadlock or a send to the wrong rank. Returns the sends made: (kind, stage,
    microbatch, to rank)."""
    sent: set[tuple] = set()
    done: set[tuple] = set()
    available: set[tuple] = set()  # inputs a rank holds: ("F"|"B", stage, microbatch)
    position = {rank: 0 for rank in actions}
    while any(position[r] < len(actions[r]) for r in actions):
        progressed = False
        for rank, rank_actions in actions.items():
            while position[rank] < len(rank_actions):
                a = rank_actions[position[rank]]
                if not _ready(a, rank, stages, done, available, sent):
                    break
                key = (a.stage, a.microbatch)
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
    return sent
