"""What a run measures: validation over every sample exactly once, peak memory, the metrics file.

Metrics computed on a rank's slice (loss, accuracy) are summed over the ranks with one
all-reduce; ``evaluate`` leaves out the samples ``DistributedSampler`` repeats to pad the dataset,
so the validation numbers are those of one process. Each epoch appends one JSON line to the
metrics file, whole or not at all (``append_metrics``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import comm, runtime
from ..errors import UserError
from ..parallel import memory
from ..plan import flops
from .config import autocast

EMPTY_EPOCH_SUMS = {"loss_sum": 0.0, "samples": 0.0, "steps": 0, "seconds": 0.0}
"""What an epoch's record adds up over its steps, before the first one."""


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader, device: torch.device, *, precision: str = "fp32"
) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, every sample counted exactly once.

    ``DistributedSampler`` pads the dataset to a multiple of the world size by repeating its first
    samples, and deals positions round-robin: this rank's i-th sample sits at position
    ``rank + i * world_size`` of the padded order, and it is padding if that position is past
    the end of the dataset. Those samples still run through the model (with FSDP every rank
    must run the same number of forwards) but are left out of the sums.

    Args:
        model: the (wrapped) model, the same on every rank.
        loader: this rank's ``data.validation_loader``.
        device: where the model computes.
        precision: ``"fp32"`` or ``"bf16"`` (autocast), as in training.
    """
    was_training = model.training
    model.eval()
    sampler = loader.sampler
    dataset_size = len(loader.dataset)
    position = sampler.rank
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct predictions, samples
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(device, precision):
            logits = model(inputs)
        losses = F.cross_entropy(logits.float(), targets, reduction="none")
        positions = position + sampler.num_replicas * torch.arange(len(targets), device=device)
        real = positions < dataset_size
        position += sampler.num_replicas * len(targets)
        correct = (logits.argmax(dim=1) == targets) & real
        totals += torch.stack([losses[real].double().sum(), correct.double().sum(), real.double().sum()])
    if dist.is_initialized() and runtime.world_size() > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    loss_sum, correct, samples = totals.tolist()
    return {"val_loss": loss_sum / samples, "val_acc": correct / samples, "val_samples": int(samples)}


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process: tensors allocated on the GPU, or the resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10), "cpu_max_rss"


def reduce_max(value: float, device: torch.device | str = "cpu") -> float:
    if not (dist.is_initialized() and runtime.world_size() > 1):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces only GPU tensors
    comm.all_reduce(tensor, op="max")
    return tensor.item()


def reduce_sum(tensor: torch.Tensor) -> list[float]:
    """The sum over ranks of ``tensor``, read back as numbers."""
    if dist.is_initialized() and runtime.world_size() > 1:
        comm.all_reduce(tensor)
    return tensor.tolist()


def append_metrics(path: str, record: dict[str, Any]) -> None:
    """Append one JSON line, whole or not at all: a line cut short by a full disk is taken back."""
    line = (json.dumps(record) + "\n").encode()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as handle:
            start = handle.tell()
            try:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
            except OSError:
                with contextlib.suppress(OSError):  # a device such as /dev/full cannot be truncated
                    handle.truncate(start)
                raise
    except OSError as error:
        raise UserError(
            f"could not write the metrics to {path} ({error.strerror or error}); the lines written before "
            "are intact: free some space or choose another --metrics file, then rerun with --resume latest"
        ) from None


def on_first_rank(action) -> None:
    """Run ``action`` on rank 0 only, and stop every rank with its error if it raises ``UserError``.

    Without this, rank 0 would stop alone and the others would wait for it in their next
    collective until the timeout.
    """
    problem = None
    if runtime.is_main():
        try:
            action()
        except UserError as error:
            problem = str(error)
    problem = runtime.from_rank0(problem)
    if problem is not None:
        raise UserError(problem)


def epoch_record(
    trainer, *, epoch: int, sums: dict[str, float], first_step: int, epoch_time_s: float
) -> dict[str, Any]:
    """One epoch's line of the metrics file: its throughput, loss, MFU, validation and memory.

    Args:
        trainer: the ``loop.Trainer`` that ran the epoch (its config, process, model and data).
        epoch: the epoch, from 0.
        sums: what its steps added up (``EMPTY_EPOCH_SUMS``'s keys).
        first_step: the step it began at (0, or where a resumed run went on).
        epoch_time_s: its seconds on the slowest rank.
    """
    steps = int(sums["steps"])
    peak_mb, peak_kind = peak_memory_mb(trainer.process.device)
    record = {
        "epoch": epoch + 1,
        "sharding": trainer.config.sharding,
        "impl": trainer.config.impl,
        "sharding_strategy": trainer.sharding_strategy,
        "world_size": trainer.process.world_size,
        "global_batch_size": trainer.config.global_batch_size,
        "micro_batch_size": trainer.micro_batch,
        "grad_accum": trainer.config.grad_accum,
        "dataset": trainer.config.dataset,
        "model": trainer.config.model,
        "precision": trainer.config.precision,
        "device": trainer.process.device.type,
        "backend": trainer.process.backend,
        "steps": steps,
        # False when --max-steps ended it early: its numbers then describe only those steps
        "epoch_complete": trainer.position.step_in_epoch == trainer.steps_per_epoch,
        "epoch_time_s": epoch_time_s,
        "samples_per_s": steps * trainer.config.global_batch_size / epoch_time_s,
        "train_loss": sums["loss_sum"] / sums["samples"],
    }
    if first_step:  # stopped and resumed inside this epoch: the sums above still cover all of it
        record["resumed_at_step"] = first_step
    record["model_tflops"] = trainer.flops_per_sample * record["samples_per_s"] / 1e12
    peak = flops.peak_tflops(trainer.process.device, flops.matmul_precision(trainer.config.precision))
    record["mfu"] = (
        None
        if peak is None
        else flops.model_flops_utilization(
            flops_per_sample=trainer.flops_per_sample,
            samples_per_s=record["samples_per_s"],
            gpus=trainer.process.world_size,
            peak_tflops_per_gpu=peak,
        )
    )
    config, device = trainer.config, trainer.process.device
    record.update(evaluate(trainer.model, trainer.val_loader, device, precision=config.precision))
    record["peak_mem_mb"] = reduce_max(peak_mb, trainer.process.device)
    record["peak_mem_kind"] = peak_kind
    # What sharding divides by N, on any device: on a CPU the peak above is the process's
    # resident memory, mostly PyTorch's own runtime, and hardly moves with N.
    held = memory.measure_model_states(trainer.model, optimizer=trainer.optimizer).total
    record["model_state_mb"] = reduce_max(held / 2**20, trainer.process.device)
    return record
