"""The networks of the lab, sized so that a laptop trains them in seconds to minutes.

=============  ===========  ============  ================================================
name           input        parameters    what it is for
=============  ===========  ============  ================================================
digits_cnn     1 x 8 x 8        35,173    the default: learns sklearn's digits in seconds
cifar_cnn      3 x 32 x 32     765,887    CIFAR-10 / synthetic: enough compute to scale
resnet18       3 x 32 x 32  11,173,962    torchvision's ResNet-18, adapted to 32x32 images
=============  ===========  ============  ================================================

``TinyTransformer`` (a GPT: token and position embeddings, pre-norm blocks of causal
self-attention and MLP, a language-model head) is the model of tensor, pipeline and 3-D
parallelism: it learns the characters of the Zen of Python (``data.zen_windows``) in seconds.
It is an ``nn.Sequential`` of [embedding, block, ..., block, head], so a pipeline cuts it
between any two entries, and its attention reshapes by ``-1`` heads, so the same code runs
with only a tensor-parallel rank's share of the heads.

Layer widths are chosen so that parameter counts do *not* divide evenly by 2, 3 or 4 ranks
(35,173 is odd and not a multiple of 3): sharding code must handle the remainder.

Why no BatchNorm. BatchNorm normalises with statistics of the batch *on this rank*. Split a
global batch of 256 over 4 ranks and each normalises over 64 samples: the result changes with
the number of ranks, and each rank's running statistics drift apart (DDP only averages
gradients, not buffers). ``SyncBatchNorm`` fixes that with an extra all-reduce in every forward
of every normalisation layer, and needs a GPU. We use GroupNorm instead: it normalises each
sample on its own, so there is nothing to synchronise, and training is identical on 1 or N
ranks (the property the strong-scaling study needs). ResNet-18 therefore gets
``GroupNorm(32 groups)`` in place of each BatchNorm.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .checks import check_choice
from .errors import UserError

IMAGE_MODELS = ("digits_cnn", "cifar_cnn", "resnet18")
"""The image classifiers the trainer builds (``build_model``); the planner's transformers are
``plan.specs.MODELS``."""


class DigitsCNN(nn.Sequential):
    """Two convolutions and two linear layers for 1x8x8 digits (35,173 parameters).

    Args:
        num_classes: outputs of the last layer, one logit per class.
    """

    input_shape = (1, 8, 8)

    def __init__(self, *, num_classes: int = 10):
        super().__init__(
            nn.Sequential(nn.Conv2d(1, 15, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(15, 30, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),  # -> 30 x 4 x 4
            nn.Sequential(nn.Flatten(), nn.Linear(30 * 4 * 4, 63), nn.ReLU()),
            nn.Linear(63, num_classes),
        )


class CifarCNN(nn.Sequential):
    """A VGG-style CNN for 3x32x32 images (765,887 parameters), no normalisation layers."""

    input_shape = (3, 32, 32)

    def __init__(self, *, num_classes: int = 10):
        def block(c_in, c_out, pool):
            layers = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
            return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)

        super().__init__(
            block(3, 32, pool=False),
            block(32, 64, pool=True),  # -> 16 x 16
            block(64, 128, pool=True),  # -> 8 x 8
            block(128, 128, pool=True),  # -> 4 x 4
            nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 255), nn.ReLU()),
            nn.Linear(255, num_classes),
        )


def resnet18_cifar(*, num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 for 32x32 inputs: a 3x3 stem, no max-pool, GroupNorm for BatchNorm."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes, norm_layer=lambda channels: nn.GroupNorm(32, channels))
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model.input_shape = (3, 32, 32)
    return model


class Embedding(nn.Module):
    """Token plus learned position embeddings: (batch, seq) token ids -> (batch, seq, d_model)."""

    def __init__(self, vocab_size: int, d_model: int, max_seq_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_seq_len, d_model)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's embedding plus its position's.

        Args:
            ids: (batch, seq) token ids.
            positions: (seq,) where those tokens sit in their sequences (None: 0 to seq - 1;
                context parallelism passes the positions of its chunk).
        """
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class CausalAttention(nn.Module):
    """``softmax(q kᵀ / √d) v`` with a causal mask, on the whole sequence held by this process.

    Context parallelism swaps it for ``parallel.context.RingAttention``, which computes the same
    on a chunk of the sequence.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; ``q``, ``k``, ``v`` and ``out`` are plain linear layers."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise UserError(f"d_model {d_model} must be a multiple of n_heads {n_heads}")
        self.head_dim = d_model // n_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        self.attend = CausalAttention()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries, keys and values of ``x`` (sequence parallelism's Megatron variant overrides it)."""
        return self.q(x), self.k(x), self.v(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries, keys, values = self.project(x)
        batch, seq, _ = queries.shape

        def heads(
            t,
        ):  # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim); -1: however many are here
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        attended = self.attend(heads(queries), heads(keys), heads(values))
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """The transformer's feed-forward layer: ``fc2(gelu(fc1(x)))``, widening to ``hidden`` and back.

    Args:
        d_model: the width of the tokens it reads and writes.
        hidden: the width in between (4 x ``d_model`` in ``Block``).
    """

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)).

    Args:
        d_model: the width of the tokens it reads and writes.
        n_heads: attention heads (``d_model`` must be a multiple).
        mlp_ratio: the MLP's hidden width, as a multiple of ``d_model``.
    """

    def __init__(self, d_model: int, n_heads: int, *, mlp_ratio: int = 4):
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(d_model), SelfAttention(d_model, n_heads)
        self.norm2, self.mlp = nn.LayerNorm(d_model), MLP(d_model, mlp_ratio * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LMHead(nn.Module):
    """Final norm and the projection to one logit per vocabulary entry."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class TinyTransformer(nn.Sequential):
    """[Embedding, Block x n_layers, LMHead]: a character-level GPT small enough for a laptop CPU.

    Args:
        vocab_size: how many distinct tokens (characters) it reads and predicts.
        d_model: the width of every token's vector.
        n_heads: attention heads per block (``d_model`` must be a multiple).
        n_layers: transformer blocks.
        max_seq_len: the longest sequence its position embedding covers.
        tie_embeddings: the output projection *is* the token embedding (one parameter in two
            places, as in GPT-2): fewer parameters, and both uses train the same weights.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 4,
        max_seq_len: int = 32,
        tie_embeddings: bool = False,
    ):
        super().__init__(
            Embedding(vocab_size, d_model, max_seq_len),
            *(Block(d_model, n_heads) for _ in range(n_layers)),
            LMHead(d_model, vocab_size),
        )
        self.d_model, self.n_heads, self.vocab_size = d_model, n_heads, vocab_size
        if tie_embeddings:
            self[-1].proj.weight = self[0].tokens.weight


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token prediction over every position.

    Args:
        logits: (batch, seq, vocabulary) scores, the output of ``TinyTransformer``.
        targets: (batch, seq) token ids, the inputs shifted by one (``data.zen_windows``).
    """
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(name: str, *, num_classes: int = 10) -> nn.Module:
    """A fresh network of the lab, by name (the table above); the seed set before decides its weights.

    Args:
        name: ``"digits_cnn"``, ``"cifar_cnn"`` or ``"resnet18"``.
        num_classes: outputs of the last layer.
    """
    check_choice("model", name, IMAGE_MODELS)
    if name == "digits_cnn":
        return DigitsCNN(num_classes=num_classes)
    if name == "cifar_cnn":
        return CifarCNN(num_classes=num_classes)
    return resnet18_cifar(num_classes=num_classes)


def model_input_shape(name: str) -> tuple[int, int, int]:
    return {"digits_cnn": DigitsCNN.input_shape, "cifar_cnn": CifarCNN.input_shape, "resnet18": (3, 32, 32)}[
        name
    ]


def check_model_fits_data(model_name: str, dataset_name: str, input_shape: tuple[int, int, int]) -> None:
    check_choice("model", model_name, IMAGE_MODELS)
    expected = model_input_shape(model_name)
    if tuple(expected) != tuple(input_shape):
        fitting = [m for m in IMAGE_MODELS if model_input_shape(m) == tuple(input_shape)]
        raise UserError(
            f"model {model_name} expects {'x'.join(map(str, expected))} images but dataset {dataset_name} "
            f"has {'x'.join(map(str, input_shape))}: use --model {' or --model '.join(fitting)}"
        )


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP treats as one unit each: one all-gather before, one reduce-scatter after.

    Our CNNs are sequences of blocks, so each block with parameters is a unit; for ResNet-18 each
    residual block is one. Smaller units mean less memory held at once, but more, smaller messages.

    Args:
        model: one of the lab's CNNs or ResNet-18 (``build_model``).
    """
    # A ResNet was built by torchvision, which is then imported already: importing it only to ask
    # would cost every rank about a second.
    torchvision_models = sys.modules.get("torchvision.models")
    if torchvision_models is not None and isinstance(model, torchvision_models.ResNet):
        return [
            block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer
        ]
    return [child for child in model.children() if any(True for _ in child.parameters())]


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that ``model`` holds in more than one place (tied weights).

    ``model.parameters()`` lists such a parameter once and ``state_dict()`` under every name.

    Args:
        model: any module.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def count_parameters(model: nn.Module) -> int:
    """Elements in every parameter of ``model`` (Ψ in the memory and traffic formulas).

    Args:
        model: any module.
    """
    return sum(p.numel() for p in model.parameters())


def flat_parameters(state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
    """All tensors of a state dict as one vector, in key order: handy for comparing two models."""
    return torch.cat([state_dict[key].detach().reshape(-1).float().cpu() for key in sorted(state_dict)])
