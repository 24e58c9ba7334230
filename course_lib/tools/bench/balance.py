"""``bench balance``: how evenly a mixture of experts spreads its tokens, trained three ways.

One process trains ``parallel.dropless.dropless_transformer`` on the Zen of Python three times,
from one seed and on the same batches: with no balancing, with Switch's auxiliary loss (weight
``aux_weight``), and with DeepSeek-V3's bias (``dropless.balance`` after each step, rate
``bias_rate``). Every step records the load imbalance, the busiest expert's load over the mean
(``dropless.load_imbalance``): the step waits for the busiest expert, so it is that slowdown.

Then, on the unbalanced run's last batch, what the capacity design would have dropped: the same
router scores through ``expert.route`` at capacity factors 1.0 to 2.0 (softmax and sigmoid rank
the experts alike, so the choices are the same), against none dropless. Last, one layer's
experts computed two ways on the same rows, timed interleaved: stacked weights through
``dropless.grouped_mm`` (one call: one kernel on a Hopper GPU, a loop here) and one
``models.MLP`` per expert, the capacity design's loop.
"""

from __future__ import annotations

import torch

from ... import data, models
from ...parallel import dropless
from ...parallel import expert as ep
from ..timing import interleaved_medians

METHODS = ("none", "aux_loss", "bias")
"""The balancing of each run: none, Switch's loss, DeepSeek-V3's bias."""
CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)


def _train(method: str, *, steps, experts, top_k, bias_rate, aux_weight, d_model, seq, batch, lr):
    """One run: every step's load imbalance, and the model (its last forward's routing kept)."""
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    torch.manual_seed(0)
    rate = bias_rate if method == "bias" else 0.0
    shape = dict(d_model=d_model, max_seq_len=seq, num_experts=experts, top_k=top_k)
    model = dropless.dropless_transformer(len(vocabulary), **shape, bias_update_rate=rate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator, imbalance = torch.Generator().manual_seed(1), []  # the same batches in every run
    for _ in range(steps):
        chosen = torch.randint(0, len(inputs), (batch,), generator=generator)
        loss = models.lm_loss(model(inputs[chosen]), targets[chosen])
        layers = dropless.dropless_layers(model)
        if method == "aux_loss":
            loss = loss + aux_weight * torch.stack([layer.last_routing.aux_loss for layer in layers]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if method == "bias":
            dropless.balance(model)
        imbalance.append(dropless.load_imbalance(model))
    return imbalance, model, inputs[chosen]


def _dropped_at_capacity(model, batch: torch.Tensor, top_k: int) -> dict[str, int]:
    """What the capacity design drops on the first layer's scores of ``batch``, per capacity factor,
    and what the dropless layer dropped of the same assignments."""
    layer = dropless.dropless_layers(model)[0]
    captured = {}
    hook = layer.router.register_forward_hook(lambda module, args, out: captured.setdefault("logits", out))
    with torch.no_grad():
        model(batch)
    hook.remove()
    logits, routing = captured["logits"], layer.last_routing
    dropped = {str(f): ep.route(logits, top_k=top_k, capacity_factor=f).dropped for f in CAPACITY_FACTORS}
    dropped["dropless"] = logits.shape[0] * top_k - int(routing.load.sum())  # every assignment computed
    return dropped


def _grouped_against_loop(*, experts: int, d_model: int, rows: int, steps: int, warmup: int) -> dict:
    """One layer's experts on the same uneven rows: grouped weights in one call, against a loop of MLPs."""
    torch.manual_seed(0)
    grouped = dropless.GroupedExperts(d_model, 4 * d_model, experts)
    looped = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model, bias=False), torch.nn.GELU(),
                            torch.nn.Linear(4 * d_model, d_model, bias=False))
        for _ in range(experts)
    )  # fmt: skip
    with torch.no_grad():  # the same weights both ways
        for e, mlp in enumerate(looped):
            mlp[0].weight.copy_(grouped.up[e].t())
            mlp[2].weight.copy_(grouped.down[e].t())
    weights = torch.rand(experts, generator=torch.Generator().manual_seed(2)) + 0.2
    counts = (weights / weights.sum() * rows).long().tolist()
    x = torch.randn(sum(counts), d_model, generator=torch.Generator().manual_seed(3))
    one_call = grouped(x, counts)
    by_loop = torch.cat([mlp(piece) for mlp, piece in zip(looped, x.split(counts), strict=True)])
    torch.testing.assert_close(one_call, by_loop, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        medians = interleaved_medians(
            {"grouped": lambda: grouped(x, counts),
             "loop": lambda: [mlp(piece) for mlp, piece in zip(looped, x.split(counts), strict=True)]},
            steps, warmup,
        )  # fmt: skip
    return {"rows_per_expert": counts, "grouped_ms": medians["grouped"], "loop_ms": medians["loop"],
            "loop_over_grouped": medians["loop"] / medians["grouped"]}  # fmt: skip


def balance_benchmark(
    *,
    steps: int = 60,
    experts: int = 8,
    top_k: int = 2,
    bias_rate: float = 0.02,
    aux_weight: float = 0.01,
    d_model: int = 32,
    seq: int = 16,
    batch: int = 16,
    lr: float = 3e-3,
    timed_steps: int = 20,
    warmup: int = 3,
    profile: str | None = None,
) -> dict:
    """The three runs' load imbalance step by step, the capacity design's drops, grouped against looped.

    Args:
        steps: optimizer steps of each run.
        experts: routed experts per layer.
        top_k: experts per token.
        bias_rate: γ, the bias's step (DeepSeek-V3 used 0.001 over 14.8T tokens; a short run needs more).
        aux_weight: the auxiliary loss's weight (Switch used 0.01).
        d_model: the transformer's width.
        seq: characters per window.
        batch: windows per step.
        lr: AdamW's learning rate.
        timed_steps: timed rounds of the grouped and looped experts.
        warmup: untimed rounds first.
        profile: unused (the benchmark records no anatomy).
    """
    options = dict(steps=steps, experts=experts, top_k=top_k, bias_rate=bias_rate, aux_weight=aux_weight,
                   d_model=d_model, seq=seq, batch=batch, lr=lr)  # fmt: skip
    imbalance, last = {}, None
    for method in METHODS:
        imbalance[method], model, batch_seen = _train(method, **options)
        if method == "none":
            last = (model, batch_seen)
    tokens = last[1].numel()
    return {
        "benchmark": "balance",
        **options,
        "load_imbalance": imbalance,
        "final_imbalance": {m: sum(values[-10:]) / len(values[-10:]) for m, values in imbalance.items()},
        "assignments_last_batch": tokens * top_k,
        "dropped": _dropped_at_capacity(*last, top_k),
        **_grouped_against_loop(
            experts=experts, d_model=d_model, rows=tokens * top_k, steps=timed_steps, warmup=warmup
        ),  # fmt: skip
    }
