"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

A mixture-of-experts (MoE) layer replaces the transformer's one MLP by E expert MLPs and a
**router**, a linear layer that scores every token against every expert. Each token goes to its
top-k experts only, and their outputs are added, weighted by the router's probabilities (the
gates). The layer has E times the parameters of one MLP for the compute of k MLPs per token:
that is why the largest models are MoEs.

**Capacity.** An expert takes at most ``capacity = ceil(capacity_factor · tokens · k / E)`` tokens
of a batch, so that its work is bounded and buffers have a fixed size. Tokens beyond it are
*dropped*: the layer returns 0 for them and the residual connection carries them on
(``Routing.dropped`` counts them). Queues fill first choices first, then second choices, each
in token order (GShard's rule).

**Balance.** Nothing stops the router from sending every token to one expert. The auxiliary
loss ``E · Σ_e f_e · P_e`` (f_e: the fraction of assignments that chose expert e, P_e: the mean
probability the router gave e) is smallest, 1, when both are uniform; adding a small multiple
of it to the loss keeps the experts busy alike (Switch Transformer).

**Expert parallelism.** With E experts on N ranks, rank r holds experts [r·E/N, (r+1)·E/N) and
its own tokens (the ranks also split the batch, as data parallelism does). One layer is:

1. route this rank's tokens; sort the kept assignments by expert, hence by the rank that owns it;
2. **dispatch**: an all-to-all sends each rank the rows for its experts (the row counts are
   exchanged first, by a small all-to-all, since they change every step);
3. each expert computes on the rows it received from every rank;
4. **combine**: the reverse all-to-all brings the results home, where they are weighted and added.

Cost per rank and layer: the expert weights of E/N experts; sent, forward, twice (dispatch and
combine) the rows routed to other ranks, about (N-1)/N · k · tokens · d_model values each way
with balanced routing, and as much again backward. The all-to-all crosses every pair of ranks,
so expert parallelism likes a fast all-to-all network.

Papers: Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", ICLR 2017 (arXiv:1701.06538); Lepikhin et al., "GShard", 2020
(arXiv:2006.16668): capacity, groups, expert parallelism with all-to-all; Fedus, Zoph and
Shazeer, "Switch Transformers", JMLR 2022 (arXiv:2101.03961): top-1 routing and the
load-balancing loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import check_group, check_int, check_module, check_number
from ..distributed import comm, runtime
from ..errors import UserError
from ..llama import GatedMLP, Llama
from ..models import MLP, Block, TinyTransformer
from .all_to_all import exchange_rows
from .claims import claim_module
from .dropless import DroplessMoE


@dataclass
class Routing:
    """Where one group of tokens goes. The assignments are listed choice by choice (all first
    choices, then all second choices...), each in token order.

    ``token``, ``expert``, ``gate`` and ``kept`` have one entry per assignment (tokens x k).
    """

    token: torch.Tensor  # which token
    expert: torch.Tensor  # to which expert
    gate: torch.Tensor  # with which weight (differentiable: the router learns from it)
    kept: torch.Tensor  # False: beyond the expert's capacity, dropped
    capacity: int
    aux_loss: torch.Tensor  # E · Σ f_e P_e
    tokens_per_expert: torch.Tensor  # assignments each expert was chosen for, before dropping

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def expert_capacity(tokens: int, num_experts: int, *, top_k: int, capacity_factor: float) -> int:
    """The most assignments one expert takes from a group of ``tokens`` tokens.

    Args:
        tokens: the tokens routed together.
        num_experts: E.
        top_k: experts per token.
        capacity_factor: 1.0 is exactly the fair share; more leaves room for imbalance.
    """
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


# #region experts
def route(logits: torch.Tensor, *, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing with a capacity, for one group of tokens.

    Args:
        logits: (tokens, E), the router's scores.
        top_k: experts per token; with k > 1 the k gates are renormalised to sum to 1.
        capacity_factor: see ``expert_capacity``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise UserError(
            f"route takes the router's scores as one (tokens, experts) tensor, got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
        )
    tokens, num_experts = logits.shape
    check_experts(num_experts, 1, top_k=top_k, capacity_factor=capacity_factor)
    probabilities = logits.softmax(dim=-1)
    gates, experts = probabilities.topk(top_k, dim=-1)  # (tokens, k)
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    expert = experts.t().reshape(-1)  # choice-major: first choices first
    token = torch.arange(tokens, device=logits.device).repeat(top_k)
    one_hot = nn.functional.one_hot(expert, num_experts)
    place_in_queue = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)
    capacity = expert_capacity(tokens, num_experts, top_k=top_k, capacity_factor=capacity_factor)
    chosen = one_hot.sum(dim=0)
    fraction_chosen = chosen.float() / expert.numel()
    aux_loss = num_experts * (fraction_chosen * probabilities.mean(dim=0)).sum()
    kept = place_in_queue < capacity
    return Routing(token, expert, gates.t().reshape(-1), kept, capacity, aux_loss, chosen)


def all_to_all_bytes(kept_experts: list[torch.Tensor], rank: int, *, num_experts: int, row_bytes: int) -> int:
    """What rank ``rank`` sends in one expert-parallel layer, forward and backward (the theory).

    Each kept row bound for another rank's expert leaves once to be computed (dispatch) and once
    as its gradient (backward of combine); each row another rank sent here leaves once as its
    result (combine) and once as its gradient (backward of dispatch). Plus the int64 row counts
    for the other ranks' experts.

    Args:
        kept_experts: for every rank, in rank order, the expert of each of its kept assignments
            (``routing.expert[routing.kept]``).
        rank: the rank that sends.
        num_experts: E, spread evenly over ``len(kept_experts)`` ranks.
        row_bytes: one token's bytes (d_model x element size).
    """
    size = len(kept_experts)
    owners = [experts // (num_experts // size) for experts in kept_experts]
    mine_away = int((owners[rank] != rank).sum())
    theirs_here = sum(int((owners[r] == rank).sum()) for r in range(size) if r != rank)
    return 2 * (mine_away + theirs_here) * row_bytes + (num_experts - num_experts // size) * 8


def check_experts(num_experts: int, degree: int, *, top_k: int, capacity_factor: float) -> None:
    """Refuse, before any process waits, experts that do not split or a routing that cannot work."""
    check_int("num_experts", num_experts, minimum=1)
    check_int("top_k", top_k, minimum=1, maximum=num_experts)
    check_number("capacity_factor", capacity_factor, above=0)
    if num_experts % degree:
        raise UserError(
            f"{num_experts} experts do not divide over expert-parallel degree {degree}: use a number of "
            f"experts that is a multiple of {degree}, or a degree that divides {num_experts}"
        )


class MoE(nn.Module):
    """A mixture-of-experts MLP: a router and ``num_experts`` ``models.MLP`` experts.

    On one process it holds every expert; ``apply_expert_parallel`` spreads them over a group. After
    each forward, ``last_routing`` holds the routings (one per token group) for the auxiliary
    loss (``aux_loss``) and the dropped-token count (``dropped``), and ``rows_computed`` the rows
    this rank's experts computed (from every rank's tokens).

    Args:
        d_model: the width of the tokens.
        hidden: each expert's hidden width.
        num_experts: E.
        top_k: experts per token.
        capacity_factor: an expert's room, as a multiple of its fair share of the assignments.
        routing_groups: route the batch in this many groups of equal size along the batch, each
            with its own capacity: what N expert-parallel ranks do with their own tokens, so one
            process with ``routing_groups=N`` computes what N ranks compute.
        expert: what an expert is, ``expert(d_model, hidden)``: ``models.MLP`` (GELU), or
            ``llama.GatedMLP`` (SwiGLU, as Mixtral's).
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        *,
        num_experts: int = 4,
        top_k: int = 1,
        capacity_factor: float = 1.25,
        routing_groups: int = 1,
        expert=MLP,
    ):
        super().__init__()
        check_experts(num_experts, 1, top_k=top_k, capacity_factor=capacity_factor)
        check_int("routing_groups", routing_groups, minimum=1)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.routing_groups = routing_groups
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(expert(d_model, hidden) for _ in range(num_experts))
        self.first_expert, self.group, self.sharded = 0, None, False
        self.last_routing: list[Routing] = []
        self.rows_computed = 0

    @property
    def aux_loss(self) -> torch.Tensor:
        return torch.stack([r.aux_loss for r in self.last_routing]).mean()

    @property
    def dropped(self) -> int:
        return sum(r.dropped for r in self.last_routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.routing_groups:
            raise UserError(f"a batch of {x.shape[0]} does not cut into {self.routing_groups} routing groups")
        outputs, self.last_routing, self.rows_computed = [], [], 0
        for part in x.chunk(self.routing_groups, dim=0):
            tokens = part.reshape(-1, part.shape[-1])
            routing = route(self.router(tokens), top_k=self.top_k, capacity_factor=self.capacity_factor)
            self.last_routing.append(routing)
            outputs.append(self._mix(tokens, routing).reshape(part.shape))
        return torch.cat(outputs, dim=0)

    def _mix(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every kept assignment's expert output, weighted by its gate and added to its token."""
        kept = routing.kept.nonzero().squeeze(-1)
        order = kept[routing.expert[kept].argsort(stable=True)]  # sorted by expert: by owning rank
        rows_per_expert = torch.bincount(routing.expert[order], minlength=self.num_experts).tolist()
        results = self._experts_on(tokens[routing.token[order]], rows_per_expert)
        mixed = torch.zeros_like(tokens)
        return mixed.index_add(0, routing.token[order], results * routing.gate[order].unsqueeze(-1))

    def _experts_on(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        if not self.sharded:  # every expert is here
            self.rows_computed += rows.shape[0]
            pieces = rows.split(rows_per_expert)
            return torch.cat([expert(piece) for expert, piece in zip(self.experts, pieces, strict=True)])
        return self._experts_across_ranks(rows, rows_per_expert)

    def _experts_across_ranks(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        size, local = runtime.world_size(group=self.group), len(self.experts)
        # 1. Tell every rank how many rows of each of its experts are coming: (N x E/N) counts.
        counts = torch.tensor(rows_per_expert, device=rows.device)
        incoming = torch.empty_like(counts)
        comm.all_to_all_single(incoming, counts, group=self.group)
        incoming = incoming.view(size, local).tolist()  # [source rank][my expert]
        send = [sum(rows_per_expert[r * local : (r + 1) * local]) for r in range(size)]
        receive = [sum(row) for row in incoming]
        self.rows_computed += sum(receive)
        # 2. Dispatch. What arrives is ordered by source rank, then by expert.
        arrived = exchange_rows(rows, send, receive, group=self.group)
        pieces = arrived.split([n for row in incoming for n in row])
        # 3. Each local expert on its rows from every source.
        done = [None] * len(pieces)
        for e, expert in enumerate(self.experts):
            mine = [s * local + e for s in range(size)]
            outputs = expert(torch.cat([pieces[i] for i in mine])).split([pieces[i].shape[0] for i in mine])
            for i, output in zip(mine, outputs, strict=True):
                done[i] = output
        # 4. Combine: the results go back where their rows came from.
        return exchange_rows(torch.cat(done), receive, send, group=self.group)


# #endregion experts


def apply_expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """Keep only this rank's experts in every mixture-of-experts layer of ``model``.

    Every rank must start from the same weights (same seed). The routers and everything outside
    the experts stay replicated, so their gradients are averaged as in data parallelism. An
    ``MoE`` keeps its E/N consecutive experts (E must divide by N); a ``dropless.DroplessMoE``
    keeps ``dropless.expert_range``'s, any E of at least N.

    Args:
        model: a module holding ``MoE`` or ``DroplessMoE`` layers (``moe_transformer``'s), or one
            layer; changed in place and returned.
        group: the expert-parallel process group (None: every rank).
    """
    check_module("model", model)
    check_group("group", group)
    dropless = [m for m in model.modules() if isinstance(m, DroplessMoE)]
    layers = moe_layers(model)
    if not layers and not dropless:
        raise UserError(
            f"apply_expert_parallel: this {type(model).__name__} holds no mixture-of-experts layer"
        )
    size, rank = runtime.world_size(group=group), runtime.rank(group=group)
    for moe in layers:
        check_experts(moe.num_experts, size, top_k=moe.top_k, capacity_factor=moe.capacity_factor)
        claim_module(moe, "expert parallelism")
        if moe.routing_groups != 1:
            raise UserError(
                "an expert-parallel MoE routes each rank's tokens as one group: use routing_groups=1"
            )
        local = moe.num_experts // size
        moe.first_expert, moe.group, moe.sharded = rank * local, group, True
        moe.experts = nn.ModuleList(list(moe.experts)[rank * local : (rank + 1) * local])
    for layer in dropless:
        layer.shard(group)
    return model


def moe_transformer(
    vocab_size: int,
    *,
    d_model: int = 32,
    n_heads: int = 4,
    n_layers: int = 2,
    max_seq_len: int = 32,
    num_experts: int = 4,
    top_k: int = 1,
    capacity_factor: float = 1.25,
    routing_groups: int = 1,
) -> nn.Module:
    """``models.TinyTransformer`` whose blocks' MLPs are ``MoE`` layers (hidden 2 x d_model each).

    Args:
        vocab_size: distinct tokens.
        d_model: the width of every token's vector.
        n_heads: attention heads per block.
        n_layers: transformer blocks.
        max_seq_len: the longest sequence.
        num_experts: experts per MoE layer.
        top_k: experts per token.
        capacity_factor: room per expert (see ``expert_capacity``).
        routing_groups: see ``MoE``.
    """
    model = TinyTransformer(
        vocab_size, d_model=d_model, n_heads=n_heads, n_layers=n_layers, max_seq_len=max_seq_len
    )
    for block in model:
        if isinstance(block, Block):
            block.mlp = MoE(
                d_model,
                2 * d_model,
                num_experts=num_experts,
                top_k=top_k,
                capacity_factor=capacity_factor,
                routing_groups=routing_groups,
            )
    return model


def moe_llama(spec, *, capacity_factor: float = 1.25) -> Llama:
    """The ``llama.Llama`` of a spec with experts (Mixtral's shape): each block's MLP an ``MoE`` of
    ``spec.experts`` SwiGLU experts, ``spec.top_k`` a token, a router without bias; the parameters
    are ``ModelSpec.parameters()``.

    Args:
        spec: a ``plan.specs.ModelSpec`` with ``experts`` > 1.
        capacity_factor: room per expert (see ``expert_capacity``).
    """
    if getattr(spec, "experts", 1) < 2:
        raise UserError(f"{getattr(spec, 'name', 'this spec')} has no experts: build it with llama.Llama")
    if getattr(spec, "shared_experts", 0):
        raise UserError(
            f"{spec.name} has shared experts, which moe_llama's capacity MoE does not build: plan it, or "
            "build its layers with dropless.DroplessMoE(shared_experts=...)"
        )
    model = Llama(dataclasses.replace(spec, experts=1, top_k=1))
    for block in model:
        if isinstance(block, Block):
            block.mlp = MoE(
                spec.d_model, spec.ffn_hidden, num_experts=spec.experts, top_k=spec.top_k,
                capacity_factor=capacity_factor, expert=GatedMLP,
            )  # fmt: skip
    return model


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every ``MoE`` layer inside ``model``, in order.

    Args:
        model: any module (``moe_transformer``'s, typically).
    """
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The mean load-balancing loss of every MoE layer's last forward.

    Args:
        model: a module holding ``MoE`` layers, after a forward.
    """
    return torch.stack([layer.aux_loss for layer in moe_layers(model)]).mean()
