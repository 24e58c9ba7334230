"""``recompute``: the memory each recomputation policy saves and the time it pays, side by side.

The course's transformer, data parallel on the ranks, under ``none``, ``full`` and ``selective``
(``course_lib.parallel.recompute``): what one forward leaves alive for backward
(``memory.live_tensor_bytes``) against the planner's formula (``cost_model.predict``), and the
median step time, the three policies timed in rotating order in one run.
"""

from __future__ import annotations

import copy

import torch

from ... import models
from ...data import zen_windows
from ...distributed import runtime
from ...parallel import memory, recompute
from ...parallel.ddp import DataParallel
from ...plan import cost_model, specs
from ...plan.layout import Layout
from ..timing import interleaved_medians


def recompute_benchmark(
    *,
    d_model: int,
    layers: int,
    seq: int,
    batch: int,
    steps: int,
    warmup: int,
    profile: str | None = None,
) -> dict | None:
    """Activation bytes and step time of each recomputation policy, and their ratios to ``none``.

    Args:
        d_model: the transformer's width (4 heads).
        layers: its blocks.
        seq: tokens per sequence.
        batch: sequences per rank per step.
        steps: timed rounds; the median is reported.
        warmup: untimed rounds first.
        profile: unused (the benchmark records no traces).
    """
    torch.set_num_threads(1)
    world, rank = runtime.world_size(), runtime.rank()
    inputs, targets, vocabulary = zen_windows(seq_len=seq)
    torch.manual_seed(0)
    dense = models.TinyTransformer(
        len(vocabulary), d_model=d_model, n_heads=4, n_layers=layers, max_seq_len=seq
    )
    generator = torch.Generator().manual_seed(rank)
    mine = torch.randint(0, len(inputs), (batch,), generator=generator)
    x, y = inputs[mine], targets[mine]
    spec = specs.ModelSpec.of(dense)
    rows, steps_by_policy = [], {}
    for policy in recompute.POLICIES:
        model = DataParallel(recompute.apply_recomputation(copy.deepcopy(dense), policy=policy))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with memory.live_tensor_bytes() as live:
            loss = models.lm_loss(model(x), y)
            kept = live.now
        loss.backward()
        layout = Layout(
            data=world, recomputation=policy, precision="fp32", loss_parallel=False, micro_batch=batch
        )
        formula = cost_model.predict(
            spec, specs.CLUSTERS["alps"], layout, seq_len=seq, global_batch=batch * world
        ).peak.activations_kept
        rows.append({"policy": policy, "activation_bytes": kept, "activation_bytes_formula": formula})

        def step(model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad()
            models.lm_loss(model(x), y).backward()
            optimizer.step()

        steps_by_policy[policy] = step
    medians = interleaved_medians(steps_by_policy, steps, warmup)
    if rank != 0:
        return None
    plain = rows[0]
    for row in rows:
        row["step_ms"] = medians[row["policy"]]
        row["kept_over_none"] = row["activation_bytes"] / plain["activation_bytes"]
        row["time_over_none"] = row["step_ms"] / medians["none"]
    return {
        "benchmark": "recompute",
        "world_size": world,
        "model": {"d_model": d_model, "layers": layers, "seq": seq, "batch_per_rank": batch},
        "threads_per_rank": 1,
        "rows": rows,
        "formula_matches": all(row["activation_bytes"] == row["activation_bytes_formula"] for row in rows),
    }
