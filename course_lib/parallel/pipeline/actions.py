"""What a pipeline schedule is made of: actions, and which rank holds which stage.

A schedule is, for each rank, an ordered list of ``Action``s: compute a forward (``F``) or a
backward (``B``; in the zero-bubble schedules ``B`` is the input's gradient only and ``W`` the
weights'), or move a tensor to or from a neighbour (``SEND_F``, ``RECV_F``, ``SEND_B``,
``RECV_B``). Writing a schedule as data, not as code that runs it, is what lets the course print
it, check it (``schedules.check_schedule``), simulate it (``theory.simulate_timeline``) and draw
it before anything runs: ``torch.distributed.pipelining`` does the same with its ``_Action``.

Where the stages sit. With v stages per rank ("virtual" stages, or chunks), stage s lives on rank
``rank_of_stage(s)``: round the ranks (``"loop"``: rank r holds r, r + p, r + 2p...), or down and
back up (``"v"``: rank r holds r and 2p - 1 - r), as ZB-V and DualPipeV place them.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from ...checks import check_choice
from ...errors import UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v")
SPLIT_BACKWARD = ("zb_h1", "zb_v", "dualpipe_v")
"""The schedules that split each backward into B (the input's gradient) and W (the weights')."""
WHOLE_BACKWARD = tuple(schedule for schedule in SCHEDULES if schedule not in SPLIT_BACKWARD)
"""The others, each backward one pass: their bubble is (p - 1) / (v m) (``bubble_overhead_theory``),
and they are the ones the planner prices."""
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


def check_schedule_arguments(
    schedule: str, pipeline_size: int, microbatches: int, *, virtual_stages: int = 1
) -> None:
    check_choice("schedule", schedule, SCHEDULES)
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
