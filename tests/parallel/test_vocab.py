"""Vocabulary parallelism equals one process and DTensor's ``loss_parallel`` at T = 1-4, padding included.

The loss and the logits' gradients of logits split over the vocabulary; the split embedding and
output projection against the dense ones; the logits' and the loss's memory per rank against
1/T; the transformer trained with tensor and vocabulary parallelism against one process, and
laid out over context and sequence-parallel tensor ranks together; bad inputs refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib import data, models
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.parallel import sequence as sp
from course_lib.parallel import tensor as tp
from course_lib.parallel import vocab
from course_lib.parallel.memory import saved_tensor_bytes

VOCAB = 13  # 2, 3 and 4 ranks hold 7, 5 and 4 rows: the last rank pads 1, 2 and 3
TOKENS, D_MODEL = (3, 5), 8


def test_every_entry_lives_on_one_rank_and_the_padding_fills_the_rest():
    assert [vocab.vocab_range(13, 4, r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 13)]
    assert vocab.rows_per_rank(13, 4) == 4  # 16 rows: 3 of them padding
    assert [vocab.vocab_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # all padding


def _my_slice(full: torch.Tensor) -> torch.Tensor:
    """This rank's columns of (..., V) logits, zero columns for the padding."""
    start, stop = vocab.vocab_range(VOCAB, runtime.world_size(), runtime.rank())
    width = vocab.rows_per_rank(VOCAB, runtime.world_size())
    return torch.nn.functional.pad(full[..., start:stop], (0, width - (stop - start)))


def _loss_against_one_process_and_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    generator = torch.Generator().manual_seed(0)
    full = torch.randn(*TOKENS, VOCAB, generator=generator) * 3
    targets = torch.randint(0, VOCAB, TOKENS, generator=generator)
    dense = full.clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(dense.flatten(0, 1), targets.flatten())
    expected.backward()

    mine = _my_slice(full).requires_grad_()
    with comm.CommLog() as log:
        loss = vocab.vocab_parallel_cross_entropy(mine, targets, vocab_size=VOCAB)
        loss.backward()

    sharded = distribute_tensor(full.clone(), init_device_mesh("cpu", (runtime.world_size(),)), [Shard(-1)])
    sharded.requires_grad_()
    with loss_parallel():
        theirs = torch.nn.functional.cross_entropy(sharded.flatten(0, 1), targets.flatten())
        theirs.backward()
    return {
        "loss": (loss.detach(), expected.detach(), theirs.full_tensor().detach()),
        "grad": (mine.grad, _my_slice(dense.grad), _my_slice(sharded.grad.full_tensor())),
        "sent": log.bytes_per_rank(),
        "calls": log.count(),
    }


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_the_loss_of_split_logits_equals_one_process_and_dtensors_loss_parallel(degree):
    for result in launch(_loss_against_one_process_and_dtensor, degree):
        ours, one_process, dtensor = result["loss"]
        torch.testing.assert_close(ours, one_process, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours, dtensor, rtol=1e-6, atol=1e-6)
        ours, one_process, dtensor = result["grad"]
        torch.testing.assert_close(ours, one_process, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours, dtensor, rtol=1e-6, atol=1e-6)
        # two all-reduces of a few values per token (max; sum of exponentials and target logit)
        tokens = TOKENS[0] * TOKENS[1]
        assert result["calls"] == 2
        assert result["sent"] == comm.ring_bytes("all_reduce", 4 * 3 * tokens, degree)


def _layers_against_dense():
    torch.manual_seed(0)
    embedding, projection = torch.nn.Embedding(VOCAB, D_MODEL), torch.nn.Linear(D_MODEL, VOCAB)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, TOKENS, generator=generator)
    targets = torch.randint(0, VOCAB, TOKENS, generator=generator)
    dense_loss = models.lm_loss(projection(embedding(ids)), targets)
    dense_loss.backward()
    split_embedding = vocab.VocabParallelEmbedding.from_dense(embedding)
    split_projection = vocab.VocabParallelLinear.from_dense(projection)
    logits = split_projection(split_embedding(ids))
    loss = vocab.vocab_parallel_cross_entropy(logits, targets, vocab_size=VOCAB)
    loss.backward()
    return {
        "loss": (loss.detach(), dense_loss.detach()),
        "logits": (vocab.gather_vocab_logits(logits.detach(), vocab_size=VOCAB), projection(embedding(ids))),
        "embedding grad": (split_embedding.weight.grad, _rows(embedding.weight.grad)),
        "projection grad": (split_projection.weight.grad, _rows(projection.weight.grad)),
        "bias grad": (split_projection.bias.grad, _rows(projection.bias.grad)),
    }


def _rows(dense: torch.Tensor) -> torch.Tensor:
    return _my_slice(dense.T).T if dense.dim() > 1 else _my_slice(dense)


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_the_split_embedding_and_projection_compute_what_the_dense_ones_do(degree):
    for result in launch(_layers_against_dense, degree):
        for what, (ours, theirs) in result.items():
            torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6, msg=what)


def _head_memory(vocab_size: int):
    torch.manual_seed(0)
    head = torch.nn.Linear(D_MODEL, vocab_size)
    x = torch.randn(*TOKENS, D_MODEL, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, vocab_size, TOKENS, generator=torch.Generator().manual_seed(2))
    if runtime.world_size() > 1:
        head = vocab.VocabParallelLinear.from_dense(head)
    logits = head(x)
    with saved_tensor_bytes() as saved:
        if runtime.world_size() > 1:
            vocab.vocab_parallel_cross_entropy(logits, targets, vocab_size=vocab_size)
        else:
            models.lm_loss(logits, targets)
    return logits.numel() * logits.element_size(), saved.bytes


def test_the_logits_and_the_losss_memory_per_rank_fall_as_one_over_t():
    for vocab_size in (12, 13):
        one_logits, one_saved = launch(_head_memory, 1, vocab_size)[0]
        for degree in (2, 3, 4):
            share = vocab.rows_per_rank(vocab_size, degree) / vocab_size  # 1/T, or a little more with padding
            for logits, saved in launch(_head_memory, degree, vocab_size):
                assert logits == one_logits * share
                # the loss keeps its slice of the softmax (and, per token, a flag and an index) where one
                # process keeps the whole log-softmax (and the targets and nll_loss's total weight)
                tokens = TOKENS[0] * TOKENS[1]
                assert saved - tokens * (1 + 8) == (one_saved - tokens * 8 - 4) * share
    assert vocab.rows_per_rank(12, 4) / 12 == 1 / 4


def _train(tensor: int, steps: int, tied: bool):
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=8)
    model = models.TinyTransformer(
        len(vocabulary), d_model=24, n_heads=12, n_layers=2, max_seq_len=8, tie_embeddings=tied
    )
    if tensor > 1:
        tp.apply_tensor_parallel(model)
        vocab.apply_vocabulary_parallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (4,), generator=generator)
        optimizer.zero_grad()
        logits = model(inputs[batch])
        if tensor > 1:
            loss = vocab.vocab_parallel_cross_entropy(logits, targets[batch], vocab_size=len(vocabulary))
        else:
            loss = models.lm_loss(logits, targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_the_transformer_trains_with_tensor_and_vocabulary_parallelism_like_one_process():
    for tied in (False, True):
        reference = launch(_train, 1, 1, 4, tied)[0]
        for degree in (2, 3, 4):  # 45 characters: 23, 15 and 12 rows a rank, padding on the last
            for losses in launch(_train, degree, degree, 4, tied):
                assert losses == pytest.approx(reference, rel=1e-5), (degree, tied)


def _sequence_and_vocabulary_parallel():
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=8)
    dense = models.TinyTransformer(len(vocabulary), d_model=24, n_heads=4, n_layers=2, max_seq_len=8)
    x, y = inputs[:4], targets[:4]
    expected = models.lm_loss(dense(x), y)
    expected.backward()
    model = sp.apply_sequence_parallel(copy.deepcopy(dense))
    vocab.apply_vocabulary_parallel(model, sequence_parallel=True)
    loss = vocab.vocab_parallel_cross_entropy(model(x), y, vocab_size=len(vocabulary))
    loss.backward()
    sp.all_reduce_sequence_parallel_gradients(model)
    norm = dict(model.named_parameters())["3.norm.weight"].grad
    return loss.detach(), expected.detach(), norm, dense[3].norm.weight.grad


def test_sequence_parallelism_gathers_the_tokens_before_the_split_head():
    for loss, expected, norm_grad, expected_norm_grad in launch(_sequence_and_vocabulary_parallel, 2):
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm_grad, expected_norm_grad, rtol=1e-4, atol=1e-6)


def _bad_inputs():
    from conftest import user_errors

    return user_errors(
        {
            "width": lambda: vocab.vocab_parallel_cross_entropy(
                torch.zeros(3, 13), torch.zeros(3, dtype=torch.long), vocab_size=13
            ),
            "reduction": lambda: vocab.vocab_parallel_cross_entropy(
                torch.zeros(3, 7), torch.zeros(3, dtype=torch.long), vocab_size=13, reduction="max"
            ),
            "model": lambda: vocab.apply_vocabulary_parallel(torch.nn.Linear(2, 2)),
        }
    )


def test_bad_inputs_are_refused_with_the_fix():
    for errors in launch(_bad_inputs, 2):
        assert errors["width"].startswith(
            "logits must be (..., 7): this rank's slice of 13 entries over 2 ranks"
        )
        assert "choose mean, sum or none" in errors["reduction"]
        assert "no Embedding or LMHead found" in errors["model"]


def _context_and_sequence_parallel(loss_parallel: bool, attention: str):
    """``plan.parallelize`` on a 2 x 2 grid of context and tensor ranks, sequence parallel."""
    from course_lib.parallel.mesh import Mesh
    from course_lib.plan.layout import Layout
    from course_lib.plan.parallelize import parallelize

    seq_len = 16
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=seq_len)
    dense = models.TinyTransformer(len(vocabulary), d_model=24, n_heads=4, n_layers=2, max_seq_len=seq_len)
    x, y = inputs[:4], targets[:4]
    expected = models.lm_loss(dense(x), y)
    expected.backward()
    layout = Layout(
        context=2,
        tensor=2,
        sharding="ddp",
        sequence_parallel=True,
        loss_parallel=loss_parallel,
        context_attention=attention,
    )
    mesh = Mesh(context=2, tensor=2)
    model = parallelize(copy.deepcopy(dense), mesh, layout, seq_len=seq_len).stages[0]
    tokens = layout.sequence_chunks(seq_len)
    x, y = (tokens.local(t, mesh.coordinates.context) for t in (x, y))
    logits = model(x)
    if loss_parallel:
        summed = vocab.vocab_parallel_cross_entropy(
            logits, y, vocab_size=len(vocabulary), reduction="sum", group=mesh.group("tensor")
        )
    else:  # the logits of this tensor rank's tokens only
        mine = y.chunk(2, dim=1)[mesh.coordinates.tensor]
        summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum")
    share = summed / (4 * seq_len)
    share.backward()
    sp.all_reduce_sequence_parallel_gradients(model, group=mesh.group("tensor"))
    head = next(m for m in model.modules() if isinstance(m, models.LMHead))
    norm = head.norm.weight.grad
    comm.all_reduce(norm, op="sum", group=mesh.group("context"))
    loss = share.detach().clone()
    for axis in ("context",) if loss_parallel else ("tensor", "context"):
        comm.all_reduce(loss, op="sum", group=mesh.group(axis))
    return loss, expected.detach(), norm, dense[3].norm.weight.grad


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
@pytest.mark.parametrize("loss_parallel", [False, True])
def test_context_and_sequence_parallelism_together_compute_what_one_process_does(loss_parallel, attention):
    """Ring attention or Ulysses over the context ranks, the norms on s/(C·T) tokens: the embedding's
    output is cut twice (under Ulysses each tensor rank's 2 heads are traded over the context ranks)."""
    for loss, expected, norm_grad, expected_norm_grad in launch(
        _context_and_sequence_parallel, 4, loss_parallel, attention
    ):
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm_grad, expected_norm_grad, rtol=1e-4, atol=1e-6)
