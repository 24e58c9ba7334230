"""Ulysses (all-to-all) attention and the USP hybrid equal one process's attention, bytes equal theory.

Forward and backward, causal and not, at U = 1-4 with a sequence that cuts unevenly; the hybrid
on a 2 x 2 grid (Ulysses inside, ring across); the transformer trained with Ulysses against one
process; heads that do not divide refused on every rank before any message.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import context as cp
from course_lib.parallel import context_chunks, ulysses
from course_lib.parallel.memory import saved_tensor_bytes
from course_lib.plan import attention_time

BATCH, HEADS, HEAD_DIM = 2, 12, 4  # 12 heads divide by 1, 2, 3 and 4
SEQ = 13  # cuts unevenly into 2, 3 and 4 chunks


def _whole_attention(causal: bool, seq: int):
    generator = torch.Generator().manual_seed(0)
    q, k, v, weights = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=causal)
    (expected * weights).sum().backward()
    return (q, k, v, weights), [expected, *(t.grad for t in whole)]


def _against_one_process(attend, local, causal: bool, seq: int):
    """``attend`` on this rank's tokens (cut by ``local``) against one process: pairs and bytes sent."""
    (q, k, v, weights), expected = _whole_attention(causal, seq)
    mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
    with comm.CommLog() as log:
        out = attend(*mine)
        (out * local(weights)).sum().backward()
    ours = [out, *(t.grad for t in mine)]
    return [
        (a.detach(), local(b).detach()) for a, b in zip(ours, expected, strict=True)
    ], log.bytes_per_rank()


def _ulysses_against_one_process(causal: bool, seq: int):
    rank, size = runtime.rank(), runtime.world_size()
    chunks = context_chunks.SequenceChunks(seq, size, zigzag=False)
    return _against_one_process(
        lambda q, k, v: ulysses.ulysses_attention(q, k, v, chunks=chunks, causal=causal),
        lambda t: chunks.local(t, rank, dim=2),
        causal,
        seq,
    )


def _assert_equal(results, theory):
    for rank, (pairs, sent) in enumerate(results):
        for what, (ours, theirs) in zip(("output", "dq", "dk", "dv"), pairs, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"{what} on rank {rank}")
        assert sent == theory(rank), f"rank {rank}"


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_ulysses_equals_one_process_forward_and_backward_and_sends_what_theory_says(degree):
    chunks = context_chunks.SequenceChunks(SEQ, degree, zigzag=False)
    per_token = BATCH * HEADS * HEAD_DIM * 4
    for causal in (False, True):
        results = launch(_ulysses_against_one_process, degree, causal, SEQ)
        _assert_equal(
            results, lambda rank: ulysses.ulysses_bytes_per_rank(chunks, rank, bytes_per_token=per_token)
        )


def test_the_byte_theory_is_the_papers_count_and_falls_with_the_degree():
    per_token, seq = 1, 4096
    for degree in (2, 4, 8):
        chunks = context_chunks.SequenceChunks(seq, degree, zigzag=False)
        sent = ulysses.ulysses_bytes_per_rank(chunks, 0, bytes_per_token=per_token)
        # four all-to-alls forward, four backward, each (U-1)/U of the S/U tokens a rank holds
        assert sent == 8 * (degree - 1) * seq // degree**2
        ring = context_chunks.ring_bytes_per_rank(
            context_chunks.SequenceChunks(seq, degree, zigzag=True), 0, bytes_per_token=2 * per_token
        )
        assert ring == 2 * (3 * degree - 2) * seq // degree  # K and V, forward and backward
        assert sent < ring
        # Megatron-LM's sequence parallelism around attention: all-gather in, reduce-scatter out, and both
        # again backward, of the whole sequence's activation: Ulysses sends 2/U of it
        megatron = 4 * comm.ring_bytes("all_gather", seq * per_token, degree)
        assert sent * degree == 2 * megatron
    bytes_at = [
        ulysses.ulysses_bytes_per_rank(
            context_chunks.SequenceChunks(1024 * u, u, zigzag=False), 0, bytes_per_token=1
        )
        for u in (2, 4, 8)
    ]
    assert bytes_at == [
        4096,
        6144,
        7168,
    ]  # S grown with U: below 8 x S/U, where the ring's 2(3U-2) x S/U grows


def _usp_against_one_process(causal: bool, seq: int):
    chunks = ulysses.UspChunks(seq, 2, 2)
    ulysses_group, ring_group = ulysses.usp_groups(2)
    return _against_one_process(
        lambda q, k, v: ulysses.usp_attention(
            q, k, v, chunks=chunks, causal=causal, ulysses_group=ulysses_group, ring_group=ring_group
        ),
        lambda t: chunks.local(t, runtime.rank(), dim=2),
        causal,
        seq,
    )


def test_the_usp_hybrid_on_a_2x2_grid_equals_one_process():
    seq = 19  # ring chunks of 10 and 9 tokens (zig-zag: 5+5, 5+4), Ulysses pieces of 5 and 4-5
    chunks = ulysses.UspChunks(seq, 2, 2)
    positions = torch.cat([chunks.local(torch.arange(seq).view(1, -1), r) for r in range(4)], dim=1)
    assert sorted(positions.flatten().tolist()) == list(range(seq))
    per_token = BATCH * HEADS * HEAD_DIM * 4
    for causal in (False, True):
        results = launch(_usp_against_one_process, 4, causal, seq)
        _assert_equal(
            results, lambda rank: ulysses.usp_bytes_per_rank(chunks, rank, bytes_per_token=per_token)
        )


def _attention_memory(seq: int):
    size, rank = runtime.world_size(), runtime.rank()
    chunks = context_chunks.SequenceChunks(seq, size, zigzag=False)
    q, k, v = (torch.randn(BATCH, HEADS, chunks.tokens(rank), HEAD_DIM, requires_grad=True) for _ in range(3))
    with saved_tensor_bytes() as saved:
        ulysses.ulysses_attention(q, k, v, chunks=chunks, causal=True)
    return saved.bytes


def test_attention_activation_memory_per_rank_falls_as_one_over_the_degree():
    seq = 48
    one = launch(_attention_memory, 1, seq)[0]
    for degree in (2, 4):
        assert launch(_attention_memory, degree, seq) == [one // degree] * degree


def _train(degree: int, steps: int, seq: int):
    rank = runtime.rank()
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    model = models.TinyTransformer(len(vocabulary), d_model=24, n_heads=4, n_layers=2, max_seq_len=seq)
    chunks = context_chunks.SequenceChunks(seq, degree, zigzag=False)
    if degree > 1:
        ulysses.apply_ulysses_parallel(model, chunks=chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (4,), generator=generator)
        x, y = inputs[batch], targets[batch]
        optimizer.zero_grad()
        logits = model(chunks.local(x, rank))
        loss = cp.context_parallel_loss(logits, chunks.local(y, rank), total_tokens=y.numel())
        loss.backward()
        if degree > 1:
            comm.all_reduce_coalesced([p.grad for p in model.parameters()], op="sum")
            loss = loss.detach().clone()
            comm.all_reduce(loss, op="sum")
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_the_transformer_trains_with_ulysses_like_one_process():
    seq = 14  # 7, or 4 4 3 3 tokens
    reference = launch(_train, 1, 1, 4, seq)[0]
    for degree in (2, 4):
        for losses in launch(_train, degree, degree, 4, seq):
            assert losses == pytest.approx(reference, rel=1e-5)


def _bad_inputs():
    from conftest import user_errors

    chunks = context_chunks.SequenceChunks(8, 2, zigzag=False)
    return user_errors(
        {
            "heads": lambda: ulysses.ulysses_attention(
                *(torch.zeros(1, 3, 4, 2) for _ in range(3)), chunks=chunks
            ),
            "zigzag": lambda: ulysses.ulysses_attention(
                *(torch.zeros(1, 2, 4, 2) for _ in range(3)),
                chunks=context_chunks.SequenceChunks(8, 2, zigzag=True),
            ),
            "model": lambda: ulysses.apply_ulysses_parallel(
                models.TinyTransformer(10, d_model=9, n_heads=3, n_layers=1, max_seq_len=8), chunks=chunks
            ),
            "grid": lambda: ulysses.UspChunks(4, 2, 3),
        }
    )


def test_heads_that_do_not_divide_are_refused_on_every_rank_before_any_message():
    for errors in launch(_bad_inputs, 2):
        assert errors["heads"].startswith("3 attention heads do not divide by the Ulysses degree 2")
        assert "usp_attention" in errors["heads"]
        assert "zigzag=False" in errors["zigzag"]
        assert errors["model"].startswith("3 attention heads do not divide by the Ulysses degree 2")
        assert "does not cut into 3 Ulysses pieces" in errors["grid"]


def _grouped_query_against_one_process(kv_heads: int, seq: int):
    """Ulysses with fewer key/value heads than query heads, against PyTorch's own grouped-query
    attention on one process (``enable_gqa``): output, the three gradients, and the bytes sent."""
    rank, size = runtime.rank(), runtime.world_size()
    chunks = context_chunks.SequenceChunks(seq, size, zigzag=False)
    generator = torch.Generator().manual_seed(0)
    q, weights = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator) for _ in range(2))
    k, v = (torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=generator) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    (expected * weights).sum().backward()
    local = lambda t: chunks.local(t, rank, dim=2)  # noqa: E731
    mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
    with comm.CommLog() as log:
        out = ulysses.ulysses_attention(*mine, chunks=chunks, causal=True)
        (out * local(weights)).sum().backward()
    pairs = [
        (a.detach(), local(b).detach())
        for a, b in zip([out, *(t.grad for t in mine)], [expected, *(t.grad for t in whole)])
    ]
    return pairs, log.bytes_per_rank()


@pytest.mark.parametrize(
    "degree, kv_heads", [(3, 6), (2, 1), (4, 2), (4, 1)]
)  # divides the key/value heads; then more ranks than key/value heads: each copied 2, 2, 4 times
def test_grouped_query_attention_goes_past_the_key_value_heads_by_copying_them(degree, kv_heads):
    """The limit is the query heads: with more ranks than key/value heads each is copied to the ranks
    whose queries read it, and the copies' gradients add up; the bytes count the copies."""
    chunks = context_chunks.SequenceChunks(SEQ, degree, zigzag=False)
    per_token = BATCH * HEADS * HEAD_DIM * 4
    kv_per_token = BATCH * max(kv_heads, degree) * HEAD_DIM * 4  # the heads the all-to-all carries
    _assert_equal(
        launch(_grouped_query_against_one_process, degree, kv_heads, SEQ),
        lambda rank: ulysses.ulysses_bytes_per_rank(
            chunks, rank, bytes_per_token=per_token, kv_bytes_per_token=kv_per_token
        ),
    )


def test_key_value_heads_that_cannot_deal_out_are_refused_naming_the_degrees_that_can():
    assert ulysses.kv_copies(32, 8, 32) == 4 and ulysses.kv_copies(32, 8, 4) == 1
    with pytest.raises(
        UserError, match="6 key/value heads and a Ulysses degree of 4: the degree must divide"
    ):
        ulysses.check_heads(12, 4, kv_heads=6)
    with pytest.raises(UserError, match="3 key/value heads and a Ulysses degree of 4"):
        ulysses.check_heads(12, 4, kv_heads=3)
    with pytest.raises(UserError, match="12 query heads do not share 5 key/value heads evenly"):
        ulysses.check_heads(12, 2, kv_heads=5)


@pytest.mark.slow
@pytest.mark.timing
def test_the_attention_benchmark_compares_the_four_methods_with_their_theory():
    from conftest import assert_accounted, run_bench

    result = run_bench(
        "attention", "--world-size", "4", "--seq", "40", "--heads", "4", "--head-dim", "8", "--steps", "2"
    )
    rows = {row["method"]: row for row in result["rows"]}
    assert list(rows) == ["ring_contiguous", "ring_zigzag", "ulysses", "usp"]
    assert_accounted(rows, rows)
    for row in rows.values():
        assert row["bytes_per_rank_measured"] == row["bytes_per_rank_theory"]
        assert row["max_error_vs_one_process"] < 1e-5 and row["step_ms"] > 0
        assert row["attention_bytes_over_one_process"] == pytest.approx(1 / 4)
    # Ulysses: 2 all-to-alls forward (q, k, v together; the output) and 2 backward
    assert rows["ulysses"]["calls_per_rank"] == [4] * 4
    assert rows["ulysses"]["bytes_per_rank_measured"][0] < rows["usp"]["bytes_per_rank_measured"][0]
    assert rows["usp"]["bytes_per_rank_measured"][0] < rows["ring_zigzag"]["bytes_per_rank_measured"][0]
    assert result["ulysses_degree_of_the_hybrid"] == 2


def test_the_time_model_hides_the_rings_messages_only_when_a_block_outlasts_a_chunk():
    h100 = dict(heads=32, head_dim=128, degree=8, flops_per_s=400e12, latency_s=20e-6)
    fast, slow = 150e9, 12.5e9  # a rank's NVLink and its share of a node's network, bytes/s
    for link in (fast, slow):
        long = attention_time.attention_time_model(seq=524288, link_bytes_per_s=link, **h100)
        chunk = 2 * 32 * (524288 // 8) * 128 * 2  # K and V of S/C tokens, bf16
        # long: every block outlasts its chunk, so only the gradients' last trip home shows
        assert long["ring_s"] == pytest.approx(long["compute_s"] + 20e-6 + chunk / link)
        assert long["ring_s"] < long["ulysses_s"]
    short = attention_time.attention_time_model(seq=8192, link_bytes_per_s=slow, **h100)
    assert short["ulysses_s"] < short["ring_s"]  # short: the chunks outlast the blocks, and add up
    # an all-to-all on a fully connected node uses every peer's link at once: three times one link's rate
    node = dict(h100, degree=4)
    one_link = attention_time.attention_time_model(seq=8192, link_bytes_per_s=fast, **node)
    three = attention_time.attention_time_model(
        seq=8192, link_bytes_per_s=fast, all_to_all_bytes_per_s=3 * fast, **node
    )
    moved = one_link["ulysses_s"] - one_link["compute_s"] - 4 * 20e-6
    assert three["ulysses_s"] - three["compute_s"] - 4 * 20e-6 == pytest.approx(moved / 3)
    assert three["ring_s"] == one_link["ring_s"]  # the ring talks to one neighbour only
    one = attention_time.attention_time_model(seq=4096, link_bytes_per_s=fast, **(h100 | {"degree": 1}))
    assert one["ring_s"] == one["ulysses_s"] == one["compute_s"]
    with pytest.raises(UserError, match="link_bytes_per_s must be a finite number above 0, got 0"):
        attention_time.attention_time_model(seq=4096, link_bytes_per_s=0, **h100)
