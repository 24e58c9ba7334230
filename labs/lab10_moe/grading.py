"""The grading suite of lab 10: what ``python -m course_lib.tools.labs check lab10_moe`` checks.

Your routing and load-balancing loss against the course's ``expert.route``; your all-to-all with
uneven pieces, forward and backward; your layer at 2 and 4 processes, top-1 and top-2, with a
capacity that drops tokens and one that drops none, against one process holding every expert
(``expert.MoE`` routing each rank's tokens as its own group): outputs, the input's, the
router's and every expert's gradients, the bytes sent against the routing.

Part 2: your dropless routing against the course's ``dropless.route_dropless``; your bias update
on 2 and 4 ranks against DeepSeek-V3's rule on the summed loads, and the load spread it leaves
over 40 steps; your dropless layer with 5 experts (no world here divides them) at 2 and 4
processes against ``dropless.DroplessMoE`` holding every expert: outputs and gradients, and the
messages (one all-gather of the counts, two all-to-alls forward, two backward, their bytes equal
to ``dropless.all_to_all_bytes``).
"""

from __future__ import annotations

import copy

import torch

from course_lib.distributed import comm, runtime
from course_lib.parallel import dropless
from course_lib.parallel import expert as ep
from course_lib.tools.labs import Property, Question, case_seed, in_sandbox, on_ranks

WORLD_SIZES = (2, 4)
D_MODEL, HIDDEN, EXPERTS, TOKENS = 6, 10, 4, 9  # 9 tokens a rank: capacities 3 (k=1) and 5 (k=2) at 1.25
CASES = [(1, 0.5), (1, float(EXPERTS)), (2, 0.75), (2, float(EXPERTS))]  # (top_k, capacity factor)


def _scores(seed: int, tokens: int = 23) -> torch.Tensor:
    return torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(case_seed(seed))) * 2


def _your_routing(lab, logits: torch.Tensor, top_k: int, factor: float) -> dict[str, torch.Tensor]:
    """Your ``route``'s fields (its result is of your own class: only its tensors travel)."""
    routing = lab.route(logits, top_k=top_k, capacity_factor=factor)
    return {field: getattr(routing, field).detach() for field in ("token", "expert", "kept", "gate")}


def _your_gate_gradient(lab, logits: torch.Tensor) -> torch.Tensor | None:
    logits = logits.clone().requires_grad_()
    lab.route(logits, top_k=2, capacity_factor=1.0).gate.sum().backward()
    return logits.grad


def _assert_same_routing(
    yours: dict, course, fields: tuple[str, ...], *, where: str, gates: str = ""
) -> None:
    """Your routing's integer fields equal the course's, and its gates within 1e-6 (``gates``: why not)."""
    for field in fields:
        got, wanted = yours[field], getattr(course, field)
        assert torch.equal(got, wanted), (
            f"{where}: your {field} starts {got[:8].tolist()}, the course's {wanted[:8].tolist()}"
        )
    assert torch.allclose(yours["gate"], course.gate, atol=1e-6), (
        f"{where}: your gates differ from the course's" + (f" ({gates})" if gates else "")
    )


def check_route(lab) -> None:
    for seed, (top_k, factor) in enumerate(CASES):
        logits = _scores(seed)
        yours = in_sandbox(_your_routing, lab, logits, top_k, factor)
        course = ep.route(logits, top_k=top_k, capacity_factor=factor)
        _assert_same_routing(
            yours, course, ("token", "expert", "kept"), where=f"top-{top_k}, capacity factor {factor:g}"
        )
    gradient = in_sandbox(_your_gate_gradient, lab, _scores(9))
    assert gradient is not None and gradient.abs().sum() > 0, "the gates must stay differentiable"


def _your_balancing_loss(lab, logits: torch.Tensor, expert: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Your loss's value and its gradient with respect to the logits."""
    logits = logits.clone().requires_grad_()
    loss = lab.load_balancing_loss(logits, expert)
    (gradient,) = torch.autograd.grad(loss, logits)
    return loss.item(), gradient


def check_balancing_loss(lab) -> None:
    for seed, (top_k, factor) in enumerate(CASES):
        logits = _scores(seed).requires_grad_()
        course = ep.route(logits, top_k=top_k, capacity_factor=factor)
        got_value, got = in_sandbox(_your_balancing_loss, lab, logits.detach(), course.expert)
        wanted_value = course.aux_loss.item()
        assert abs(got_value - wanted_value) < 1e-5, (
            f"top-{top_k}: your loss is {got_value:.5f}, E x Σ f_e P_e is {wanted_value:.5f}"
        )
        (wanted,) = torch.autograd.grad(course.aux_loss, logits)
        assert torch.allclose(got, wanted, atol=1e-6), "your loss's gradient differs: only P_e carries one"
    uniform = torch.zeros(8, EXPERTS)
    balanced = torch.arange(8) % EXPERTS
    assert abs(float(lab.load_balancing_loss(uniform, balanced)) - 1.0) < 1e-6, (
        "balanced routing should give 1"
    )


def _exchange(lab):
    rank, size = runtime.rank(), runtime.world_size()
    send = [(rank + 2 * j) % 3 for j in range(size)]  # 0, 1 or 2 rows to each rank: uneven, some empty
    receive = [(j + 2 * rank) % 3 for j in range(size)]
    rows = torch.tensor([[100.0 * rank + j] * 3 for j in range(sum(send))], requires_grad=True)
    out = lab.AllToAll.apply(rows, send, receive)
    out.backward(torch.arange(out.shape[0], dtype=torch.float32).unsqueeze(-1).expand(-1, 3) + 1000 * rank)
    return send, receive, rows.detach(), out.detach(), rows.grad


def check_all_to_all(lab) -> None:
    for world in WORLD_SIZES:
        results = on_ranks(world, _exchange, lab)
        for rank, (_, receive, _, out, _) in enumerate(results):
            wanted = []
            for source, (source_send, _, source_rows, _, _) in enumerate(results):
                start = sum(source_send[:rank])
                wanted.append(source_rows[start : start + receive[source]])
            assert torch.equal(out, torch.cat(wanted)), (
                f"on {world} ranks rank {rank} received {out[:, 0].tolist()}, not {torch.cat(wanted)[:, 0].tolist()}"
            )
        for rank, (send, _, _, _, grad) in enumerate(results):
            wanted = []
            for target, (_, target_receive, _, _, _) in enumerate(results):
                start = sum(target_receive[:rank])
                rows = (
                    torch.arange(start, start + send[target], dtype=torch.float32).unsqueeze(-1).expand(-1, 3)
                )
                wanted.append(rows + 1000 * target)
            assert grad is not None and torch.equal(grad, torch.cat(wanted)), (
                f"on {world} ranks rank {rank}'s rows got back the wrong gradients: each row's gradient goes "
                "back to where the row came from"
            )


def _layer_inputs(top_k: int, factor: float, world: int):
    """One process holding every expert (routing each rank's tokens as its own group), every rank's
    tokens, and the weights of the sum that stands in for a loss."""
    torch.manual_seed(case_seed(0))  # this grading's own weights: a recording of another cannot match
    reference = ep.MoE(
        D_MODEL, HIDDEN, num_experts=EXPERTS, top_k=top_k, capacity_factor=factor, routing_groups=world
    )
    generator = torch.Generator().manual_seed(case_seed(1))
    everyone = torch.randn(world, TOKENS, D_MODEL, generator=generator)
    weights = torch.randn(world, TOKENS, D_MODEL, generator=generator)
    return reference, everyone, weights


def _layer(lab, top_k: int, factor: float):
    """On a rank: your layer on this rank's tokens; what it gives back, for the judge to compare."""
    rank, size = runtime.rank(), runtime.world_size()
    reference, everyone, weights = _layer_inputs(top_k, factor, size)
    layer = lab.ExpertParallelMoE(
        copy.deepcopy(reference.router),
        copy.deepcopy(list(reference.experts)),
        top_k=top_k,
        capacity_factor=factor,
    )
    x = everyone[rank].clone().requires_grad_()
    with comm.CommLog() as log:
        out = layer(x)
        (out * weights[rank]).sum().backward()
    if layer.router.weight.grad is None:  # no gradient reached the router: compared as zeros
        layer.router.weight.grad = torch.zeros_like(layer.router.weight)
    comm.all_reduce(layer.router.weight.grad, op="sum")  # the router is replicated: its gradient is the sum
    return {
        "output": out.detach(),
        "input gradient": x.grad,
        "router gradient": layer.router.weight.grad,
        "expert gradients": [[param.grad for param in expert.parameters()] for expert in layer.experts],
        "sent": log.bytes_per_rank("all_to_all"),
    }


def _one_process(top_k: int, factor: float, world: int) -> dict:
    """In the judge: what every rank should give back, and the routing's drops and bytes."""
    reference, everyone, weights = _layer_inputs(top_k, factor, world)
    whole = everyone.clone().requires_grad_()
    output = reference(whole)
    (output * weights).sum().backward()
    kept = [routing.expert[routing.kept] for routing in reference.last_routing]
    local = EXPERTS // world
    return {
        "output": output.detach(),
        "input gradient": whole.grad,
        "router gradient": reference.router.weight.grad,
        "experts": [[param.grad for param in expert.parameters()] for expert in reference.experts],
        "local": local,
        "dropped": sum(routing.dropped for routing in reference.last_routing),
        "theory": [
            ep.all_to_all_bytes(kept, rank, num_experts=EXPERTS, row_bytes=D_MODEL * 4)
            for rank in range(world)
        ],
    }


def _largest_difference(got, wanted) -> float:
    """The largest element-wise difference of two tensors (or lists of them); inf where shapes differ.
    A missing gradient (None: no token reached that expert) counts as zeros."""
    if wanted is None or got is None:
        present = got if wanted is None else wanted
        return 0.0 if present is None else _largest_difference(torch.zeros_like(present), present)
    if torch.is_tensor(wanted):
        if not torch.is_tensor(got) or got.shape != wanted.shape:
            return float("inf")
        return (got - wanted).abs().max().item() if wanted.numel() else 0.0
    if not isinstance(got, (list, tuple)) or len(got) != len(wanted):
        return float("inf")
    return max((_largest_difference(a, b) for a, b in zip(got, wanted)), default=0.0)


def _assert_as_one_process(got: dict, wanted: dict, *, where: str) -> None:
    """Each of a rank's results within 1e-5 of what one process holding every expert computed."""
    for what, value in wanted.items():
        error = _largest_difference(got[what], value)
        assert error < 1e-5, f"{where} {what} differs from one process's by {error:.2e}"


def check_layer(lab) -> None:
    for top_k, factor in CASES:
        for world in WORLD_SIZES:
            whole = _one_process(top_k, factor, world)
            results = on_ranks(world, _layer, lab, top_k, factor)
            where = f"top-{top_k}, capacity factor {factor:g}, {world} ranks"
            if factor < 1:
                assert whole["dropped"] > 0, f"{where}: the case meant to drop tokens dropped none"
            else:
                assert whole["dropped"] == 0
            local = whole["local"]
            for rank, result in enumerate(results):
                wanted = {
                    "output": whole["output"][rank],
                    "input gradient": whole["input gradient"][rank],
                    "router gradient": whole["router gradient"],
                    "expert gradients": whole["experts"][rank * local : (rank + 1) * local],
                }
                _assert_as_one_process(result, wanted, where=f"{where}: rank {rank}'s")


def check_traffic(lab) -> None:
    for world in WORLD_SIZES:
        theory = _one_process(2, 0.75, world)["theory"]
        for rank, result in enumerate(on_ranks(world, _layer, lab, 2, 0.75)):
            assert result["sent"] == theory[rank], (
                f"on {world} ranks rank {rank} sent {result['sent']:.0f} bytes in all-to-alls, the routing says "
                f"{theory[rank]}: the kept rows bound for other ranks, there and back, forward and backward, "
                "and the (E,) counts once"
            )


# -- part 2: dropless ----------------------------------------------------------------------------------

DROPLESS_EXPERTS, DROPLESS_TOP_K = 5, (1, 2)  # 5 experts: 2 and 4 ranks hold uneven shares
BIAS_RATE, BALANCE_STEPS = 0.05, 40


def _dropless_scores(seed: int, tokens: int = 23) -> torch.Tensor:
    skew = torch.linspace(1.5, -1.5, DROPLESS_EXPERTS)  # experts 0 and 1 popular
    return (
        torch.randn(tokens, DROPLESS_EXPERTS, generator=torch.Generator().manual_seed(case_seed(seed))) + skew
    )


def _your_dropless_routing(lab, logits, top_k, bias) -> dict:
    logits = logits.clone().requires_grad_()
    routing = lab.route_dropless(logits, top_k=top_k, bias=bias)
    (gradient,) = torch.autograd.grad(routing.gate.pow(2).sum(), logits)
    fields = {field: getattr(routing, field).detach() for field in ("token", "expert", "gate", "load")}
    return fields | {"gradient": gradient}


def check_route_dropless(lab) -> None:
    for seed, top_k in enumerate(DROPLESS_TOP_K):
        logits = _dropless_scores(20 + seed)
        bias = torch.randn(DROPLESS_EXPERTS, generator=torch.Generator().manual_seed(case_seed(30 + seed)))
        for with_bias in (None, bias):
            yours = in_sandbox(_your_dropless_routing, lab, logits, top_k, with_bias)
            wanted_logits = logits.clone().requires_grad_()
            course = dropless.route_dropless(wanted_logits, top_k=top_k, bias=with_bias)
            (wanted_gradient,) = torch.autograd.grad(course.gate.pow(2).sum(), wanted_logits)
            where = f"top-{top_k}, {'with' if with_bias is not None else 'without'} a bias"
            _assert_same_routing(yours, course, ("token", "expert", "load"), where=where,
                                 gates="the bias chooses; the scores alone weigh")  # fmt: skip
            assert torch.allclose(yours["gradient"], wanted_gradient, atol=1e-6), (
                f"{where}: the router's gradient through your gates differs (is the bias inside them?)"
            )


def _dropless_inputs(world: int):
    """One process holding every expert (the course's layer, a bias set), every rank's tokens, the
    weights of the sum that stands in for a loss."""
    torch.manual_seed(case_seed(40))
    reference = dropless.DroplessMoE(
        D_MODEL, HIDDEN, num_experts=DROPLESS_EXPERTS, top_k=1, bias_update_rate=1.0
    )
    generator = torch.Generator().manual_seed(case_seed(41))
    reference.expert_bias.copy_(torch.randn(DROPLESS_EXPERTS, generator=generator))
    everyone = torch.randn(world, TOKENS, D_MODEL, generator=generator)
    weights = torch.randn(world, TOKENS, D_MODEL, generator=generator)
    return reference, everyone, weights


def _dropless_layer(lab):
    """On a rank: your dropless layer at top-1 and top-2, forward and backward, and its messages."""
    rank, size = runtime.rank(), runtime.world_size()
    reference, everyone, weights = _dropless_inputs(size)
    cases = []
    for top_k in DROPLESS_TOP_K:
        layer = lab.DroplessExpertParallel(
            copy.deepcopy(reference.router), reference.experts.up.detach(), reference.experts.down.detach(),
            top_k=top_k, bias=reference.expert_bias.clone(),
        )  # fmt: skip
        x = everyone[rank].clone().requires_grad_()
        with comm.CommLog() as log:
            out = layer(x)
            (out * weights[rank]).sum().backward()
        router_gradient = layer.router.weight.grad
        if router_gradient is None:
            router_gradient = torch.zeros_like(layer.router.weight)
        comm.all_reduce(router_gradient, op="sum")  # replicated: its gradient is the sum
        cases.append({
            "output": out.detach(), "input gradient": x.grad, "router gradient": router_gradient,
            "expert gradients": [layer.up.grad, layer.down.grad],
            "sent": log.bytes_per_rank("all_to_all") + log.bytes_per_rank("all_gather"),
            "calls": {op: log.count(op) for op in ("all_gather", "all_to_all", "all_reduce")},
        })  # fmt: skip
    return cases


def _balance(lab) -> list[torch.Tensor]:
    """On a rank: 40 steps of your routing of this rank's tokens, each followed by your bias update."""
    logits = _dropless_scores(50 + runtime.rank())
    bias, biases = torch.zeros(DROPLESS_EXPERTS), []
    for _ in range(BALANCE_STEPS):
        bias = lab.update_bias(bias, lab.route_dropless(logits, top_k=2, bias=bias).load, rate=BIAS_RATE)
        biases.append(bias.clone())
    return biases


def _dropless_one_process(world: int) -> list[dict]:
    """In the judge: what every rank should give back at top-1 and top-2, and the bytes it should send."""
    reference, everyone, weights = _dropless_inputs(world)
    wanted = []
    for top_k in DROPLESS_TOP_K:
        layer = copy.deepcopy(reference)
        layer.top_k = top_k
        whole = everyone.clone().requires_grad_()
        with torch.no_grad():  # each rank's tokens, routed as that rank routes them
            loads = [
                dropless.route_dropless(
                    layer.router(everyone[r]), top_k=top_k, bias=layer.expert_bias
                ).load.tolist()
                for r in range(world)
            ]
        output = layer(whole.view(-1, D_MODEL)).view(world, TOKENS, D_MODEL)
        (output * weights).sum().backward()
        wanted.append({
            "output": output.detach(), "input gradient": whole.grad, "router gradient": layer.router.weight.grad,
            "up": layer.experts.up.grad, "down": layer.experts.down.grad,
            "theory": [dropless.all_to_all_bytes(loads, r, num_experts=DROPLESS_EXPERTS, row_bytes=D_MODEL * 4)
                       for r in range(world)],
        })  # fmt: skip
    return wanted


def _course_biases(world: int) -> list[torch.Tensor]:
    """DeepSeek-V3's rule on the loads summed over ``world`` ranks' tokens, step by step."""
    logits = [_dropless_scores(50 + rank) for rank in range(world)]
    bias, biases = torch.zeros(DROPLESS_EXPERTS), []
    for _ in range(BALANCE_STEPS):
        load = sum(dropless.route_dropless(rank_logits, top_k=2, bias=bias).load for rank_logits in logits)
        bias = dropless.bias_step(bias, load, rate=BIAS_RATE)
        biases.append(bias.clone())
    return biases


def _imbalance(world: int, bias: torch.Tensor) -> float:
    """The busiest expert's load over the mean, over ``world`` ranks' tokens routed with ``bias``."""
    load = sum(
        dropless.route_dropless(_dropless_scores(50 + r), top_k=2, bias=bias).load for r in range(world)
    )
    return float(load.max() / load.float().mean())


def check_bias_update(lab) -> None:
    for world in WORLD_SIZES:
        results = on_ranks(world, _balance, lab)
        wanted = _course_biases(world)
        for rank, biases in enumerate(results):
            for step, (got, bias) in enumerate(zip(biases, wanted, strict=True)):
                assert torch.allclose(got, bias, atol=1e-6), (
                    f"on {world} ranks rank {rank}'s biases after step {step + 1} are {got.tolist()}, "
                    f"DeepSeek-V3's rule on the loads summed over the ranks gives {bias.tolist()}"
                )
        start, end = _imbalance(world, torch.zeros(DROPLESS_EXPERTS)), _imbalance(world, results[0][-1])
        assert end < start, (
            f"on {world} ranks the load spread went from {start:.2f} to {end:.2f}: it should fall"
        )


def check_dropless_layer(lab) -> None:
    for world in WORLD_SIZES:
        results, wanted = on_ranks(world, _dropless_layer, lab), _dropless_one_process(world)
        for case, (top_k, whole) in enumerate(zip(DROPLESS_TOP_K, wanted, strict=True)):
            where = f"dropless top-{top_k}, {DROPLESS_EXPERTS} experts on {world} ranks"
            for rank, result in enumerate(results):
                got, held = result[case], dropless.expert_range(DROPLESS_EXPERTS, world, rank)
                expected = {
                    "output": whole["output"][rank], "input gradient": whole["input gradient"][rank],
                    "router gradient": whole["router gradient"],
                    "expert gradients": [whole["up"][held.start : held.stop], whole["down"][held.start : held.stop]],
                }  # fmt: skip
                _assert_as_one_process(got, expected, where=f"{where}: rank {rank}'s")


def check_dropless_messages(lab) -> None:
    for world in WORLD_SIZES:
        results, wanted = on_ranks(world, _dropless_layer, lab), _dropless_one_process(world)
        for case, (top_k, whole) in enumerate(zip(DROPLESS_TOP_K, wanted, strict=True)):
            for rank, result in enumerate(results):
                got = result[case]
                where = f"dropless top-{top_k} on {world} ranks, rank {rank}"
                calls = got["calls"]
                assert calls["all_gather"] == 1 and calls["all_to_all"] == 4, (
                    f"{where} made {calls['all_gather']} all-gather(s) and {calls['all_to_all']} all-to-all(s) in a "
                    "forward and backward: one all-gather of the counts, dispatch and combine, and their mirrors"
                )
                assert got["sent"] == whole["theory"][rank], (
                    f"{where} sent {got['sent']:.0f} bytes, dropless.all_to_all_bytes says {whole['theory'][rank]}: "
                    "every row bound for another rank's expert, there and back, forward and backward, and the E "
                    "counts once to each other rank"
                )


PROPERTIES = [
    Property(
        "the routing picks the top-k experts and drops what exceeds an expert's capacity, as GShard does",
        check_route,
        "Choice-major means all first choices (token order), then all second ones: a queue place is "
        "the number of earlier assignments to the same expert.",
    ),
    Property(
        "the load-balancing loss is E x Σ f_e P_e, its gradient through P_e only",
        check_balancing_loss,
        "f_e is a fraction of counts (torch.bincount), P_e a mean of probabilities; multiply and sum.",
    ),
    Property(
        "the all-to-all deals uneven pieces out and their gradients back (2, 4 ranks)",
        check_all_to_all,
        "all_to_all_single cuts its input along dimension 0 into input_split_sizes pieces, piece j "
        "for rank j; backward is the same exchange with the two lists swapped.",
    ),
    Property(
        "the expert-parallel layer equals one process, top-1 and top-2, with and without drops (2, 4 ranks)",
        check_layer,
        "Rows must travel sorted by expert (stable argsort), and arrive by source rank, then expert: "
        "the counts exchanged first tell each rank how to cut what arrives.",
    ),
    Property(
        "the all-to-alls send the kept rows bound elsewhere and the counts, nothing more",
        check_traffic,
        "Exchange the per-expert counts once, as one (E,) tensor; send only kept assignments.",
    ),
    Property(
        "part 2: dropless routing keeps every assignment; the bias chooses, the scores alone weigh",
        check_route_dropless,
        "sigmoid scores; topk of (scores.detach() + bias); gates gathered from the scores and normalized; "
        "load = torch.bincount(expert, minlength=E).",
    ),
    Property(
        "part 2: the bias update moves every rank's biases alike toward an even load, and the spread falls "
        "(2, 4 ranks)",
        check_bias_update,
        "all_reduce the load (a float copy) first, then bias + rate x sign(mean load - load).",
    ),
    Property(
        "part 2: the dropless layer equals one process holding every expert, 5 experts on 2 and 4 ranks",
        check_dropless_layer,
        "expert_range places the experts; the all-gathered (N, E) counts give send (your experts' columns "
        "summed per destination) and receive (the sources' counts for your experts); what arrives is by "
        "source then expert: reorder it for grouped_mm, and back.",
    ),
    Property(
        "part 2: its messages: one all-gather of the counts and the uneven all-to-alls, as many bytes as the "
        "formula",
        check_dropless_messages,
        "gather the E counts once (all_gather_into_tensor); send each row once each way; nothing else.",
    ),
]


# -- the README's questions -------------------------------------------------------------------------------

Q_TOKENS, Q_EXPERTS, Q_TOP_K, Q_FACTOR, Q_D_MODEL, Q_RANKS = 4096, 64, 2, 1.25, 4096, 8


def _dispatch_bytes() -> float:
    """Balanced routing: each expert gets tokens x k / E assignments of every rank's tokens."""
    per_expert = Q_TOKENS * Q_TOP_K // Q_EXPERTS
    experts = torch.arange(Q_EXPERTS).repeat_interleave(per_expert)
    everyone = [experts] * Q_RANKS
    combined = ep.all_to_all_bytes(everyone, 0, num_experts=Q_EXPERTS, row_bytes=Q_D_MODEL * 2)
    counts = (Q_EXPERTS - Q_EXPERTS // Q_RANKS) * 8
    return (combined - counts) / 4  # one of dispatch and combine, forward only


def _aux_loss_collapsed() -> float:
    logits = torch.zeros(Q_TOKENS, 8)
    logits[:, 0] = 100.0  # the router sends every token to expert 0, with probability 1
    return float(ep.route(logits, top_k=1, capacity_factor=1.0).aux_loss)


def _bias_after_overloaded_steps() -> float:
    """An expert above the mean load in each of 10 steps, γ = 0.001: its bias after them."""
    bias, load = torch.zeros(Q_EXPERTS), torch.ones(Q_EXPERTS)
    load[0] = 2.0
    for _ in range(10):
        bias = dropless.bias_step(bias, load, rate=0.001)
    return float(bias[0])


def _counts_bytes() -> float:
    """What one rank sends to gather every rank's E counts (int64), with no rows to send."""
    return dropless.all_to_all_bytes([[0] * Q_EXPERTS] * Q_RANKS, 0, num_experts=Q_EXPERTS, row_bytes=0)


QUESTIONS = [
    Question(
        "capacity_tokens4096_e64_top2_factor1p25",
        lambda: ep.expert_capacity(Q_TOKENS, Q_EXPERTS, top_k=Q_TOP_K, capacity_factor=Q_FACTOR),
        "ceil(factor x tokens x k / E): the fair share of the assignments, with room for imbalance",
    ),
    Question(
        "dispatch_bytes_per_rank_forward_tokens4096_top2_d4096_bf16_n8",
        _dispatch_bytes,
        "balanced routing keeps (N-1)/N of the k x tokens assignments away from home: rows of d_model "
        "values of 2 bytes (course_lib/parallel/expert.py, all_to_all_bytes)",
    ),
    Question(
        "aux_loss_every_token_to_one_expert_e8",
        _aux_loss_collapsed,
        "f and P are both 1 for that expert and 0 for the others: E x Σ f_e P_e",
    ),
    Question(
        "bias_of_an_expert_overloaded_10_steps_rate0p001",
        _bias_after_overloaded_steps,
        "each step moves the bias by γ against the sign of (load - mean load), whatever the size of the gap",
        rel_tol=1e-6,
    ),
    Question(
        "counts_bytes_per_rank_e64_n8_int64",
        _counts_bytes,
        "every rank's E counts, 8 bytes each, go to each of the other N-1 ranks once a layer "
        "(course_lib/parallel/dropless.py, all_to_all_bytes)",
    ),
]
