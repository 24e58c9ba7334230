"""A Llama-style transformer built from the shapes the planner plans: one model, planned and trained.

The planner reads a model as a ``plan.specs.ModelSpec`` (a built-in one, or a Hugging Face
``config.json`` read by ``plan.from_files``). ``Llama(spec)`` builds exactly that model, as
Llama 3 and torchtitan's ``Transformer`` write it: ``[TokenEmbedding, LlamaBlock x L, LlamaHead]``

- RMSNorm before the attention and before the MLP (one weight, one statistic a token: Zhang and
  Sennrich, arXiv:1910.07467);
- rotary position embedding on the queries and keys (Su et al., arXiv:2104.09864), no learned
  positions;
- grouped-query attention (Ainslie et al., arXiv:2305.13245): ``kv_heads`` key and value heads,
  each shared by ``heads / kv_heads`` query heads, through ``scaled_dot_product_attention`` with
  ``enable_gqa`` (flash attention on a GPU);
- a SwiGLU MLP (Shazeer, arXiv:2002.05202): ``fc2(silu(fc1(x)) * up(x))``;
- no biases; an output projection tied to the embedding or its own.

Its blocks *are* the course's ``models.Block`` (``x + attention(norm1(x))``, then
``x + mlp(norm2(x))``) with these parts, so the course's verbs apply to it as to
``models.TinyTransformer``: ``parallel.tensor.apply_tensor_parallel`` cuts q, k, v, fc1 and up by
columns (whole heads a rank) and out and fc2 by rows; FSDP shards each child; recomputation wraps
each block; a pipeline cuts the list of children.

The cost is the planner's count: ``ModelSpec.parameters()`` parameters (the tests hold the two
equal) and ``flops_per_token`` FLOPs a token. A spec with experts is built by
``parallel.expert.moe_llama``, each block's MLP a mixture of these SwiGLU experts.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import UserError
from .models import Block, CausalAttention, LMHead, SelfAttention

SPEC_FIELDS = ("layers", "d_model", "heads", "kv_heads", "ffn_hidden", "vocab", "head_dim")
"""What ``Llama`` reads of a spec (a ``plan.specs.ModelSpec``, or anything with these fields)."""

ROPE_THETA = 500_000.0
"""Llama 3's rotary base (``rope_theta`` in its config.json)."""


def rotate(x: torch.Tensor, *, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim) at positions 0 to seq - 1.

    Each pair of features (i, i + d/2) is turned by the angle position x theta^(-2i/d): the dot
    product of a query and a key then depends on their positions only through their distance.
    (The pairs as Hugging Face's Llama lays them out, so its weights load unchanged.)

    Args:
        x: queries or keys.
        theta: the base of the angles' frequencies.
    """
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(x.shape[-2], device=x.device, dtype=torch.float32), frequencies)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class GroupedCausalAttention(CausalAttention):
    """Causal fused attention of ``heads`` queries over ``kv_heads`` keys and values (each shared
    by ``heads / kv_heads`` queries): ``scaled_dot_product_attention(..., enable_gqa=True)``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class LlamaAttention(SelfAttention):
    """Grouped-query self-attention with rotary positions; ``q``, ``k``, ``v``, ``out`` without biases.

    Args:
        d_model: the width of the tokens it reads and writes.
        heads: query heads.
        kv_heads: key and value heads (``heads`` must be a multiple).
        head_dim: features a head.
        theta: the rotary base.
    """

    def __init__(self, d_model: int, heads: int, kv_heads: int, head_dim: int, *, theta: float = ROPE_THETA):
        nn.Module.__init__(self)
        if heads % kv_heads:
            raise UserError(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
        self.head_dim, self.kv_heads, self.theta = head_dim, kv_heads, theta
        self.q = nn.Linear(d_model, heads * head_dim, bias=False)
        self.k, self.v = (nn.Linear(d_model, kv_heads * head_dim, bias=False) for _ in range(2))
        self.out = nn.Linear(heads * head_dim, d_model, bias=False)
        self.attend = GroupedCausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in self.project(x))
        attended = self.attend(rotate(q, theta=self.theta), rotate(k, theta=self.theta), v)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))


class GatedMLP(nn.Module):
    """SwiGLU: ``fc2(silu(fc1(x)) * up(x))``, widening to ``hidden`` twice and back, no biases.

    Args:
        d_model: the width of the tokens it reads and writes.
        hidden: the width in between.
    """

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1, self.up = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.act, self.fc2 = nn.SiLU(), nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)) * self.up(x))


class LlamaBlock(Block):
    """A ``models.Block`` of Llama's parts: RMSNorm, ``LlamaAttention``, RMSNorm, ``GatedMLP``.

    Args:
        spec: the shapes (``SPEC_FIELDS``).
        eps: the norms' epsilon.
        theta: the rotary base.
    """

    def __init__(self, spec, *, eps: float = 1e-5, theta: float = ROPE_THETA):
        nn.Module.__init__(self)
        h = spec.d_model
        self.norm1 = nn.RMSNorm(h, eps=eps)
        self.attention = LlamaAttention(h, spec.heads, spec.kv_heads, spec.head_dim, theta=theta)
        self.norm2, self.mlp = nn.RMSNorm(h, eps=eps), GatedMLP(h, spec.ffn_hidden)


class TokenEmbedding(nn.Module):
    """Token embeddings alone (the positions are rotary, in the attention): ids -> (batch, seq, d)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids)


class LlamaHead(LMHead):
    """The final RMSNorm and the projection to the vocabulary, without a bias."""

    def __init__(self, d_model: int, vocab_size: int, *, eps: float = 1e-5):
        nn.Module.__init__(self)
        self.norm, self.proj = nn.RMSNorm(d_model, eps=eps), nn.Linear(d_model, vocab_size, bias=False)


class Llama(nn.Sequential):
    """``[TokenEmbedding, LlamaBlock x layers, LlamaHead]``, the model a ``ModelSpec`` describes.

    Args:
        spec: the shapes: a ``plan.specs.ModelSpec`` (or anything with ``SPEC_FIELDS``, and
            ``tied_embeddings`` and ``experts`` where it has them).
        eps: the norms' epsilon (Llama 3: 1e-5).
        theta: the rotary base (Llama 3: 500,000).
    """

    def __init__(self, spec, *, eps: float = 1e-5, theta: float = ROPE_THETA):
        missing = [name for name in SPEC_FIELDS if not isinstance(getattr(spec, name, None), int)]
        if missing:
            raise UserError(f"a Llama is built from a ModelSpec; this {type(spec).__name__} lacks {missing}")
        if getattr(spec, "experts", 1) > 1:
            raise UserError(
                f"{getattr(spec, 'name', 'this spec')} has {spec.experts} experts: Llama builds a dense "
                "model; build this one with parallel.expert.moe_llama(spec)"
            )
        super().__init__(
            TokenEmbedding(spec.vocab, spec.d_model),
            *(LlamaBlock(spec, eps=eps, theta=theta) for _ in range(spec.layers)),
            LlamaHead(spec.d_model, spec.vocab, eps=eps),
        )
        self.d_model, self.n_heads, self.vocab_size = spec.d_model, spec.heads, spec.vocab
        if getattr(spec, "tied_embeddings", False):
            self[-1].proj.weight = self[0].tokens.weight
