"""Dropless experts compute what one process holding every expert computes, with no token dropped.

The grouped matmul against each row times its own expert's matrix (experts with no rows
included); the routing on hand-made scores (every assignment kept, the bias choosing but not
weighing, at most M nodes per token); the layer with 5 experts over 1 to 4 ranks (5 divides by
none of 2, 3, 4), shared experts and node-limited routing, against one process, forward and
backward; the bias moved alike on every rank; bad arguments refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import dropless
from course_lib.parallel import expert as ep

D_MODEL, HIDDEN, EXPERTS, TOKENS = 6, 4, 5, 7
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def test_the_grouped_matmul_multiplies_each_row_by_its_own_experts_matrix():
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(4, 3, 5, generator=generator)
    counts = [2, 0, 3, 1]  # expert 1 gets no row
    rows = torch.randn(sum(counts), 3, generator=generator)
    owner = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    expected = torch.stack([row @ weights[e] for row, e in zip(rows, owner.tolist(), strict=True)])
    torch.testing.assert_close(dropless.grouped_mm(rows, weights, counts), expected)
    with pytest.raises(UserError, match="one count per expert"):
        dropless.grouped_mm(rows, weights, [2, 0, 3])


def test_every_assignment_is_kept_and_the_bias_chooses_without_weighing():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.0], [0.5, 0.4, 0.3]])
    plain = dropless.route_dropless(logits, top_k=2)
    assert plain.load.sum() == 8 and plain.expert.numel() == 8  # tokens x k, none dropped
    torch.testing.assert_close(plain.gate.view(2, 4).sum(0), torch.ones(4))
    pushed = dropless.route_dropless(logits, top_k=1, bias=torch.tensor([0.0, 0.0, 10.0]))
    assert pushed.expert.tolist() == [2, 2, 2, 2]  # the bias decides the choice...
    assert pushed.gate.tolist() == [1.0] * 4  # ... and the gate is the chosen score's own share
    grouped = dropless.route_dropless(torch.randn(50, 8), top_k=4, nodes=4, node_limit=2)
    nodes_used = (grouped.expert.view(4, 50) // 2).t()
    assert max(len(set(row.tolist())) for row in nodes_used) <= 2


def _dropless_against_one_process(shared: int, nodes: int, node_limit, fine: bool = False):
    """``fine``: DeepSeek-MoE's fine-grained experts, twice as many at half the width, with k = 4."""
    rank, size = runtime.rank(), runtime.world_size()
    torch.manual_seed(0)
    experts, hidden, top_k = (2 * EXPERTS, HIDDEN // 2, 4) if fine else (EXPERTS, HIDDEN, 2)
    layer = dropless.DroplessMoE(D_MODEL, hidden, num_experts=experts * nodes, top_k=top_k,
                                 shared_experts=shared, nodes=nodes, node_limit=node_limit)  # fmt: skip
    inputs = [
        torch.randn(TOKENS + r, D_MODEL, generator=torch.Generator().manual_seed(r)) for r in range(size)
    ]
    weights = [
        torch.randn_like(x, generator=torch.Generator().manual_seed(50 + r)) for r, x in enumerate(inputs)
    ]
    reference = copy.deepcopy(layer)
    for r in range(size):  # one process: every rank's tokens, each routed on its own
        mine = inputs[r].clone().requires_grad_()
        output = reference(mine)
        (output * weights[r]).sum().backward()
        if r == rank:
            expected, expected_grad = output.detach(), mine.grad
    parallel = ep.apply_expert_parallel(copy.deepcopy(layer))
    mine = inputs[rank].clone().requires_grad_()
    with comm.CommLog() as log:
        output = parallel(mine)
        (output * weights[rank]).sum().backward()
    held = dropless.expert_range(layer.num_experts, size, rank)
    torch.testing.assert_close(output, expected, **TOLERANCE)
    torch.testing.assert_close(mine.grad, expected_grad, **TOLERANCE)
    comm.all_reduce(parallel.router.weight.grad)  # the router is replicated: its gradient summed
    torch.testing.assert_close(parallel.router.weight.grad, reference.router.weight.grad, **TOLERANCE)
    held_grad = reference.experts.up.grad[held.start : held.stop]
    torch.testing.assert_close(parallel.experts.up.grad, held_grad, **TOLERANCE)
    assert parallel.experts.up.shape[0] == len(held)
    loads = [reference_load(reference, x) for x in inputs]  # every rank's routing, as one process sees it
    theory = dropless.all_to_all_bytes(loads, rank, num_experts=layer.num_experts, row_bytes=D_MODEL * 4)
    sent = log.bytes_per_rank("all_to_all") + log.bytes_per_rank("all_gather")
    assert sent == theory, (sent, theory)
    return [record.op for record in log.records]


def reference_load(layer: dropless.DroplessMoE, x: torch.Tensor) -> list[int]:
    with torch.no_grad():
        layer(x)
    return layer.last_routing.load.tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dropless_experts_over_ranks_equal_one_process_holding_them_all(world):
    ops = launch(_dropless_against_one_process, world, 1, 1, None)[0]
    assert ops[:2] == ["all_gather", "all_to_all"]  # the counts, then the rows


def test_node_limited_routing_over_two_nodes_equals_one_process():
    launch(_dropless_against_one_process, 4, 0, 2, 1)


def test_fine_grained_experts_with_a_larger_k_over_three_ranks_equal_one_process():
    launch(_dropless_against_one_process, 3, 1, 1, None, True)  # 10 experts of width 2, top-4, one shared


def _balanced_alike():
    torch.manual_seed(0)
    layer = dropless.DroplessMoE(D_MODEL, HIDDEN, num_experts=EXPERTS, top_k=1, bias_update_rate=0.1)
    layer(torch.randn(20, D_MODEL, generator=torch.Generator().manual_seed(runtime.rank())))
    load = dropless.balance(layer)
    return layer.expert_bias.tolist(), load.tolist()


def test_the_bias_moves_toward_the_mean_load_alike_on_every_rank():
    (bias, load), (other, _) = launch(_balanced_alike, 2)
    assert bias == other and sum(load) == 40  # both ranks' tokens, summed
    mean = sum(load) / len(load)
    assert bias == [pytest.approx(0.1 * (1 if n < mean else -1 if n > mean else 0)) for n in load]


def test_a_routing_that_cannot_work_is_refused_in_one_line():
    def refused(**options) -> str:
        with pytest.raises(UserError) as raised:
            dropless.DroplessMoE(4, 4, **options)
        return str(raised.value)

    assert "top_k 9 is more than the 8 experts" in refused(num_experts=8, top_k=9)
    assert "bias_update_rate" in refused(bias_update_rate=-0.1)
    assert "bias_update_rate" in refused(bias_update_rate=float("nan"))
    assert "num_experts" in refused(num_experts=0, shared_experts=1)
    assert "node_limit 3 is more than the 2 nodes" in refused(nodes=2, node_limit=3)
    assert "do not spread evenly over 3 nodes" in refused(num_experts=8, nodes=3)


def _world_that_does_not_split_into_nodes():
    layer = dropless.DroplessMoE(4, 4, num_experts=6, nodes=2, node_limit=1, top_k=2)
    with pytest.raises(UserError, match="3 ranks do not split into 2 nodes"):
        ep.apply_expert_parallel(layer)


def test_a_world_that_does_not_split_into_the_nodes_is_refused_on_every_rank():
    launch(_world_that_does_not_split_into_nodes, 3)


def test_the_balance_benchmark_measures_loads_drops_and_the_grouped_call(tmp_path):
    """The three runs' loads step by step (the bias evens them most), the capacity design's drops
    falling as its capacity grows against none dropless, and the grouped call beside the loop."""
    from conftest import run_bench

    picture = tmp_path / "balance.png"
    result = run_bench("balance", "--steps", "12", "--timed-steps", "2", "--plot", str(picture))
    assert {len(values) for values in result["load_imbalance"].values()} == {12}
    final = result["final_imbalance"]
    assert final["bias"] < final["none"] and min(final.values()) >= 1.0
    dropped = result["dropped"]
    by_capacity = [dropped[factor] for factor in ("1.0", "1.25", "1.5", "2.0")]
    assert (
        by_capacity == sorted(by_capacity, reverse=True) and by_capacity[0] > 0 and dropped["dropless"] == 0
    )
    assert sum(result["rows_per_expert"]) <= result["assignments_last_batch"]
    assert result["grouped_ms"] > 0 and result["loop_ms"] > 0 and picture.stat().st_size > 10_000


def _overlapped_against_plain_order():
    from course_lib.parallel import moe_overlap

    rank = runtime.rank()
    torch.manual_seed(0)
    layer = ep.apply_expert_parallel(
        dropless.DroplessMoE(D_MODEL, HIDDEN, num_experts=EXPERTS, shared_experts=1)
    )
    batches = [torch.randn(TOKENS + i + rank, D_MODEL, generator=torch.Generator().manual_seed(10 * rank + i))
               for i in range(2)]  # fmt: skip
    with torch.no_grad():
        plain = [layer(x) for x in batches]
    with comm.CommLog() as log:
        overlapped, events = moe_overlap.overlapped_forward(layer, batches)
    for mine, expected in zip(overlapped, plain, strict=True):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
    return [record.op for record in log.records], [(i, phase) for i, phase, *_ in events]


@pytest.mark.parametrize("world", [2, 3])
def test_two_micro_batches_interleaved_compute_what_the_plain_order_does(world):
    ops, phases = launch(_overlapped_against_plain_order, world)[0]
    # both dispatches are posted before either combine: each travels while the other computes
    assert ops == ["all_gather", "all_to_all", "all_gather", "all_to_all", "all_to_all", "all_to_all"]
    assert phases.index((1, "route")) < phases.index((0, "experts")) < phases.index((1, "experts"))
    assert phases.index((0, "combine")) < phases.index((1, "experts")) < phases.index((0, "mix"))


def test_the_sequence_wise_loss_sees_what_a_batch_wise_loss_averages_away():
    """Two sequences, each sending every token to its own expert: balanced over the batch (Switch's
    loss is 1), lopsided in each sequence (DeepSeek-V3's sequence-wise loss is not)."""
    logits = torch.tensor([[2.0, -2.0], [2.0, -2.0], [-2.0, 2.0], [-2.0, 2.0]])
    assert float(dropless.route_dropless(logits, top_k=1).aux_loss) == pytest.approx(1.0)
    lopsided = dropless.route_dropless(logits, top_k=1, sequences=2).aux_loss
    assert float(lopsided) == pytest.approx(2 * float(torch.sigmoid(torch.tensor(2.0))))  # E · f · P, f = 1
