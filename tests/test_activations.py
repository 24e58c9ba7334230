"""The activation formulas equal what autograd keeps, measured with ``memory.saved_tensor_bytes``.

One process here: a whole ``TinyTransformer`` (embedding, blocks, head and loss) at shapes that
divide by nothing in particular. The parallel layouts are held to the formula on real processes in
``tests/parallel/test_sequence.py`` and ``tests/parallel/test_context.py``.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import models
from course_lib.parallel.memory import saved_tensor_bytes
from course_lib.plan.activations import (
    block_activation_elements,
    embedding_activation_bytes,
    head_activation_bytes,
)


@pytest.mark.parametrize(
    "vocab, d_model, heads, layers, seq, batch", [(50, 24, 6, 3, 12, 2), (37, 20, 5, 1, 7, 3)]
)
def test_a_whole_transformer_keeps_embedding_plus_blocks_plus_head(vocab, d_model, heads, layers, seq, batch):
    torch.manual_seed(0)
    model = models.TinyTransformer(vocab, d_model=d_model, n_heads=heads, n_layers=layers, max_seq_len=seq)
    ids, targets = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    with saved_tensor_bytes(ignore=model.parameters()) as saved:
        models.lm_loss(model(ids), targets)
    block = block_activation_elements(batch=batch, seq=seq, d_model=d_model, heads=heads)["total"]
    expected = (
        embedding_activation_bytes(batch=batch, seq=seq)
        + layers * 4 * block
        + head_activation_bytes(batch=batch, seq=seq, d_model=d_model, vocab=vocab)
    )
    assert saved.bytes == expected
