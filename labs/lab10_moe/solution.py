"""Solution of lab 10: a mixture-of-experts layer, its experts spread over the ranks.

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

Part 2, the design of 2024-2026 (DeepSeek-V3, Megatron-Core, torchtitan): **dropless** routing
keeps every assignment (sigmoid scores, top-k, no capacity), each expert's **bias** steers the
choice toward an even load without a loss (moved after each step by the loads summed over the
ranks), and a rank's experts multiply their rows in one **grouped** call. E need not divide by N:
rank r holds experts [⌊rE/N⌋, ⌊(r+1)E/N⌋) (``expert_range``).

Check your work (every property, at 2 and 4 processes):

    python -m course_lib.tools.labs check lab10_moe
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib.distributed import comm, runtime
from course_lib.parallel.dropless import expert_range, grouped_mm  # part 2's placement and grouped call
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
    # BEGIN SOLUTION: the gates come from the router's softmax over the experts a token chose (they sum to 1 over its choices); the queues fill choice-major: every token's first choice before any second one, in token order. Pitfall: a token's place in a queue counts only the assignments before it, and the gates must stay differentiable
    probabilities = logits.softmax(dim=-1)
    gates, experts = probabilities.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    expert = experts.t().reshape(-1)
    one_hot = nn.functional.one_hot(expert, num_experts)
    place = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)
    capacity = expert_capacity(tokens, num_experts, top_k=top_k, capacity_factor=capacity_factor)
    token = torch.arange(tokens).repeat(top_k)
    return Routing(token, expert, gates.t().reshape(-1), place < capacity)
    # END SOLUTION


def load_balancing_loss(logits: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """E x Σ_e f_e x P_e from the router's (tokens, E) scores and every assignment's expert (dropped too)."""
    # BEGIN SOLUTION: f_e counts assignments (an integer count: no gradient flows through it) over all assignments; P_e is the mean over tokens of the softmax probability of e (the gradient flows through it). Pitfall: count every expert, also the ones nobody chose (minlength)
    num_experts = logits.shape[-1]
    share = torch.bincount(expert, minlength=num_experts).float() / expert.numel()
    return num_experts * (share * logits.softmax(dim=-1).mean(dim=0)).sum()
    # END SOLUTION


class AllToAll(torch.autograd.Function):
    """Rows dealt out to the ranks (``send_counts[j]`` rows to rank j, in rank order); backward reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
        # BEGIN SOLUTION: the output holds sum(receive_counts) rows of the same width; comm.all_to_all_single takes the split sizes of both sides. Keep both lists on ctx: the gradient travels back the other way
        ctx.send_counts, ctx.receive_counts = send_counts, receive_counts
        out = rows.new_empty((sum(receive_counts), *rows.shape[1:]))
        comm.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=receive_counts, input_split_sizes=send_counts
        )
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # BEGIN SOLUTION: each row's gradient goes home: the same exchange with the two lists swapped (and a contiguous gradient); the counts get no gradient
        back = grad.new_empty((sum(ctx.send_counts), *grad.shape[1:]))
        comm.all_to_all_single(
            back, grad.contiguous(), output_split_sizes=ctx.send_counts, input_split_sizes=ctx.receive_counts
        )
        return back, None, None
        # END SOLUTION


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
        # BEGIN SOLUTION: each rank must learn how many rows it will receive before it can receive them, then the rows travel to the ranks that own their experts and come back the same way, to be weighted by their gates and added to their tokens. Pitfall: a dropped assignment is not sent at all, and rows arrive grouped by the rank that sent them
        kept = routing.kept.nonzero().squeeze(-1)
        order = kept[routing.expert[kept].argsort(stable=True)]
        per_expert = torch.bincount(routing.expert[order], minlength=self.num_experts)
        incoming = torch.empty_like(per_expert)
        comm.all_to_all_single(incoming, per_expert)
        incoming = incoming.view(size, self.local).tolist()  # [source rank][my expert]
        send = per_expert.view(size, self.local).sum(dim=-1).tolist()
        receive = [sum(row) for row in incoming]
        arrived = AllToAll.apply(x[routing.token[order]], send, receive)
        pieces = arrived.split([n for row in incoming for n in row])
        results = [None] * len(pieces)
        for e, expert in enumerate(self.experts):
            mine = [source * self.local + e for source in range(size)]
            outputs = expert(torch.cat([pieces[i] for i in mine])).split([pieces[i].shape[0] for i in mine])
            for i, output in zip(mine, outputs, strict=True):
                results[i] = output
        back = AllToAll.apply(torch.cat(results), receive, send)
        weighted = back * routing.gate[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, routing.token[order], weighted)
        # END SOLUTION


# -- part 2: dropless routing, the bias that balances it, and its uneven dispatch -------------------


@dataclass
class DroplessRouting:
    """One entry per assignment (tokens x k, choice by choice), none dropped; ``load``: each expert's count."""

    token: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    load: torch.Tensor


def route_dropless(logits: torch.Tensor, *, top_k: int, bias: torch.Tensor | None = None) -> DroplessRouting:
    """Top-k of the (tokens, E) scores' sigmoids, every assignment kept; ``bias`` (E,) chooses, never weighs."""
    tokens, num_experts = logits.shape
    # BEGIN SOLUTION: each expert is scored on its own (a sigmoid, not a softmax over the experts); the bias is added to the detached scores to choose the top k, and the gates are the chosen experts' scores without it, normalized to sum to 1 over a token's choices. Order the assignments choice-major, as in part 1. Pitfall: a bias inside the gates would pull on the router's gradient
    scores = logits.sigmoid()
    choosing = scores.detach() + (bias if bias is not None else 0)
    experts = choosing.topk(top_k, dim=-1).indices
    chosen = scores.gather(1, experts)
    gates = chosen / chosen.sum(dim=-1, keepdim=True)
    expert = experts.t().reshape(-1)
    token = torch.arange(tokens).repeat(top_k)
    return DroplessRouting(
        token, expert, gates.t().reshape(-1), torch.bincount(expert, minlength=num_experts)
    )
    # END SOLUTION


def update_bias(bias: torch.Tensor, load: torch.Tensor, *, rate: float) -> torch.Tensor:
    """The biases after one step: each moved by ``rate`` toward an even load (DeepSeek-V3, section 2.1.2)."""
    # BEGIN SOLUTION: every rank routed its own tokens, so sum the loads over the ranks first (one all-reduce): then every rank moves its copy alike. An expert above the mean load goes down by rate, one below goes up (the sign of the difference, not its size). Pitfall: the load is an integer count; the biases are floats
    total = load.to(bias.dtype)
    comm.all_reduce(total, op="sum")
    return bias + rate * torch.sign(total.mean() - total)
    # END SOLUTION


class DroplessExpertParallel(nn.Module):
    """A dropless mixture-of-experts layer holding this rank's experts (``expert_range``).

    Args:
        router: ``nn.Linear(d_model, E, bias=False)``, the same on every rank.
        up: (E, d_model, hidden), every expert's first matrix (the same on every rank).
        down: (E, hidden, d_model), every expert's second matrix.
        top_k: experts per token.
        bias: (E,), the routing bias (the same on every rank).
    """

    def __init__(
        self, router: nn.Linear, up: torch.Tensor, down: torch.Tensor, *, top_k: int, bias: torch.Tensor
    ):
        super().__init__()
        size, rank = runtime.world_size(), runtime.rank()
        self.num_experts, self.top_k, self.bias = up.shape[0], top_k, bias
        self.local = expert_range(self.num_experts, size, rank)
        self.router = router
        self.up = nn.Parameter(up[self.local.start : self.local.stop].clone())
        self.down = nn.Parameter(down[self.local.start : self.local.stop].clone())
        self.routing = None

    def experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on their rows, sorted by expert (``counts[e]`` rows for local expert e)."""
        return grouped_mm(nn.functional.gelu(grouped_mm(rows, self.up, counts)), self.down, counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, d_model) -> (tokens, d_model): every assignment computed, weighted and added."""
        routing = self.routing = route_dropless(self.router(x), top_k=self.top_k, bias=self.bias)
        size = runtime.world_size()
        # BEGIN SOLUTION: sort the assignments by expert (stable); gather every rank's E counts (one all-gather) to size what each rank sends and receives; send the rows with your AllToAll, put what arrives (by source rank, then expert) in expert order for one grouped call, put the results back in arrival order, and return them the same way. Pitfall: the placement is expert_range, not E/N each, and a rank may get no rows for an expert
        order = routing.expert.argsort(stable=True)
        everyone = torch.empty(size * self.num_experts, dtype=routing.load.dtype)
        comm.all_gather_into_tensor(everyone, routing.load)
        table = everyone.view(size, self.num_experts)  # [source rank][expert]
        held = [expert_range(self.num_experts, size, r) for r in range(size)]
        send = [int(routing.load[r.start : r.stop].sum()) for r in held]
        incoming = table[:, self.local.start : self.local.stop]  # [source rank][local expert]
        receive = incoming.sum(dim=-1).tolist()
        arrived = AllToAll.apply(x[routing.token[order]], send, receive)
        starts = torch.tensor([0, *receive]).cumsum(0)[:-1, None] + incoming.cumsum(dim=-1) - incoming
        gather = torch.cat([
            torch.arange(int(starts[s, e]), int(starts[s, e] + incoming[s, e]))
            for e in range(len(self.local)) for s in range(size)
        ])  # fmt: skip
        results = self.experts(arrived[gather], incoming.sum(dim=0).tolist())
        done = torch.empty_like(arrived).index_copy(0, gather, results)
        back = AllToAll.apply(done, receive, send)
        weighted = back * routing.gate[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, routing.token[order], weighted)
        # END SOLUTION
