"""Dropless mixture of experts: every token computed, a rank's experts in one grouped matmul.

The capacity design (``expert.py``: GShard and Switch, 2020-2021) gives each expert a buffer of
fixed size and drops the tokens beyond it. Megatron-Core and torchtitan route every token
instead (**dropless**): an expert receives however many rows its tokens chose, so the dispatch
all-to-all moves uneven splits (``all_to_all_single`` with split sizes, the counts exchanged
first), and all of a rank's experts multiply their rows in one **grouped matmul**
(``torch._grouped_mm`` on Hopper, one kernel for every expert, what torchtitan's ``GroupedExperts``
calls; where it is missing, the same contract computed expert by expert, ``grouped_mm``).

**Balance without an auxiliary loss** (DeepSeek-V3, arXiv:2412.19437, section 2.1.2). Each expert
has a bias b_e that is added to the routing scores for choosing the top-k only; the gates come
from the scores without it, so the bias steers tokens without pulling on the router's gradient.
After each step, ``balance`` moves every b_e by γ (``bias_update_rate``): down for an expert that
took more than the mean load, up for one that took less.

**Shared and fine-grained experts** (DeepSeek-MoE, arXiv:2401.06066). Many small experts with a
larger k combine more specialists for the same compute per token; a few **shared** experts take
every token (one dense MLP of their combined width beside the routed ones).

**Node-limited routing** (DeepSeek-V3). With the experts spread over ``nodes`` groups of ranks,
each token may choose experts on at most ``node_limit`` of them: the nodes whose best k/M scores
add up highest. It bounds the rows that leave a node, the slow part of the all-to-all.

**Placement.** E experts on N ranks need not divide: rank r holds experts [⌊rE/N⌋, ⌊(r+1)E/N⌋)
(``expert_range``).

Cost per rank and layer: as ``expert.py``, without the dropped rows, and with the counts of all E
experts gathered once (E integers per rank) to size the uneven splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import check_group, check_int, check_module, check_number
from ..distributed import comm, runtime
from ..errors import UserError
from ..models import MLP, Block, TinyTransformer
from .all_to_all import exchange_rows
from .claims import claim_module


def expert_range(num_experts: int, size: int, rank: int) -> range:
    """The experts rank ``rank`` of ``size`` holds: [⌊rank·E/size⌋, ⌊(rank+1)·E/size⌋).

    Args:
        num_experts: E (any number at least ``size``).
        size: the expert-parallel ranks.
        rank: this rank.
    """
    return range(rank * num_experts // size, (rank + 1) * num_experts // size)


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's rows times that expert's matrix, as one call: rows sorted by expert.

    On a Hopper GPU in bf16 this is ``torch._grouped_mm`` (one kernel, ``offs`` the rows' ends);
    elsewhere the same product expert by expert, which the tests hold equal to it.

    Args:
        rows: (sum(counts), d_in), expert 0's rows first.
        weights: (experts, d_in, d_out).
        counts: the rows of each expert, in order (zero for an expert that got none).
    """
    if len(counts) != weights.shape[0] or sum(counts) != rows.shape[0]:
        raise UserError(
            f"grouped_mm: {len(counts)} counts adding up to {sum(counts)} for {weights.shape[0]} experts and "
            f"{rows.shape[0]} rows: give one count per expert, adding up to the rows"
        )
    if one_kernel(rows):
        ends = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(rows, weights, offs=ends)
    pieces = rows.split(counts)
    return torch.cat([piece @ weight for piece, weight in zip(pieces, weights, strict=True)])


def one_kernel(rows: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` runs these rows as one kernel: ``torch._grouped_mm`` exists, and the
    rows are bf16 on a Hopper GPU or newer (compute capability 9), the kernel's requirements.

    Args:
        rows: the rows ``grouped_mm`` would multiply.
    """
    return (
        hasattr(torch, "_grouped_mm")
        and rows.is_cuda
        and rows.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(rows.device)[0] >= 9
    )


class GroupedExperts(nn.Module):
    """E expert MLPs (GELU, no biases) stored as two stacked weights: what a grouped matmul takes.

    Args:
        d_model: the tokens' width.
        hidden: each expert's hidden width (small, for fine-grained experts).
        num_experts: the experts held here.
    """

    def __init__(self, d_model: int, hidden: int, num_experts: int):
        super().__init__()
        self.up = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        for weight, fan_in in ((self.up, d_model), (self.down, hidden)):  # as nn.Linear draws them
            nn.init.uniform_(weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return grouped_mm(nn.functional.gelu(grouped_mm(rows, self.up, counts)), self.down, counts)


@dataclass
class DroplessRouting:
    """Where every token goes: ``token``, ``expert`` and ``gate`` per assignment (tokens x k,
    choice by choice); ``load``, the assignments each expert took (none dropped); ``aux_loss``,
    the balancing loss E · Σ f_e P_e (f_e: the share of the assignments that chose e, P_e: e's
    mean share of a token's scores), taken over each sequence and averaged: Switch's over the
    whole batch (one sequence), DeepSeek-V3's "complementary sequence-wise" loss, kept tiny beside
    the bias (section 2.1.2), over each sequence. Even routing makes it 1."""

    token: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    load: torch.Tensor
    aux_loss: torch.Tensor


# #region dropless-routing
def route_dropless(
    logits: torch.Tensor,
    *,
    top_k: int,
    bias: torch.Tensor | None = None,
    nodes: int = 1,
    node_limit: int | None = None,
    sequences: int = 1,
) -> DroplessRouting:
    """Top-k of sigmoid scores, every assignment kept; the bias chooses, the scores weigh.

    Args:
        logits: (tokens, E), the router's output.
        top_k: experts per token.
        bias: (E,), added to the scores to choose the experts only (None: none).
        nodes: the groups of ranks the experts are spread over, in order (E must divide by it).
        node_limit: M, the most nodes one token's experts may be on (None: any).
        sequences: how many sequences the tokens are, one after the other, for ``aux_loss``.
    """
    tokens, num_experts = logits.shape
    scores = logits.sigmoid()  # DeepSeek-V3's affinities: each expert scored on its own
    choosing = scores.detach() + (bias if bias is not None else 0)
    if node_limit is not None and node_limit < nodes:  # keep each token's best M nodes only
        by_node = choosing.view(tokens, nodes, num_experts // nodes)
        best = by_node.topk(max(1, top_k // node_limit), dim=-1).values.sum(dim=-1)
        allowed = torch.zeros(tokens, nodes, dtype=torch.bool, device=logits.device)
        allowed.scatter_(1, best.topk(node_limit, dim=-1).indices, True)
        mask = allowed.repeat_interleave(num_experts // nodes, dim=1)
        choosing = choosing.masked_fill(~mask, float("-inf"))
    experts = choosing.topk(top_k, dim=-1).indices  # (tokens, k)
    chosen = scores.gather(1, experts)
    gates = chosen / chosen.sum(dim=-1, keepdim=True)  # the k gates of a token add up to 1
    expert = experts.t().reshape(-1)
    token = torch.arange(tokens, device=logits.device).repeat(top_k)
    load = torch.bincount(expert, minlength=num_experts)
    share = (scores / scores.sum(dim=-1, keepdim=True)).view(sequences, -1, num_experts).mean(dim=1)
    chose = torch.zeros(tokens, num_experts, device=logits.device).scatter_(1, experts, 1.0)
    fraction = chose.view(sequences, -1, num_experts).mean(dim=1) / top_k  # each sequence's f_e
    aux_loss = (num_experts * (fraction * share).sum(dim=-1)).mean()
    return DroplessRouting(token, expert, gates.t().reshape(-1), load, aux_loss)


# #endregion dropless-routing


def all_to_all_bytes(loads: list[list[int]], rank: int, *, num_experts: int, row_bytes: int) -> int:
    """What rank ``rank`` sends in one dropless expert-parallel layer, forward and backward (the theory).

    Each of its rows bound for another rank's expert leaves twice (dispatch, then the backward of
    combine), each row another rank sent here twice (combine, then the backward of dispatch):
    the splits are as uneven as the router made them. Plus its E counts, once to each other rank.

    Args:
        loads: for every rank, in order, its assignments to each expert (``routing.load``).
        rank: the rank that sends.
        num_experts: E, held as ``expert_range`` places them.
        row_bytes: one token's bytes (d_model x element size).
    """
    size = len(loads)
    held = [expert_range(num_experts, size, r) for r in range(size)]
    away = sum(loads[rank][e] for r in range(size) if r != rank for e in held[r])
    here = sum(loads[r][e] for r in range(size) if r != rank for e in held[rank])
    return 2 * (away + here) * row_bytes + (size - 1) * num_experts * 8


@dataclass
class Splits:
    """One rank's rows in an expert-parallel layer: ``send[j]`` rows to rank j and ``receive[j]``
    from it; ``gather`` puts what arrives (by source, then expert) in expert order, ``per_expert``
    rows for each local expert."""

    send: list[int]
    receive: list[int]
    gather: torch.Tensor
    per_expert: list[int]


def check_dropless(
    num_experts: int, *, top_k: int, shared_experts: int, bias_update_rate: float, nodes: int, node_limit
) -> None:
    """Refuse, in one line naming the fix, a routing that cannot work (``DroplessMoE``'s arguments).

    Args:
        num_experts: E, the routed experts (at least one, even beside shared ones).
        top_k: routed experts per token, at most E.
        shared_experts: experts every token goes through.
        bias_update_rate: γ, at least 0 and finite.
        nodes: the groups of ranks the experts are spread over; E must divide by it.
        node_limit: the most nodes a token's experts may be on (None: any), at most ``nodes``.
    """
    check_int("num_experts", num_experts, minimum=1)
    check_int("top_k", top_k, minimum=1)
    if top_k > num_experts:
        raise UserError(
            f"top_k {top_k} is more than the {num_experts} experts: choose k of at most {num_experts}"
        )
    check_int("shared_experts", shared_experts, minimum=0)
    check_number("bias_update_rate", bias_update_rate, minimum=0)
    check_int("nodes", nodes, minimum=1)
    if num_experts % nodes:
        raise UserError(
            f"{num_experts} experts do not spread evenly over {nodes} nodes: use a multiple of {nodes}"
        )
    if node_limit is not None:
        check_int("node_limit", node_limit, minimum=1)
        if node_limit > nodes:
            raise UserError(f"node_limit {node_limit} is more than the {nodes} nodes: use at most {nodes}")
        if top_k > node_limit * (num_experts // nodes):
            raise UserError(
                f"{top_k} experts cannot come from {node_limit} node(s) of {num_experts // nodes} experts: "
                "raise node_limit or lower top_k"
            )


class DroplessMoE(nn.Module):
    """A mixture-of-experts MLP that routes every token: a router, E grouped experts, shared experts.

    On one process it holds every expert; ``expert.apply_expert_parallel`` spreads them over a
    group (E need not divide by its size). After each forward, ``last_routing`` holds where this
    rank's tokens went and ``rows_computed`` the rows this rank's experts computed.

    Args:
        d_model: the tokens' width.
        hidden: each routed expert's hidden width.
        num_experts: E, the routed experts.
        top_k: routed experts per token.
        shared_experts: experts every token also goes through (one MLP of ``shared_experts`` x
            ``hidden``), DeepSeek-MoE's; 0: none.
        bias_update_rate: γ, how far ``balance`` moves each expert's bias per step; 0: no bias
            (the routing is the scores' own top-k).
        nodes: the groups of ranks the experts are spread over, for ``node_limit``.
        node_limit: the most nodes one token's experts may be on (None: any).
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        *,
        num_experts: int = 8,
        top_k: int = 2,
        shared_experts: int = 0,
        bias_update_rate: float = 0.0,
        nodes: int = 1,
        node_limit: int | None = None,
    ):
        super().__init__()
        check_dropless(num_experts, top_k=top_k, shared_experts=shared_experts,
                       bias_update_rate=bias_update_rate, nodes=nodes, node_limit=node_limit)  # fmt: skip
        self.num_experts, self.top_k, self.bias_update_rate = num_experts, top_k, bias_update_rate
        self.nodes, self.node_limit = nodes, node_limit
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.experts = GroupedExperts(d_model, hidden, num_experts)
        self.shared = MLP(d_model, shared_experts * hidden) if shared_experts else None
        self.local = range(num_experts)  # the experts this rank holds
        self.group, self.sharded = None, False
        self.last_routing: DroplessRouting | None = None
        self.rows_computed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing, order = self.route(tokens, sequences=x.shape[0] if x.dim() == 3 else 1)
        rows, counts = tokens[routing.token[order]], routing.load.tolist()
        if self.sharded:
            results = self._experts_across_ranks(rows, counts)
        else:
            self.rows_computed = len(order)
            results = self.experts(rows, counts)
        return self.mix(tokens, routing, order, results).reshape(x.shape)

    def route(self, tokens: torch.Tensor, *, sequences: int = 1) -> tuple[DroplessRouting, torch.Tensor]:
        """Where ``tokens`` (tokens, d_model; ``sequences`` of them one after the other) go, and
        their assignments sorted by expert (hence by the rank that holds it)."""
        bias = self.expert_bias if self.bias_update_rate else None
        routing = route_dropless(self.router(tokens), top_k=self.top_k, bias=bias, nodes=self.nodes,
                                 node_limit=self.node_limit, sequences=sequences)  # fmt: skip
        self.last_routing = routing
        return routing, routing.expert.argsort(stable=True)

    def mix(self, tokens, routing: DroplessRouting, order, results: torch.Tensor) -> torch.Tensor:
        """Every assignment's expert output weighted by its gate and added to its token, and the
        shared experts' output on every token."""
        weighted = results * routing.gate[order, None]
        mixed = torch.zeros_like(tokens).index_add(0, routing.token[order], weighted)
        return mixed + self.shared(tokens) if self.shared is not None else mixed

    def splits(self, counts: list[int], device: torch.device) -> Splits:
        """How rows sorted by expert leave this rank and arrive (``Splits``): every rank's count of
        every expert, E integers each, gathered first."""
        size = runtime.world_size(group=self.group)
        mine = torch.tensor(counts, device=device)
        everyone = torch.empty(size * len(counts), dtype=mine.dtype, device=device)
        comm.all_gather_into_tensor(everyone, mine, group=self.group)
        table = everyone.view(size, -1).tolist()  # [source rank][expert]
        send = [sum(counts[e] for e in expert_range(self.num_experts, size, r)) for r in range(size)]
        incoming = [[table[source][e] for e in self.local] for source in range(size)]
        receive = [sum(row) for row in incoming]
        starts = [sum(receive[:source]) for source in range(size)]
        first = [[starts[s] + sum(incoming[s][:e]) for s in range(size)] for e in range(len(self.local))]
        gather = torch.cat([  # each local expert's rows from every source, in expert order
            torch.arange(first[e][s], first[e][s] + incoming[s][e], device=device)
            for e in range(len(self.local)) for s in range(size)
        ])  # fmt: skip
        per_expert = [sum(incoming[source][e] for source in range(size)) for e in range(len(self.local))]
        return Splits(send, receive, gather, per_expert)

    def _experts_across_ranks(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        splits = self.splits(counts, rows.device)  # 1. the uneven splits' sizes
        # 2. Dispatch: what arrives is ordered by source rank, then by expert.
        arrived = exchange_rows(rows, splits.send, splits.receive, group=self.group)
        # 3. Each local expert's rows from every source, expert by expert, in one grouped call.
        self.rows_computed = len(splits.gather)
        results = self.experts(arrived[splits.gather], splits.per_expert)
        done = torch.empty_like(arrived).index_copy(0, splits.gather, results)
        # 4. Combine: the results go back where their rows came from.
        return exchange_rows(done, splits.receive, splits.send, group=self.group)

    def shard(self, group) -> None:
        """Keep only this rank's experts (``expert_range``); the router and shared experts stay whole."""
        size, rank = runtime.world_size(group=group), runtime.rank(group=group)
        if self.num_experts < size:
            raise UserError(
                f"{self.num_experts} experts cannot spread over {size} expert-parallel ranks: use at least "
                f"{size} experts, or fewer ranks"
            )
        if self.nodes > 1 and size % self.nodes:
            raise UserError(
                f"{size} ranks do not split into {self.nodes} nodes: use a multiple of {self.nodes}"
            )
        claim_module(self, "expert parallelism")
        self.local, self.group, self.sharded = expert_range(self.num_experts, size, rank), group, True
        held = slice(self.local.start, self.local.stop)
        self.experts.up = nn.Parameter(self.experts.up.detach()[held].clone())
        self.experts.down = nn.Parameter(self.experts.down.detach()[held].clone())


@torch.no_grad()
def balance(model: nn.Module, *, group=None) -> torch.Tensor | None:
    """After a step, move each ``DroplessMoE``'s expert biases toward an even load; return the last
    layer's load over the group (None: no layer with a bias to move).

    Every rank routes its own tokens, so the loads are summed over ``group`` first: every rank
    then moves its copy of the biases alike, and the router stays replicated.

    Args:
        model: a module holding ``DroplessMoE`` layers (their last forward's routing is read).
        group: the ranks whose tokens the loads are summed over (None: every rank).
    """
    check_module("model", model)
    check_group("group", group)
    load = None
    for layer in (m for m in model.modules() if isinstance(m, DroplessMoE) and m.bias_update_rate):
        if layer.last_routing is None:
            raise UserError("balance reads the last forward's routing: call it after a forward and backward")
        load = layer.last_routing.load.to(layer.expert_bias.dtype)
        comm.all_reduce(load, op="sum", group=group)
        layer.expert_bias.copy_(bias_step(layer.expert_bias, load, rate=layer.bias_update_rate))
    return load


def bias_step(bias: torch.Tensor, load: torch.Tensor, *, rate: float) -> torch.Tensor:
    """DeepSeek-V3's rule: each expert's bias moved by ``rate``, down above the mean load, up below it.

    Args:
        bias: (E,), the biases now.
        load: (E,), each expert's assignments in the step (over every rank's tokens).
        rate: γ, the step.
    """
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


def dropless_layers(model: nn.Module) -> list[DroplessMoE]:
    """Every ``DroplessMoE`` layer inside ``model``, in order.

    Args:
        model: any module.
    """
    return [m for m in model.modules() if isinstance(m, DroplessMoE)]


def load_imbalance(model: nn.Module) -> float:
    """The busiest expert's load over the mean load, averaged over ``model``'s dropless layers, in
    their last forward: 1 is even; the step waits for the busiest expert, so this is its slowdown.

    Args:
        model: a module holding ``DroplessMoE`` layers, after a forward.
    """
    loads = [layer.last_routing.load.float() for layer in dropless_layers(model)]
    if not loads:
        raise UserError(f"this {type(model).__name__} holds no DroplessMoE layer to read a load from")
    return float(torch.stack([load.max() / load.mean() for load in loads]).mean())


def dropless_transformer(
    vocab_size: int,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    shared_experts: int = 0,
    bias_update_rate: float = 0.0,
    **shape,
) -> nn.Module:
    """``models.TinyTransformer`` whose blocks' MLPs are ``DroplessMoE`` layers (hidden d_model each).

    Args:
        vocab_size: distinct tokens.
        num_experts: routed experts per layer.
        top_k: routed experts per token.
        shared_experts: experts every token goes through.
        bias_update_rate: γ of ``balance`` (0: no bias).
        shape: ``models.TinyTransformer``'s own keywords (``d_model``, ``n_heads``, ``n_layers``,
            ``max_seq_len``).
    """
    model = TinyTransformer(vocab_size, **shape)
    routing = dict(num_experts=num_experts, top_k=top_k, shared_experts=shared_experts)
    for block in model:
        if isinstance(block, Block):
            block.mlp = DroplessMoE(
                model.d_model, model.d_model, **routing, bias_update_rate=bias_update_rate
            )
    return model
