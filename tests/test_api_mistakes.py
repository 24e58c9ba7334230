"""The Python API used as a notebook would, mistakes included: each gets a ``UserError`` naming the rule.

Never an error from deep inside torch, a process aborted by gloo, or a peer's "connection
closed": applying one parallelism twice, two data-parallel wrappers around one model, a router
asked for more experts than there are, a pipeline stage without parameters, a collective given a
list, or tensors that differ from rank to rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import context as cp
from course_lib.parallel import context_chunks
from course_lib.parallel import expert as ep
from course_lib.parallel import pipeline as pp
from course_lib.parallel import sequence as sp
from course_lib.parallel import tensor as tp
from course_lib.parallel.ddp import DataParallel
from course_lib.parallel.fsdp import FullyShardedDataParallel
from course_lib.parallel.zero import ZeroDataParallel

from conftest import user_errors


def _transformer() -> models.TinyTransformer:
    torch.manual_seed(0)
    return models.TinyTransformer(13, d_model=16, n_heads=2, n_layers=2, max_seq_len=8)


def _twice() -> dict[str, str]:
    mlp = lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))  # noqa: E731
    model, wrapped_twice = mlp(), mlp()
    DataParallel(wrapped_twice)
    zero_model = mlp()
    zero = ZeroDataParallel(zero_model)
    tensor_parallel, then_sequence = _transformer(), _transformer()
    tp.apply_tensor_parallel(tensor_parallel)
    tp.apply_tensor_parallel(then_sequence)
    context_parallel = _transformer()
    layout = context_chunks.SequenceChunks(8, 2, zigzag=True)
    cp.apply_context_parallel(context_parallel, chunks=layout)
    moe = ep.MoE(8, 16, num_experts=4)
    ep.apply_expert_parallel(moe)
    DataParallel(model)
    return user_errors(
        {
            "DDP twice": lambda: DataParallel(wrapped_twice),
            "FSDP around ZeRO": lambda: FullyShardedDataParallel(zero),
            "ZeRO on a wrapped model": lambda: ZeroDataParallel(zero_model),
            "FSDP on a DDP model": lambda: FullyShardedDataParallel(model),
            "TP twice": lambda: tp.apply_tensor_parallel(tensor_parallel),
            "SP after TP": lambda: sp.apply_sequence_parallel(then_sequence),
            "CP twice": lambda: cp.apply_context_parallel(context_parallel, chunks=layout),
            "EP twice": lambda: ep.apply_expert_parallel(moe),
        }
    )


@pytest.fixture(scope="module")
def twice() -> dict[str, str]:
    return launch(_twice, 2)[0]


TWICE = {
    "DDP twice": "DataParallel was already applied to this model: apply each parallelism once",
    "FSDP around ZeRO": "its submodule Sequential is already converted by ZeroDataParallel, and "
    "FullyShardedDataParallel would convert it again: a model takes one data-parallel wrapper",
    "ZeRO on a wrapped model": "ZeroDataParallel was already applied to this model",
    "FSDP on a DDP model": "this model is already converted by DataParallel",
    "TP twice": "tensor parallelism was already applied to its submodule SelfAttention",
    "SP after TP": "is already converted by tensor parallelism, and sequence parallelism would convert it "
    "again: sequence parallelism is tensor parallelism with its own communication",
    "CP twice": "context parallelism was already applied to this model",
    "EP twice": "expert parallelism was already applied to this model",
}


@pytest.mark.parametrize("case", TWICE)
def test_a_parallelism_applied_twice_is_refused(case, twice):
    assert TWICE[case] in twice[case], twice.get(case)


def _tensor_then_context() -> bool:
    model = _transformer()
    tp.apply_tensor_parallel(model)  # tensor x context, as train_3d does
    cp.apply_context_parallel(model, chunks=context_chunks.SequenceChunks(8, 1, zigzag=False))
    return True


def test_two_parallelisms_that_compose_are_still_allowed():
    assert launch(_tensor_then_context, 1) == [True]


def test_a_router_asked_for_what_cannot_be_is_refused():
    logits = torch.randn(10, 4)
    errors = user_errors(
        {
            "top_k": lambda: ep.route(logits, top_k=5, capacity_factor=1.0),
            "capacity": lambda: ep.route(logits, top_k=1, capacity_factor=0.0),
            "scores": lambda: ep.route(logits[None], top_k=1, capacity_factor=1.0),
            "moe": lambda: ep.MoE(8, 16, num_experts=4, top_k=0),
        }
    )
    assert "top_k must be a whole number, from 1 to 4, got 5" in errors["top_k"]
    assert "capacity_factor must be a finite number above 0, got 0.0" in errors["capacity"]
    assert "one (tokens, experts) tensor, got (1, 10, 4)" in errors["scores"]
    assert "top_k must be a whole number, from 1 to 4, got 0" in errors["moe"]


SEQ, BATCH, MICRO = 8, 4, 2


def _stages_with_an_empty_one():
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
        nn.Sequential(nn.ReLU()),
        nn.Sequential(nn.Linear(6, 3)),
    ]


def _batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)


def _pipeline_with_an_empty_stage():
    stages = _stages_with_an_empty_one()
    rank = runtime.rank()
    mine = {s: stages[s] for s in range(3) if pp.rank_of_stage(s, 3) == rank}
    executor = pp.PipelineExecutor(mine, 3, "1f1b", MICRO, nn.functional.cross_entropy, (BATCH // MICRO, 6))
    inputs, targets = _batch()
    executor.step(inputs, targets)
    return {f"{s}.{n}": p.grad for s, stage in mine.items() for n, p in stage.named_parameters()}


def test_a_pipeline_stage_without_parameters_runs_like_one_process():
    stages = _stages_with_an_empty_one()
    inputs, targets = _batch()
    nn.functional.cross_entropy(nn.Sequential(*stages)(inputs), targets).backward()
    expected = {f"{s}.{n}": p.grad for s, stage in enumerate(stages) for n, p in stage.named_parameters()}
    grads = {name: grad for rank in launch(_pipeline_with_an_empty_stage, 3) for name, grad in rank.items()}
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _collective_mistake(case: str) -> str:
    rank = runtime.rank()
    attempts = {
        "a list": lambda: comm.all_reduce([torch.ones(3)]),
        "shapes differ": lambda: comm.all_reduce(torch.ones(3 + rank)),
        "dtypes differ": lambda: comm.broadcast(
            torch.ones(3, dtype=torch.float64 if rank else torch.float32)
        ),
        "calls differ": lambda: (comm.all_reduce if rank else comm.broadcast)(torch.ones(3)),
        "gather pieces differ": lambda: comm.all_gather_into_tensor(
            torch.empty(2 * (2 + rank)), torch.ones(2 + rank)
        ),
    }
    return user_errors({case: attempts[case]})[case]


COLLECTIVE_MISTAKES = {
    "a list": "comm.all_reduce: tensor must be one torch.Tensor, got list: stack the values into one tensor",
    "shapes differ": "comm: the ranks made different calls (rank 0: all_reduce of float32 (3,); "
    "rank 1: all_reduce of float32 (4,)): every rank of the group must make the same collectives, in the "
    "same order, with tensors of the same shape and dtype",
    "dtypes differ": "(rank 0: broadcast of float32 (3,); rank 1: broadcast of float64 (3,))",
    "calls differ": "(rank 0: broadcast of float32 (3,); rank 1: all_reduce of float32 (3,))",
    "gather pieces differ": "(rank 0: all_gather of float32 (2,); rank 1: all_gather of float32 (3,))",
}


@pytest.mark.parametrize("case", COLLECTIVE_MISTAKES)
def test_a_collective_misused_on_some_rank_names_the_rule_on_every_rank(case):
    messages = launch(_collective_mistake, 2, case)
    assert messages[0] == messages[1]  # every rank stops with the same line
    assert COLLECTIVE_MISTAKES[case] in messages[0]


def _uneven_exchange() -> list[float]:
    rank = runtime.rank()
    rows = [[1, 2], [3, 1]][rank]  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 and 1
    received = [[1, 3], [2, 1]][rank]
    output = torch.empty(sum(received), 2)
    comm.all_to_all_single(
        output, torch.full((sum(rows), 2), float(rank)), output_split_sizes=received, input_split_sizes=rows
    )
    return output[:, 0].tolist()


def test_uneven_pieces_that_are_meant_to_differ_still_pass_the_check():
    assert launch(_uneven_exchange, 2) == [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]


def _door_attempts() -> dict:
    """Values of the wrong type or sign given to what a student calls, each before any process."""
    from course_lib.parallel import tensor as tp
    from course_lib.parallel import vocab
    from course_lib.plan import cost_model, planner, specs
    from course_lib.plan.frameworks import TORCHTITAN_PROFILE
    from course_lib.plan.layout import Layout
    from course_lib.plan.parallelize import parallelize

    llama, alps = specs.MODELS["llama3-8b"], specs.CLUSTERS["alps"]
    predict = lambda **changes: cost_model.predict(  # noqa: E731
        **{"model": llama, "cluster": alps, "layout": Layout(data=8), "seq_len": 8192, "global_batch": 8}
        | changes
    )
    mlp = lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))  # noqa: E731
    return {
        "Layout flag as a string": lambda: Layout(sequence_parallel="false"),
        "Layout degree as a float": lambda: Layout(data=2.0),
        "Layout degree zero": lambda: Layout(tensor=0),
        "ModelSpec negative layers": lambda: specs.ModelSpec("m", -3, 64, 4, 4, 128, 100),
        "ModelSpec top_k above experts": lambda: specs.ModelSpec(
            "m", 2, 64, 4, 4, 128, 100, experts=2, top_k=3
        ),
        "Link bandwidth nan": lambda: specs.Link(1e-6, float("nan")),
        "Cluster memory negative": lambda: dataclasses.replace(alps, gpu_memory_bytes=-1.0),
        "Cluster unknown gpu": lambda: dataclasses.replace(alps, gpu="h300"),
        "Framework negative bytes": lambda: TORCHTITAN_PROFILE.with_(grad_bytes=-2),
        "Framework flag as a number": lambda: TORCHTITAN_PROFILE.with_(compiled=1),
        "predict negative sequence": lambda: predict(seq_len=-8192),
        "predict negative batch": lambda: predict(global_batch=-8),
        "predict cluster by name": lambda: predict(cluster="alps"),
        "plan gpus as text": lambda: planner.plan(llama, alps, gpus="8", seq_len=8192, global_batch=8),
        "parallelize a dict layout": lambda: parallelize(_transformer(), None, {"data": 2}, seq_len=8),
        "parallelize past the positions": lambda: parallelize(_transformer(), None, Layout(), seq_len=10_000),
        "DDP flag as a string": lambda: DataParallel(mlp(), find_unused_parameters="yes"),
        "FSDP flag as a string": lambda: FullyShardedDataParallel(mlp(), forward_prefetch="no"),
        "column-parallel flag": lambda: tp.ColumnParallelLinear(4, 4, gather_output="true"),
        "vocabulary flag": lambda: vocab.apply_vocabulary_parallel(_transformer(), sequence_parallel="on"),
        "sequence flag": lambda: sp.apply_sequence_parallel(_transformer(), regather_in_backward=0),
        "context chunks as a number": lambda: cp.apply_context_parallel(_transformer(), chunks=2),
    }


DOOR = {
    "Layout flag as a string": "Layout sequence_parallel must be True or False, got 'false' "
    "(e.g. Layout(..., sequence_parallel=True))",
    "Layout degree as a float": "Layout data must be a whole number, 1 or more, got 2.0",
    "Layout degree zero": "Layout tensor must be a whole number, 1 or more, got 0 "
    "(e.g. Layout(..., tensor=1))",
    "ModelSpec negative layers": "ModelSpec layers must be a whole number, 1 or more, got -3",
    "ModelSpec top_k above experts": "top_k (3) cannot exceed the experts (2)",
    "Link bandwidth nan": "Link bandwidth must be a finite number, above 0, got nan",
    "Cluster memory negative": "ClusterSpec gpu_memory_bytes must be a finite number, above 0, got -1.0",
    "Cluster unknown gpu": "unknown ClusterSpec gpu 'h300': choose one of h100-sxm",
    "Framework negative bytes": "Framework grad_bytes must be a finite number, at least 0, got -2",
    "Framework flag as a number": "Framework compiled must be True or False, got 1",
    "predict negative sequence": "predict's seq_len must be a whole number, 1 or more, got -8192",
    "predict negative batch": "predict's global_batch must be a whole number, 1 or more, got -8",
    "predict cluster by name": "predict's cluster must be a ClusterSpec, got str 'alps'",
    "plan gpus as text": "plan's gpus must be a whole number, got '8'",
    "parallelize a dict layout": "parallelize's layout must be a Layout, got dict",
    "parallelize past the positions": "parallelize's seq_len 10000 is longer than the 8 positions",
    "DDP flag as a string": "find_unused_parameters must be True or False, got 'yes'",
    "FSDP flag as a string": "forward_prefetch must be True or False, got 'no'",
    "column-parallel flag": "gather_output must be True or False, got 'true'",
    "vocabulary flag": "sequence_parallel must be True or False, got 'on'",
    "sequence flag": "regather_in_backward must be True or False, got 0",
    "context chunks as a number": "chunks must be a SequenceChunks, got int 2",
}


@pytest.mark.parametrize("attempt", list(DOOR))
def test_a_wrong_type_or_sign_is_refused_at_the_door_naming_the_argument(attempt):
    """One checker (``checks.check_fields``, ``check_flag``, ``check_instance``) serves every public
    dataclass and verb: a string is never read as a boolean, a negative size never reaches a formula."""
    errors = user_errors({attempt: _door_attempts()[attempt]})
    assert attempt in errors, f"{attempt} was accepted"
    assert DOOR[attempt] in errors[attempt]


def _only_rank_0_reduces():
    if runtime.rank() == 0:
        comm.all_reduce(torch.ones(3))
    return runtime.rank()


def test_a_collective_one_rank_never_makes_is_named_without_the_collective_check():
    """Under torchrun no check runs before each collective (``launch`` makes one): gloo then only
    says "Connection closed by peer"; the course says what it means."""
    with pytest.raises(UserError, match="ranks waited in a collective that other ranks never made"):
        launch(_only_rank_0_reduces, 2, check_collectives=False, timeout_s=60)
