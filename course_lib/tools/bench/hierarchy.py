"""``bench hierarchy``: a flat ring, the hierarchy and the double binary tree, timed side by side.

The three all-reduces of ``distributed.hierarchical`` on the same message, in turns, ``--repeats``
times each (the median is reported), with every rank's bytes inside a node and across nodes. A
"node" is ``--gpus-per-node`` consecutive ranks. To give it meaning, run it where the ranks of
different nodes talk over a slower link than those of one node: on a cluster under ``srun`` or
``torchrun``, or on one machine in network namespaces joined by shaped virtual links
(``tests/test_two_nodes.py`` builds two such "nodes"). The node's own link is measured too (an
all-reduce inside each node): with the link between nodes, it is what ``plan.network_model``
needs to predict the three.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ...distributed import comm, hierarchical, runtime
from ...distributed.ledger import CommLog
from ...distributed.ring import ring_all_reduce


def hierarchy_benchmark(*, gpus_per_node: int, message_bytes: int, repeats: int) -> dict | None:
    """The three algorithms on one fp32 message; rank 0's result (every rank must call it).

    Args:
        gpus_per_node: G, the consecutive ranks of one node.
        message_bytes: the message, rounded down to a whole number of fp32 elements.
        repeats: timed runs of each algorithm.
    """
    groups = hierarchical.node_groups(gpus_per_node=gpus_per_node)
    numel = max(1, message_bytes // 4)
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(runtime.rank()))
    algorithms = {
        "flat_ring": ring_all_reduce,
        "hierarchical": lambda t: hierarchical.hierarchical_all_reduce(t, groups=groups),
        "tree": hierarchical.tree_all_reduce,
        "inside_node": lambda t: comm.all_reduce(t, group=groups.inside),  # the node's own link
    }
    seconds = {name: [] for name in algorithms}
    sent = {}
    for name, algorithm in algorithms.items():  # a warm-up of each, its bytes counted
        with CommLog() as log:
            algorithm(mine.clone())
        sent[name] = hierarchical.bytes_by_link_class(log, gpus_per_node=gpus_per_node)
    for _ in range(repeats):
        for name, algorithm in algorithms.items():
            work = mine.clone()
            comm.barrier()
            started = time.perf_counter()
            algorithm(work)
            comm.barrier()  # the slowest rank's end
            seconds[name].append(time.perf_counter() - started)
    every_rank = [None] * runtime.world_size()
    dist.all_gather_object(every_rank, sent)
    result = {
        "benchmark": "hierarchy",
        "world_size": runtime.world_size(),
        "gpus_per_node": gpus_per_node,
        "nodes": groups.nodes,
        "message_bytes": 4 * numel,
        "seconds": {name: statistics.median(times) for name, times in seconds.items()},
        "bytes_by_rank": every_rank,
    }
    return result if runtime.is_main() else None
