"""Pipeline schedules are valid and hold the activations theory says; the executor's gradients are exact."""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import pipeline as pp
from course_lib.parallel import recompute
from course_lib.plan import activations
from course_lib.tools import plots

CASES = [(schedule, p, m, 1) for schedule in ("gpipe", "1f1b") for p in (2, 4) for m in (4, 8)] + [
    ("interleaved_1f1b", p, m, 2) for p in (2, 4) for m in (4, 8)
]
SEQ, D_MODEL, LAYERS, BATCH = 16, 32, 6, 8  # 8 pipeline entries: embedding, 6 blocks, head
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_schedules_are_valid_and_hold_the_activations_theory_says(schedule, p, m, v):
    actions = pp.build_schedule(schedule, p, m, virtual_stages=v)
    pp.check_schedule(actions, p, m, virtual_stages=v)  # complete, causal, matched, deadlock-free
    for rank in range(p):
        assert pp.peak_in_flight(actions[rank]) == pp.peak_activations_theory(
            schedule, p, m, rank, virtual_stages=v
        )
    if schedule == "gpipe":
        assert all(pp.peak_in_flight(actions[r]) == m for r in range(p))  # GPipe keeps all m
    if schedule == "1f1b":
        assert [pp.peak_in_flight(actions[r]) for r in range(p)] == [min(p - r, m) for r in range(p)]
    # with equal forward and backward times the idle share is exactly (p - 1) / (v m + p - 1)
    timeline = pp.simulate_timeline(actions, p, forward_time=1, backward_time=1)
    assert pp.bubble_fraction(timeline) == pytest.approx(pp.bubble_fraction_theory(p, m, virtual_stages=v))


def test_a_schedule_is_readable():
    shown = [" ".join(map(str, actions)) for actions in pp.build_schedule("1f1b", 2, 3).values()]
    assert shown == [
        "F0.0 SEND_F1.0->1 F0.1 SEND_F1.1->1 RECV_B0.0<-1 B0.0 F0.2 SEND_F1.2->1 RECV_B0.1<-1 B0.1 "
        "RECV_B0.2<-1 B0.2",
        "RECV_F1.0<-0 F1.0 B1.0 SEND_B0.0->0 RECV_F1.1<-0 F1.1 B1.1 SEND_B0.1->0 RECV_F1.2<-0 F1.2 B1.2 "
        "SEND_B0.2->0",
    ]


def test_broken_schedules_are_caught():
    actions = pp.build_schedule("1f1b", 2, 2)
    swapped = dict(actions)
    swapped[1] = [a for a in actions[1] if a.kind != "RECV_F"]  # rank 1 never receives its inputs
    with pytest.raises(ValueError, match="deadlock"):
        pp.check_schedule(swapped, 2, 2)
    backwards_first = dict(actions)
    backwards_first[0] = sorted(actions[0], key=lambda a: a.kind != "B")
    with pytest.raises(ValueError, match="deadlock"):
        pp.check_schedule(backwards_first, 2, 2)
    missing = {r: [a for a in acts if (a.kind, a.microbatch) != ("B", 1)] for r, acts in actions.items()}
    with pytest.raises(ValueError, match="exactly once"):
        pp.check_schedule(missing, 2, 2)


def _model_and_batch(batch: int = BATCH):
    inputs, targets, vocabulary = data.zen_windows(seq_len=SEQ)
    torch.manual_seed(0)
    model = models.TinyTransformer(
        len(vocabulary), d_model=D_MODEL, n_heads=4, n_layers=LAYERS, max_seq_len=SEQ
    )
    return model, inputs[:batch], targets[:batch]


def _named_grads(model, modules) -> dict[str, torch.Tensor]:
    held = {id(p) for module in modules for p in module.parameters()}
    return {name: p.grad.clone() for name, p in model.named_parameters() if id(p) in held}


def _single_grads():
    model, inputs, targets = _model_and_batch()
    loss = models.lm_loss(model(inputs), targets)
    loss.backward()
    return loss.detach(), _named_grads(model, [model])


def _course_pipeline(schedule: str, m: int, v: int):
    model, inputs, targets = _model_and_batch()
    pipeline = pp.apply_pipeline_parallel(model, schedule=schedule, virtual_stages=v)  # the outer verb
    p, rank = runtime.world_size(), runtime.rank()
    assert sorted(pipeline.stages) == [s for s in range(p * v) if pp.rank_of_stage(s, p) == rank]
    executor = pipeline.executor(
        microbatches=m, loss_fn=models.lm_loss, boundary_shape=(BATCH // m, SEQ, D_MODEL)
    )
    loss = executor.step(inputs, targets)
    return loss, _named_grads(model, pipeline.stages.values()), executor.stats.peak_activations


@pytest.fixture(scope="module")
def single():
    return launch(_single_grads, 1)[0]


@pytest.mark.parametrize(
    "schedule, p, m, v",
    [
        ("gpipe", 2, 4, 1),
        ("1f1b", 2, 4, 1),
        ("gpipe", 4, 8, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved_1f1b", 2, 4, 2),
        ("interleaved_1f1b", 4, 4, 2),
    ],
)
def test_executor_gradients_equal_one_process(schedule, p, m, v, single):
    expected_loss, expected_grads = single
    ranks = launch(_course_pipeline, p, schedule, m, v)
    grads = {}
    for rank, (_loss, rank_grads, peak) in enumerate(ranks):
        grads.update(rank_grads)
        # measured while running
        assert peak == pp.peak_activations_theory(schedule, p, m, rank, virtual_stages=v)
    torch.testing.assert_close(ranks[p - 1][0], expected_loss, **TOLERANCE)  # the last stage's rank
    assert sorted(grads) == sorted(expected_grads)  # every parameter lives on exactly one rank
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **TOLERANCE, msg=name)


def _torch_pipeline(schedule: str, m: int, v: int):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    model, inputs, targets = _model_and_batch()
    p, rank = runtime.world_size(), runtime.rank()
    stages = pp.split_model(model, p * v)
    mine = [s for s in range(p * v) if pp.rank_of_stage(s, p) == rank]
    torch_stages = [PipelineStage(stages[s], s, p * v, torch.device("cpu")) for s in mine]
    if schedule == "interleaved_1f1b":
        runner = ScheduleInterleaved1F1B(torch_stages, m, loss_fn=models.lm_loss)
    else:
        runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
            torch_stages[0], m, loss_fn=models.lm_loss
        )
    losses = []
    runner.step(inputs if 0 in mine else None, target=targets if p * v - 1 in mine else None, losses=losses)
    return _named_grads(model, [stages[s] for s in mine])


@pytest.mark.parametrize(
    "schedule, p, m, v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2)]
)
def test_course_pipeline_equals_torch_pipelining(schedule, p, m, v):
    ours, theirs = {}, {}
    for rank_result in launch(_course_pipeline, p, schedule, m, v):
        ours.update(rank_result[1])
    for rank_result in launch(_torch_pipeline, p, schedule, m, v):
        theirs.update(rank_result)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], **TOLERANCE, msg=name)


def test_timelines_are_drawn_from_a_schedule_and_from_a_run(tmp_path):
    schedule = pp.simulate_timeline(pp.build_schedule("interleaved_1f1b", 2, 4, virtual_stages=2), 2)
    drawn = plots.plot_timeline(schedule, path=tmp_path / "schedule.png", pipeline_size=2)
    legend = [text.get_text() for text in drawn.axes[0].get_legend().get_texts()]
    assert legend == [
        "forward (chunk 0, 2, ...)", "backward (chunk 0, 2, ...)",
        "forward (chunk 1, 3, ...)", "backward (chunk 1, 3, ...)", "idle (the bubble)",
    ]  # fmt: skip
    assert drawn.axes[0].get_xlabel() == "time (one forward = 1)"
    stats = launch(_stats, 2)
    events = pp.on_one_clock(dict(enumerate(stats)))
    drawn = plots.plot_timeline(events, path=tmp_path / "measured.png", title="measured", measured=True)
    assert drawn.axes[0].get_xlabel() == "time since the step started (ms)"
    for name in ("schedule.png", "measured.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(len(rank_events) == 2 * 4 for rank_events in events.values())  # 4 forwards, 4 backwards
    assert all(start <= end for rank_events in events.values() for *_, start, end in rank_events)
    # one clock: each rank's events shifted by how long after the first rank it started
    first = min(rank_stats.clock_start for rank_stats in stats)
    for rank, rank_stats in enumerate(stats):
        shift = rank_stats.clock_start - first
        assert events[rank][0][3] == pytest.approx(shift + rank_stats.events[0][3])
    assert min(rank_events[0][3] for rank_events in events.values()) < 0.1  # seconds after the first start


def _stats():
    model, inputs, targets = _model_and_batch()
    p, rank = runtime.world_size(), runtime.rank()
    stages = pp.split_model(model, p)
    executor = pp.PipelineExecutor(
        {rank: stages[rank]}, p, "1f1b", 4, models.lm_loss, (BATCH // 4, SEQ, D_MODEL)
    )
    executor.step(inputs, targets)
    assert 0 <= executor.stats.bubble_fraction < 1
    return executor.stats


def test_bad_inputs_get_clear_errors():
    model, inputs, targets = _model_and_batch()
    with pytest.raises(UserError, match="cannot cut 8 layers into 9 stages"):
        pp.split_model(model, 9)
    with pytest.raises(UserError, match="unknown schedule 'zero_bubble'"):
        pp.build_schedule("zero_bubble", 2, 4)
    with pytest.raises(UserError, match="use a number of micro-batches that is a multiple of 4, not 6"):
        pp.build_schedule("interleaved_1f1b", 4, 6, virtual_stages=2)
    with pytest.raises(UserError, match="virtual stages need schedule interleaved_1f1b"):
        pp.build_schedule("1f1b", 2, 4, virtual_stages=2)
    with pytest.raises(UserError, match="cut points"):
        pp.split_model(model, 3, cut_points=[5, 2])
    with pytest.raises(UserError, match="model must be an nn.Sequential of layers"):
        pp.apply_pipeline_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="unknown schedule 'zero_bubble'"):
        pp.apply_pipeline_parallel(model, schedule="zero_bubble")
    message = launch(_uneven_batch, 2)[0]
    assert "a batch of 8 samples does not split into 3 equal micro-batches" in message


def _uneven_batch():
    model, inputs, targets = _model_and_batch()
    stages = pp.split_model(model, 2)
    rank = runtime.rank()
    executor = pp.PipelineExecutor({rank: stages[rank]}, 2, "gpipe", 3, models.lm_loss, (3, SEQ, D_MODEL))
    try:
        executor.step(inputs, targets)
    except UserError as error:
        return str(error)
    return "no error"


def _cut_badly(layers: str, schedule: str):
    """One step of two stages of a model whose cut is wrong for its pipeline."""
    torch.manual_seed(0)
    model = {
        "wider": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),  # 8 wide, not 4
        "tuple": torch.nn.Sequential(torch.nn.LSTM(4, 4, batch_first=True), torch.nn.Linear(4, 2)),
    }[layers]
    executor = pp.apply_pipeline_parallel(model, schedule=schedule).executor(
        microbatches=2, loss_fn=torch.nn.functional.cross_entropy, boundary_shape=(3, 4)
    )
    executor.step(torch.randn(6, 4), torch.randint(0, 2, (6,)))


@pytest.mark.parametrize(
    "layers, schedule, message",
    [
        ("wider", "1f1b", "stage 0's output is (3, 8) of torch.float32, but the next stage receives into "
         "boundary_shape=(3, 4)"),
        ("tuple", "1f1b", "stage 0 returned a tuple, not a tensor"),
        ("tuple", "zb_h1", "every layer with weights must return one tensor: LSTM returns a tuple"),
    ],
)  # fmt: skip
def test_a_cut_whose_message_the_next_stage_cannot_receive_is_refused_in_one_line(layers, schedule, message):
    """Sent, a message of another size would abort the receiving process inside gloo (status -6)."""
    with pytest.raises(UserError) as raised:
        launch(_cut_badly, 2, layers, schedule, timeout_s=60)
    assert message in str(raised.value)


def _parameter_free_first_stage(schedule: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 2))  # stages [ReLU], [Linear]
    whole = copy.deepcopy(model)
    inputs, targets = torch.randn(6, 4), torch.randint(0, 2, (6,))
    pipeline = pp.apply_pipeline_parallel(model, schedule=schedule)
    loss_fn = torch.nn.functional.cross_entropy
    pipeline.executor(microbatches=3, loss_fn=loss_fn, boundary_shape=(2, 4)).step(inputs, targets)
    torch.nn.functional.cross_entropy(whole(inputs), targets).backward()
    wanted = list(whole[runtime.rank()].parameters())
    pairs = zip(pipeline.parameters(), wanted, strict=True)
    return max(((p.grad - w.grad).abs().max().item() for p, w in pairs), default=0.0)  # rank 0 holds none


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_first_stage_without_weights_trains_like_one_process(schedule):
    """A first stage without weights (a ReLU) on an input without a gradient has nothing to
    differentiate: its backward is skipped, not an autograd error, and the next stage's gradients
    are one process's."""
    assert max(launch(_parameter_free_first_stage, 2, schedule)) < 1e-6


@pytest.fixture(scope="module")
def pipeline_bench() -> dict:
    """``bench pipeline`` at 2 stages, run once for the tests of its transformer and compute-bound rows.
    Half the default hidden width: a micro-batch's forward still takes over 10 ms against a message
    of 130 kB (compute-bound), in half the time. (A quarter put ZB-V's half-stages at 3 ms, where
    a loaded machine moved its bubble 0.21 off the theory.)"""
    from conftest import run_bench

    sizes = "--stages 2 --d-model 16 --seq 8 --batch 8 --steps 3 --warmup 1 --bubble-hidden 4096"
    return run_bench("pipeline", *sizes.split())


@pytest.mark.slow
@pytest.mark.timing
def test_pipeline_benchmark_prints_the_promised_json(pipeline_bench):
    from conftest import assert_accounted

    rows = pipeline_bench["rows"]
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [
        (s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (4, 8)
    ]
    for row in rows:
        assert row["peak_activations_measured"] == row["peak_activations_theory"]
        if row["schedule"] == "1f1b" and row["microbatches"] == 8:
            assert_accounted(row, ["course", "torch"])
        assert 0 <= row["bubble_measured"] < 1 and row["bubble_theory"] == pytest.approx(
            pp.bubble_fraction_theory(2, row["microbatches"], virtual_stages=row["virtual_stages"])
        )
        assert row["ratio"] > 0


@pytest.mark.slow
@pytest.mark.timing
def test_where_stages_compute_far_longer_than_a_message_the_measured_bubble_is_the_theory(pipeline_bench):
    """The benchmark's compute-bound rows: equal stages of wide MLP blocks, kilobyte messages.

    ``bench pipeline`` on this machine, with its default steps, measures these bubbles (on one clock,
    over the window common to both ranks) 0.01 to 0.04 above (p - 1) / (m + p - 1); the margin here
    is wider because the test shares the machine's cores with the rest of the suite.
    """
    result = pipeline_bench
    rows = result["compute_bound_rows"]
    assert [(r["schedule"], r["stages"], r["microbatches"]) for r in rows] == [
        (s, 2, m) for s in ("gpipe", "1f1b") for m in (4, 8)
    ]
    for row in rows:
        assert row["bubble_theory"] == pytest.approx(1 / (row["microbatches"] + 1))
        # compute-bound: a micro-batch's forward takes milliseconds, its message a few hundred kB
        assert row["forward_ms_per_microbatch"] > 2 and row["message_bytes"] < 1e6
        assert abs(row["bubble_measured"] - row["bubble_theory"]) < 0.15, row
    assert result["compute_bound_max_bubble_error"] == max(abs(r["bubble_error"]) for r in rows)


def test_the_compute_bound_rows_are_measured_only_where_each_stage_has_its_own_core():
    from course_lib.tools import bench

    assert bench.stage_counts_with_a_core_each([2, 4, 8], cores=4) == [2, 4]
    assert bench.stage_counts_with_a_core_each([4], cores=2) == []


# -- the memory of the micro-batches in flight -------------------------------------------------


CASES = [
    (schedule, m, policy)
    for schedule, m in (("gpipe", 4), ("1f1b", 4), ("1f1b", 2))
    for policy in recompute.POLICIES
]


def _kept_in_flight():
    """For each case, what this rank's forwards held alive at most, its peak in flight, its blocks."""
    p, rank = runtime.world_size(), runtime.rank()
    results = []
    for schedule, m, policy in CASES:
        model, inputs, targets = _model_and_batch()
        recompute.apply_recomputation(model, policy=policy)
        stage = pp.split_model(model, p)[rank]
        executor = pp.PipelineExecutor(
            {rank: stage}, p, schedule, m, models.lm_loss, (BATCH // m, SEQ, D_MODEL), measure_memory=True
        )
        executor.step(inputs, targets)
        blocks = sum(isinstance(layer, models.Block) for layer in stage)
        results.append((executor.stats.peak_kept_bytes, executor.stats.peak_activations, blocks))
    return results


def _left_alive_by_one_forward(
    micro_batch: int, vocab: int, blocks: int, rank: int, p: int, policy: str
) -> float:
    """What the formula says one micro-batch's forward leaves alive on this stage, less what it was handed."""
    first, last = rank == 0, rank == p - 1
    stage = activations.stage_activation_bytes(
        batch=micro_batch,
        seq=SEQ,
        d_model=D_MODEL,
        heads=4,
        vocab=vocab,
        blocks=blocks,
        first=first,
        last=last,
        recomputation=policy,
    )
    boundary = 4 * micro_batch * SEQ * D_MODEL
    ids = 8 * micro_batch * SEQ  # the token ids on the first stage, the targets on the last: the batch's
    stage -= ids if first else boundary  # handed in: the ids, or the activation received
    stage += 4 - ids if last else boundary  # the loss (and the targets, handed in), or the output sent on
    return stage


@pytest.mark.parametrize("p", [2, 3])
def test_the_micro_batches_in_flight_hold_what_the_formula_says(p):
    vocab = len(data.zen_windows(seq_len=SEQ)[2])
    checked = 0
    for rank, results in enumerate(launch(_kept_in_flight, p)):
        for (schedule, m, policy), (kept, in_flight, blocks) in zip(CASES, results, strict=True):
            assert in_flight == pp.peak_activations_theory(schedule, p, m, rank)
            per_microbatch = _left_alive_by_one_forward(BATCH // m, vocab, blocks, rank, p, policy)
            expected = activations.pipeline_activation_bytes(
                per_microbatch, schedule=schedule, pipeline_size=p, microbatches=m, rank=rank
            )
            assert kept == expected, (schedule, m, policy, rank)
            checked += 1
    assert checked == len(CASES) * p


@pytest.mark.slow
@pytest.mark.timing
def test_the_zero_bubble_rows_run_beside_1f1b_and_pytorch(pipeline_bench):
    """``bench pipeline``'s zero-bubble rows: the same gradients as PyTorch's schedules, less idle than
    1F1B, and, with full recomputation, the forwards that B and W each recompute counted.

    On this machine with the benchmark's defaults the measured bubbles came 0.02 to 0.08 above the
    schedule simulated with the measured F, B and W; the *replayed* bubble (each step's actions,
    as long as they were, with nothing between them) splits that into unequal actions and time
    between actions. The time between actions is where a loaded machine shows: the backend's
    threads wait for a core to take or deliver a message (with both cores kept busy by other
    processes: 20-45 ms of posting per step, the measured bubbles 0.05 to 0.10 above the replayed,
    and 0.18 against a theory of 0.02 once in the suite). So the schedule is held to its theory
    through the replay of the same steps' actions, which load lengthens but cannot reorder, and the
    time between actions is reported, not bounded.
    """
    rows = pipeline_bench["zero_bubble_rows"]
    assert [(r["schedule"], r["recomputation"]) for r in rows] == [
        ("1f1b", "none"), ("zb_h1", "none"), ("zb_v", "none"), ("1f1b", "full"), ("zb_h1", "full")
    ]  # fmt: skip
    for row in rows:
        assert row["max_grad_difference_to_torch"] == 0, row
        assert 0 <= row["bubble_replayed"] <= row["bubble_measured"] < 1, row  # nothing between: less idle
        assert abs(row["bubble_replayed"] - row["bubble_theory"]) < 0.15, row
        assert row["message_ms"] > 0 and row["ratio_to_torch"] > 0
    plain = {r["schedule"]: r for r in rows if r["recomputation"] == "none"}
    assert plain["zb_h1"]["bubble_theory"] < plain["1f1b"]["bubble_theory"] / 2
    assert plain["zb_v"]["bubble_theory"] < plain["zb_h1"]["bubble_theory"]
    assert plain["1f1b"]["weight_ms"] == 0 and plain["zb_h1"]["weight_ms"] > 0
    recomputed = {r["schedule"]: r for r in rows if r["recomputation"] == "full"}
    assert all(r["block_forwards_per_microbatch"] == 1 for r in plain.values())
    assert recomputed["1f1b"]["block_forwards_per_microbatch"] == 2  # the forward, once recomputed
    assert recomputed["zb_h1"]["torch_block_forwards_per_microbatch"] == 3  # once for B, once for W
    assert recomputed["zb_h1"]["block_forwards_per_microbatch"] > 3  # the course's split: per layer
    assert pipeline_bench["zero_bubble_max_bubble_error"] == max(
        abs(r["bubble_error"]) for r in plain.values()
    )
