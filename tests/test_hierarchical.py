"""Hierarchical and tree all-reduce: equal to all_reduce at 4 and 6 ranks laid out as 2 or 3 nodes,
and the bytes each rank sends inside a node and across nodes equal to the formulas."""

from __future__ import annotations

import pytest
import torch

from course_lib.distributed import comm, hierarchical, runtime
from course_lib.distributed.launch import launch
from course_lib.distributed.ledger import CommLog
from course_lib.distributed.ring import ring_all_reduce
from course_lib.errors import UserError

UNEVEN, EVEN = 61, 60  # elements: 61 divides by no world size; 60 by every one, for the byte formulas


def _three_ways(gpus_per_node: int) -> dict:
    groups = hierarchical.node_groups(gpus_per_node=gpus_per_node)
    algorithms = {
        "hierarchical": lambda t: hierarchical.hierarchical_all_reduce(t, groups=groups),
        "tree": hierarchical.tree_all_reduce,
        "flat ring": ring_all_reduce,
    }
    result = {}
    for numel in (UNEVEN, EVEN):
        mine = torch.randn(numel, generator=torch.Generator().manual_seed(runtime.rank()))
        expected = mine.clone()
        comm.all_reduce(expected)
        for name, algorithm in algorithms.items():
            summed = mine.clone()
            with CommLog() as log:
                algorithm(summed)
            result[name, numel] = {
                "difference": (summed - expected).abs().max().item(),
                "sent": hierarchical.bytes_by_link_class(log, gpus_per_node=gpus_per_node),
            }
    return result


@pytest.mark.parametrize("world, gpus_per_node", [(4, 2), (6, 3), (6, 2)])
def test_the_hierarchy_and_the_tree_sum_as_all_reduce_and_send_what_the_formulas_say(world, gpus_per_node):
    nodes = world // gpus_per_node
    results = launch(_three_ways, world, gpus_per_node)
    for rank, result in enumerate(results):
        for (name, numel), row in result.items():
            assert row["difference"] < 1e-5, (name, numel, rank)  # another order of the same sums
        element = 4
        assert result["hierarchical", EVEN]["sent"] == pytest.approx(
            hierarchical.hierarchical_bytes(EVEN * element, gpus_per_node=gpus_per_node, nodes=nodes)
        )
        assert result["flat ring", EVEN]["sent"] == pytest.approx(
            hierarchical.flat_ring_bytes(
                EVEN * element, rank=rank, gpus_per_node=gpus_per_node, world_size=world
            )
        )
        halves = tuple(len(half) * element for half in torch.tensor_split(torch.empty(UNEVEN), 2))
        assert result["tree", UNEVEN]["sent"] == pytest.approx(
            hierarchical.tree_bytes(halves, rank=rank, gpus_per_node=gpus_per_node, world_size=world)
        )
    # the most any one NIC carries: the flat ring's boundary rank against the hierarchy's, G times or more
    busiest = {
        name: max(result[name, EVEN]["sent"]["across nodes"] for result in results)
        for name in ("flat ring", "hierarchical")
    }
    assert busiest["flat ring"] >= gpus_per_node * busiest["hierarchical"] > 0


def test_a_node_size_that_does_not_divide_the_world_is_refused_in_one_line():
    with pytest.raises(
        UserError, match="6 ranks do not make whole nodes of 4: choose a node size that divides 6"
    ):
        hierarchical.check_node_size(6, 4)
    with pytest.raises(UserError, match="gpus_per_node must be a whole number"):
        hierarchical.check_node_size(6, 0)


def test_the_network_model_prices_the_three_as_their_steps_and_bytes_say():
    from course_lib.plan import network_model as nm
    from course_lib.plan.specs import CLUSTERS

    alps = CLUSTERS["alps"]
    g, k, inside, across = alps.gpus_per_node, 16, alps.inside_node, alps.between_nodes
    big, small = 1e10, 1e3
    ring = nm.flat_ring_seconds(big, world=g * k, across=across)
    hierarchy = nm.hierarchical_seconds(big, gpus_per_node=g, nodes=k, inside=inside, across=across)
    # large: bandwidth-bound; across nodes the hierarchy moves 1/G of the bytes a NIC, plus its NVLink part
    n = g * k
    assert ring == pytest.approx(2 * (n - 1) * across.latency_s + 2 * (n - 1) / n * big / across.bandwidth)
    in_node = 2 * (g - 1) * inside.latency_s + 2 * (g - 1) / g * big / inside.bandwidth
    cross = 2 * (k - 1) * across.latency_s + 2 * (k - 1) / k * big / g / across.bandwidth
    assert hierarchy == pytest.approx(in_node + cross)
    # small: latency-bound; 2(N-1) ring steps against the tree's 8 log2 N messages
    assert nm.tree_seconds(small, world=g * k, across=across) < nm.flat_ring_seconds(
        small, world=g * k, across=across
    )
    assert nm.tree_seconds(big, world=g * k, across=across) > ring
    assert nm.hierarchical_seconds(
        big, gpus_per_node=g, nodes=1, inside=inside, across=across
    ) == pytest.approx(in_node, rel=1e-3)  # one node: nothing crosses
    # NCCL's flat ring, a channel per NIC: the hierarchy's bandwidth across, the ring's 2(N-1) steps
    channels = nm.channel_rings_seconds(big, world=n, gpus_per_node=g, across=across)
    every_nic = 2 * (n - 1) / n * big / g / across.bandwidth
    assert channels == pytest.approx(2 * (n - 1) * across.latency_s + every_nic)
    assert channels < ring / (g - 1)  # not G times slower than the hierarchy: that is the course's one ring
    assert nm.channel_rings_seconds(small, world=n, gpus_per_node=g, across=across) > nm.tree_seconds(
        small, world=n, across=across
    )  # small messages: its 2(N-1) latency steps are what the tree saves
