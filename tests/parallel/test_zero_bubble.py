"""Zero-bubble pipelines: the backward split into B and W, the ZB-H1, ZB-V and DualPipeV schedules
checked, simulated and held to their theory, and run equal to 1F1B, to one process and to
``torch.distributed.pipelining``."""

from __future__ import annotations

import pytest
import test_pipeline as pipeline_tests
import torch
from test_pipeline import _named_grads
from torch import nn

from course_lib import models
from course_lib.distributed import runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import pipeline as pp
from course_lib.parallel.memory import live_tensor_bytes
from course_lib.parallel.pipeline.zero_bubble import BackwardSplitter

ZERO_BUBBLE = [("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2)]
SEQ, D_MODEL, BATCH = pipeline_tests.SEQ, pipeline_tests.D_MODEL, 12  # 8 pipeline entries: a V of 4 ranks
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _enough(schedule: str, p: int) -> int:
    return {"zb_h1": p, "zb_v": 2 * p - 1, "dualpipe_v": 2 * p}[schedule]


@pytest.mark.parametrize("schedule, v", ZERO_BUBBLE)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_schedules_are_valid_and_hold_their_theory(schedule, v, p):
    placement = pp.placement_of(schedule)
    for m in range(2 * p if schedule == "dualpipe_v" else 1, 4 * p + 2):
        actions = pp.build_schedule(schedule, p, m, virtual_stages=v)
        pp.check_schedule(actions, p, m, virtual_stages=v, placement=placement)
        assert pp.splits_backward(actions)
        for rank in range(p):
            assert pp.peak_in_flight(actions[rank]) == pp.peak_activations_theory(
                schedule, p, m, rank, virtual_stages=v
            )
        if m < _enough(schedule, p):
            continue
        # the papers' bubbles: ZB-H1's for any times, the V's for the equal times they were built for
        times = (
            [(1, 1, 1), (1, 2, 1), (1, 1, 0.5), (1, 2, 2), (2, 1, 1)] if schedule == "zb_h1" else [(1, 1, 1)]
        )
        for forward, backward, weight in times:
            kw = dict(forward_time=forward, backward_time=backward, weight_time=weight)
            simulated = pp.bubble_fraction(pp.simulate_timeline(actions, p, **kw))
            assert simulated == pytest.approx(
                pp.bubble_fraction_theory(p, m, virtual_stages=v, schedule=schedule, **kw)
            ), (m, kw)


def test_zero_bubble_shrinks_the_bubble_as_the_papers_say():
    p, m = 4, 8
    equal = dict(forward_time=1, backward_time=1, weight_time=1)
    one_f_one_b = pp.bubble_time_theory("1f1b", p, forward_time=1, backward_time=2)  # B + W = 2
    assert pp.bubble_time_theory("zb_h1", p, **equal) == pytest.approx(one_f_one_b / 3)  # "a third"
    assert pp.bubble_time_theory("zb_v", p, virtual_stages=2, **equal) == pytest.approx(one_f_one_b / 6)
    # ZB-H1 keeps 1F1B's rank-0 peak (p) on every rank; ZB-V 2p half-size chunks, the same bytes
    assert [pp.peak_activations_theory("zb_h1", p, m, r) for r in range(p)] == [p] * p
    assert [pp.peak_activations_theory("zb_v", p, m, r, virtual_stages=2) for r in range(p)] == [2 * p] * p
    assert pp.peak_activations_theory("dualpipe_v", p, m, 0, virtual_stages=2) == 2 * p + 1


def test_a_zero_bubble_schedule_is_readable():
    shown = [" ".join(map(str, actions)) for actions in pp.build_schedule("zb_h1", 2, 3).values()]
    assert shown == [
        "F0.0 SEND_F1.0->1 F0.1 SEND_F1.1->1 RECV_B0.0<-1 B0.0 W0.0 F0.2 SEND_F1.2->1 RECV_B0.1<-1 B0.1 "
        "W0.1 RECV_B0.2<-1 B0.2 W0.2",
        "RECV_F1.0<-0 F1.0 B1.0 SEND_B0.0->0 RECV_F1.1<-0 F1.1 B1.1 SEND_B0.1->0 W1.0 RECV_F1.2<-0 F1.2 "
        "B1.2 SEND_B0.2->0 W1.1 W1.2",
    ]
    # the V: rank 0 holds the first and the last stage, rank 3 the two middle ones, back to back
    v = pp.build_schedule("zb_v", 4, 8, virtual_stages=2)
    assert {a.stage for a in v[0] if a.kind == "F"} == {0, 7}
    assert {a.stage for a in v[3] if a.kind == "F"} == {3, 4}
    assert not any(a.kind.startswith(("SEND", "RECV")) and a.stage in (3, 4) and a.peer == 3 for a in v[3])


def test_broken_zero_bubble_schedules_are_caught():
    actions = pp.build_schedule("zb_h1", 2, 2)
    w_first = dict(actions)
    w_first[1] = sorted(actions[1], key=lambda a: a.kind != "W")  # a W before its B
    with pytest.raises(ValueError, match="deadlock"):
        pp.check_schedule(w_first, 2, 2)
    no_w = dict(actions)
    no_w[0] = [a for a in actions[0] if (a.kind, a.microbatch) != ("W", 1)]
    with pytest.raises(ValueError, match=r"every forward, backward \(B\) and weight gradient \(W\)"):
        pp.check_schedule(no_w, 2, 2)
    v = pp.build_schedule("zb_v", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="stage 3 lives on rank 1"):
        pp.check_schedule(v, 2, 4, virtual_stages=2)  # checked as a loop: stage 3 is rank 0's in a V


def test_bad_zero_bubble_input_gets_one_clear_error():
    with pytest.raises(UserError, match="even number of chunks per rank, not 3: pass virtual_stages=2"):
        pp.build_schedule("zb_v", 2, 4, virtual_stages=3)
    with pytest.raises(UserError, match="runs exactly 2 chunks per rank"):
        pp.build_schedule("dualpipe_v", 2, 8, virtual_stages=4)
    with pytest.raises(UserError, match="at least 2p = 8 micro-batches, not 6"):
        pp.build_schedule("dualpipe_v", 4, 6, virtual_stages=2)
    with pytest.raises(UserError, match="1f1b does not split the backward into B and W"):
        pp.bubble_fraction_theory(2, 4, schedule="1f1b", weight_time=1)
    with pytest.raises(UserError, match="this schedule does not split the backward into B and W"):
        pp.simulate_timeline(pp.build_schedule("1f1b", 2, 4), 2, weight_time=1)
    with pytest.raises(UserError, match="closed form only for T_F = T_B = T_W"):
        pp.bubble_time_theory("zb_v", 2, virtual_stages=2, backward_time=2)
    with pytest.raises(UserError, match="at least 3 micro-batches for p = 2"):
        pp.bubble_fraction_theory(2, 2, virtual_stages=2, schedule="zb_v")
    with pytest.raises(UserError, match="holds 'extra' and sub-layers too"):
        BackwardSplitter([_LayerWithChildren()])


class _LayerWithChildren(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.extra = nn.Parameter(torch.zeros(2))


# -- B and W on one process --------------------------------------------------------------------


def test_b_computes_only_the_input_gradient_and_w_the_rest_exactly():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
    x, grad = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    stage(x).backward(grad)
    expected_input, expected = x.grad.clone(), [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    splitter = BackwardSplitter([stage])
    x = x.detach().requires_grad_()
    output, record = splitter.forward(stage, x)
    torch.testing.assert_close(splitter.backward_input(record, output, grad, x), expected_input)
    assert all(p.grad is None for p in stage.parameters())  # B left the weights alone
    splitter.backward_weights(record)
    for got, want in zip((p.grad for p in stage.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want)
    splitter.remove()
    assert stage(x).grad_fn.name() != "_StitchBackward"  # the hooks are gone


def test_after_b_a_stage_keeps_only_what_w_needs():
    """B needs the whole saved forward; W only each linear layer's input and output gradient."""
    torch.manual_seed(0)
    batch, width, hidden = 64, 32, 128
    stage = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
    x, grad = torch.randn(batch, width, requires_grad=True), torch.randn(batch, width)
    splitter = BackwardSplitter([stage])
    floats = 4
    with live_tensor_bytes() as live:
        output, record = splitter.forward(stage, x)
        # the forward keeps: the first layer's output (GELU's input), GELU's output, the stage's output
        assert live.now == pytest.approx(floats * (2 * batch * hidden + batch * width), abs=8)
        input_grad = splitter.backward_input(record, output, grad, x)
        del output
        # W needs: the second layer's input (GELU's output) and the first layer's output gradient
        # (x and the incoming gradient were made outside); the input's gradient is on its way out
        kept_for_w = live.now - input_grad.numel() * floats
        assert kept_for_w == pytest.approx(floats * (batch * hidden + batch * hidden), abs=8)
        splitter.backward_weights(record)
        grads = sum(p.grad.numel() for p in stage.parameters()) * floats
        assert live.now - input_grad.numel() * floats - grads == pytest.approx(0, abs=8)


# -- run on real processes ------------------------------------------------------------------------


def _model_and_batch():
    return pipeline_tests._model_and_batch(BATCH)


def _single():
    model, inputs, targets = _model_and_batch()
    loss = models.lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach(), _named_grads(model, [model])


# micro-batches for each pipeline size: none divides by p where the batch of 12 allows it
MICROBATCHES = {2: {"1f1b": 3, "zb_h1": 3, "zb_v": 3, "dualpipe_v": 4}, 3: dict.fromkeys(
    ("1f1b", "zb_h1", "zb_v", "dualpipe_v"), 4) | {"dualpipe_v": 6}, 4: {"1f1b": 6, "zb_h1": 6, "zb_v": 6,
    "dualpipe_v": 12}}  # fmt: skip


def _every_schedule():
    """On each rank: (loss, gradients, peak in flight) of a step under 1F1B and each zero-bubble schedule."""
    p, rank = runtime.world_size(), runtime.rank()
    results = {}
    for schedule, v in [("1f1b", 1), *ZERO_BUBBLE]:
        m = MICROBATCHES[p][schedule]
        model, inputs, targets = _model_and_batch()
        stages = pp.split_model(model, p * v)
        mine = {
            s: stages[s]
            for s in pp.stages_on_rank(rank, p, virtual_stages=v, placement=pp.placement_of(schedule))
        }
        executor = pp.PipelineExecutor(mine, p * v, schedule, m, models.lm_loss, (BATCH // m, SEQ, D_MODEL))
        loss = executor.step(inputs, targets)
        assert {e[0] for e in executor.stats.events} == (
            {"F", "B", "W"} if v == 2 or schedule == "zb_h1" else {"F", "B"}
        )
        results[schedule] = (loss, _named_grads(model, mine.values()), executor.stats.peak_activations)
    return results


@pytest.fixture(scope="module")
def single():
    return launch(_single, 1)[0]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zero_bubble_gradients_equal_1f1b_and_one_process(p, single):
    expected_loss, expected = single
    ranks = launch(_every_schedule, p)
    for schedule in ("1f1b", "zb_h1", "zb_v", "dualpipe_v"):
        v = 2 if schedule in pp.V_SHAPED else 1
        m = MICROBATCHES[p][schedule]
        grads, losses = {}, []
        for rank, results in enumerate(ranks):
            loss, rank_grads, peak = results[schedule]
            grads.update(rank_grads)
            losses += [loss] if loss is not None else []
            assert peak == pp.peak_activations_theory(schedule, p, m, rank, virtual_stages=v), (
                schedule,
                rank,
            )
        assert len(losses) == 1  # the last stage's rank: rank 0 in a V
        torch.testing.assert_close(losses[0], expected_loss, **TOLERANCE)
        assert sorted(grads) == sorted(expected)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], **TOLERANCE, msg=f"{schedule} {name}")
            if schedule != "1f1b":  # and equal to 1F1B's, run in the same processes
                one_f_one_b = next(r["1f1b"][1][name] for r in ranks if name in r["1f1b"][1])
                torch.testing.assert_close(grad, one_f_one_b, **TOLERANCE, msg=f"{schedule} {name}")


def _torch_zero_bubble(schedule: str, m: int):
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    model, inputs, targets = _model_and_batch()
    p, rank = runtime.world_size(), runtime.rank()
    v = 2 if schedule in pp.V_SHAPED else 1
    stages = pp.split_model(model, p * v)
    mine = pp.stages_on_rank(rank, p, virtual_stages=v, placement=pp.placement_of(schedule))
    torch_stages = [PipelineStage(stages[s], s, p * v, torch.device("cpu")) for s in mine]
    runner = {
        "zb_h1": ScheduleInterleavedZeroBubble,  # with one stage per rank: ZB-H1 ("ZB1P")
        "zb_v": ScheduleZBVZeroBubble,
        "dualpipe_v": ScheduleDualPipeV,
    }[schedule](torch_stages, m, loss_fn=models.lm_loss)
    runner.step(inputs if 0 in mine else None, target=targets if p * v - 1 in mine else None, losses=[])
    return _named_grads(model, [stages[s] for s in mine])


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v", "dualpipe_v"])
def test_the_course_zero_bubble_schedules_equal_torch_pipelining(schedule, single):
    _, expected = single
    theirs = {}
    for rank_grads in launch(_torch_zero_bubble, 2, schedule, 4):
        theirs.update(rank_grads)
    assert sorted(theirs) == sorted(expected)
    for name, grad in theirs.items():
        torch.testing.assert_close(grad, expected[name], **TOLERANCE, msg=name)
