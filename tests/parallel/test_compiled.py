"""Compiled blocks: equal to eager on one process, under the course's tensor parallelism and FSDP, and
under DTensor and FSDP2 (``bench compile``); graph breaks where the course's collectives are, none in
a plain block.

The tests compile with ``aot_eager`` (TorchDynamo and AOTAutograd, PyTorch's own operators): what
tracing does to the results and where graphs break. Inductor's generated code takes about 20 s to
compile even one small block on this CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from course_lib import models
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import compiled
from course_lib.parallel.fsdp import FullyShardedDataParallel

from conftest import call_main, run_bench, tiny_transformer


def _losses(kind: str, steps: int = 3) -> dict:
    """The same training eager and with compiled blocks; plus where a block's graphs break."""
    result = {}
    for compile_them in (False, True):
        torch._dynamo.reset()
        model, inputs, targets = tiny_transformer(seq=16, d_model=32, heads=4)
        if kind == "fsdp":
            model = FullyShardedDataParallel(model, auto_wrap_policy=models.sharding_units(model))
        if compile_them:
            blocks = [m for m in model.modules() if isinstance(m, models.Block)]
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
            result["breaks"] = compiled.graph_breaks(blocks[0], x)  # one forward, traced, not compiled
            compiled.apply_compile(model, backend="aot_eager")
            result["compiled_blocks"] = compiled.compiled_blocks(model)
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


# The course's tensor parallelism compiled is held against eager by bench compile's test below
# (forward and backward, bit for bit); here, training steps with the optimizer.
@pytest.mark.parametrize("kind, world", [("one process", 1), ("fsdp", 2)])
def test_compiled_blocks_train_as_eager_does(kind, world):
    for result in launch(_losses, world, kind):
        assert result["compiled_blocks"] == 2
        assert result["compiled"] == pytest.approx(result["eager"], rel=1e-6)
        if kind == "one process":
            assert result["breaks"] == {"graphs": 1, "breaks": 0, "reasons": []}


@pytest.mark.slow  # four compilations
def test_the_compile_benchmark_compiles_under_each_parallelism_and_equals_eager(tmp_path):
    """``bench compile`` with aot_eager: DTensor's and FSDP2's blocks compile into one graph (their
    collectives are traceable, or outside the block), the course's tensor parallelism breaks the
    graph at each of its Python-logged collectives, and every compiled loss is the eager one."""
    output = tmp_path / "compile.json"
    sizes = "--d-model 32 --heads 4 --seq 16 --batch 2 --layers 1 --steps 2 --warmup 1"
    result = run_bench("compile", "--compiler", "aot_eager", *sizes.split(), "--output", str(output))
    assert json.loads(output.read_text()) == result
    for variant in ("one_process", "course_tp", "dtensor_tp", "fsdp2"):
        row = result[variant]
        assert row["max_loss_difference"] == 0, (variant, row)
        assert row["first_compiled_step_s"] > 0 and row["eager_step_ms"] > 0 and row["compiled_step_ms"] > 0
        if variant == "course_tp":
            assert row["graph_breaks_per_block"] == row["graphs_per_block"] - 1 >= 2, row
            assert row["break_reasons"] == ["Skip calling `torch.compiler.disable()`d function"]
        else:
            assert (row["graphs_per_block"], row["graph_breaks_per_block"]) == (1, 0), (variant, row)
        saved_ms = row["eager_step_ms"] - row["compiled_step_ms"]
        repay = row["steps_to_repay_compile"]
        assert repay == (
            pytest.approx(1000 * row["first_compiled_step_s"] / saved_ms) if saved_ms > 0 else None
        )


def test_the_compile_benchmark_refuses_what_it_cannot_compile_in_one_line(monkeypatch, capsys):
    from course_lib.tools import bench

    shown = call_main(bench.main, ["compile", "--heads", "3"], capsys)
    assert shown.returncode == 2 and "argument --heads: must be a multiple of --world-size 2" in shown.stderr
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    shown = call_main(bench.main, ["compile"], capsys)
    assert shown.returncode == 2 and len(shown.stderr.strip().splitlines()) == 1
    assert "Inductor backend needs a C++ compiler on a CPU" in shown.stderr


def test_inductor_without_a_compiler_and_a_wrong_backend_are_refused_in_one_line(monkeypatch):
    model = tiny_transformer(seq=16, d_model=32, heads=4)[0]
    with pytest.raises(UserError, match="backend"):
        compiled.apply_compile(model, backend="tensorrt")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="Inductor backend needs a C\\+\\+ compiler on a CPU: install one"):
        compiled.apply_compile(model)
