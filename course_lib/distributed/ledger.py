"""The ledger: how many bytes each collective makes every rank send, and a log that counts them.

Bytes per rank. For a tensor of S bytes and a group of N ranks, the classic bandwidth-optimal
(ring) algorithms make each rank send:

==================  ===================  ====================================================
operation           bytes sent per rank  why
==================  ===================  ====================================================
all_reduce          2 (N-1)/N · S        a reduce-scatter, then an all-gather
reduce_scatter      (N-1)/N · S          S is the full input; each rank keeps 1/N of the sum
all_gather          (N-1)/N · S          S is the full output; each rank contributes 1/N
broadcast, reduce   S                    every rank but the last forwards the tensor once
gather              S/N; the root: 0     each rank sends its share; the root receives (N-1)/N · S
scatter             (N-1)/N · S at root  the root sends each other rank its share; the others send 0
all_to_all          (N-1)/N · S          S is this rank's input: it keeps 1/N, each other rank
                                         gets another 1/N (expert parallelism's exchange)
send / recv         S / 0                point to point
barrier             0
==================  ===================  ====================================================

(This is NCCL's "bus bandwidth" accounting; with N = 1 nothing is sent.) A benchmark that
all-reduces S bytes in T seconds reports two rates: the *algorithm bandwidth* S/T, which
depends on N, and the *bus bandwidth* S/T x 2(N-1)/N (``bus_bandwidth``), the rate each rank's
link really carried, which can be compared with the link's speed at any N. Note the 2 in
all-reduce: data parallelism sends about twice the model's gradient bytes per step, *whatever
N is*. Adding ranks adds no bytes per rank: data parallelism scales in bandwidth. It does not
scale for free in time: the ring's 2(N-1) messages each pay a latency (a term 2(N-1)·alpha that
grows with N), and under strong scaling the compute that could hide the communication shrinks
as 1/N (``scaling.strong_scaling_seconds``).

``CommLog`` records every call made through ``comm`` while its ``with`` block runs (the
operation, the tensor's bytes, the bytes this rank sent by the formula above, the group, the
seconds), so a lesson can set the traffic it measured beside the traffic the theory predicts.

Papers: the ring all-reduce and why it is bandwidth-optimal, Patarasuk and Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009; the per-operation costs
and the latency-bandwidth (alpha-beta) model, Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class CommRecord:
    op: str
    tensor_bytes: int  # S: the full tensor (the output of all_gather, the input of reduce_scatter)
    bytes_per_rank: float  # what the ring algorithm makes each rank send
    group_size: int
    seconds: float | None = None  # launch to completion (async: until wait() returned)
    group_ranks: tuple[int, ...] = ()  # the global ranks of the group
    sequence: int = 0  # this collective's number on its group, from 0, the same on every rank (-1: p2p)
    issued_s: float = 0.0  # when this rank called it (time.time(): one clock for the ranks of a machine)
    peer: int | None = None  # a send's or receive's other rank (global), None for a collective


# #region bytes-per-rank
def ring_bytes(op: str, tensor_bytes: int, group_size: int) -> float:
    """Bytes each rank sends for ``op`` on a tensor of ``tensor_bytes`` (see the module's table).

    Args:
        op: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``, ``"broadcast"``, ``"reduce"``,
            ``"gather"``, ``"scatter"``, ``"send"``, ``"recv"`` or ``"barrier"``.
        tensor_bytes: S, the full tensor (the output of an all-gather, the input of a reduce-scatter).
        group_size: N, the ranks taking part.
    """
    n = group_size
    if n <= 1 or op == "barrier" or op == "recv":
        return 0.0
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "gather": 1 / n,  # a rank that is not the root; the root sends nothing
        "all_to_all": (n - 1) / n,
        "scatter": (n - 1) / n,  # the root; the others send nothing
        "broadcast": 1.0,
        "reduce": 1.0,
        "send": 1.0,
    }[op]
    return factor * tensor_bytes


# #endregion bytes-per-rank


def bus_bandwidth(op: str, algorithm_bandwidth: float, group_size: int) -> float:
    """The rate a rank's link carried: the algorithm bandwidth S/T times ``ring_bytes``' factor.

    This is how ``nccl-tests`` report "busbw": for an all-reduce, algbw x 2(N-1)/N. A ring that
    runs at the link's speed shows a bus bandwidth equal to that speed, whatever N is.

    Args:
        op: the collective, as in ``ring_bytes`` (``"all_reduce"``, ``"all_gather"``...).
        algorithm_bandwidth: S / T, the tensor's bytes over the operation's seconds.
        group_size: N, the ranks taking part.
    """
    return ring_bytes(op, 1, group_size) * algorithm_bandwidth


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements.

    Args:
        tensor: any tensor.
    """
    return tensor.numel() * tensor.element_size()


active_logs: list[CommLog] = []  # every CommLog whose ``with`` block is running


class CommLog:
    """Record every collective made through this module while the ``with`` block runs.

    >>> with CommLog() as log:
    ...     all_reduce(grad)
    >>> print(log.summary())
    """

    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommLog:
        active_logs.append(self)
        return self

    def __exit__(self, *exc) -> None:
        active_logs.remove(self)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def bytes_per_rank(self, op: str | None = None) -> float:
        return sum(r.bytes_per_rank for r in self.records if op is None or r.op == op)

    def totals(self) -> dict[str, dict[str, float]]:
        table: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "tensor_bytes": 0, "bytes_per_rank": 0.0, "seconds": 0.0}
        )
        for record in self.records:
            row = table[record.op]
            row["calls"] += 1
            row["tensor_bytes"] += record.tensor_bytes
            row["bytes_per_rank"] += record.bytes_per_rank
            row["seconds"] += record.seconds or 0.0
        return dict(table)

    def summary(self) -> str:
        lines = [f"{'operation':<16}{'calls':>7}{'tensor MB':>12}{'sent/rank MB':>14}{'seconds':>10}"]
        for op, row in sorted(self.totals().items()):
            lines.append(
                f"{op:<16}{row['calls']:>7}{row['tensor_bytes'] / 1e6:>12.3f}"
                f"{row['bytes_per_rank'] / 1e6:>14.3f}{row['seconds']:>10.4f}"
            )
        lines.append(f"{'total':<16}{self.count():>7}{'':>12}{self.bytes_per_rank() / 1e6:>14.3f}")
        return "\n".join(lines)
