"""``memory``: ddp, zero1, zero2 and fsdp (ZeRO-3) at 2 and 4 ranks, with Adam in fp32: the
bytes of parameters, gradients and optimizer state a rank really holds after two steps, against
``memory.model_state_bytes``; and the bytes it sent during the second step, measured by
``CommLog``, against ``memory.traffic_elements_per_rank``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed import comm, runtime
from ...parallel import memory
from ...parallel.data_parallel import apply_data_parallel
from .common import anatomies, mlp, rank_batch, training_step


def measure_sharding(
    model: nn.Module,
    sharding: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    units: list[nn.Module] | None = None,
    loss=F.cross_entropy,
):
    """Two Adam steps of ``model`` under ``sharding``; returns (model-state bytes held, bytes sent in step 2).

    Args:
        model: the model, the same on every rank.
        sharding: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"`` (``memory.SHARDINGS``; the
            course's wrappers).
        inputs: this rank's batch.
        targets: its labels.
        units: the FSDP units for ``"fsdp"``.
        loss: ``loss(outputs, targets)``.
    """
    model = apply_data_parallel(model, sharding=sharding, units=units)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        with comm.CommLog() as log:  # ZeRO-1/2 gather the previous update in this step's forward
            loss(model(inputs), targets).backward()
            optimizer.step()
    return memory.measure_model_states(model, optimizer=optimizer), log.bytes_per_rank()


def memory_benchmark(*, width: int, layers: int, batch: int, profile: str | None = None) -> list[dict] | None:
    """Model-state bytes held and bytes sent by each of ``memory.SHARDINGS``, against the memory
    model, and where each one's step goes (its anatomy).

    Args:
        width: the MLP's width (its layers are width x width).
        layers: its linear layers.
        batch: samples per rank per step.
        profile: a folder for each sharding's per-rank traces (None: none are written).
    """
    world = runtime.world_size()
    inputs, targets = rank_batch(batch, width)
    rows = []
    for sharding in memory.SHARDINGS:
        torch.manual_seed(0)
        model = mlp(width, layers)
        params = sum(p.numel() for p in model.parameters())
        units = [m for m in model if isinstance(m, nn.Linear)]
        measured, sent = measure_sharding(model, sharding, inputs, targets, units=units, loss=F.mse_loss)
        torch.manual_seed(0)
        fresh = mlp(width, layers)
        wrapped = apply_data_parallel(
            fresh, sharding=sharding, units=[m for m in fresh if isinstance(m, nn.Linear)]
        )
        where = anatomies(
            {"course": training_step(wrapped, inputs, targets)},
            trace_dir=f"{profile}/{sharding}_{world}_ranks" if profile else None,
        )
        expected = memory.model_state_bytes(params, world, sharding, **memory.FP32_ADAM)
        traffic = 4 * memory.traffic_elements_per_rank(params, world, sharding)
        rows.append(
            where
            | {
                "world_size": world,
                "sharding": sharding,
                "params": params,
                "measured_bytes": measured.total,
                "model_bytes": expected.total,
                "ratio": measured.total / expected.total,
                "measured_by_kind": {
                    "params": measured.params,
                    "grads": measured.grads,
                    "optimizer": measured.optimizer,
                },
                "model_by_kind": {
                    "params": expected.params,
                    "grads": expected.grads,
                    "optimizer": expected.optimizer,
                },
                "traffic_bytes_measured": sent,
                "traffic_bytes_model": traffic,
                "traffic_ratio": sent / traffic,
            }
        )
    return rows if runtime.is_main() else None
