"""Expert parallelism computes what one process computes with the same routing, for the bytes theory says.

The router's rules (capacity, first choices first, the balancing loss) on hand-made scores; the
MoE layer with its experts spread over 1, 2 and 4 ranks against one process holding them all
(top-1 and top-2, with and without dropped tokens), forward and backward; the all-to-all bytes
against the routing; what the layer keeps for backward against ``activations.moe_activation_bytes``,
exactly, with and without dropped tokens; a transformer with MoE blocks trained on 2 and 4 ranks against one
process; bad arguments refused on every rank before any message.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.parallel import expert as ep
from course_lib.parallel.memory import saved_tensor_bytes

D_MODEL, HIDDEN, EXPERTS = 6, 10, 4
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def test_capacity_queues_first_choices_first_and_counts_the_dropped():
    # 4 tokens, 2 experts: every token prefers expert 0, second choice expert 1
    logits = torch.tensor([[2.0, 1.0], [3.0, 0.0], [1.0, 0.5], [0.2, 0.1]])
    top1 = ep.route(logits, top_k=1, capacity_factor=1.0)  # capacity 2
    assert top1.capacity == 2
    assert top1.kept.tolist() == [True, True, False, False] and top1.dropped == 2
    top2 = ep.route(logits, top_k=2, capacity_factor=1.0)  # capacity 4: 4 first choices, then 4 seconds
    assert top2.expert.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert top2.kept.all() and top2.dropped == 0
    torch.testing.assert_close(top2.gate.view(2, 4).sum(0), torch.ones(4))  # renormalised gates
    assert ep.expert_capacity(10, 4, top_k=2, capacity_factor=1.25) == 7


def test_the_balancing_loss_is_one_when_the_load_is_even_and_grows_with_imbalance():
    even = ep.route(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), top_k=1, capacity_factor=1.0)
    assert float(even.aux_loss) == pytest.approx(1.0)
    skewed = ep.route(torch.tensor([[3.0, 0.0], [2.0, 0.0]]), top_k=1, capacity_factor=1.0)
    assert float(skewed.aux_loss) > 1.5


def _expert_parallel_against_one_process(top_k: int, capacity_factor: float):
    rank, size = runtime.rank(), runtime.world_size()
    torch.manual_seed(0)
    moe = ep.MoE(D_MODEL, HIDDEN, num_experts=EXPERTS, top_k=top_k, capacity_factor=capacity_factor)
    inputs = [
        torch.randn(3, 5, D_MODEL, generator=torch.Generator().manual_seed(10 + r)) for r in range(size)
    ]
    weights = [
        torch.randn(3, 5, D_MODEL, generator=torch.Generator().manual_seed(20 + r)) for r in range(size)
    ]
    # The reference: one process, every expert, each rank's tokens routed as their own group.
    reference, outputs, kept_experts = copy.deepcopy(moe), [], []
    input_grads = []
    for r in range(size):
        reference.router.zero_grad()
        mine = inputs[r].clone().requires_grad_()  # an activation: its gradient goes back through the experts
        y = reference(mine)
        ((y * weights[r]).sum() + reference.aux_loss).backward()
        outputs.append(y.detach())
        input_grads.append(mine.grad)
        routing = reference.last_routing[0]
        kept_experts.append(routing.expert[routing.kept])
        if r == rank:
            router_grad, dropped = reference.router.weight.grad.clone(), reference.dropped
    parallel = ep.apply_expert_parallel(copy.deepcopy(moe))
    mine = inputs[rank].clone().requires_grad_()
    with comm.CommLog() as log:
        y = parallel(mine)
        ((y * weights[rank]).sum() + parallel.aux_loss).backward()
    experts = []
    for i, expert in enumerate(parallel.experts):  # a parameter's gradient: every rank's tokens' share
        everyone = reference.experts[parallel.first_expert + i]
        experts += [
            (ours.grad, theirs.grad) for ours, theirs in zip(expert.parameters(), everyone.parameters())
        ]
    theory = ep.all_to_all_bytes(kept_experts, rank, num_experts=EXPERTS, row_bytes=D_MODEL * 4)
    return {
        "output": (y.detach(), outputs[rank]),
        "input gradient": (mine.grad, input_grads[rank]),
        "router": (parallel.router.weight.grad, router_grad),
        "experts": experts,
        "dropped": (parallel.dropped, dropped),
        "bytes": (log.bytes_per_rank("all_to_all"), float(theory)),
    }


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_expert_parallel_equals_one_process_with_the_same_routing(degree):
    for top_k, capacity_factor in ((1, 4.0), (1, 0.75), (2, 4.0), (2, 0.5)):
        dropped_somewhere = False
        for result in launch(_expert_parallel_against_one_process, degree, top_k, capacity_factor):
            for name in ("output", "input gradient", "router"):
                torch.testing.assert_close(*result[name], **TOLERANCE, msg=f"{name} top-{top_k}")
            for ours, theirs in result["experts"]:
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            assert result["dropped"][0] == result["dropped"][1]
            dropped_somewhere |= result["dropped"][0] > 0
            assert result["bytes"][0] == result["bytes"][1]
        assert dropped_somewhere == (capacity_factor < 1)  # both cases are really exercised


def _train_expert_parallel(steps: int, top_k: int, reference_groups: int):
    """A transformer with MoE blocks on every rank's share of the batch; one process when alone."""
    size, rank = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=8)
    model = ep.moe_transformer(
        len(vocabulary), d_model=16, n_heads=2, n_layers=2, max_seq_len=8, top_k=top_k, capacity_factor=1.0
    )
    if size == 1:  # the reference routes the batch in as many groups as the parallel run has ranks
        for layer in ep.moe_layers(model):
            layer.routing_groups = reference_groups
    else:
        for layer in ep.moe_layers(model):
            ep.apply_expert_parallel(layer)
    experts = {id(p) for layer in ep.moe_layers(model) for p in layer.experts.parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses, dropped = torch.Generator().manual_seed(1), [], 0
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (8,), generator=generator)
        x, y = inputs[batch].chunk(size)[rank], targets[batch].chunk(size)[rank]
        optimizer.zero_grad()
        loss = models.lm_loss(model(x), y) + 0.01 * ep.aux_loss(model)
        loss.backward()
        dropped += sum(layer.dropped for layer in ep.moe_layers(model))
        for param in model.parameters():
            # replicated weights: average like data parallelism; experts already hold every rank's
            # tokens' gradient (the all-to-all brought them), summed: divide by N for the batch mean
            if id(param) in experts:
                param.grad /= size
            else:
                comm.all_reduce(param.grad, op="mean")
        optimizer.step()
        loss = loss.detach().clone()
        comm.all_reduce(loss, op="mean")
        losses.append(float(loss))
    return losses, dropped


@pytest.mark.parametrize("degree", [2, 4])
def test_a_transformer_with_moe_blocks_trains_on_several_ranks_like_one_process(degree):
    for top_k in (1, 2):
        reference, reference_dropped = launch(_train_expert_parallel, 1, 4, top_k, degree)[0]
        results = launch(_train_expert_parallel, degree, 4, top_k, degree)
        assert results[0][0] == pytest.approx(reference, rel=1e-5)
        assert sum(dropped for _, dropped in results) == reference_dropped > 0


def _bad_arguments():
    from conftest import user_errors

    return user_errors(
        {
            "experts": lambda: ep.apply_expert_parallel(ep.MoE(4, 4, num_experts=3)),
            "capacity": lambda: ep.MoE(4, 4, capacity_factor=0),
            "top_k": lambda: ep.MoE(4, 4, num_experts=2, top_k=3),
        }
    )


def test_bad_arguments_are_refused_on_every_rank_before_any_message():
    for errors in launch(_bad_arguments, 2):
        assert "3 experts do not divide over expert-parallel degree 2" in errors["experts"]
        assert "capacity_factor" in errors["capacity"]
        assert "top_k" in errors["top_k"]


@pytest.mark.timing
def test_ep_benchmark_prints_the_promised_json():
    from conftest import assert_accounted, run_bench

    result = run_bench(
        "ep", "--tokens", "48", "--d-model", "8", "--hidden", "8", "--experts", "4", "--steps", "2"
    )
    assert {"expert_parallel_step_ms", "one_process_step_ms", "ratio", "dropped_tokens_rank0"} <= set(result)
    assert_accounted(result, ["course", "one_process"])
    assert result["all_to_all_bytes_rank0_measured"] == result["all_to_all_bytes_rank0_theory"]
    assert sum(result["assignments_per_expert_rank0"]) == 48 * 2  # top-2 by default
    assert result["expert_parameters_per_rank"] * 2 == result["expert_parameters_one_process"]


def test_the_benchmarks_refuse_sizes_that_do_not_split():
    from conftest import run_tool

    refused = run_tool("bench", "ep", "--experts", "3")
    assert refused.returncode == 2 and "must be a multiple of --world-size 2" in refused.stderr
    refused = run_tool("bench", "cp", "--seq", "5")
    assert refused.returncode == 2 and "--seq: must be at least 2 x --world-size (8)" in refused.stderr


# -- what the layer keeps for backward ----------------------------------------------------------


def _saved_against_formula(h: int = 64, tokens: tuple[int, int] = (8, 32)):
    from course_lib.plan.activations import moe_activation_bytes

    results = []
    for top_k, capacity_factor in ((1, 1.25), (2, 1.25), (1, 1.0), (2, 0.5)):
        torch.manual_seed(0)
        moe = ep.MoE(h, 2 * h, num_experts=4, top_k=top_k, capacity_factor=capacity_factor)
        if runtime.world_size() > 1:
            ep.apply_expert_parallel(moe)
        x = torch.randn(*tokens, h, generator=torch.Generator().manual_seed(runtime.rank() + 1))
        x.requires_grad_()
        with saved_tensor_bytes(ignore=[*moe.parameters(), x]) as saved:
            moe(x)
        routed = sum(int(r.kept.sum()) for r in moe.last_routing)
        formula = moe_activation_bytes(
            tokens=tokens[0] * tokens[1],
            d_model=h,
            hidden=2 * h,
            num_experts=4,
            top_k=top_k,
            rows_routed=routed,
            rows_computed=moe.rows_computed,
        )
        results.append((saved.bytes, formula, moe.dropped))
    return results


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_an_moe_layer_keeps_what_the_activation_formula_says(degree):
    dropped = 0
    for rank_results in launch(_saved_against_formula, degree):
        for saved, formula, dropped_here in rank_results:
            assert saved == formula
            dropped += dropped_here
    assert dropped > 0  # the formula holds with tokens dropped too
