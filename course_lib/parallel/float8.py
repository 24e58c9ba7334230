"""Float8 training: the linear layers' matmuls in 8-bit floats, each tensor scaled into their range.

A float8 number has 8 bits: e4m3 (4 bits of exponent, 3 of mantissa: up to 448, about 2 significant
digits) or e5m2 (up to 57,344, one digit and a half). A GPU's tensor cores multiply them at twice
the bf16 rate (H100: 1,979 against 989 dense TFLOP/s), and a float8 tensor is half the bytes.
But the range is narrow. So every tensor is *scaled* first: divided by amax / 448, its largest
magnitude lands on the format's largest value, and the scale goes along with the 8-bit data.
``torch._scaled_mm(a8, b8, scale_a, scale_b)`` multiplies the two and multiplies the scales back
in, accumulating in higher precision.

Two recipes, as torchao's float8 training has them:

- **tensorwise**: one scale per tensor. The forward's input and weight are e4m3. The backward's
  output gradient is e5m2, because gradients need range more than digits.
- **rowwise**: one scale per row of the left operand and per column of the right one, along the
  dimension the matmul sums over, all e4m3. One outlier token then costs precision only to its own
  row, not to the whole tensor. Each scale is rounded down to a power of two, so that applying it
  is exact and the cast is the only rounding.

Each scale comes from the tensor at hand (*dynamic* scaling, torchao's default). The older
*delayed* scaling took it from a history of past amaxes, one step stale; torchao dropped it.

Finer still, and not built here: *block-scaled* formats give every small block of a row its own
scale. The OCP Microscaling (MX) formats, mxfp8 and mxfp4, scale each 32 elements by a power of
two (an 8-bit exponent, E8M0); NVIDIA's nvfp4 scales each 16 four-bit elements by an e4m3 number.
Blackwell's tensor cores apply these scales inside the matmul (an H100's cannot), and torchao's
``mx_formats`` trains with mxfp8. One outlier then costs precision to 32 elements, not to a row.

What stays in high precision: the master weights and the optimizer (the casts are made afresh from
them each step); the tensors kept for backward (this lesson keeps them whole, torchao can keep the
float8 casts); the norms, the softmax, the residual stream; the output head (its vocabulary-wide
logits are sensitive, and torchtitan leaves it out); every matmul's accumulation.

Communication: FSDP can gather the parameters as float8 (``fsdp_units.MixedPrecision(gather_dtype=
torch.float8_e4m3fn)``): one byte an element, half of bf16's. Every rank scales its shard by the
unit's amax over all ranks (one all-reduce of one number first), so the gathered bytes are exactly
the float8 cast of the whole unit, whatever the number of ranks.

Cost: three casts per matmul (amax, divide, round), which are memory-bound. They pay only where the
matmul is large: torchao's tables show a speedup from about 4,096 x 4,096 on an H100. On this CPU,
``_scaled_mm`` runs but is not faster: the lesson is the numbers, not the speed.

Papers and twins: Micikevicius et al., "FP8 Formats for Deep Learning", 2022 (the two formats);
NVIDIA Transformer Engine (the recipes); torchao's ``Float8Linear`` / ``convert_to_float8_training``,
PyTorch's own, which this file matches bit for bit in bf16 (tests/parallel/test_float8.py; it runs
on a CPU too, where its speed means nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_choice, check_module
from ..errors import UserError

RECIPES = ("tensorwise", "rowwise")
FORWARD_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPE = {"tensorwise": torch.float8_e5m2, "rowwise": torch.float8_e4m3fn}
TILE = 16  # the scaled matmul takes dimensions that are multiples of 16 (the tensor cores' tile)
AMAX_FLOOR = 1e-12  # torchao's: the smallest amax a scale is computed from


# #region scale-and-multiply
def to_float8(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    dim: int | None = None,
    amax: torch.Tensor | None = None,
    power_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` scaled into ``dtype``'s range and rounded to it, the scale to multiply back).

    Args:
        x: the tensor, any floating dtype.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        dim: None for one scale for the whole tensor; else the dimension each scale's amax runs
            over (kept, of size 1), one scale per slice across it.
        amax: the largest magnitude to scale by, if not ``x``'s own (a shard scaled like the
            whole tensor it belongs to, as FSDP's float8 all-gather does).
        power_of_two: round the scale down to a power of two (the rowwise recipe's choice):
            multiplying by one is exact, so the cast is the only rounding.
    """
    if amax is None:
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    # the format's largest value over amax, computed as torchao computes it (in float64, then
    # float32) so that both cast every element alike; an all-zero tensor gets a finite scale
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    largest = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    recipe: str,
    a_dtype: torch.dtype,
    out_dtype: torch.dtype,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """``a @ b`` with both operands in float8: ``a`` (m, k) in ``a_dtype``, ``b`` (k, n) in e4m3.

    Args:
        a: the left operand (activations, or an output gradient).
        b: the right operand.
        recipe: ``"tensorwise"`` (one scale each) or ``"rowwise"`` (a scale per row of ``a`` and
            per column of ``b``, their amax over k, each a power of two).
        a_dtype: the left operand's float8 format.
        out_dtype: the result's dtype (the accumulation is in higher precision).
        fast_accumulation: let the GPU's tensor cores accumulate in lower precision (the recipes
            allow it in the forward product only; a CPU ignores it).
    """
    rowwise = recipe == "rowwise"
    a8, scale_a = to_float8(a, a_dtype, dim=1 if rowwise else None, power_of_two=rowwise)  # (m, 1)
    b8, scale_b = to_float8(b, FORWARD_DTYPE, dim=0 if rowwise else None, power_of_two=rowwise)  # (1, n)
    # the right operand column-major, as the scaled matmul wants it
    return torch._scaled_mm(
        a8,
        b8.t().contiguous().t(),
        scale_a=scale_a,
        scale_b=scale_b,
        out_dtype=out_dtype,
        use_fast_accum=fast_accumulation,
    )


# #endregion scale-and-multiply


class _Float8Matmul(torch.autograd.Function):
    """y = x W^T in float8; backward: both gradients in float8, the output gradient in the recipe's format."""

    @staticmethod
    def forward(ctx, x, weight, recipe):
        ctx.save_for_backward(x, weight)  # whole: torchao may keep the float8 casts instead
        ctx.recipe = recipe
        return scaled_matmul(
            x, weight.t(), recipe=recipe, a_dtype=FORWARD_DTYPE, out_dtype=x.dtype, fast_accumulation=True
        )

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        kind = GRADIENT_DTYPE[ctx.recipe]
        grad_x = scaled_matmul(grad, weight, recipe=ctx.recipe, a_dtype=kind, out_dtype=grad.dtype)
        grad_weight = scaled_matmul(grad.t(), x, recipe=ctx.recipe, a_dtype=kind, out_dtype=weight.dtype)
        return grad_x, grad_weight, None


def _check_rowwise_runs(device: torch.device) -> None:
    """Refuse, in one line, a rowwise recipe where this PyTorch's scaled matmul lacks it."""
    try:
        ones = torch.ones(TILE, TILE, device=device)
        scaled_matmul(ones, ones, recipe="rowwise", a_dtype=FORWARD_DTYPE, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as error:
        raise UserError(
            f"this PyTorch ({torch.__version__}) cannot scale float8 matmuls by row on {device.type} "
            f"({str(error).splitlines()[0]}): use recipe='tensorwise', or a PyTorch that has it"
        ) from None


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls (forward and both of backward) run in float8; weights stay as they are.

    Args:
        in_features: the input's width, a multiple of 16.
        out_features: the output's width, a multiple of 16.
        bias: learn a bias (added in the layer's own dtype, after the matmul).
        recipe: ``"tensorwise"`` or ``"rowwise"`` (see the module's docstring).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, recipe: str = "tensorwise"):
        check_choice("recipe", recipe, RECIPES)
        for name, width in (("in_features", in_features), ("out_features", out_features)):
            if width % TILE:
                raise UserError(
                    f"float8 needs {name} a multiple of {TILE} (the scaled matmul's tile), got {width}: "
                    "pad the layer, or leave it in high precision (apply_float8 skips it)"
                )
        super().__init__(in_features, out_features, bias=bias)
        self.recipe = recipe
        if recipe == "rowwise":
            _check_rowwise_runs(self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: str = "tensorwise") -> Float8Linear:
        """The same layer, its weights shared, its matmuls in float8."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe)
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # as nn.Linear would: the input in autocast's dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        rows = x.reshape(-1, x.shape[-1])
        # the weight goes to float8 from its own precision: one rounding, not two through bf16
        y = _Float8Matmul.apply(rows, self.weight, self.recipe).reshape(*x.shape[:-1], -1)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def apply_float8(model: nn.Module, *, recipe: str = "tensorwise", skip: tuple[str, ...] = ()) -> nn.Module:
    """Swap every ``nn.Linear`` whose widths are multiples of 16 for a ``Float8Linear``, in place.

    Returns ``model`` (``float8_layers`` names the layers converted). Layers named in ``skip``
    (the output head, as torchtitan does), the layers inside a module named there, and layers the
    scaled matmul cannot take stay in high precision.

    Args:
        model: any module.
        recipe: ``"tensorwise"`` or ``"rowwise"``.
        skip: names (as ``named_modules`` gives them) of modules to leave as they are, with
            everything inside them; a name that is not a module of ``model`` is refused (a skip
            list that matches nothing would convert the head it meant to keep).
    """
    check_module("model", model)
    check_choice("recipe", recipe, RECIPES)
    if isinstance(skip, str):
        raise UserError(f"skip must be a tuple of module names, not the string {skip!r}: write ({skip!r},)")
    names = dict(model.named_modules())
    unknown = [name for name in skip if name not in names or name == ""]
    if unknown:
        children = ", ".join(name for name, _ in model.named_children())
        raise UserError(
            f"apply_float8: skip names {', '.join(map(repr, unknown))}, which is not a module of this "
            f"{type(model).__name__} (its children: {children}): name modules as named_modules() gives them"
        )

    def skipped(full: str) -> bool:
        return any(full == name or full.startswith(name + ".") for name in skip)

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            fits = type(child) is nn.Linear and child.in_features % TILE == child.out_features % TILE == 0
            if fits and not skipped(full):
                setattr(module, child_name, Float8Linear.from_linear(child, recipe=recipe))
    return model


def float8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s ``Float8Linear`` layers, in order.

    Args:
        model: any module.
    """
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
