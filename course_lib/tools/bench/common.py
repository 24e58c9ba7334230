"""What the benchmarks share: the MLP they train, one training step, a rank's batch, their sizes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ... import data, models
from ...distributed import runtime
from ...observe import anatomy, profiling

MLP_WIDTH = 1024
"""Width of the MLP the ddp, fsdp and memory benchmarks train (layers of width x width)."""
MLP_LAYERS = 4
"""Linear layers of that MLP: 4.2M parameters at width 1024."""
MLP_BATCH = 64
"""Samples per rank per step in the ddp, fsdp and memory benchmarks."""
TIMED_STEPS = 30
"""Timed steps per variant in the ddp and fsdp benchmarks (the median is reported)."""
WARMUP_STEPS = 3
"""Untimed steps per variant before them."""


def mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` square linear layers with ReLU: (width + 1) x width parameters each.

    Args:
        width: the layers' inputs and outputs.
        layers: how many linear layers.
    """
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


ANATOMY_STEPS = 5
"""Steps the benchmarks record for each variant's anatomy (after ``WARMUP_STEPS`` more)."""


def training_step(model: nn.Module, inputs, targets) -> Callable[[], None]:
    """One SGD step of ``model`` on a fixed batch, as a function to time, its phases marked.

    Args:
        model: the (wrapped) model to train.
        inputs: this rank's batch.
        targets: what the mean-squared error compares the output with (the output's shape).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        with anatomy.phase("optimizer"):
            optimizer.zero_grad(set_to_none=True)
        with anatomy.phase("forward"):
            loss = F.mse_loss(model(inputs), targets)
        with anatomy.phase("backward"):
            loss.backward()
        with anatomy.phase("optimizer"):
            optimizer.step()

    return step


def data_parallel_header(benchmark: str, *, params: int, batch: int, steps: int) -> dict:
    """What the ddp and fsdp benchmarks' JSON starts with: what ran, on how many ranks and threads.

    Args:
        benchmark: its name.
        params: the model's parameters.
        batch: samples per rank per step.
        steps: timed steps per variant.
    """
    return {
        "benchmark": benchmark,
        "world_size": runtime.world_size(),
        "params": params,
        "threads_per_rank": torch.get_num_threads(),
        "batch_per_rank": batch,
        "steps_timed": steps,
    }


def anatomies(
    steps_by_name: dict[str, Callable[[], object]],
    *,
    steps: int = ANATOMY_STEPS,
    trace_dir: str | Path | None = None,
) -> dict[str, dict]:
    """Where each variant's step goes (``profiling.record_steps``): its typical step's parts, averaged
    over the ranks, in ms and as fractions of the step (``exposed_communication_share``...).

    Each step is marked as a phase of its own: what runs in it and is neither computation nor
    communication is host overhead (a step that marks finer phases keeps them).

    Args:
        steps_by_name: the step functions of the variants, run on every rank.
        steps: steps recorded for each.
        trace_dir: where each variant's traces go (``trace_dir/<variant>/rank<N>.json``), or None.
    """

    def marked(step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with anatomy.phase("step"):
                step()

        return run

    return {
        name: profiling.record_steps(
            marked(step),
            steps=steps,
            warmup=WARMUP_STEPS,
            trace_dir=Path(trace_dir) / name.replace(" ", "_").replace(",", "") if trace_dir else None,
        ).summary()
        for name, step in steps_by_name.items()
    }


def rank_batch(batch: int, width: int):
    generator = torch.Generator().manual_seed(runtime.rank())
    return torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)


def transformer(layers: int, d_model: int, seq: int):
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    torch.manual_seed(0)
    return (
        models.TinyTransformer(len(vocabulary), d_model=d_model, n_heads=4, n_layers=layers, max_seq_len=seq),
        inputs,
        targets,
    )
