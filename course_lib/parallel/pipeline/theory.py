"""What the theory says: the bubble and the activations in closed form, and a simulator.

The closed forms (``bubble_fraction_theory``, ``bubble_time_theory``, ``peak_activations_theory``)
are what the papers state; ``simulate_timeline`` replays any schedule with given times for F, B,
W and the messages, and ``bubble_fraction`` measures the idle share of a timeline, simulated or
measured by the executor: the tests hold the three equal where the papers' assumptions hold.
"""

from __future__ import annotations

from collections import defaultdict

from ...checks import check_choice
from ...errors import UserError
from .actions import COMPUTE, SCHEDULES, SPLIT_BACKWARD, Action, splits_backward


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
    check_choice("schedule", schedule, SCHEDULES)
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
