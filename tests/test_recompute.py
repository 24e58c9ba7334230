"""Recomputation keeps what ``activations`` says, at every layout, and changes no number.

What a block leaves alive after its forward is measured with ``memory.live_tensor_bytes`` (it sees
a checkpoint's stored input and a selective checkpoint's cache, which autograd's saved-tensor hooks
do not) on real processes: one process, tensor parallelism at T = 2 and 3, both sequence-parallel
variants, context parallelism at C = 2 and 3, each under the three policies: 27 layouts and
policies, every one equal to ``block_activation_elements`` exactly. A whole transformer, the
trainer and FSDP train exactly as without recomputation.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib import models
from course_lib.distributed import runtime
from course_lib.distributed.launch import launch
from course_lib.parallel import context as cp
from course_lib.parallel import context_chunks, recompute
from course_lib.parallel import sequence as sp
from course_lib.parallel import tensor as tp
from course_lib.parallel.memory import live_tensor_bytes
from course_lib.plan.activations import (
    block_activation_elements,
    embedding_activation_bytes,
    head_activation_bytes,
)

BATCH, SEQ, D_MODEL, HEADS = 5, 24, 24, 6  # 24 tokens cut into 2C zig-zag chunks at C = 2, 3
LAYOUTS = {
    1: ("one",),
    2: ("tensor", "sequence", "sequence_regathered", "context"),
    3: ("tensor", "sequence", "context"),
}


def _formula(kind: str, degree: int, policy: str) -> float:
    options = {
        "one": {},
        "tensor": {"tensor_degree": degree},
        "sequence": {"tensor_degree": degree, "sequence_parallel": True},
        "sequence_regathered": {
            "tensor_degree": degree,
            "sequence_parallel": True,
            "regather_in_backward": True,
        },
        "context": {"context_degree": degree},
    }[kind]
    return block_activation_elements(
        batch=BATCH, seq=SEQ, d_model=D_MODEL, heads=HEADS, recomputation=policy, **options
    )["total"]


def _kept_by_one_block(kinds: tuple[str, ...]) -> dict[tuple[str, str], int]:
    """Elements each layout's block leaves alive after its forward on this rank, per policy."""
    size, rank = runtime.world_size(), runtime.rank()
    kept = {}
    for kind in kinds:
        for policy in recompute.POLICIES:
            torch.manual_seed(0)
            block = models.Block(D_MODEL, HEADS)
            x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1))
            if kind == "tensor":
                tp.apply_tensor_parallel(block)
            elif kind.startswith("sequence"):
                sp.sequence_parallel_block(block, regather_in_backward=kind == "sequence_regathered")
                x = x.chunk(size, dim=1)[rank]
            elif kind == "context":
                chunks = context_chunks.SequenceChunks(SEQ, size, zigzag=True)
                cp.apply_context_parallel(block, chunks=chunks)
                x = chunks.local(x, rank)
            recompute.apply_recomputation(block, policy=policy)
            x = x.contiguous().requires_grad_()
            with live_tensor_bytes() as live:
                out = block(x)
                # The block's input is made by the layer before (here, by the test), and the
                # formula counts it; the output is the next layer's to count.
                kept[(kind, policy)] = (live.now - out.numel() * out.element_size()) // 4 + x.numel()
                out.sum().backward()
    return kept


@pytest.fixture(scope="module")
def kept_by_layout() -> dict[tuple[str, int, str], list[int]]:
    results = {}
    for degree, kinds in LAYOUTS.items():
        for rank_result in launch(_kept_by_one_block, degree, kinds):
            for (kind, policy), elements in rank_result.items():
                results.setdefault((kind, degree, policy), []).append(elements)
    return results


def test_every_layout_and_policy_keeps_exactly_what_the_formula_says(kept_by_layout):
    assert len(kept_by_layout) >= 20
    for (kind, degree, policy), per_rank in kept_by_layout.items():
        assert per_rank == [_formula(kind, degree, policy)] * degree, (kind, degree, policy)


def test_recomputation_keeps_less_in_the_order_of_the_table(kept_by_layout):
    for kind, degree, _ in kept_by_layout:
        none, selective, full = (kept_by_layout[(kind, degree, p)][0] for p in ("none", "selective", "full"))
        assert full < selective < none, kind


def test_selective_keeps_no_partial_sum_so_it_saves_at_every_tensor_degree(kept_by_layout):
    """A row-parallel layer's result is a partial sum of the whole activation; kept, the two of a block
    would hold 2·sbh that no degree divides, more than no recomputation keeps at T = 8. Measured at
    T = 2 and 3 the block keeps exactly the formula, which has no such term; the formula, so held,
    keeps less than none at every degree."""
    for degree in (2, 3):
        for kind in ("tensor", "sequence"):
            measured = kept_by_layout[(kind, degree, "selective")][0]
            assert measured == _formula(kind, degree, "selective")
            assert (
                block_activation_elements(
                    batch=BATCH,
                    seq=SEQ,
                    d_model=D_MODEL,
                    heads=HEADS,
                    tensor_degree=degree,
                    sequence_parallel=kind == "sequence",
                    recomputation="selective",
                )["row_outputs"]
                == 0
            )
    for degree in (2, 4, 8, 16):
        for kind in ("tensor", "sequence"):
            assert _formula(kind, degree, "selective") < _formula(kind, degree, "none"), (kind, degree)


def _transformer_and_batch(vocab=37, layers=3):
    torch.manual_seed(0)
    model = models.TinyTransformer(vocab, d_model=D_MODEL, n_heads=HEADS, n_layers=layers, max_seq_len=SEQ)
    generator = torch.Generator().manual_seed(2)
    ids, targets = (torch.randint(0, vocab, (BATCH, SEQ), generator=generator) for _ in range(2))
    return model, ids, targets


@pytest.mark.parametrize("policy", recompute.POLICIES)
def test_a_whole_transformer_keeps_the_formula_and_gets_the_same_gradients(policy):
    dense, ids, targets = _transformer_and_batch()
    model = recompute.apply_recomputation(copy.deepcopy(dense), policy=policy)
    with live_tensor_bytes() as live:
        loss = models.lm_loss(model(ids), targets)
        kept = live.now
    loss.backward()
    models.lm_loss(dense(ids), targets).backward()
    block = block_activation_elements(
        batch=BATCH, seq=SEQ, d_model=D_MODEL, heads=HEADS, recomputation=policy
    )
    made_outside = 8 * ids.numel() + 8 * targets.numel()  # the ids and targets, counted by the formulas
    expected = (
        embedding_activation_bytes(batch=BATCH, seq=SEQ)
        + 3 * 4 * block["total"]
        + head_activation_bytes(batch=BATCH, seq=SEQ, d_model=D_MODEL, vocab=37)
        - made_outside
        + 4  # the loss
    )
    assert kept == expected
    for (name, ours), theirs in zip(model.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0, msg=name)


def test_every_kth_block_is_recomputed_and_keeps_the_average_of_the_two_policies():
    """torchtitan's "selective layer" checkpointing: the 2nd block of 3 recomputed, the others
    keeping everything; what the forward keeps is that mix of the formula's two counts."""
    dense, ids, targets = _transformer_and_batch()
    model = recompute.apply_recomputation(copy.deepcopy(dense), policy="full", every=2)
    units = recompute.recomputation_units(model)
    assert [getattr(unit, "recomputation", "none") for unit in units] == ["none", "full", "none"]
    kept = {}
    for name, module in (("mixed", model), ("none", dense)):
        with live_tensor_bytes() as live:
            loss = models.lm_loss(module(ids), targets)
            kept[name] = live.now
        loss.backward()
    shape = {"batch": BATCH, "seq": SEQ, "d_model": D_MODEL, "heads": HEADS}
    one = {p: 4 * block_activation_elements(**shape, recomputation=p)["total"] for p in ("none", "full")}
    assert kept["none"] - kept["mixed"] == one["none"] - one["full"]  # one block of three recomputed
    for (name, ours), theirs in zip(model.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0, msg=name)


def test_recomputation_works_on_a_cnn_by_its_sharding_units():
    torch.manual_seed(0)
    dense = models.build_model("cifar_cnn")
    model = recompute.apply_recomputation(copy.deepcopy(dense), policy="full")
    assert [m.recomputation for m in recompute.recomputation_units(model)] == ["full"] * 6
    x = torch.randn(3, 3, 32, 32)
    kept = {}
    for name, module in (("all", dense), ("inputs", model)):
        with live_tensor_bytes() as live:
            out = module(x).sum()
            kept[name] = live.now
            out.backward()
    assert kept["inputs"] < kept["all"] / 3  # each unit's input, not its convolutions' outputs
    for ours, theirs in zip(model.parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)


def test_bad_policies_are_refused_with_the_fix():
    from conftest import user_errors

    block = models.Block(8, 2)
    recompute.apply_recomputation(block, policy="full")
    errors = user_errors(
        {
            "unknown": lambda: recompute.apply_recomputation(models.Block(8, 2), policy="some"),
            "twice": lambda: recompute.apply_recomputation(block, policy="selective"),
            "formula": lambda: block_activation_elements(
                batch=1, seq=2, d_model=8, heads=2, recomputation="all"
            ),
            "nothing": lambda: recompute.apply_recomputation(torch.nn.Linear(4, 4), policy="full"),
        }
    )
    assert "finds nothing to recompute in this Linear" in errors["nothing"]
    assert "choose one of none, full, selective" in errors["unknown"]
    assert "already recomputes (full): apply a policy once" in errors["twice"]
    assert "unknown recomputation 'all'" in errors["formula"]


@pytest.mark.timing
def test_the_benchmark_measures_each_policy_against_the_planners_formula():
    from conftest import run_bench

    result = run_bench(*"recompute --d-model 32 --layers 2 --seq 16 --batch 2 --steps 2 --warmup 1".split())
    assert result["formula_matches"]
    kept = {row["policy"]: row["kept_over_none"] for row in result["rows"]}
    assert kept["full"] < kept["selective"] < kept["none"] == 1.0
    assert all(row["step_ms"] > 0 for row in result["rows"])
