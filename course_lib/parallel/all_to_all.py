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


class _RowsToRanks(torch.autograd.Function):
    """Rows dealt out to the ranks; backward deals their gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, send_counts, receive_counts, group):
        ctx.group, ctx.send_counts, ctx.receive_counts = group, send_counts, receive_counts
        out = rows.new_empty((sum(receive_counts), *rows.shape[1:]))
        comm.all_to_all_single(
            out,
            rows.contiguous(),
            output_split_sizes=receive_counts,
            input_split_sizes=send_counts,
            group=group,
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send_counts), *grad.shape[1:]))
        comm.all_to_all_single(
            back,
            grad.contiguous(),
            output_split_sizes=ctx.send_counts,
            input_split_sizes=ctx.receive_counts,
            group=ctx.group,
        )
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
