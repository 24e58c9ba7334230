"""Compiled blocks: ``torch.compile`` on each transformer block, the way torchtitan applies it.

``torch.compile`` traces a module's Python into a graph (TorchDynamo), derives the backward from it
(AOTAutograd), and hands both to a backend that generates code. Inductor, the default, fuses the
chains of element-wise work between the matmuls (a norm, a GELU, a residual add, a dropout) into
one kernel each. That saves memory traffic, which is where element-wise work spends its time, and
the launches of the operators it merges. Inductor emits Triton on a GPU and C++/OpenMP on a CPU,
which needs a C++ compiler. The matmuls stay library calls (cuBLAS, oneDNN).

Compiling *each block* rather than the whole model, as torchtitan does, keeps compile time
independent of depth: the blocks are identical, so the first block's graph serves every block.
It also leaves the parallelism's collectives outside or at the edges of the graphs. Where the
tracer meets code it cannot put in a graph, it *breaks* the graph: it runs that code eagerly and
starts a new graph after it. The course's tensor parallelism calls its collectives through
``comm``, which logs and checks each call in Python, and marks that Python ``torch.compiler.disable``
(traced, its counters would force a recompilation at every call). So under it a block compiles as
several graphs with a break at each collective, and the matmuls between them are still compiled.
PyTorch's own DTensor and functional collectives are traceable, and compile into one graph.
``graph_breaks`` lists where they land and why (``torch._dynamo.explain``). ``TORCH_LOGS=graph_breaks``
prints the same while a run goes.

Cost: compiling takes seconds to minutes before the first step: about 20 s for one small block's
forward and backward with Inductor on this 2-core CPU, against a step of milliseconds. It pays
over a long run. A graph is recompiled when its input shapes change.

Sources: Ansel et al., "PyTorch 2", ASPLOS 2024; torchtitan's ``apply_compile``
(``torch.compile(block, fullgraph=True)`` per block); the ``torch.compile`` and
``torch._dynamo.explain`` documentation.
"""

from __future__ import annotations

import shutil

import torch
from torch import nn

from ..checks import check_choice, check_flag, check_module
from ..errors import UserError
from ..models import Block

BACKENDS = ("inductor", "aot_eager", "eager")
"""Inductor generates fused code; aot_eager traces forward and backward but runs PyTorch's own
operators (fast to compile: what the tests use to check tracing and results); eager only traces."""


def check_compiler(backend: str) -> None:
    """Refuse, in one line, Inductor on a CPU machine without the C++ compiler it generates code for."""
    check_choice("backend", backend, BACKENDS)
    if backend == "inductor" and not torch.cuda.is_available():
        if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
            raise UserError(
                "torch.compile's Inductor backend needs a C++ compiler on a CPU: install one "
                "(apt-get install g++), or use backend='aot_eager'"
            )


def apply_compile(model: nn.Module, *, backend: str = "inductor", fullgraph: bool = False) -> nn.Module:
    """Compile every transformer ``Block`` of ``model`` in place, and return ``model``.

    Apply it after the parallelism (``apply_tensor_parallel``, FSDP...): each block then compiles
    with the collectives its parallelism put in it. Compiling per block, not the whole model, is
    torchtitan's choice: the blocks are alike, so one graph is compiled and reused.

    Args:
        model: a ``models.TinyTransformer`` (or any module holding ``Block``s), parallel or not.
        backend: ``"inductor"`` (fused generated code), ``"aot_eager"`` or ``"eager"``.
        fullgraph: refuse any graph break (torchtitan's setting), instead of running that code
            eagerly between graphs.
    """
    check_module("model", model)
    check_flag("fullgraph", fullgraph)
    check_compiler(backend)
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    if not blocks:
        raise UserError(f"apply_compile compiles transformer blocks; this {type(model).__name__} holds none")
    for block in blocks:
        block.compile(backend=backend, fullgraph=fullgraph)  # in place: names and state dicts unchanged
    return model


def compiled_blocks(model: nn.Module) -> int:
    """How many of ``model``'s ``Block``s ``apply_compile`` compiled.

    Args:
        model: any module.
    """
    return sum(isinstance(m, Block) and m._compiled_call_impl is not None for m in model.modules())


def graph_breaks(module: nn.Module, *inputs: torch.Tensor) -> dict:
    """How TorchDynamo cuts ``module``'s forward on these inputs into graphs, and why.

    Returns ``graphs`` (how many), ``breaks`` (how many) and ``reasons`` (one line each).

    Args:
        module: the module to trace (its forward runs once, on ``inputs``).
        inputs: example inputs.
    """
    check_module("module", module)
    explained = torch._dynamo.explain(module)(*inputs)
    return {
        "graphs": explained.graph_count,
        "breaks": explained.graph_break_count,
        "reasons": [str(reason.reason).splitlines()[0] for reason in explained.break_reasons],
    }
