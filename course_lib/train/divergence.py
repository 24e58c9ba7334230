"""A run that diverged: found on every rank at the same step, and stopped with what to try.

A loss or a gradient that is not finite (NaN, inf) makes every later step meaningless, and an
update would write it into the weights and the next checkpoint. So the step is checked before
the optimizer runs, on every rank together (the training step all-reduces the verdict), and the
run stops there: no update, no checkpoint, the newest checkpoint still the last good one, and a
line that says where it started (which rank's loss) and what to change (a lower learning rate,
clipping, fp32). Exit status 4 (``errors.EXIT_DIVERGED``): a requeue would only diverge again.
"""

from __future__ import annotations

import math

import torch

from ..errors import Diverged
from . import checkpoint
from .checkpoint import TrainingPosition
from .config import TrainConfig
from .metrics import append_metrics, on_first_rank


def gradients_finite(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """Whether every gradient this rank holds is finite (a shard's, for a sharded model), on the device."""
    gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    gradients = [
        grad.to_local() if hasattr(grad, "to_local") else grad for grad in gradients
    ]  # FSDP2's DTensors
    if not gradients:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(grad).all().to(device) for grad in gradients]).all()


def stop(
    config: TrainConfig,
    position: TrainingPosition,
    world_size: int,
    step_loss: float,
    grad_norm: float | None,
    local_loss: float,
) -> None:
    """Record the divergence, tell the user what to try, and stop (every rank raises ``Diverged``).

    Args:
        config: the run.
        position: where training stands (the step that diverged is the next).
        world_size: the ranks of the run.
        step_loss: the step's loss, summed over the ranks.
        grad_norm: the gradients' norm, where it was measured (clipping).
        local_loss: this rank's own loss, before any rank's was summed: the ranks compare them
            (one all-gather, on this path only) to say where a non-finite loss came from.
    """
    step = position.global_step + 1
    what = (
        f"the loss is {step_loss}"
        if not math.isfinite(step_loss)
        else f"the loss is {step_loss:.4g} but a gradient is not finite"
    )
    if world_size > 1:
        finite = [None] * world_size
        torch.distributed.all_gather_object(finite, math.isfinite(local_loss))
        if not all(finite) and any(finite):
            bad = [rank for rank, ok in enumerate(finite) if not ok]
            what += (
                f", first on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} (the others' "
                "losses were finite: look at the batch that rank drew)"
            )
    if grad_norm is not None:
        what += f" (gradient norm {grad_norm:.4g})"
    tries = [f"a lower --lr (this run: {config.lr:g})"]
    tries.append(
        f"a smaller --clip-grad-norm (this run: {config.clip_grad_norm:g})"
        if config.clip_grad_norm
        else "--clip-grad-norm 1.0"
    )
    if config.precision != "fp32":
        tries.append("--precision fp32")
    saved = checkpoint.latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None
    # Resuming the newest checkpoint replays the same batch, so an older one may be the way back;
    # its run then needs a folder of its own, where the newer checkpoint cannot be taken for its own.
    resume = (
        f"; the checkpoints from before it are kept: the newest is {saved} (--resume latest), an older "
        f"one resumes with --resume {saved.parent}/step-XXXXXXXX and a new --checkpoint-dir"
        if saved
        else ""
    )
    if config.metrics:
        record = {
            "event": "diverged",
            "epoch": position.epoch + 1,
            "step": step,
            "loss": repr(step_loss),
            "grad_norm": grad_norm,
            "lr": config.lr,
        }
        on_first_rank(lambda: append_metrics(config.metrics, record))
    raise Diverged(
        f"training diverged at step {step} (epoch {position.epoch + 1}): {what}; try "
        f"{', '.join(tries[:-1])} or {tries[-1]}{resume}"
    )
