"""Each parallelism claims the modules it converts, so that none is applied twice in silence.

Applying a parallelism twice raises nothing in torch: gradients are averaged twice, weights
already cut are cut again, and a different model trains without a word. So every technique of
the course notes, on each module it converts, that it did (``claim_module``), and a second
claim by the same technique, or by another of the same family (two data-parallel wrappers
around one model; tensor and sequence parallelism on one block), is refused in one line.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError

CONVERTED_BY = "_course_converted_by"
"""The attribute where ``claim_module`` notes which parallelisms converted a module."""

DATA_PARALLEL_WRAPPER = "a data-parallel wrapper"
SPLIT_LAYERS = "a split of the layers"
FAMILY_ADVICE = {
    DATA_PARALLEL_WRAPPER: "a model takes one data-parallel wrapper (DDP, ZeRO or FSDP): build it again and "
    "wrap it once",
    SPLIT_LAYERS: "sequence parallelism is tensor parallelism with its own communication: build the model "
    "again and apply one of the two",
}


def claim_module(module: Any, technique: str, *, family: str | None = None) -> None:
    """Note that ``technique`` converts ``module``; refuse it if the module was converted so before.

    Applying a parallelism twice raises nothing in torch: gradients are averaged twice, weights
    already cut are cut again, and a different model trains in silence. So every technique of
    the course claims the modules it converts, and a second claim by the same technique, or by
    another of the same ``family`` (two data-parallel wrappers around one model), is refused.

    Args:
        module: the module about to be converted.
        technique: what converts it, as the message should name it.
        family: techniques that exclude each other (``DATA_PARALLEL_WRAPPER``, ``SPLIT_LAYERS``).
    """
    check_not_converted(module, technique, family=family)
    vars(module).setdefault(CONVERTED_BY, []).append((technique, family))


def check_not_converted(module: Any, technique: str, *, family: str | None = None) -> None:
    """``claim_module``'s refusal alone, for a caller that reads the module before converting it.

    Args:
        module: the module about to be converted.
        technique: what will convert it.
        family: techniques that exclude each other.
    """
    for inner in module.modules():
        for done, done_family in vars(inner).get(CONVERTED_BY, ()):
            where = "this model" if inner is module else f"its submodule {type(inner).__name__}"
            if done == technique:
                raise UserError(
                    f"{technique} was already applied to {where}: apply each parallelism once, to a model "
                    "built afresh (converting it twice would train another model in silence)"
                )
            if family is not None and done_family == family:
                raise UserError(
                    f"{where} is already converted by {done}, and {technique} would convert it again: "
                    f"{FAMILY_ADVICE[family]}"
                )
