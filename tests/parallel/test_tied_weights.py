"""A weight tied between two layers stays one weight under every course wrapper.

The model is a small language model whose output projection *is* its token embedding
(``TinyTransformer(tie_embeddings=True)``). Trained by the course's ZeRO-1/2, FSDP (every
sharding strategy, and with the tie spanning two units), and by DDP with the course's sharded
optimizer, it must end where one process and PyTorch's FSDP2 end, at 1 to 4 ranks, and the two
names of the tied weight must still hold the same tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_lib import models
from course_lib.distributed import runtime
from course_lib.distributed.launch import launch
from course_lib.parallel.ddp import DataParallel
from course_lib.parallel.fsdp import FullyShardedDataParallel
from course_lib.parallel.pipeline import split_model
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.parallel.zero_optimizer import ShardedOptimizer

from conftest import user_errors

VOCAB, SEQ, BATCH, STEPS = 13, 6, 12, 3
TIED = ["0.tokens.weight", "3.proj.weight"]
TOLERANCE = dict(rtol=1e-5, atol=5e-6)


def _model() -> models.TinyTransformer:
    torch.manual_seed(0)
    return models.TinyTransformer(
        VOCAB, d_model=8, n_heads=2, n_layers=2, max_seq_len=SEQ, tie_embeddings=True
    )


def test_the_tied_model_holds_one_parameter_in_two_places():
    model = _model()
    assert model[0].tokens.weight is model[-1].proj.weight
    assert models.tied_parameters(model) == [TIED]
    psi = models.count_parameters(model)
    assert all(psi % n for n in (2, 3, 4)), psi  # shards never divide evenly


def _batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _blocks(model):
    return [m for m in model if isinstance(m, models.Block)]


# SGD, not Adam: a key's bias gets a gradient that is zero but for rounding (softmax ignores a
# constant added to every score), and Adam would turn that rounding into full-size steps.
OPTIMIZER = dict(lr=0.2, momentum=0.9, weight_decay=0.01)


def _wrap(kind: str, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    def sgd(params):
        return torch.optim.SGD(params, **OPTIMIZER)

    if kind == "single":
        return model, sgd(model.parameters())
    if kind in ("zero1", "zero2"):
        wrapped = ZeroDataParallel(model, stage=int(kind[-1]))
    elif kind == "sharded_optimizer":
        wrapped = DataParallel(model)
        return wrapped, ShardedOptimizer(wrapped.parameters(), torch.optim.SGD, **OPTIMIZER)
    elif kind == "fsdp_tie_across_units":  # the embedding and the head are units of their own
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=[model[0], *_blocks(model), model[-1]])
    elif kind.startswith("fsdp_"):
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=_blocks(model), sharding_strategy=kind.removeprefix("fsdp_")
        )
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        raise ValueError(kind)
    return wrapped, sgd(wrapped.parameters())


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    state = model.module.state_dict() if isinstance(model, DataParallel) else model.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()
    }


def _train(kind: str) -> dict[str, torch.Tensor]:
    n, rank = runtime.world_size(), runtime.rank()
    model, optimizer = _wrap(kind, _model())
    for step in range(STEPS):
        ids, targets = _batch(step)
        if kind != "single":
            ids, targets = ids[rank::n], targets[rank::n]
        optimizer.zero_grad()
        models.lm_loss(model(ids), targets).backward()
        optimizer.step()
    return _full_state(model)


KINDS = [
    "zero1",
    "zero2",
    "sharded_optimizer",
    "fsdp_FULL_SHARD",
    "fsdp_SHARD_GRAD_OP",
    "fsdp_NO_SHARD",
    "fsdp_tie_across_units",
    "fsdp2",
]


def _every_kind() -> dict[str, dict[str, torch.Tensor]]:
    return {kind: _train(kind) for kind in KINDS}


def _hybrid() -> dict[str, torch.Tensor]:
    return _train("fsdp_HYBRID_SHARD")


@pytest.fixture(scope="module")
def single() -> dict[str, torch.Tensor]:
    return launch(_train, 1, "single")[0]


def _assert_same(state: dict, reference: dict, what: str) -> None:
    assert state.keys() == reference.keys(), what
    for key in reference:
        torch.testing.assert_close(state[key], reference[key], **TOLERANCE, msg=f"{what}: {key}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_wrapper_keeps_the_tie_and_trains_like_one_process_and_fsdp2(world_size, single):
    torch.testing.assert_close(single[TIED[0]], single[TIED[1]], rtol=0, atol=0)
    untrained = _model().state_dict()
    assert not torch.equal(single[TIED[0]], untrained[TIED[0]])  # it did train
    results = launch(_every_kind, world_size)
    for kind in KINDS:
        state = results[0][kind]
        for other_rank in results[1:]:
            _assert_same(other_rank[kind], state, f"{kind}: every rank")
        torch.testing.assert_close(state[TIED[0]], state[TIED[1]], rtol=0, atol=0, msg=f"{kind}: still tied")
        _assert_same(state, single, f"{kind} at {world_size} ranks vs one process")
        _assert_same(state, results[0]["fsdp2"], f"{kind} at {world_size} ranks vs FSDP2")


def test_hybrid_shard_keeps_the_tie(single):
    _assert_same(launch(_hybrid, 4)[0], single, "HYBRID_SHARD on 2 x 2 vs one process")


def _round_trip() -> bool:
    model = _model()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=_blocks(model))
    state = wrapped.full_state_dict()
    plain = _model()
    plain.load_state_dict(state)  # strict: both names are there
    wrapped.load_full_state_dict(state)
    return plain[0].tokens.weight is plain[-1].proj.weight


def test_a_full_state_dict_of_a_tied_model_loads_into_a_plain_one():
    assert launch(_round_trip, 2) == [True, True]


def test_a_pipeline_cut_through_a_tie_is_refused():
    model = _model()
    errors = user_errors({"cut": lambda: split_model(model, 2)})
    assert "tied" in errors["cut"] and "tie_embeddings=False" in errors["cut"]
    assert len(split_model(models.TinyTransformer(VOCAB, n_layers=2, max_seq_len=SEQ), 2)) == 2


def _listed_twice() -> str:
    model = _model()
    params = list(model[0].parameters()) + list(model[-1].parameters())
    return user_errors({"twice": lambda: ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)})["twice"]


def test_the_sharded_optimizer_refuses_a_parameter_listed_twice():
    message = launch(_listed_twice, 1)[0]
    assert "listed twice" in message and "model.parameters()" in message
