"""The planner's formulas: the models' sizes, each term against the lesson it comes from, the one
reason a layout is refused, the ranking, and the command line."""

from __future__ import annotations

import json

import pytest

from course_lib.errors import UserError
from course_lib.parallel import memory
from course_lib.parallel.pipeline import bubble_overhead_theory
from course_lib.plan import compute_model, kernels, memory_model, network_model, planner, scaling, specs
from course_lib.plan import cost_model as cm
from course_lib.plan.layout import Layout
from course_lib.plan.specs import StepShape
from course_lib.tools import plan as plan_tool

LLAMA_8B, ALPS = specs.MODELS["llama3-8b"], specs.CLUSTERS["alps"]


def test_the_models_have_their_published_sizes():
    assert LLAMA_8B.parameters() == 8_030_261_248  # Meta-Llama-3-8B: 8.03 B
    assert round(specs.MODELS["llama3-70b"].parameters() / 1e9, 1) == 70.6
    mixtral = specs.MODELS["mixtral-8x7b"]
    assert round(mixtral.parameters() / 1e9, 1) == 46.7  # "47B parameters, 13B active"
    assert round(mixtral.active_parameters() / 1e9, 1) == 12.9


def test_a_collective_costs_what_the_alpha_beta_lesson_says():
    link = specs.Link(latency_s=5e-6, bandwidth=20e9)
    for group in (1, 2, 3, 8):
        assert network_model.collective_seconds("all_reduce", 1e8, group, link) == pytest.approx(
            scaling.ring_all_reduce_seconds(
                group, message_bytes=1e8, latency_s=5e-6, bandwidth_bytes_per_s=20e9
            )
        )
    # a reduce-scatter then an all-gather is one all-reduce
    halves = sum(
        network_model.collective_seconds(op, 1e8, 4, link) for op in ("reduce_scatter", "all_gather")
    )
    assert halves == pytest.approx(network_model.collective_seconds("all_reduce", 1e8, 4, link))


def test_the_tensor_axis_stays_inside_a_node_and_the_data_axis_leaves_it():
    layout = Layout(data=4, tensor=4)  # 16 GPUs, 4 per node
    assert network_model.link_of("tensor", layout, ALPS) is ALPS.inside_node
    assert network_model.link_of("data", layout, ALPS) is ALPS.between_nodes
    assert network_model.link_of("data", Layout(data=4), ALPS) is ALPS.inside_node


def test_a_group_spanning_nodes_leaves_each_node_through_its_members_nics():
    nic = ALPS.between_nodes.bandwidth
    # one member per node (tensor fills the node): one NIC
    assert network_model.link_of("data", Layout(data=8, tensor=4), ALPS) is ALPS.between_nodes
    # whole nodes: all four NICs, 4 x 25 GB/s, where the published all-reduce reaches 93 GB/s
    whole = network_model.link_of("data", Layout(data=16), ALPS)
    assert whole.bandwidth == 4 * nic and whole.latency_s == ALPS.between_nodes.latency_s
    assert 0.85 < 93e9 / whole.bandwidth <= 1
    # FSDP's group is data x context: with the context axis inside a node, still whole nodes
    assert network_model.link_of(("data", "context"), Layout(data=4, context=4), ALPS).bandwidth == 4 * nic
    assert network_model.link_of("data", Layout(data=4, context=4), ALPS) is ALPS.between_nodes
    # two members per node (tensor 2): two NICs; never more than the link inside the node
    assert network_model.link_of("data", Layout(data=8, tensor=2), ALPS).bandwidth == 2 * nic
    wide = specs.CLUSTERS["h100-node"]
    assert network_model.link_of("data", Layout(data=64), wide).bandwidth == min(
        wide.inside_node.bandwidth, 8 * wide.between_nodes.bandwidth
    )


def test_an_all_reduce_across_many_nodes_takes_the_tree_for_small_messages_and_the_ring_for_large():
    net, node = specs.Link(20e-6, 50e9), specs.Link(10e-6, 436e9)
    group, nodes = 1024, 128  # 8 GPUs a node
    ring = lambda size: network_model.collective_seconds("all_reduce", size, group, net)  # noqa: E731
    # NCCL's tree: a chain of 7 hops inside each node and 7 levels across 128 nodes, up and down
    small, chosen = network_model.all_reduce_seconds(1e6, group, net, nodes=nodes, inside=node)
    assert chosen == "tree" and small == pytest.approx(
        2 * (7 * 10e-6 + 7 * 20e-6) + 2 * 1e6 / (network_model.TREE_BANDWIDTH * 50e9)
    )
    assert small < ring(1e6) / 10  # the ring's 2046 latencies dominate a megabyte
    # 2046 latencies are 41 ms: the tree's 8 % less bandwidth costs more only past about 12 GB
    large, chosen = network_model.all_reduce_seconds(1e11, group, net, nodes=nodes, inside=node)
    assert chosen == "ring" and large == ring(1e11)
    # the crossover: where the tree's saved latencies equal its bandwidth lost
    saved = (2 * (group - 1) - 2 * (7 + 7)) * 20e-6 + 2 * 7 * (20e-6 - 10e-6)
    lost_per_byte = 2 / (network_model.TREE_BANDWIDTH * 50e9) - 2 * (group - 1) / group / 50e9
    crossover = saved / lost_per_byte
    for size, algorithm in ((crossover * 0.9, "tree"), (crossover * 1.1, "ring")):
        assert network_model.all_reduce_seconds(size, group, net, nodes=nodes, inside=node)[1] == algorithm
    # inside one node NCCL keeps the ring
    assert network_model.all_reduce_seconds(1e3, 8, node)[1] == "ring"


def test_a_group_spans_the_nodes_its_members_fill():
    assert network_model.nodes_of("data", Layout(data=4), ALPS) == 1
    assert network_model.nodes_of("data", Layout(data=16), ALPS) == 4  # 4 a node
    assert network_model.nodes_of("data", Layout(data=8, tensor=4), ALPS) == 8  # one a node
    assert network_model.nodes_of("data", Layout(data=6, tensor=2), ALPS) == 3  # two a node


def _predict(layout: Layout, **options):
    return cm.predict(LLAMA_8B, ALPS, layout, seq_len=options.get("seq_len", 4096), global_batch=64)


def test_model_states_are_the_memory_lessons_sharded_over_data_and_context():
    one_stage = _predict(Layout(data=8, context=2, sharding="zero1"))
    expected = memory.model_state_bytes(LLAMA_8B.parameters(), 16, "zero1")
    assert one_stage.memory["optimizer"] == pytest.approx(expected.optimizer)
    assert one_stage.memory["parameters"] == pytest.approx(expected.params)


def test_each_policy_keeps_less_and_pays_more():
    kept, paid = {}, {}
    for policy in ("none", "selective", "full"):
        prediction = _predict(Layout(data=16, tensor=4, recomputation=policy))
        kept[policy], paid[policy] = prediction.peak.activations_kept, prediction.time["recomputation"]
    assert kept["full"] < kept["selective"] < kept["none"]
    assert paid["none"] == 0 < paid["selective"] < paid["full"]
    work = compute_model.products(StepShape(LLAMA_8B, ALPS, Layout(data=16, tensor=4), 4096, 64))
    # full: one more forward of the blocks (their matmuls and attention, and a third of their
    # memory-bound work, which is what selective pays), and under tensor parallelism selective
    # also recomputes the out projection, whose partial sums it does not keep
    out_projection = work.block_forward * compute_model.output_projection_share(LLAMA_8B)
    assert paid["selective"] == pytest.approx(
        paid["full"] - work.block_forward + out_projection - work.attention_forward, rel=1e-3
    )


def test_tensor_parallelism_splits_every_term_and_selective_keeps_no_partial_sums():
    spec, layout = LLAMA_8B, Layout(tensor=1)
    one = memory_model.block_activation_elements(spec, layout, micro_batch=1, seq_len=1024)
    four = memory_model.block_activation_elements(spec, layout.with_(tensor=4), micro_batch=1, seq_len=1024)
    assert four == pytest.approx(one / 4)  # Megatron-LM's sequence parallelism: everything / T
    selective = [
        memory_model.block_activation_elements(
            spec, layout.with_(tensor=t, recomputation="selective"), micro_batch=1, seq_len=1024
        )
        for t in (1, 4)
    ]
    row_outputs = 2 * 1024 * spec.d_model  # out's and fc2's results: kept on one GPU, recomputed under TP
    assert selective[1] == pytest.approx((selective[0] - row_outputs) / 4)
    none = memory_model.block_activation_elements(
        spec, Layout(tensor=8, sequence_parallel=True), micro_batch=1, seq_len=8192
    )
    sac = memory_model.block_activation_elements(
        spec, Layout(tensor=8, sequence_parallel=True, recomputation="selective"), micro_batch=1, seq_len=8192
    )
    assert sac < none  # at T = 8 with sequence parallelism too, selective keeps less than none


def test_the_bubble_is_the_pipeline_lessons():
    layout = Layout(data=4, pipeline=4, sharding="zero1")
    prediction = _predict(layout)
    microbatches = 64 // 4
    busy = prediction.time["compute"] + prediction.time["memory-bound operations"]
    assert prediction.time["pipeline bubble"] == pytest.approx(bubble_overhead_theory(4, microbatches) * busy)
    interleaved = _predict(layout.with_(schedule="interleaved_1f1b", virtual_stages=2))
    assert interleaved.time["pipeline bubble"] == pytest.approx(prediction.time["pipeline bubble"] / 2)


def test_the_step_and_memory_are_the_sums_of_their_parts_and_mfu_follows():
    prediction = _predict(Layout(data=8, pipeline=2, tensor=4))
    for parts in (prediction.memory, prediction.time):
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    flops = LLAMA_8B.flops_per_token(4096) * prediction.tokens_per_s
    assert prediction.mfu == pytest.approx(flops / (64 * ALPS.peak_flops))
    assert prediction.mfu <= ALPS.achieved_flops / ALPS.peak_flops


@pytest.mark.parametrize(
    "layout, reason",
    [
        (Layout(data=8, tensor=16), "8 key/value heads do not split over tensor degree 16"),
        (Layout(data=2, pipeline=64), "32 layers cannot fill 64 stages"),
        (Layout(data=16, context=8), "a sequence of 4100 does not cut into 16 zig-zag chunks"),
        (
            Layout(tensor=8, context=8, context_attention="ulysses"),
            "4 attention heads do not divide by the Ulysses degree 8 (a tensor rank's share",
        ),
        (Layout(data=16, context=8, context_attention="ulysses"), "a sequence of 4100 does not cut into 8"),
        (Layout(data=128), "a global batch of 64 sequences does not split into 128 replicas"),
        (Layout(data=16, expert=2), "expert parallelism needs a mixture-of-experts model"),
        (Layout(data=64, sharding="ddp"), "needs 1"),  # 16 bytes x 8 B parameters on every GPU
    ],
)
def test_a_layout_that_cannot_run_says_the_one_reason(layout, reason):
    prediction = cm.predict(
        LLAMA_8B, ALPS, layout, seq_len=4100 if layout.context > 1 else 4096, global_batch=64
    )
    assert not prediction.fits
    assert reason in prediction.problem


def test_a_bad_layout_is_refused_with_the_rule():
    with pytest.raises(UserError, match="Layout tensor must be a whole number, 1 or more, got 0"):
        Layout(tensor=0)
    with pytest.raises(
        UserError, match="unknown Layout sharding 'zero3': choose one of ddp, zero1, zero2, fsdp"
    ):
        Layout(sharding="zero3")
    with pytest.raises(UserError, match="expert degree 3 must divide data x context = 4"):
        Layout(data=4, expert=3)
    with pytest.raises(UserError, match="virtual_stages 2 needs schedule='interleaved_1f1b'"):
        Layout(pipeline=2, virtual_stages=2)
    with pytest.raises(
        UserError, match="unknown Layout context_attention 'all': choose one of ring, ulysses"
    ):
        Layout(context=2, context_attention="all")
    with pytest.raises(UserError, match="the planner does not lay out 'zb_h1' yet"):
        Layout(pipeline=2, schedule="zb_h1")


def test_the_plan_ranks_what_fits_fastest_first():
    fitting, rejected = planner.plan(LLAMA_8B, ALPS, gpus=16, seq_len=8192, global_batch=64)
    assert fitting and rejected
    speeds = [p.tokens_per_s for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.memory["total"] <= ALPS.gpu_memory_bytes for p in fitting)
    assert all(p.problem for p in rejected)
    assert {p.layout.gpus for p in fitting + rejected} == {16}


def test_the_command_prints_the_ranked_layouts_and_the_reasons(tmp_path, capsys):
    out = tmp_path / "new-folder" / "plan.json"  # a folder that does not exist yet is made
    argv = ["--model", "llama3-8b", "--cluster", "alps", "--gpus", "16", "--global-batch-tokens", "512K"]
    assert plan_tool.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "64 sequences of 8192 tokens per step" in printed
    assert "layouts fit; the 10 fastest" in printed and "layouts rejected, by reason" in printed
    records = json.loads(out.read_text())
    assert {"layout", "memory_bytes", "time_s", "tokens_per_s", "mfu", "problem"} <= set(records[0])


def test_a_json_under_a_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a folder")
    argv = ["--model", "llama3-8b", "--cluster", "alps", "--gpus", "8"]
    with pytest.raises(SystemExit) as stopped:
        plan_tool.main([*argv, "--json", str(tmp_path / "taken" / "plan.json")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "argument --json" in error and "is a file; choose another location" in error, error


def test_the_command_refuses_a_batch_that_is_not_whole_sequences(capsys):
    argv = ["--model", "llama3-8b", "--cluster", "alps", "--gpus", "8", "--global-batch-tokens", "1000"]
    assert plan_tool.main(argv) == 2
    assert (
        "--global-batch-tokens 1,000 is not a whole number of sequences of --seq-len 8192"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        plan_tool.main(
            ["--model", "llama3-8b", "--cluster", "alps", "--gpus", "8", "--global-batch-tokens", "4Q"]
        )
    assert "is not a token count: write e.g. 4M" in capsys.readouterr().err


def test_the_course_transformer_is_a_spec_with_its_exact_parameter_count():
    from course_lib import models

    model = models.TinyTransformer(37, d_model=24, n_heads=6, n_layers=3, max_seq_len=12)
    assert specs.ModelSpec.of(model).parameters() == models.count_parameters(model)


COURSE_LAYOUTS = [
    ({}, {}),
    ({"tensor": 2, "sequence_parallel": False}, {"tensor_degree": 2}),
    ({"tensor": 3, "sequence_parallel": False}, {"tensor_degree": 3}),
    (
        {"tensor": 2},
        {"tensor_degree": 2, "sequence_parallel": True, "regather_in_backward": True},
    ),
    ({"context": 2}, {"context_degree": 2}),
    ({"context": 3}, {"context_degree": 3}),
]


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("planner, course", COURSE_LAYOUTS)
def test_the_planners_block_is_the_measured_formula_for_the_course_block(planner, course, policy):
    from course_lib import models
    from course_lib.plan import activations

    spec = specs.ModelSpec.of(models.TinyTransformer(37, d_model=24, n_heads=6, n_layers=2, max_seq_len=24))
    layout = Layout(precision="fp32", recomputation=policy, **planner)
    ours = memory_model.block_activation_elements(spec, layout, micro_batch=5, seq_len=24)
    measured_formula = activations.block_activation_elements(
        batch=5, seq=24, d_model=24, heads=6, recomputation=policy, **course
    )["total"]
    assert ours == pytest.approx(measured_formula)


def test_the_planners_head_is_the_measured_formula_for_the_course_head():
    from course_lib import models
    from course_lib.plan import activations

    spec = specs.ModelSpec.of(models.TinyTransformer(37, d_model=24, n_heads=6, n_layers=2, max_seq_len=24))
    ours = memory_model.head_activation_bytes(spec, Layout(precision="fp32"), micro_batch=5, seq_len=24)
    theirs = activations.head_activation_bytes(batch=5, seq=24, d_model=24, vocab=37)
    assert ours == theirs - 4 - 8 * 5 * 24  # the cross-entropy's saved scalar; the targets, the batch's


@pytest.mark.slow
def test_run_trains_the_first_layout_here_and_prints_predicted_beside_measured(capsys):
    argv = "--model course-transformer --cluster this-machine --gpus 2 --seq-len 16 --global-batch-tokens 128"
    assert plan_tool.main([*argv.split(), "--run", "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "the first the course's loop runs here: predicted -> measured" in printed
    lines = {line.split()[0]: line for line in printed.splitlines() if "->" in line and "(x" in line}
    assert lines["activations"].endswith("(x1.000)") and lines["sent"].endswith("(x1.000)")


@pytest.mark.slow
def test_the_plan_weighs_ulysses_all_to_alls_where_the_ring_hides_under_attention(capsys):
    """Llama 3 70B, 8,192 tokens on Alps: the ring's passes hide under attention, Ulysses' cannot."""
    argv = ["--model", "llama3-70b", "--cluster", "alps", "--gpus", "64", "--top", "1"]
    first = {}
    for attention in ("ring", "ulysses"):
        assert plan_tool.main([*argv, "--context-attention", attention]) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("1 "))
        first[attention] = line.split()
    assert "ulysses" not in first["ring"] and "ulysses" in first["ulysses"]
    exposed = {attention: float(words[-1]) for attention, words in first.items()}
    assert exposed["ring"] < 0.1 < 1 < exposed["ulysses"]
    # both, ranked together: the ring's best first, and Ulysses' best after ring layouts only
    assert plan_tool.main([*argv[:-1], "50"]) == 0
    rows = [  # the table's rows: a rank right-aligned in three columns, then the layout
        line.split()
        for line in capsys.readouterr().out.splitlines()
        if line[:3].strip().isdigit() and line[3] == " "
    ]
    assert rows[0][1:3] == first["ring"][1:3]
    first_ulysses = next(number for number, words in enumerate(rows) if "ulysses" in words)
    assert rows[first_ulysses][1:4] == first["ulysses"][1:4]
    assert all("ulysses" not in words for words in rows[:first_ulysses])


def test_run_is_refused_for_a_model_this_machine_cannot_train(capsys):
    argv = ["--model", "llama3-8b", "--cluster", "alps", "--gpus", "8", "--run"]
    assert plan_tool.main(argv) == 2
    assert (
        "--run trains on this machine's processes: use --model course-transformer" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--validate --gpus 64 --run", "takes none of --gpus, --run"),
        ("--model course-transformer --cluster this-machine --gpus 2 --seq-len 8192 --run",
         "a sequence of 8192 characters does not fit the course's text"),
    ],
)  # fmt: skip
def test_flags_that_cannot_combine_are_refused_before_anything_runs(argv, message, capsys, monkeypatch):
    from course_lib.tools.evidence import plan_validation

    def calibrated(*args, **kwargs):  # calibrating started before the refusal
        raise AssertionError("the machine was calibrated before the flags were checked")

    monkeypatch.setattr(plan_tool, "calibrate", calibrated)
    monkeypatch.setattr(plan_validation, "calibrate", calibrated)
    try:
        status = plan_tool.main(argv.split())
    except SystemExit as stop:  # argparse's error
        status = stop.code
    assert status == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "schedule, p, m, v",
    [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1), ("interleaved_1f1b", 2, 4, 2)],
)
@pytest.mark.parametrize("backward_over_forward", [2.0, 3.0])
def test_the_planners_bubble_is_the_simulated_schedules_and_equals_the_theory(
    schedule, p, m, v, backward_over_forward
):
    from course_lib.parallel import pipeline

    simulated = compute_model.bubble_overhead(schedule, p, m, v, backward_over_forward)
    assert simulated == pytest.approx(pipeline.bubble_overhead_theory(p, m, virtual_stages=v))


def test_beyond_the_simulated_count_the_formula_prices_what_the_simulation_would():
    from course_lib.parallel import pipeline

    p, m = 4, compute_model.SIMULATED_MICROBATCHES + 1
    actions = pipeline.build_schedule("1f1b", p, m)
    idle = pipeline.bubble_fraction(
        pipeline.simulate_timeline(actions, p, forward_time=1.0, backward_time=2.0)
    )
    assert compute_model.bubble_overhead("1f1b", p, m, 1, 2.0) == pytest.approx(idle / (1 - idle))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "1000000000"], "--gpus must be a whole number, from 1 to 262144, got 1000000000"),
        (
            ["--gpus", "64", "--global-batch-tokens", "4G"],
            "--global-batch-tokens 4,294,967,296 is more than any",
        ),
    ],
)
def test_a_job_no_cluster_holds_is_refused_before_anything_is_enumerated(argv, message, capsys, monkeypatch):
    from course_lib.plan import planner

    def enumerated(*args, **kwargs):  # it enumerated for 60-90 s before refusing
        raise AssertionError("the layouts were enumerated before the job's size was checked")

    monkeypatch.setattr(planner, "candidate_layouts", enumerated)
    assert plan_tool.main(["--model", "llama3-8b", "--cluster", "alps", *argv]) == 2
    assert message in capsys.readouterr().err


def test_recomputing_every_kth_block_keeps_and_pays_the_average():
    layout = Layout(data=16, tensor=4, recomputation="full")
    shape = {"micro_batch": 1, "seq_len": 4096}
    none = memory_model.block_activation_elements(LLAMA_8B, layout.with_(recomputation="none"), **shape)
    full = memory_model.block_activation_elements(LLAMA_8B, layout, **shape)
    every = memory_model.block_activation_elements(LLAMA_8B, layout.with_(recompute_every=2), **shape)
    assert every == pytest.approx((none + full) / 2)
    paid = {k: _predict(layout.with_(recompute_every=k)).time["recomputation"] for k in (1, 2)}
    assert paid[2] == pytest.approx(paid[1] / 2)
    assert Layout.from_name("d16.t4 fsdp ac/2") == layout.with_(recompute_every=2)
    assert layout.with_(recompute_every=2).name() == "d16.t4 fsdp ac/2"
    with pytest.raises(UserError, match="Layout recompute_every must be a whole number, 1 or more, got 0"):
        layout.with_(recompute_every=0)


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_the_time_model_streams_the_logits_the_memory_model_keeps(loss_parallel):
    """One count of the logits for both: with sequence parallelism and no loss parallelism a rank
    holds s/T tokens' logits, and the loss's kernels stream those, not every token's."""
    layout = Layout(tensor=8, sequence_parallel=True, loss_parallel=loss_parallel)
    shape = {"micro_batch": 1, "seq_len": 8192}
    kept = memory_model.head_activation_bytes(LLAMA_8B, layout, **shape, logit_bytes=4)
    rest = memory_model.head_activation_bytes(LLAMA_8B, layout, **shape, logit_bytes=0)
    logits = memory_model.logit_elements(LLAMA_8B, layout, **shape)
    assert kept - rest == pytest.approx(4 * logits)
    assert logits == pytest.approx(8192 * (16032 if loss_parallel else LLAMA_8B.vocab / 8))
    step = StepShape(LLAMA_8B, specs.CLUSTERS["h100-node"], layout, 8192, 1)
    fit = kernels.kernel_fit("nvidia-h100-80gb-hbm3")
    gpu = kernels.GPUS["h100-sxm"]
    head = compute_model.memory_bound(step)[1]
    assert head == pytest.approx(
        3 * rest / (fit.pointwise_eager * gpu.memory_bandwidth)
        + 4 * logits / (fit.loss * gpu.memory_bandwidth)
    )


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_the_last_stage_keeps_one_micro_batch_of_the_head_unless_gpipe_keeps_them_all(schedule, virtual):
    """The head is the last stage's; in the 1F1B schedules each micro-batch's backward follows its
    forward there, so one micro-batch's logits are alive however many blocks' inputs are."""
    from course_lib.parallel.pipeline import peak_activations_theory

    layout = Layout(data=1, pipeline=4, schedule=schedule, virtual_stages=virtual, sharding="zero1")
    step = StepShape(LLAMA_8B, ALPS, layout, 4096, 8)
    blocks, head, microbatches = 1000.0, 10**6, step.microbatches
    last = memory_model._activations_per_gpu(LLAMA_8B, layout, blocks, head, step.tokens, microbatches, 4096)
    in_flight = peak_activations_theory(schedule, 4, microbatches, 3, virtual_stages=virtual) / virtual
    boundary = layout.element_bytes * step.tokens * LLAMA_8B.d_model
    stage = 8 * blocks - boundary  # the last stage's 8 blocks, less the output it does not send
    heads = microbatches if schedule == "gpipe" else 1
    assert last == pytest.approx(max(
        peak_activations_theory(schedule, 4, microbatches, 0, virtual_stages=virtual) / virtual
        * (8 * blocks + boundary),
        in_flight * stage + heads * (head + 8),
    ))  # fmt: skip


def test_the_busiest_expert_sets_the_pace_of_a_mixture_of_experts():
    """``Framework.expert_imbalance``: the busiest expert rank's all-to-all rows and its experts'
    matmuls grow with the load's skew; without expert parallelism there is no rank to wait for."""
    from course_lib.plan.frameworks import COURSE_PROFILE

    def predicted(model, imbalance, layout):
        framework = COURSE_PROFILE.with_(expert_imbalance=imbalance)
        return cm.predict(model, ALPS, layout, seq_len=4096, global_batch=256, framework=framework)

    mixtral, layout = specs.MODELS["mixtral-8x7b"], Layout(data=8, expert=8, pipeline=4, tensor=4)
    even, skewed = predicted(mixtral, 1.0, layout), predicted(mixtral, 1.5, layout)
    assert skewed.traffic["expert"] == pytest.approx(1.5 * even.traffic["expert"])
    assert skewed.time["expert (exposed)"] > even.time["expert (exposed)"]
    assert skewed.time["compute"] > even.time["compute"]
    dense = Layout(data=8, pipeline=4, tensor=4)
    assert predicted(LLAMA_8B, 1.5, dense).time == predicted(LLAMA_8B, 1.0, dense).time
    # every expert on every rank: each rank computes its own tokens' rows, however they spread
    assert predicted(mixtral, 1.5, dense).time == predicted(mixtral, 1.0, dense).time
    with pytest.raises(UserError, match="expert_imbalance"):
        COURSE_PROFILE.with_(expert_imbalance=0.5)


def test_a_stack_that_groups_its_experts_matmuls_runs_many_small_experts_faster():
    """``Framework.grouped_experts``: a rank's experts in one grouped kernel (``kernels.grouped_matmul_
    seconds``) against one launch each; with one expert a rank there is nothing to group."""
    from course_lib.plan.frameworks import COURSE_PROFILE

    def compute(model, grouped, layout):
        framework = COURSE_PROFILE.with_(grouped_experts=grouped)
        return cm.predict(model, ALPS, layout, seq_len=4096, global_batch=256, framework=framework).time[
            "compute"
        ]

    gpt_oss, sixteen_a_rank = specs.MODELS["gpt-oss-120b"], Layout(data=16, expert=8, pipeline=4)
    assert compute(gpt_oss, True, sixteen_a_rank) < compute(gpt_oss, False, sixteen_a_rank)
    mixtral, one_a_rank = specs.MODELS["mixtral-8x7b"], Layout(data=8, expert=8, pipeline=4, tensor=4)
    assert compute(mixtral, True, one_a_rank) == compute(mixtral, False, one_a_rank)


def test_shared_experts_are_priced_as_a_dense_mlp_beside_the_routed_ones():
    """Every token goes through them: their parameters are active, their products dense (split over
    T, whole on every expert rank), their hidden activations kept for backward."""
    import dataclasses

    mixtral = specs.MODELS["mixtral-8x7b"]
    shared = dataclasses.replace(mixtral, shared_experts=1)
    assert (
        shared.active_parameters() - mixtral.active_parameters()
        == mixtral.layers * mixtral.expert_parameters()
    )
    assert memory_model.block_matmuls(shared)[-1] == (mixtral.ffn_hidden, mixtral.d_model, 1, True)
    layout = Layout(data=8, expert=8, pipeline=4, tensor=4)
    plain, more = (
        cm.predict(model, ALPS, layout, seq_len=4096, global_batch=256) for model in (mixtral, shared)
    )
    assert more.memory["activations"] > plain.memory["activations"]
    assert more.time["compute"] > plain.time["compute"]
    with pytest.raises(UserError, match="shared experts beside no routed ones"):
        dataclasses.replace(LLAMA_8B, shared_experts=1)
