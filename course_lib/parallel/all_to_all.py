"""Rows dealt out to the ranks and back, differentiably: expert parallelism's dispatch and combine.

``all_to_all_single`` with split sizes sends rank r's ``send[j]`` rows to rank j and receives
``receive[j]`` from it; the splits change every step, as the router's choices do, so every rank
learns them first (``expert.py`` by a small all-to-all, ``dropless.py`` by an all-gather of the
counts). Backward deals the rows' gradients back the same way, reversed: the dispatch's backward
is a combine, and the combine's a dispatch.
"""

from __future__ import annotations

import torch

from ..distributed import comm


def post_rows(rows: torch.Tensor, send: list[int], receive: list[int], *, group=None, async_op: bool = False):
    """The all-to-all itself, outside autograd: where the received rows land, and the work handle
    (None unless ``async_op``; wait on it before reading them).

    Args:
        rows: (sum(send), ...), the rows for rank 0 first.
        send: rows for each rank of ``group``.
        receive: rows from each rank of ``group``.
        group: the expert-parallel group (None: every rank).
        async_op: return at once, the rows still travelling.
    """
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    work = comm.all_to_all_single(
        out,
        rows.contiguous(),
        output_split_sizes=receive,
        input_split_sizes=send,
        group=group,
        async_op=async_op,
    )
    return out, work


class _RowsToRanks(torch.autograd.Function):
    """Rows dealt out to the ranks; backward deals their gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, send_counts, receive_counts, group):
        ctx.group, ctx.send_counts, ctx.receive_counts = group, send_counts, receive_counts
        return post_rows(rows, send_counts, receive_counts, group=group)[0]

    @staticmethod
    def backward(ctx, grad):
        back = post_rows(grad, ctx.receive_counts, ctx.send_counts, group=ctx.group)[0]
        return back, None, None, None


def exchange_rows(rows: torch.Tensor, send: list[int], receive: list[int], *, group=None) -> torch.Tensor:
    """Send ``send[j]`` rows (in order) to rank j and return the ``receive[j]`` rows from each rank j.

    Args:
        rows: (sum(send), ...), the rows for rank 0 first.
        send: rows for each rank of ``group``.
        receive: rows from each rank of ``group`` (what they send here).
        group: the expert-parallel group (None: every rank).
    """
    return _RowsToRanks.apply(rows, send, receive, group)
