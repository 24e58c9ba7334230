"""Exercise: lab 1: data parallelism by hand: broadcast, overlapped all-reduce, buckets.

``HandDDP`` wraps a model the way PyTorch's ``DistributedDataParallel`` does, in three steps you
write yourself (the TODOs of exercise.py):

1. ``broadcast_parameters``: every replica starts from rank 0's weights;
2. per-parameter mode (``bucket_mb=None``): as soon as backward has accumulated a parameter's
   gradient, a hook launches an *asynchronous* all-reduce of it, so communication runs while
   backward computes the gradients of earlier layers; ``finish_gradient_sync`` (called right
   after ``loss.backward()``) waits for every handle and turns the sums into averages;
3. bucket mode: one message per parameter costs a latency each, so gradients are grouped into
   buckets of about ``bucket_mb`` MB, in reverse order of the parameters (the order backward
   produces them); a bucket is flattened and all-reduced as soon as its last gradient is ready.

Check your work (every property, at 2, 3 and 4 processes):

    python -m course_lib.tools.labs check lab1_ddp
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.distributed import comm, runtime


def broadcast_parameters(module: nn.Module) -> None:
    """Make every rank's parameters and buffers equal to rank 0's."""
    # TODO: replicas that start equal stay equal; look up comm.broadcast, and do not forget the buffers (batch norm's statistics) nor that a broadcast writes into the tensor you give it
    raise NotImplementedError(
        "TODO: replicas that start equal stay equal; look up comm.broadcast, and do not forget the buffers (batch norm's statistics) nor that a broadcast writes into the tensor you give it"
    )


def bucket_parameters(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Group ``params`` into buckets as PyTorch's DDP does, starting from the last parameter.

    A bucket is closed as soon as it holds ``bucket_mb`` MB or more; no bucket is empty.
    """
    # TODO: walk the parameters in the order backward makes their gradients; a bucket is full once it reaches the size (PyTorch's rule: it never waits for a gradient that would not fit), so check after adding, not before; count bytes, and remember that MB here means 2**20 bytes
    raise NotImplementedError(
        "TODO: walk the parameters in the order backward makes their gradients; a bucket is full once it reaches the size (PyTorch's rule: it never waits for a gradient that would not fit), so check after adding, not before; count bytes, and remember that MB here means 2**20 bytes"
    )


class HandDDP(nn.Module):
    """Data parallelism by hand around ``module``: call ``finish_gradient_sync()`` after backward.

    Args:
        module: the model, built on every rank (rank 0's weights are broadcast to all).
        bucket_mb: None to all-reduce each gradient alone, else the bucket size in MB.
    """

    def __init__(self, module: nn.Module, *, bucket_mb: float | None = None):
        super().__init__()
        self.module, self.bucket_mb = module, bucket_mb
        self.world_size = runtime.world_size()
        broadcast_parameters(module)
        # A tied weight appears once in parameters(); a frozen one never gets a gradient.
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = bucket_parameters(self.params, bucket_mb) if bucket_mb is not None else []
        self.bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self.pending: list = []  # (async handle, what to do once it is done)
        self.ready_in_bucket = [0] * len(self.buckets)
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` holds this backward's whole gradient."""
        if self.bucket_mb is None:
            # TODO: start the all-reduce of this gradient now, without waiting for it (async_op=True gives a handle); keep the handle, the averaging comes once it is done
            raise NotImplementedError(
                "TODO: start the all-reduce of this gradient now, without waiting for it (async_op=True gives a handle); keep the handle, the averaging comes once it is done"
            )
            return
        # TODO: count the ready gradients of this parameter's bucket; when the bucket is complete, copy its gradients into one flat tensor (torch.cat of flattened views) and start its all-reduce asynchronously; remember how to copy the result back
        raise NotImplementedError(
            "TODO: count the ready gradients of this parameter's bucket; when the bucket is complete, copy its gradients into one flat tensor (torch.cat of flattened views) and start its all-reduce asynchronously; remember how to copy the result back"
        )

    def finish_gradient_sync(self) -> None:
        """After ``loss.backward()``: wait for every all-reduce, and leave averaged gradients."""
        # TODO: wait on every pending handle; a bucket's summed flat tensor goes back into each parameter's .grad (in the order it was packed); every gradient is then divided by the world size; clear what is pending for the next step
        raise NotImplementedError(
            "TODO: wait on every pending handle; a bucket's summed flat tensor goes back into each parameter's .grad (in the order it was packed); every gradient is then divided by the world size; clear what is pending for the next step"
        )
