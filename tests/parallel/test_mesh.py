"""The 3-D grid of ranks: documented groups for several shapes; a 2x2x2 run trains like one process."""

from __future__ import annotations

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import comm
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import mesh
from course_lib.plan.layout import Layout
from course_lib.train.three_d import RUN_DEFAULTS, RunShape, run_layout, train_3d

SHORT = RunShape(steps=6)


@pytest.mark.parametrize(
    "world, degrees, expected",
    [
        (
            8,
            dict(data=2, pipeline=2, tensor=2),
            {
                "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "context": [[r] for r in range(8)],
            },
        ),
        (
            8,
            dict(data=2, context=2, tensor=2),
            {
                "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "context": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "pipeline": [[r] for r in range(8)],
            },
        ),
        (
            8,
            dict(data=4, tensor=2),
            {
                "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "data": [[0, 2, 4, 6], [1, 3, 5, 7]],
                "pipeline": [[r] for r in range(8)],
                "context": [[r] for r in range(8)],
            },
        ),
        (
            4,
            dict(pipeline=4),
            {
                "tensor": [[0], [1], [2], [3]],
                "data": [[0], [1], [2], [3]],
                "pipeline": [[0, 1, 2, 3]],
                "context": [[0], [1], [2], [3]],
            },
        ),
        (
            6,
            dict(data=3, pipeline=2),
            {
                "tensor": [[r] for r in range(6)],
                "data": [[0, 1, 2], [3, 4, 5]],
                "pipeline": [[0, 3], [1, 4], [2, 5]],
                "context": [[r] for r in range(6)],
            },
        ),
        (1, {}, {"tensor": [[0]], "data": [[0]], "pipeline": [[0]], "context": [[0]]}),
    ],
)
def test_grid_groups_are_the_documented_ones(world, degrees, expected):
    assert mesh.grid_groups(world, **degrees) == expected


def test_a_four_dimensional_layout_printout():
    shown = mesh.describe_grid(16, data=2, pipeline=2, context=2, tensor=2)
    assert shown.splitlines()[0] == "16 ranks = data 2 x pipeline 2 x context 2 x tensor 2"
    assert "  13         1     1        0       1" in shown  # ((1·2 + 1)·2 + 0)·2 + 1
    assert "context groups:  [0, 2] [1, 3]" in shown


def test_degrees_must_multiply_to_the_world_size():
    with pytest.raises(UserError, match=r"data 2 x pipeline 2 x tensor 2 = 8 ranks, but 4 were started"):
        mesh.grid_groups(4, data=2, pipeline=2, tensor=2)
    with pytest.raises(UserError, match="the tensor degree must be at least 1"):
        mesh.grid_groups(4, data=4, tensor=0)


def test_the_layout_printout():
    shown = mesh.describe_grid(8, data=2, pipeline=2, tensor=2)
    assert shown.splitlines()[0] == "8 ranks = data 2 x pipeline 2 x tensor 2"
    assert "   5         1     0       1" in shown  # rank 5: pipeline 1, data 0, tensor 1
    assert "data groups:     [0, 2] [1, 3] [4, 6] [5, 7]" in shown


def _mesh_in_processes(degrees: dict):
    grid = mesh.Mesh(**degrees)
    return grid.coordinates, {axis: grid.ranks(axis) for axis in (*mesh.AXES, "expert")}


@pytest.mark.parametrize(
    "degrees",
    [dict(data=2, tensor=2), dict(pipeline=2, tensor=2), dict(data=2, pipeline=2), dict(context=2, tensor=2)],
)
def test_the_process_groups_are_those_of_the_grid(degrees):
    expected = mesh.grid_groups(4, **degrees)
    for rank, (coordinates, ranks) in enumerate(launch(_mesh_in_processes, 4, degrees)):
        assert mesh.rank_at(degrees, **vars(coordinates)) == rank
        for axis in mesh.AXES:
            assert ranks[axis] in expected[axis] and rank in ranks[axis]
        assert ranks["expert"] == ranks["data"]  # experts spread over the data replicas


@pytest.fixture(scope="module")
def single_losses():
    return launch(train_3d, 1, run_layout("single"))[0]


@pytest.mark.slow
def test_a_2x2x2_run_on_8_processes_matches_one_process(single_losses):
    losses = launch(train_3d, 8, run_layout("d2.p2.t2"), timeout_s=600)[0]
    assert losses == pytest.approx(single_losses, rel=1e-5)
    assert losses[-1] < 0.65 * losses[0]  # it learns


def test_other_grids_and_schedules_match_one_process(single_losses):
    shape = RunShape(steps=20, global_batch=16, microbatches=4)  # pipeline x tensor, 4 micro-batches
    losses = launch(train_3d, 4, run_layout("p2.t2 gpipe"), shape=shape)[0]
    assert losses == pytest.approx(single_losses, rel=1e-5)


@pytest.fixture(scope="module")
def short_single_losses():
    return launch(train_3d, 1, run_layout("single"), shape=SHORT)[0]


@pytest.mark.slow
def test_a_4d_run_data_context_tensor_on_8_processes_matches_one_process(short_single_losses):
    losses = launch(train_3d, 8, run_layout("d2.c2.t2"), shape=SHORT, timeout_s=600)[0]
    assert losses == pytest.approx(short_single_losses, rel=1e-5)


def test_context_with_pipeline_stages_matches_one_process(short_single_losses):
    losses = launch(train_3d, 4, run_layout("p2.c2"), shape=SHORT)[0]
    assert losses == pytest.approx(short_single_losses, rel=1e-5)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputation_under_pipeline_and_tensor_parallelism_matches_one_process(policy, short_single_losses):
    recomputed = {"full": "ac", "selective": "sac"}[policy]
    losses = launch(train_3d, 4, run_layout(f"p2.t2 {recomputed}"), shape=SHORT)[0]
    assert losses == pytest.approx(short_single_losses, rel=1e-5)


def _refused_context():
    try:
        train_3d(run_layout("c2"), shape=RunShape(seq_len=3))
    except UserError as error:
        return str(error)
    return "no error"


def test_a_sequence_too_short_for_the_context_degree_is_refused_on_every_rank():
    for error in launch(_refused_context, 2, timeout_s=60):
        assert "a sequence of 3 tokens does not split over context-parallel degree 2" in error


def _refused(name, shape):
    try:
        train_3d(run_layout(name), shape=RunShape(**shape))
    except UserError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("d2.p2.t2", {}), "data 2 x pipeline 2 x tensor 2 = 8 ranks, but 4 were started"),
        (
            ("t4", {"d_model": 60, "n_heads": 6}),
            "tensor-parallel degree 4 does not divide the attention heads (6)",
        ),
        (
            ("d4", {"global_batch": 18}),
            "the global batch of 18 must split into 4 data-parallel parts of 2 micro-batches",
        ),
        (("d4 fsdp", {}), "a 3-D run cannot run sharding 'fsdp' (layout 'd4 fsdp fp32')"),
    ],
)
def test_bad_grids_are_refused_on_every_rank_before_waiting(arguments, message):
    errors = launch(_refused, 4, *arguments, timeout_s=60)
    assert all(message in error for error in errors), errors[0]


@pytest.mark.slow
def test_the_3d_command_prints_both_curves_and_refuses_a_bad_grid(tmp_path):
    import json

    from conftest import run_tool

    shown = run_tool("three_d", "--layout", "p2", "--steps", "3", "--plot", str(tmp_path / "l.png"))
    assert shown.returncode == 0, shown.stderr
    result = json.loads(shown.stdout)
    assert result["max_difference"] < 1e-4 and len(result["grid_loss"]) == 3
    assert "tensor groups:   [0] [1]" in shown.stderr and (tmp_path / "l.png").exists()
    refused = run_tool("three_d", "--layout", "d3")
    assert refused.returncode == 2
    assert "the global batch of 16 must split into 3 data-parallel parts of 2 micro-batches" in refused.stderr


@pytest.mark.parametrize("grid", ["p2", "c2"])
def test_sequence_parallel_tensor_ranks_with_pipeline_stages_or_context_match_one_process(
    grid, short_single_losses
):
    """Stages that take and send 1/T of the tokens; context chunks cut again over the tensor ranks."""
    losses = launch(train_3d, 4, run_layout(f"{grid}.t2 sp"), shape=SHORT)[0]
    assert losses == pytest.approx(short_single_losses, rel=1e-5)


def test_a_context_chunk_that_the_tensor_ranks_cannot_share_is_refused_with_the_fix():
    from course_lib.errors import UserError
    from course_lib.train.three_d import check_run

    with pytest.raises(UserError, match="each context rank's tokens \\(15 of a sequence of 30 over 2"):
        check_run(run_layout("c2.t2 sp"), RunShape(seq_len=30), world_size=4)
    check_run(run_layout("c2.t2"), RunShape(seq_len=30), world_size=4)  # without it, nothing to cut


@pytest.mark.parametrize("grid", ["c2", "p2.c2", "c2.t2"])
def test_ulysses_over_the_context_ranks_matches_one_process(grid, short_single_losses):
    """Contiguous chunks, all-to-alls to a head split: with pipeline stages, or each tensor rank's heads."""
    layout = run_layout(f"{grid} ulysses")
    losses = launch(train_3d, layout.gpus, layout, shape=SHORT)[0]
    assert losses == pytest.approx(short_single_losses, rel=1e-5)


def test_heads_that_the_context_ranks_cannot_share_are_refused_under_ulysses():
    from course_lib.errors import UserError
    from course_lib.train.three_d import check_run

    with pytest.raises(UserError, match="2 attention heads do not divide by the Ulysses degree 4"):
        check_run(run_layout("c4.t2 ulysses"), RunShape(), world_size=8)
    with pytest.raises(UserError, match="unknown Layout context_attention 'both'"):
        check_run(Layout(context=2, context_attention="both", **RUN_DEFAULTS), RunShape(), world_size=2)


def _overlapped_tensor_parallel_with_sharding(
    steps: int = 3, sharding: str = "fsdp", overlap: bool = True
) -> list[float]:
    """``parallelize`` on a 2 x 2 grid: ``sharding`` over the data ranks, sequence parallelism over
    the tensor ranks with collective matmul (``tensor_overlap``); the mean loss of every step."""
    from course_lib.parallel.mesh import Mesh
    from course_lib.plan.layout import Layout
    from course_lib.plan.parallelize import parallelize

    seq_len = 16
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq_len)
    dense = models.TinyTransformer(len(vocabulary), d_model=24, n_heads=4, n_layers=2, max_seq_len=seq_len)
    mesh = Mesh(data=2, tensor=2)
    layout = Layout(data=2, tensor=2, sharding=sharding, sequence_parallel=True, precision="fp32")
    model = parallelize(dense, mesh, layout, seq_len=seq_len, tensor_overlap=overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (8,), generator=generator)
        mine = batch[mesh.coordinates.data :: 2]  # this replica's half of the global batch
        optimizer.zero_grad()
        loss = model.forward_backward(inputs[mine], targets[mine])
        model.finish_gradients()
        optimizer.step()
        comm.all_reduce(loss, op="mean", group=mesh.group("data"))
        losses.append(loss.item())
    return losses


def _one_process_losses(steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=16)
    model = models.TinyTransformer(len(vocabulary), d_model=24, n_heads=4, n_layers=2, max_seq_len=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (8,), generator=generator)
        optimizer.zero_grad()
        loss = models.lm_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("sharding", ["fsdp", "zero2", "ddp"])
def test_overlapped_tensor_parallelism_with_sharded_data_on_a_mesh_trains_like_one_process(sharding):
    """Collective matmul inside each tensor pair, FSDP (or ZeRO-2, or DDP) across the pairs: the loss
    curve of one process. Under FSDP and ZeRO the norms' partial gradients live in the flat shards,
    where the tensor ranks add them (they were left unsummed there once: 1.6e-4 off by step 3)."""
    expected = _one_process_losses()
    for losses in launch(_overlapped_tensor_parallel_with_sharding, 4, 3, sharding):
        assert losses == pytest.approx(expected, rel=1e-6)


def test_tensor_overlap_without_sequence_parallelism_is_refused_with_the_fix():
    from course_lib.plan.layout import Layout
    from course_lib.plan.parallelize import parallelize

    dense = models.TinyTransformer(45, d_model=24, n_heads=4, n_layers=2, max_seq_len=16)
    plain = Layout(tensor=2, sequence_parallel=False)
    # refused before the mesh is read: no process group is needed to hear it
    with pytest.raises(
        UserError, match="tensor_overlap .* needs a tensor degree above 1 and sequence_parallel"
    ):
        parallelize(dense, None, plain, seq_len=16, tensor_overlap=True)
