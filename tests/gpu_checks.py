"""GPU checks run in a fresh process each (``python tests/gpu_checks.py NAME``), printing one JSON line.

A CUDA context does not survive ``fork``: the pytest process never touches the GPU, and every
check starts its own Python, a world of one under ``runtime.init`` where it needs a process group.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib import memory, runtime  # noqa: E402


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        inputs = torch.randn(64, 1024, generator=generator).to(device)
        targets = torch.randint(0, 10, (64,), generator=generator).to(device)
        optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def model_state_memory() -> dict:
    """Bytes the CUDA allocator holds for an MLP's parameters, gradients and Adam state, against the model."""
    device = torch.device("cuda", 0)
    # cuBLAS takes its workspace (megabytes) through the same allocator on the first product:
    # take it before counting, so that only the model states are counted.
    warm = torch.randn(64, 1024, device=device, requires_grad=True)
    (warm @ torch.randn(1024, 1024, device=device)).sum().backward()
    del warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    model = _mlp().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _steps(model, optimizer, device)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(device) - before  # the activations of the last step are freed
    params = sum(p.numel() for p in model.parameters())
    predicted = memory.model_state_bytes(
        params, 1, "ddp", param_bytes=4, grad_bytes=4, optimizer_bytes=8
    ).total
    measured = memory.measure_model_states(model, optimizer=optimizer).total
    return {"allocator_bytes": held, "model_bytes": predicted, "counted_bytes": measured, "params": params}


def fsdp_offload() -> dict:
    """The course FSDP with its shards in pinned CPU memory, against the same model trained on the GPU."""
    from course_lib.parallel.fsdp import FullyShardedDataParallel

    context = runtime.init(backend="nccl")
    reference = _mlp().to(context.device)
    _steps(reference, torch.optim.Adam(reference.parameters(), lr=1e-3), context.device)
    sharded = FullyShardedDataParallel(_mlp().to(context.device), cpu_offload="params")
    shards = list(sharded.parameters())
    optimizer = torch.optim.Adam(shards, lr=1e-3)
    _steps(sharded, optimizer, context.device)
    state = sharded.full_state_dict()
    error = max(
        (state[key].float().cpu() - value.float().cpu()).abs().max().item()
        for key, value in reference.state_dict().items()
    )
    result = {
        "shards_on_cpu": all(p.device.type == "cpu" for p in shards),
        "shards_pinned": all(p.is_pinned() for p in shards),
        "max_weight_error": error,
    }
    del sharded, optimizer, reference
    runtime.shutdown()
    return result


def nccl_world_of_one() -> dict:
    """NCCL initialised for one rank: an all-reduce on the GPU leaves the tensor as it was."""
    context = runtime.init(backend="nccl")
    tensor = torch.arange(4.0, device=context.device)
    torch.distributed.all_reduce(tensor)
    result = {"backend": context.backend, "device": str(context.device), "sum": tensor.sum().item()}
    runtime.shutdown()
    return result


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
