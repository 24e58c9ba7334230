"""Solution of lab 5: the 1F1B pipeline schedule, written as each rank's list of actions.

A pipeline of p ranks (stage s on rank s) cuts each batch into m micro-batches. GPipe runs all m
forwards, then all m backwards: every rank keeps m micro-batches' activations. 1F1B (one forward,
one backward) starts backwards as early as possible: rank r runs ``p - r - 1`` forwards of
warm-up, then alternates one forward and one backward, then drains the last backwards. The bubble
is the same as GPipe's, (p - 1)/(m + p - 1) of the step, but rank r never holds more than
``p - r`` micro-batches' activations.

A schedule here is, for each rank, its list of ``Action``s (``course_lib.parallel.pipeline``):
``F`` and ``B`` compute a stage's forward or backward of a micro-batch; ``RECV_F`` / ``SEND_F``
move an activation to the next stage, ``RECV_B`` / ``SEND_B`` a gradient to the previous one.
``check_schedule`` replays a schedule and says what is wrong with it; the course's
``PipelineExecutor`` runs it with real sends and receives.

The optional part turns 1F1B into ZB-H1 (``compute_order_zb_h1``): the backward split into B (the
input's gradient, sent back at once) and W (the weights' gradient, put off to fill the bubble).

Check your work (every property, for several p and m):

    python -m course_lib.tools.labs check lab5_pipeline
"""

from __future__ import annotations

from course_lib.parallel.pipeline import Action


def compute_order_1f1b(rank: int, pipeline_size: int, microbatches: int) -> list[Action]:
    """Rank ``rank``'s forwards and backwards of its stage (stage = rank), in 1F1B's order."""
    # BEGIN SOLUTION: 1F1B's aim is to hold as few micro-batches at once as it can without leaving a rank idle once the pipeline is full: a stage starts backwards as soon as one can reach it, and after that never runs two forwards in a row while a backward is ready. Ask how many forwards stage r can run before the first backward reaches it. Pitfall: with fewer micro-batches than stages there are fewer forwards to warm up with
    warmup = min(pipeline_size - rank - 1, microbatches)
    actions = [Action("F", rank, i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [Action("F", rank, warmup + i), Action("B", rank, i)]
    actions += [Action("B", rank, i) for i in range(microbatches - warmup, microbatches)]
    return actions
    # END SOLUTION


def with_messages(rank: int, pipeline_size: int, compute: list[Action]) -> list[Action]:
    """``compute`` with the receives each action needs before it and the sends it makes after it."""
    actions = []
    # BEGIN SOLUTION: a forward needs the previous stage's activation (except on the first stage) and sends its output to the next stage (except on the last); a backward needs the next stage's gradient (except on the last) and sends the input's gradient to the previous (except on the first). A message names the stage that receives it and the peer rank
    last = pipeline_size - 1
    for action in compute:
        stage, microbatch = action.stage, action.microbatch
        if action.kind == "W":  # the optional part: a W uses what its B left here, no message
            actions.append(action)
        elif action.kind == "F":
            if stage > 0:
                actions.append(Action("RECV_F", stage, microbatch, peer=rank - 1))
            actions.append(action)
            if stage < last:
                actions.append(Action("SEND_F", stage + 1, microbatch, peer=rank + 1))
        else:
            if stage < last:
                actions.append(Action("RECV_B", stage, microbatch, peer=rank + 1))
            actions.append(action)
            if stage > 0:
                actions.append(Action("SEND_B", stage - 1, microbatch, peer=rank - 1))
    # END SOLUTION
    return actions


def schedule_1f1b(pipeline_size: int, microbatches: int) -> dict[int, list[Action]]:
    """Every rank's complete list of actions for 1F1B."""
    return {
        rank: with_messages(rank, pipeline_size, compute_order_1f1b(rank, pipeline_size, microbatches))
        for rank in range(pipeline_size)
    }


# -- the optional part: from 1F1B to ZB-H1 ---------------------------------------------------------


def compute_order_zb_h1(rank: int, pipeline_size: int, microbatches: int) -> list[Action]:
    """Rank ``rank``'s F, B and W actions in ZB-H1's order: 1F1B's, each backward split into B and W."""
    # BEGIN SOLUTION: start from your 1F1B order; a B now computes only the input's gradient, and its W (same stage, same micro-batch) may come any time after it: rank r puts off W's to fill the idle slots that 1F1B leaves it. Pitfall: every W must run before the step ends, and a W never comes before its B
    actions, put_off = [], []
    for action in compute_order_1f1b(rank, pipeline_size, microbatches):
        actions.append(action)
        if action.kind == "B":
            put_off.append(action.microbatch)
            if len(put_off) > rank:
                actions.append(Action("W", rank, put_off.pop(0)))
    actions += [Action("W", rank, i) for i in put_off]
    return actions
    # END SOLUTION


def schedule_zb_h1(pipeline_size: int, microbatches: int) -> dict[int, list[Action]]:
    """Every rank's complete list of actions for ZB-H1 (with_messages must let W's through)."""
    return {
        rank: with_messages(rank, pipeline_size, compute_order_zb_h1(rank, pipeline_size, microbatches))
        for rank in range(pipeline_size)
    }
