"""Compiled blocks: equal to eager on one process, under the course's tensor parallelism and FSDP, and
under DTensor; graph breaks where the course's collectives are, none in a plain block.

The tests compile with ``aot_eager`` (TorchDynamo and AOTAutograd, PyTorch's own operators): what
tracing does to the results and where graphs break. Inductor's generated code takes about 20 s to
compile even one small block on this CPU.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import models
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import compiled
from course_lib.parallel import tensor as tp
from course_lib.parallel.fsdp import FullyShardedDataParallel

from conftest import tiny_transformer


def _losses(kind: str, steps: int = 3) -> dict:
    """The same training eager and with compiled blocks; plus where a block's graphs break."""
    result = {}
    for compile_them in (False, True):
        torch._dynamo.reset()
        model, inputs, targets = tiny_transformer(seq=16, d_model=32, heads=4)
        if kind == "tensor":
            tp.apply_tensor_parallel(model)
        elif kind == "fsdp":
            model = FullyShardedDataParallel(model, auto_wrap_policy=models.sharding_units(model))
        if compile_them:
            blocks = [m for m in model.modules() if isinstance(m, models.Block)]
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
            result["breaks"] = compiled.graph_breaks(blocks[0], x)  # one forward, traced, not compiled
            result["compiled_blocks"] = compiled.compile_blocks(model, backend="aot_eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator, losses = torch.Generator().manual_seed(1), []
        for _ in range(steps):
            batch = torch.randint(0, len(inputs), (4,), generator=generator)
            loss = models.lm_loss(model(inputs[batch]), targets[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        result["compiled" if compile_them else "eager"] = losses
    return result


@pytest.mark.parametrize("kind, world", [("one process", 1), ("tensor", 2), ("fsdp", 2)])
def test_compiled_blocks_train_as_eager_does(kind, world):
    for result in launch(_losses, world, kind):
        assert result["compiled_blocks"] == 2
        assert result["compiled"] == pytest.approx(result["eager"], rel=1e-6)
        if kind == "tensor":  # the course's collectives run in Python: a break at each
            assert result["breaks"]["breaks"] >= 2, result["breaks"]
        elif kind == "one process":
            assert result["breaks"] == {"graphs": 1, "breaks": 0, "reasons": []}


def _dtensor_block() -> dict:
    """One block under DTensor's tensor parallelism: its graphs, and compiled against eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    plan = {f"attention.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan |= {"attention.out": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    block = parallelize_module(models.Block(32, 4), init_device_mesh("cpu", (2,)), plan)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    eager = block(x)
    breaks = compiled.graph_breaks(block, x)
    torch._dynamo.reset()
    block.compile(backend="aot_eager")
    return {"breaks": breaks, "difference": (block(x) - eager).abs().max().item()}


def test_pytorchs_own_tensor_parallelism_compiles_into_one_graph():
    """DTensor's collectives are traceable (functional collectives): no break, where the course's
    Python-logged ones break the block at each collective."""
    for result in launch(_dtensor_block, 2):
        assert result["breaks"] == {"graphs": 1, "breaks": 0, "reasons": []}
        assert result["difference"] == 0


def test_inductor_without_a_compiler_and_a_wrong_backend_are_refused_in_one_line(monkeypatch):
    model = tiny_transformer(seq=16, d_model=32, heads=4)[0]
    with pytest.raises(UserError, match="backend"):
        compiled.compile_blocks(model, backend="tensorrt")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="Inductor backend needs a C\\+\\+ compiler on a CPU: install one"):
        compiled.compile_blocks(model)
