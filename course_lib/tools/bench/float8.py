"""``bench float8``: a small transformer trained in bf16 from two seeds and with each float8 recipe.

The same model, data and optimizer; the linear layers of every block converted to the course's
float8 layers (``parallel.float8.apply_float8``), the output head left in bf16 as torchtitan
leaves it; autocast to bf16 around the forward in every run. Reported: every step's loss of each
run, the mean of the last ten, and the distance between the two bf16 seeds' means: the noise a
float8 run's distance to bf16 has to stay under for the recipes to count as training alike.
"""

from __future__ import annotations

import torch

from ... import data, models
from ...parallel import float8

LAST_STEPS = 10
"""The final loss of a run is the mean over its last ten steps (one step's loss is noisy)."""


def _losses(recipe: str | None, seed: int, *, steps: int, d_model: int, seq: int, batch: int, lr: float):
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    torch.manual_seed(seed)
    model = models.TinyTransformer(len(vocabulary), d_model=d_model, n_heads=4, n_layers=2, max_seq_len=seq)
    if recipe:
        float8.apply_float8(model, recipe=recipe, skip=(f"{len(model) - 1}.proj",))  # not the head
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator, losses = torch.Generator().manual_seed(1), []  # the same batches in every run
    for _ in range(steps):
        chosen = torch.randint(0, len(inputs), (batch,), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.lm_loss(model(inputs[chosen]), targets[chosen])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def float8_training_benchmark(
    *, steps: int = 60, d_model: int = 64, seq: int = 32, batch: int = 16, lr: float = 3e-3
) -> dict:
    """Four runs of the same training: bf16 (seed 0), bf16 (seed 1), float8 tensorwise, float8 rowwise.

    Args:
        steps: optimizer steps per run (at least ten: the final loss is the mean of the last ten).
        d_model: the transformer's width (a multiple of 16, so that every block's layers convert).
        seq: tokens per window.
        batch: windows per step.
        lr: AdamW's learning rate.
    """
    runs = {"bf16": (None, 0), "bf16, another seed": (None, 1)}
    runs |= {f"float8 {recipe}": (recipe, 0) for recipe in float8.RECIPES}
    sizes = dict(steps=steps, d_model=d_model, seq=seq, batch=batch, lr=lr)
    curves = {name: _losses(recipe, seed, **sizes) for name, (recipe, seed) in runs.items()}
    final = {name: sum(curve[-LAST_STEPS:]) / LAST_STEPS for name, curve in curves.items()}
    return {
        "benchmark": "float8",
        "shape": {"d_model": d_model, "seq": seq, "batch": batch, "layers": 2},
        "steps": steps,
        "curves": curves,
        "final_loss": final,
        "seed_noise": abs(final["bf16"] - final["bf16, another seed"]),
        "distance_to_bf16": {
            recipe: abs(final[f"float8 {recipe}"] - final["bf16"]) for recipe in float8.RECIPES
        },
    }
