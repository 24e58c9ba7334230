"""``bench checkpoint``: what a checkpoint costs the training, blocking against asynchronous.

The bench's MLP under FSDP2 on local processes, trained with AdamW (a checkpoint holds weights and
both moments: 12 bytes a parameter). Reported, every time the median over ``--saves`` saves:

- ``step_ms``: a training step with no save running;
- ``blocking_pause_s``: how long ``checkpoint.save`` holds the training (the whole write);
- ``async_pause_s``: how long ``async_checkpoint.AsyncSaves.start`` holds it (the copy to host memory);
- ``async_write_s``: from the start of an asynchronous save until the checkpoint is in place,
  while the training goes on;
- ``step_during_write_ms``: a step while a write runs beside it (the writer's thread and the
  training share the cores: on a GPU machine the writer shares only the host).

The checkpoints are written into a temporary folder, removed at the end.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from ...distributed import runtime
from ...train import async_checkpoint, checkpoint
from .common import mlp, rank_batch


def checkpoint_benchmark(*, width: int, layers: int, batch: int, steps: int, saves: int) -> dict | None:
    """Blocking and asynchronous saves of an FSDP2 model, timed beside its training steps.

    Args:
        width: the MLP's width (layers of width x width).
        layers: its linear layers.
        batch: samples per rank per step.
        steps: timed steps without a save.
        saves: saves of each kind (the medians are reported).
    """
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = mlp(width, layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = rank_batch(batch, width)

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        return time.perf_counter() - started

    folder = runtime.from_rank0(tempfile.mkdtemp(prefix="course-checkpoint-bench-"))
    position = checkpoint.TrainingPosition(run_id=runtime.from_rank0(checkpoint.new_run_id()))
    try:
        for _ in range(3):  # warm-up: allocations, FSDP2's lazy set-up, the optimizer's state
            step()
        plain = [step() for _ in range(steps)]
        blocking, pauses, writes, beside = [], [], [], []
        for _ in range(saves):
            position.global_step += 1
            started = time.perf_counter()
            checkpoint.save(folder, model, optimizer, position)
            blocking.append(time.perf_counter() - started)
        saver = async_checkpoint.AsyncSaves()
        for _ in range(saves):
            position.global_step += 1
            started = time.perf_counter()
            saver.start(folder, model, optimizer, position)
            pauses.append(time.perf_counter() - started)
            beside.append(step())  # the training goes on while the write runs
            saver.finish()
            writes.append(time.perf_counter() - started)
    finally:
        if runtime.rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    parameters = sum(p.numel() for p in mlp(width, layers).parameters())
    result = {
        "benchmark": "checkpoint",
        "world_size": runtime.world_size(),
        "parameters": parameters,
        "checkpoint_bytes": 12 * parameters,  # fp32 weights and AdamW's two moments
        "step_ms": 1000 * statistics.median(plain),
        "blocking_pause_s": statistics.median(blocking),
        "async_pause_s": statistics.median(pauses),
        "async_write_s": statistics.median(writes),
        "step_during_write_ms": 1000 * statistics.median(beside),
    }
    result["pause_saved"] = 1 - result["async_pause_s"] / result["blocking_pause_s"]
    return result if runtime.is_main() else None
