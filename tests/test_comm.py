"""comm: each wrapper equals torch.distributed, the ledger equals the formulas, the ring equals all_reduce."""

import pytest
import torch
import torch.distributed as dist

from course_lib.distributed import comm, ring, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError

WORLD_SIZES = [2, 3, 4]
LENGTH = 11  # divides by none of 2, 3, 4


def _rank_tensor(length=LENGTH, dtype=torch.float32):
    """Different, exactly representable values on every rank."""
    rank = runtime.rank()
    return (torch.arange(length, dtype=torch.float64) * (rank + 1) + rank * 0.5).to(dtype)


def _compare_every_wrapper():
    """Run each wrapper and the plain torch.distributed call on copies; return the mismatches."""
    n, rank = dist.get_world_size(), dist.get_rank()
    mismatches = []

    def same(name, ours, theirs):
        if not torch.equal(ours, theirs):
            mismatches.append(name)

    for op, native in [
        ("sum", dist.ReduceOp.SUM),
        ("min", dist.ReduceOp.MIN),
        ("max", dist.ReduceOp.MAX),
        ("product", dist.ReduceOp.PRODUCT),
    ]:
        ours, theirs = _rank_tensor(), _rank_tensor()
        comm.all_reduce(ours, op=op)
        dist.all_reduce(theirs, op=native)
        same(f"all_reduce {op}", ours, theirs)
    ours, theirs = _rank_tensor(), _rank_tensor()
    comm.all_reduce(ours, op="mean")
    dist.all_reduce(theirs)
    same("all_reduce mean", ours, theirs / n)
    ours = _rank_tensor()
    comm.all_reduce(ours, op="sum", async_op=True).wait()
    same("all_reduce async", ours, _rank_tensor() * 0 + theirs)

    shapes = [(2, 3), (5,), (1, 1, 4)]  # one call for all three, each reshaped back
    ours_many = [_rank_tensor(torch.Size(shape).numel()).reshape(shape) for shape in shapes]
    with comm.CommLog() as log:
        comm.all_reduce_coalesced(ours_many, op="mean")
    for shape, tensor in zip(shapes, ours_many):
        theirs = _rank_tensor(torch.Size(shape).numel()).reshape(shape)
        dist.all_reduce(theirs)
        same(f"all_reduce_coalesced {shape}", tensor, theirs / n)
    if log.count() != 1 or log.bytes_per_rank() != comm.ring_bytes("all_reduce", 4 * 15, n):
        mismatches.append("all_reduce_coalesced is one all-reduce of every byte")

    for src in range(n):
        ours, theirs = _rank_tensor(), _rank_tensor()
        comm.broadcast(ours, src=src)
        dist.broadcast(theirs, src=src)
        same(f"broadcast from {src}", ours, theirs)

    piece = _rank_tensor(3)
    ours, theirs = torch.empty(3 * n), torch.empty(3 * n)
    comm.all_gather_into_tensor(ours, piece)
    dist.all_gather_into_tensor(theirs, piece)
    same("all_gather_into_tensor", ours, theirs)
    ours_list, theirs_list = [torch.empty(3) for _ in range(n)], [torch.empty(3) for _ in range(n)]
    comm.all_gather(ours_list, piece)
    dist.all_gather(theirs_list, piece)
    same("all_gather", torch.cat(ours_list), torch.cat(theirs_list))

    full = _rank_tensor(3 * n)
    for op in ("sum", "mean"):
        ours, theirs = torch.empty(3), torch.empty(3)
        comm.reduce_scatter_tensor(ours, full, op=op)
        dist.reduce_scatter_tensor(theirs, full)
        same(f"reduce_scatter_tensor {op}", ours, theirs / n if op == "mean" else theirs)
    pieces = [_rank_tensor(3) + i for i in range(n)]
    ours, theirs = torch.empty(3), torch.empty(3)
    comm.reduce_scatter(ours, pieces)
    dist.reduce_scatter(theirs, [p.clone() for p in pieces])
    same("reduce_scatter", ours, theirs)

    ours, theirs = _rank_tensor(), _rank_tensor()
    comm.reduce(ours, dst=n - 1)
    dist.reduce(theirs, dst=n - 1)
    if rank == n - 1:
        same("reduce", ours, theirs)

    ours_list = [torch.empty(LENGTH) for _ in range(n)] if rank == 0 else None
    theirs_list = [torch.empty(LENGTH) for _ in range(n)] if rank == 0 else None
    comm.gather(_rank_tensor(), ours_list, dst=0)
    dist.gather(_rank_tensor(), theirs_list, dst=0)
    if rank == 0:
        same("gather", torch.cat(ours_list), torch.cat(theirs_list))

    source = [torch.full((4,), float(i)) for i in range(n)] if rank == 1 else None
    ours, theirs = torch.empty(4), torch.empty(4)
    comm.scatter(ours, source, src=1)
    dist.scatter(theirs, [t.clone() for t in source] if source else None, src=1)
    same("scatter", ours, theirs)

    # all-to-all: equal pieces, then rank r sends r + j + 1 rows to rank j (uneven, and different everywhere)
    pieces = torch.arange(3.0 * n) + 100 * rank
    ours, theirs = torch.empty(3 * n), torch.empty(3 * n)
    comm.all_to_all_single(ours, pieces)
    dist.all_to_all_single(theirs, pieces)
    same("all_to_all_single", ours, theirs)
    sends = [rank + j + 1 for j in range(n)]
    receives = [j + rank + 1 for j in range(n)]
    rows = torch.arange(float(sum(sends))) + 100 * rank
    ours, theirs = torch.empty(sum(receives)), torch.empty(sum(receives))
    comm.all_to_all_single(ours, rows, output_split_sizes=receives, input_split_sizes=sends)
    dist.all_to_all_single(theirs, rows, output_split_sizes=receives, input_split_sizes=sends)
    same("all_to_all_single, uneven", ours, theirs)

    comm.barrier()
    # send/recv and their async forms around a ring
    right, left = (rank + 1) % n, (rank - 1) % n
    received = torch.empty(LENGTH)
    request = comm.isend(_rank_tensor(), right)
    comm.recv(received, left)
    request.wait()
    expected = (torch.arange(LENGTH, dtype=torch.float64) * (left + 1) + left * 0.5).float()
    same("isend/recv", received, expected)
    received = torch.empty(LENGTH)
    if rank % 2 == 0:
        comm.send(_rank_tensor(), right)
        comm.irecv(received, left).wait()
    else:
        comm.irecv(received, left).wait()
        comm.send(_rank_tensor(), right)
    same("send/irecv", received, expected)

    assert runtime.rank() == rank and runtime.world_size() == n and runtime.is_main() == (rank == 0)
    return mismatches


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_wrapper_equals_torch_distributed(world_size):
    assert launch(_compare_every_wrapper, world_size) == [[]] * world_size


def _ring_versus_all_reduce(length, dtype):
    ours, theirs = _rank_tensor(length, dtype), _rank_tensor(length, dtype)
    with comm.CommLog() as log:
        ring.ring_all_reduce(ours)
    dist.all_reduce(theirs)
    return torch.equal(ours, theirs), log.bytes_per_rank("send"), theirs.numel() * theirs.element_size()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("length", [1, 7, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_ring_all_reduce_equals_all_reduce(world_size, length, dtype):
    results = launch(_ring_versus_all_reduce, world_size, length, dtype)
    assert all(equal for equal, _, _ in results)
    if length % world_size == 0 or length == 1001:
        sent, size = results[0][1], results[0][2]
        # 2(N-1) chunks of about S/N: exactly the all-reduce formula when N divides the length
        assert sent == pytest.approx(comm.ring_bytes("all_reduce", size, world_size), rel=0.01)


def _ring_on_a_non_contiguous_tensor():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (runtime.rank() + 1)
    view = base.t()
    expected = view.clone()
    dist.all_reduce(expected)
    ring.ring_all_reduce(view)
    return torch.equal(view, expected) and torch.equal(base.t(), expected)


def test_ring_all_reduce_on_a_non_contiguous_view():
    assert launch(_ring_on_a_non_contiguous_tensor, 3) == [True] * 3


def _ledger(world_size_unused=None):
    n = dist.get_world_size()
    s = 4 * 12 * n  # a float32 tensor of 12n elements
    t = torch.ones(12 * n)
    with comm.CommLog() as log:
        comm.all_reduce(t.clone())
        comm.broadcast(t.clone())
        comm.all_gather_into_tensor(torch.empty(12 * n), torch.ones(12))
        comm.reduce_scatter_tensor(torch.empty(12), t.clone())
        comm.reduce(t.clone())
        comm.gather(torch.ones(12), [torch.empty(12) for _ in range(n)] if dist.get_rank() == 0 else None)
        comm.scatter(torch.empty(12), [torch.ones(12) for _ in range(n)] if dist.get_rank() == 0 else None)
        comm.barrier()
        comm.all_reduce(t.clone(), async_op=True).wait()
    totals = log.totals()
    summary = log.summary()
    return (
        n,
        s,
        dist.get_rank(),
        {op: row["bytes_per_rank"] for op, row in totals.items()},
        log.count("all_reduce"),
        summary,
        all(r.seconds is not None for r in log.records),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_commlog_bytes_equal_the_formulas(world_size):
    for n, s, rank, by_op, all_reduces, summary, all_timed in launch(_ledger, world_size):
        assert by_op["all_reduce"] == 2 * 2 * (n - 1) / n * s  # two calls
        assert by_op["broadcast"] == s and by_op["reduce"] == s
        assert by_op["all_gather"] == (n - 1) / n * s
        assert by_op["reduce_scatter"] == (n - 1) / n * s
        root = rank == 0  # the root of the gather and of the scatter
        assert by_op["gather"] == (0 if root else s / n)  # each sends its share to the root...
        assert by_op["scatter"] == ((n - 1) / n * s if root else 0)  # ...which sends the others theirs
        assert by_op["barrier"] == 0
        assert all_reduces == 2 and all_timed
        assert "all_reduce" in summary and "total" in summary


@pytest.mark.parametrize("world_size, factor", [(1, 0), (2, 1), (4, 1.5), (8, 1.75)])
def test_bus_bandwidth_is_nccl_tests_busbw(world_size, factor):
    # nccl-tests: busbw = algbw x 2(N-1)/N for an all-reduce, algbw x (N-1)/N for an all-gather
    assert comm.bus_bandwidth("all_reduce", 10.0, world_size) == pytest.approx(10 * factor)
    assert comm.bus_bandwidth("all_gather", 10.0, world_size) == pytest.approx(10 * factor / 2)


def _all_to_all_bytes():
    rank, n = runtime.rank(), runtime.world_size()
    sends = [rank + j + 1 for j in range(n)]
    with comm.CommLog() as log:
        comm.all_to_all_single(torch.empty(4 * n), torch.zeros(4 * n))
        even = log.bytes_per_rank("all_to_all")
        receives = [j + rank + 1 for j in range(n)]
        comm.all_to_all_single(
            torch.empty(sum(receives), 2),
            torch.zeros(sum(sends), 2),
            output_split_sizes=receives,
            input_split_sizes=sends,
        )
    return even, log.bytes_per_rank("all_to_all") - even, 4 * 2 * (sum(sends) - sends[rank])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_bytes_are_what_leaves_the_rank(world_size):
    for rank, (even, uneven, wanted) in enumerate(launch(_all_to_all_bytes, world_size)):
        assert even == comm.ring_bytes(
            "all_to_all", 4 * 4 * world_size, world_size
        )  # keeps 1/N, sends the rest
        assert uneven == wanted, f"rank {rank}"


def test_ring_bytes_with_one_rank_is_zero():
    assert comm.ring_bytes("all_reduce", 1000, 1) == 0 == comm.ring_bytes("broadcast", 1000, 1)


def _bad_calls():
    errors = []
    for call in (
        lambda: comm.all_reduce(torch.ones(3, device="meta")),
        lambda: comm.all_reduce(torch.ones(3, dtype=torch.int64), op="mean"),
        lambda: comm.all_reduce(torch.ones(3), op="median"),
    ):
        try:
            call()
        except UserError as error:
            errors.append(str(error))
    comm.barrier()  # nobody was left inside a collective
    return errors


def test_bad_calls_fail_clearly_and_leave_no_rank_waiting():
    errors = launch(_bad_calls, 2, timeout_s=60)[0]
    assert (
        "tensor on meta was passed to a gloo collective, which needs cpu (or cuda) tensors: move it with"
        in errors[0]
    )
    assert "the mean of a torch.int64 tensor" in errors[1]
    assert "unknown reduction 'median'" in errors[2]
