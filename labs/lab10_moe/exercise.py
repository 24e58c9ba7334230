"""Exercise: lab 10: a mixture-of-experts layer, its experts spread over the ranks.

A router scores each token against E experts; the token goes to its top-k, and their outputs
are added, weighted by the router's probabilities (the gates). Three pieces:

- **routing with a capacity**: an expert takes at most ``capacity`` assignments of a batch; the
  queues fill first choices first, then second choices, each in token order (GShard's rule),
  and an assignment past its expert's capacity is dropped (the token gets nothing from it);
- **the load-balancing loss** ``E · Σ_e f_e · P_e`` (f_e: the share of assignments that chose e,
  P_e: the router's mean probability for e), 1 when both are uniform (Switch Transformer);
- **dispatch and combine**: rank r holds experts [r·E/N, (r+1)·E/N); the rows of every kept
  assignment go to the rank of their expert with one ``all_to_all_single`` whose pieces have
  different sizes on every rank and step (so the counts travel first), and the results come
  back the same way, reversed.

Check your work (every property, at 2 and 4 processes):

    python -m course_lib.tools.labs check lab10_moe
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib.distributed import comm, runtime
from course_lib.parallel.expert import expert_capacity  # ceil(factor x tokens x k / E)


@dataclass
class Routing:
    """One entry per assignment (tokens x k), choice by choice: all first choices, then all second ones."""

    token: torch.Tensor  # which token
    expert: torch.Tensor  # to which expert
    gate: torch.Tensor  # with which weight (differentiable: the router learns from it)
    kept: torch.Tensor  # False: past its expert's capacity, dropped


def route(logits: torch.Tensor, *, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing of (tokens, E) router scores, with a capacity per expert."""
    tokens, num_experts = logits.shape
    # TODO: the gates come from the router's softmax over the experts a token chose (they sum to 1 over its choices); the queues fill choice-major: every token's first choice before any second one, in token order. Pitfall: a token's place in a queue counts only the assignments before it, and the gates must stay differentiable
    raise NotImplementedError(
        "TODO: the gates come from the router's softmax over the experts a token chose (they sum to 1 over its choices); the queues fill choice-major: every token's first choice before any second one, in token order. Pitfall: a token's place in a queue counts only the assignments before it, and the gates must stay differentiable"
    )


def load_balancing_loss(logits: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """E x Σ_e f_e x P_e from the router's (tokens, E) scores and every assignment's expert (dropped too)."""
    # TODO: f_e counts assignments (an integer count: no gradient flows through it) over all assignments; P_e is the mean over tokens of the softmax probability of e (the gradient flows through it). Pitfall: count every expert, also the ones nobody chose (minlength)
    raise NotImplementedError(
        "TODO: f_e counts assignments (an integer count: no gradient flows through it) over all assignments; P_e is the mean over tokens of the softmax probability of e (the gradient flows through it). Pitfall: count every expert, also the ones nobody chose (minlength)"
    )


class AllToAll(torch.autograd.Function):
    """Rows dealt out to the ranks (``send_counts[j]`` rows to rank j, in rank order); backward reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
        # TODO: the output holds sum(receive_counts) rows of the same width; comm.all_to_all_single takes the split sizes of both sides. Keep both lists on ctx: the gradient travels back the other way
        raise NotImplementedError(
            "TODO: the output holds sum(receive_counts) rows of the same width; comm.all_to_all_single takes the split sizes of both sides. Keep both lists on ctx: the gradient travels back the other way"
        )

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # TODO: each row's gradient goes home: the same exchange with the two lists swapped (and a contiguous gradient); the counts get no gradient
        raise NotImplementedError(
            "TODO: each row's gradient goes home: the same exchange with the two lists swapped (and a contiguous gradient); the counts get no gradient"
        )


class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts layer holding this rank's E/N experts; every rank routes its own tokens.

    Args:
        router: ``nn.Linear(d_model, E)``, the same on every rank.
        experts: all E experts (the same on every rank); this rank keeps its E/N consecutive ones.
        top_k: experts per token.
        capacity_factor: an expert's room, as a multiple of its fair share.
    """

    def __init__(self, router: nn.Linear, experts: list[nn.Module], *, top_k: int, capacity_factor: float):
        super().__init__()
        size, rank = runtime.world_size(), runtime.rank()
        self.num_experts, self.local = len(experts), len(experts) // size
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = router
        self.experts = nn.ModuleList(experts[rank * self.local : (rank + 1) * self.local])
        self.aux_loss = self.routing = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, d_model) -> (tokens, d_model): each token's kept assignments, weighted and added."""
        logits = self.router(x)
        routing = self.routing = route(logits, top_k=self.top_k, capacity_factor=self.capacity_factor)
        self.aux_loss = load_balancing_loss(logits, routing.expert)
        size = runtime.world_size()
        # TODO: each rank must learn how many rows it will receive before it can receive them, then the rows travel to the ranks that own their experts and come back the same way, to be weighted by their gates and added to their tokens. Pitfall: a dropped assignment is not sent at all, and rows arrive grouped by the rank that sent them
        raise NotImplementedError(
            "TODO: each rank must learn how many rows it will receive before it can receive them, then the rows travel to the ranks that own their experts and come back the same way, to be weighted by their gates and added to their tokens. Pitfall: a dropped assignment is not sent at all, and rows arrive grouped by the rank that sent them"
        )
