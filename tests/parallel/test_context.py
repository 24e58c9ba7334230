"""Ring attention equals one process's attention, forward and backward, at cp = 1-4 with uneven chunks.

Also: the layouts (which positions each rank holds), the balance of causal work with and without
zig-zag, the bytes the ring sends against theory, the activation memory per rank against 1/cp,
the transformer trained with context parallelism against one process, and bad inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.parallel import context as cp
from course_lib.parallel import context_chunks
from course_lib.parallel.memory import saved_tensor_bytes

BATCH, HEADS, HEAD_DIM = 2, 3, 8
SEQ = 13  # cuts unevenly into 2, 3, 4, 6 and 8 chunks


def test_layouts_cover_the_sequence_once_uneven_chunks_included():
    assert context_chunks.chunk_lengths(13, 4) == [4, 3, 3, 3]
    chunks = context_chunks.SequenceChunks(13, 3, zigzag=True)  # 6 chunks: 3 2 2 2 2 2
    assert [[(s.start, s.length) for s in chunks.segments(r)] for r in range(3)] == [
        [(0, 3), (11, 2)],
        [(3, 2), (9, 2)],
        [(5, 2), (7, 2)],
    ]
    for zigzag in (False, True):
        chunks = context_chunks.SequenceChunks(SEQ, 4, zigzag=zigzag)
        positions = torch.cat([chunks.positions(r) for r in range(4)])
        assert sorted(positions.tolist()) == list(range(SEQ))
        whole = torch.arange(SEQ).view(1, SEQ)
        assert torch.equal(chunks.whole([chunks.local(whole, r) for r in range(4)]), whole)


def test_zig_zag_balances_the_causal_work_and_both_count_every_visible_score():
    contiguous, zigzag = (
        context_chunks.attention_work(context_chunks.SequenceChunks(64, 4, zigzag=z)) for z in (False, True)
    )
    assert contiguous == [256, 512, 768, 1024]  # rank 3 waits for nobody; rank 0 idles 3/4 of the time
    assert zigzag == [576] * 4
    # every score a causal mask keeps is computed once (the diagonal blocks whole)
    assert (
        sum(context_chunks.attention_work(context_chunks.SequenceChunks(64, 4, zigzag=False), causal=False))
        == 64 * 64
    )
    schedule = context_chunks.ring_schedule(context_chunks.SequenceChunks(64, 4, zigzag=False))
    assert [row[0]["owner"] for row in schedule] == [0, 3, 2, 1]
    assert [len(row[0]["blocks"]) for row in schedule] == [1, 0, 0, 0]


def _ring_against_one_process(zigzag: bool, causal: bool, seq: int):
    rank, size = runtime.rank(), runtime.world_size()
    generator = torch.Generator().manual_seed(0)
    q, k, v, weights = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=causal)
    (expected * weights).sum().backward()
    chunks = context_chunks.SequenceChunks(seq, size, zigzag=zigzag)
    mine = [chunks.local(t, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with comm.CommLog() as log:
        out = cp.ring_attention(*mine, chunks=chunks, causal=causal)
        (out * chunks.local(weights, rank, dim=2)).sum().backward()
    pairs = [(out, chunks.local(expected, rank, dim=2))]
    pairs += [(m.grad, chunks.local(w.grad, rank, dim=2)) for m, w in zip(mine, whole, strict=True)]
    return [(ours.detach(), theirs.detach()) for ours, theirs in pairs], log.bytes_per_rank("send")


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_ring_attention_equals_one_process_forward_and_backward(degree):
    for zigzag in (False, True):
        for causal in (False, True):
            results = launch(_ring_against_one_process, degree, zigzag, causal, SEQ)
            chunks = context_chunks.SequenceChunks(SEQ, degree, zigzag=zigzag)
            for rank, (pairs, sent) in enumerate(results):
                for what, (ours, theirs) in zip(("output", "dq", "dk", "dv"), pairs, strict=True):
                    torch.testing.assert_close(
                        ours, theirs, rtol=1e-5, atol=1e-5, msg=f"{what} zigzag={zigzag} causal={causal}"
                    )
                assert sent == context_chunks.ring_bytes_per_rank(
                    chunks, rank, bytes_per_token=2 * BATCH * HEADS * HEAD_DIM * 4
                )


def _attention_memory(seq: int):
    size, rank = runtime.world_size(), runtime.rank()
    chunks = context_chunks.SequenceChunks(seq, size, zigzag=True)
    q, k, v = (torch.randn(BATCH, HEADS, chunks.tokens(rank), HEAD_DIM, requires_grad=True) for _ in range(3))
    with saved_tensor_bytes() as saved:
        cp.ring_attention(q, k, v, chunks=chunks)
    return saved.bytes


def test_attention_activation_memory_per_rank_falls_as_one_over_cp():
    seq = 48
    one = launch(_attention_memory, 1, seq)[0]
    # q, k, v and the output (batch x heads x tokens x head_dim) and the log-sum-exp (no head_dim)
    assert one == 4 * BATCH * HEADS * seq * (4 * HEAD_DIM + 1)
    for degree in (2, 3, 4):
        assert launch(_attention_memory, degree, seq) == [one // degree] * degree


def _block_saved_bytes(seq: int, d_model: int, heads: int) -> int:
    """What one context-parallel block keeps for backward on this rank (zig-zag, its local tokens)."""
    torch.manual_seed(0)
    size, rank = runtime.world_size(), runtime.rank()
    chunks = context_chunks.SequenceChunks(seq, size, zigzag=True)
    block = cp.apply_context_parallel(models.Block(d_model, heads), chunks=chunks)
    x = torch.randn(BATCH, seq, d_model, generator=torch.Generator().manual_seed(1))
    with saved_tensor_bytes(ignore=block.parameters()) as saved:
        block(chunks.local(x, rank).requires_grad_())
    return saved.bytes


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_a_context_parallel_block_keeps_what_the_activation_formula_says(degree):
    from course_lib.plan.activations import block_activation_elements

    seq, d_model, heads = 24, 24, 6  # 24 cuts into 2C zig-zag chunks at C = 2, 3, 4: s/C tokens each
    kept = launch(_block_saved_bytes, degree, seq, d_model, heads)
    formula = (
        4
        * block_activation_elements(
            batch=BATCH, seq=seq, d_model=d_model, heads=heads, context_degree=degree
        )["total"]
    )
    assert kept == [formula] * degree


def _train(degree: int, steps: int, seq: int, zigzag: bool):
    rank = runtime.rank()
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq)
    model = models.TinyTransformer(len(vocabulary), d_model=24, n_heads=2, n_layers=2, max_seq_len=seq)
    if degree > 1:
        chunks = context_chunks.SequenceChunks(seq, degree, zigzag=zigzag)
        cp.apply_context_parallel(model, chunks=chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (4,), generator=generator)
        x, y = inputs[batch], targets[batch]
        optimizer.zero_grad()
        if degree == 1:
            loss = models.lm_loss(model(x), y)
            loss.backward()
        else:
            logits = model(chunks.local(x, rank))
            loss = cp.context_parallel_loss(logits, chunks.local(y, rank), total_tokens=y.numel())
            loss.backward()
            for param in model.parameters():  # every rank's tokens add to the replicated weights' gradients
                comm.all_reduce(param.grad, op="sum")
            loss = loss.detach().clone()
            comm.all_reduce(loss, op="sum")
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_the_transformer_trains_with_context_parallelism_like_one_process():
    seq = 14  # 3, 4 or 8 chunks of unequal length
    reference = launch(_train, 1, 1, 4, seq, False)[0]
    for degree, zigzag in ((2, True), (3, False), (4, True)):
        for losses in launch(_train, degree, degree, 4, seq, zigzag):
            assert losses == pytest.approx(reference, rel=1e-5)


def _bad_inputs():
    from conftest import user_errors

    return user_errors(
        {
            "short": lambda: context_chunks.SequenceChunks(5, 3, zigzag=True),
            "group": lambda: cp.ring_attention(
                *(torch.zeros(1, 1, 4, 2) for _ in range(3)),
                chunks=context_chunks.SequenceChunks(8, 4, zigzag=False),
            ),
            "shape": lambda: cp.ring_attention(
                *(torch.zeros(1, 1, 3, 2) for _ in range(3)),
                chunks=context_chunks.SequenceChunks(8, 2, zigzag=False),
            ),
        }
    )


def test_bad_inputs_are_refused_on_every_rank_before_any_message():
    for errors in launch(_bad_inputs, 2):
        assert "a sequence of 5 tokens does not split over context-parallel degree 3" in errors["short"]
        assert "the chunks are for 4 ranks but the group has 2" in errors["group"]
        assert "must each be (batch, heads, 4 tokens, head_dim)" in errors["shape"]


def test_pytorch_context_parallel_does_not_run_on_cpu_which_is_why_one_process_is_the_reference():
    """If a later PyTorch runs it on CPU, this fails: then compare with it here too."""
    results = launch(_torch_context_parallel_on_cpu, 2)
    assert all("does not have a sharding strategy" in r for r in results), results


def _torch_context_parallel_on_cpu():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (runtime.world_size(),))
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as error:
        return str(error)
    return "ran"


def _state_dict_keys_before_and_after():
    torch.manual_seed(0)
    model = models.TinyTransformer(10, d_model=8, n_heads=2, n_layers=1, max_seq_len=8)
    before = copy.deepcopy(model.state_dict())
    after = cp.apply_context_parallel(
        model, chunks=context_chunks.SequenceChunks(8, 2, zigzag=True)
    ).state_dict()
    return before, {key.replace("0.embedding.", "0."): value for key, value in after.items()}


def test_conversion_keeps_the_dense_weights():
    before, after = launch(_state_dict_keys_before_and_after, 2)[0]
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)


@pytest.mark.timing
def test_cp_benchmark_prints_the_promised_json():
    from conftest import assert_accounted, run_bench

    result = run_bench(
        "cp", "--world-size", "2", "--seq", "40", "--heads", "2", "--head-dim", "8", "--steps", "2"
    )
    for chunks in ("contiguous", "zigzag"):
        assert_accounted(result[chunks], ["course"])
        row = result[chunks]
        assert row["bytes_per_rank_measured"] == row["bytes_per_rank_theory"]
        assert row["attention_bytes_per_rank"] == row["attention_bytes_theory"]
        assert len(row["compute_ms_per_rank"]) == 2 and row["step_ms"] > 0
    assert result["contiguous"]["work_max_over_mean"] > result["zigzag"]["work_max_over_mean"] == 1.0
    assert "no CPU kernel" in result["native_twin"]
