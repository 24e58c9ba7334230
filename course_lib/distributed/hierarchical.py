"""All-reduce across nodes: the hierarchy (every NIC busy) and the tree (few steps), built by hand.

A cluster has two classes of link. Inside a node the GPUs share NVLink (hundreds of GB/s); between
nodes each GPU has a NIC of its own (25 to 50 GB/s). One ring over all N = K x G ranks (K nodes
of G GPUs), as ``ring.py`` builds it, crosses each node boundary once: one rank per node sends the
ring's whole 2(N-1)/N x S bytes across, through one NIC, while the node's other NICs idle. NCCL
does not run one ring: it cuts the message over several *channels*, each a ring whose crossings
leave through a different NIC, so its flat ring already uses every NIC
(``plan.network_model.channel_rings_seconds``).

**Hierarchical all-reduce** uses the node as a unit:

1. reduce-scatter inside each node: local rank g holds the node's sum of the g-th 1/G of the tensor;
2. all-reduce across the nodes, between the ranks of the same local rank (one ring per local
   rank, each through its own NIC): each moves 2(K-1)/K x S/G bytes across;
3. all-gather inside the node.

The bytes a rank sends across fall by about G (from 2(N-1)/N x S to 2(K-1)/K x S/G), and all G
NICs carry their part at once: against the course's one ring, G times the bandwidth; against
NCCL's channels, the same bandwidth. What the hierarchy and the tree buy over NCCL's rings is
fewer steps that cross nodes (2(K-1) or 2 log2 N latencies, not 2(N-1)) and, where the switches
can add (NVLink SHARP inside a node, InfiniBand SHARP across), reductions done in the network.

**The tree** trades bandwidth for steps. A ring needs 2(N-1) steps, each paying a latency; a
binary tree reduces to its root and broadcasts back in 2 log2 N levels. NCCL's *double* binary
tree halves the tensor over two trees, the second the mirror of the first, so that a rank
interior in one tree is a leaf in the other and every rank sends about the same. Here both trees
run one after the other, unpipelined: fine for small messages, where latency rules; NCCL cuts
each half into chunks that stream down the tree, and chooses ring or tree by size
(``plan.network_model.all_reduce_seconds``).

``bytes_by_link_class`` reads a ``CommLog`` per link class; ``hierarchical_bytes`` and
``tree_bytes`` are what the tests hold it against; ``plan.network_model`` prices all three.

Papers: Sanders, Speck and Träff, "Two-tree algorithms for full bandwidth broadcast, reduction
and scan", Parallel Computing 2009 (the double binary tree); NCCL 2.4's trees (NVIDIA developer
blog, "Massively Scale Your Deep Learning Training with NCCL 2.4", 2019); Goyal et al., 2017
(hierarchical all-reduce for data parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserError
from . import comm, runtime
from .ledger import CommLog
from .p2p import recv, send

LINK_CLASSES = ("inside node", "across nodes")


def check_node_size(world_size: int, gpus_per_node: int) -> None:
    """Refuse, in one line, a node size that does not cut the world into whole nodes."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise UserError(f"gpus_per_node must be a whole number of at least 1, got {gpus_per_node!r}")
    if world_size % gpus_per_node:
        raise UserError(
            f"{world_size} ranks do not make whole nodes of {gpus_per_node}: choose a node size that "
            f"divides {world_size}"
        )


@dataclass
class NodeGroups:
    """This rank's two groups: the ranks of its node, and the ranks of its local rank on every node."""

    gpus_per_node: int
    nodes: int
    inside: object  # the process group of this node's ranks (consecutive: rank // G is the node)
    across: object  # the process group of the same local rank on every node


def node_groups(*, gpus_per_node: int) -> NodeGroups:
    """Cut the world into nodes of ``gpus_per_node`` consecutive ranks (a collective: every rank calls it).

    Args:
        gpus_per_node: G, the ranks of one node (on a cluster, the launcher's LOCAL_WORLD_SIZE).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = runtime.world_size()
    check_node_size(world, gpus_per_node)
    device = runtime.process_info().device.type
    mesh = init_device_mesh(
        device, (world // gpus_per_node, gpus_per_node), mesh_dim_names=("across", "inside")
    )
    return NodeGroups(
        gpus_per_node, world // gpus_per_node, mesh["inside"].get_group(), mesh["across"].get_group()
    )


# #region hierarchy
def hierarchical_all_reduce(tensor: torch.Tensor, *, groups: NodeGroups) -> torch.Tensor:
    """Sum ``tensor`` over every rank in place: reduce-scatter in the node, all-reduce across, all-gather.

    Args:
        tensor: this rank's contribution, overwritten with the sum.
        groups: this rank's node and cross-node groups (``node_groups``).
    """
    g = groups.gpus_per_node
    flat = tensor.reshape(-1)
    padded = torch.zeros(math.ceil(flat.numel() / g) * g, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat  # G equal pieces: the last one padded with zeros
    mine = torch.empty(padded.numel() // g, dtype=tensor.dtype, device=tensor.device)
    comm.reduce_scatter_tensor(mine, padded, group=groups.inside)  # NVLink: the node's sum of my piece
    comm.all_reduce(mine, group=groups.across)  # my NIC: every node's sum of my piece
    comm.all_gather_into_tensor(padded, mine, group=groups.inside)  # NVLink: every piece
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor


# #endregion hierarchy


def _tree_links(position: int, n: int) -> tuple[int | None, list[int]]:
    """(parent, children) of ``position`` in a binary heap of n positions: parent (p - 1) // 2."""
    parent = (position - 1) // 2 if position > 0 else None
    return parent, [child for child in (2 * position + 1, 2 * position + 2) if child < n]


def tree_position(rank: int, n: int, tree: int) -> int:
    """Where ``rank`` sits in tree 0 (rank order) or tree 1 (the mirror: position n - 1 - rank).

    The mirror is its own inverse: the same call turns a position back into its rank."""
    return rank if tree == 0 else n - 1 - rank


# #region tree
def tree_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over every rank in place with two binary trees, each carrying half of it.

    In each tree a rank receives its children's partial sums, adds its own, sends the result to
    its parent; the root then holds the sum and it flows back down. Tree 1 is the mirror of tree 0,
    so a rank interior in one is (mostly) a leaf in the other.

    Args:
        tensor: this rank's contribution, overwritten with the sum.
    """
    n, rank = runtime.world_size(), runtime.rank()
    flat = tensor.reshape(-1).clone()
    for tree, half in enumerate(torch.tensor_split(flat, 2)):
        # positions -> ranks (the mirror is its own inverse)
        parent, children = _tree_links(tree_position(rank, n, tree), n)
        parent = None if parent is None else tree_position(parent, n, tree)
        children = [tree_position(child, n, tree) for child in children]
        for child in children:  # up: the children's partial sums
            incoming = torch.empty_like(half)
            recv(incoming, child, tag=tree)
            half += incoming
        if parent is not None:
            send(half, parent, tag=tree)
            recv(half, parent, tag=tree)  # down: the whole sum
        for child in children:
            send(half, child, tag=tree)
    tensor.copy_(flat.view_as(tensor))
    return tensor


# #endregion tree


def bytes_by_link_class(log: CommLog, *, gpus_per_node: int) -> dict[str, float]:
    """The bytes this rank sent in ``log``, by the class of link they crossed.

    A send crosses nodes when its peer is on another node (rank // G differs). A collective over a
    group is counted across nodes when its group spans nodes: true of every hop of the hierarchy's
    cross-node rings, which hold one rank per node (a ring over the ranks of several nodes *each*
    would cross only at node boundaries: use the hand-built ``ring_all_reduce`` for those, whose
    sends name their peers).

    Args:
        log: a ``CommLog`` of this rank's calls.
        gpus_per_node: G.
    """
    me = runtime.rank() // gpus_per_node
    sent = dict.fromkeys(LINK_CLASSES, 0.0)
    for record in log.records:
        if record.peer is not None:
            crosses = record.peer // gpus_per_node != me
        else:
            crosses = len({rank // gpus_per_node for rank in record.group_ranks}) > 1
        sent["across nodes" if crosses else "inside node"] += record.bytes_per_rank
    return sent


def hierarchical_bytes(tensor_bytes: float, *, gpus_per_node: int, nodes: int) -> dict[str, float]:
    """What ``hierarchical_all_reduce`` makes each rank send, by link class (S padded to G pieces).

    Args:
        tensor_bytes: S, the tensor's bytes, a multiple of G elements' bytes.
        gpus_per_node: G.
        nodes: K.
    """
    g, k = gpus_per_node, nodes
    inside = comm.ring_bytes("reduce_scatter", tensor_bytes, g) + comm.ring_bytes(
        "all_gather", tensor_bytes, g
    )
    return {"inside node": inside, "across nodes": comm.ring_bytes("all_reduce", tensor_bytes / g, k)}


def flat_ring_bytes(
    tensor_bytes: float, *, rank: int, gpus_per_node: int, world_size: int
) -> dict[str, float]:
    """What ``ring.ring_all_reduce`` over every rank makes ``rank`` send, by link class: all of it to
    the next rank, across nodes for the last rank of each node (S a multiple of N elements' bytes).

    Args:
        tensor_bytes: S.
        rank: the rank.
        gpus_per_node: G.
        world_size: N.
    """
    sent = comm.ring_bytes("all_reduce", tensor_bytes, world_size)
    crosses = (rank + 1) % world_size // gpus_per_node != rank // gpus_per_node
    return {"inside node": 0.0 if crosses else sent, "across nodes": sent if crosses else 0.0}


def tree_bytes(halves_bytes: tuple[float, float], *, rank: int, gpus_per_node: int, world_size: int) -> dict:
    """What ``tree_all_reduce`` makes ``rank`` send, by link class: each half once up to its parent,
    once down to each child, in each tree.

    Args:
        halves_bytes: the bytes of the two halves (``tensor_split`` in 2: they may differ by one element).
        rank: the rank.
        gpus_per_node: G.
        world_size: N.
    """
    n, sent = world_size, dict.fromkeys(LINK_CLASSES, 0.0)
    for tree, half in enumerate(halves_bytes):
        parent, children = _tree_links(tree_position(rank, n, tree), n)
        for peer in [parent] * (parent is not None) + children:
            crosses = tree_position(peer, n, tree) // gpus_per_node != rank // gpus_per_node
            sent["across nodes" if crosses else "inside node"] += half
    return sent
