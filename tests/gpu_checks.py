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

from course_lib.distributed import runtime  # noqa: E402
from course_lib.parallel import memory


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
    # cuBLAS and cuBLASLt (a linear layer's product with its bias) each take a workspace through
    # the same allocator on their first product, once per stream: the same steps on a throwaway
    # copy first, so that only the model states are counted.
    warm = _mlp().to(device)
    _steps(warm, torch.optim.Adam(warm.parameters(), lr=1e-3), device)
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
    # Adam also keeps one fp32 step counter per parameter tensor, on the host unless it is fused
    # or capturable: counted by measure_model_states, not held by the CUDA allocator.
    steps = 4 * len(optimizer.state)
    return {
        "allocator_bytes": held,
        "model_bytes": predicted,
        "counted_bytes": measured,
        "step_counter_bytes": steps,
        "params": params,
    }


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


def matmul_peak() -> dict:
    """A large bf16 product's measured rate, against this GPU's datasheet peak (course_lib.plan.flops)."""
    from course_lib.plan import flops

    device = torch.device("cuda", 0)
    measured = flops.measure_matmul_tflops(device=device, size=8192, dtype=torch.bfloat16, repeats=20)
    return {
        "gpu": torch.cuda.get_device_name(device),
        "measured_tflops": measured,
        "datasheet_tflops": flops.peak_tflops(device, "bf16"),
    }


def nccl_world_of_one() -> dict:
    """NCCL initialised for one rank: an all-reduce on the GPU leaves the tensor as it was."""
    context = runtime.init(backend="nccl")
    tensor = torch.arange(4.0, device=context.device)
    torch.distributed.all_reduce(tensor)
    result = {"backend": context.backend, "device": str(context.device), "sum": tensor.sum().item()}
    runtime.shutdown()
    return result


def _anatomy_of(wrapped: nn.Module, device: torch.device, *, batch: int, width: int):
    """Five recorded steps (after three warm ones) of ``wrapped``: the benchmarks' SGD step."""
    from course_lib.observe import profiling
    from course_lib.tools.bench import training_step

    generator = torch.Generator(device=device).manual_seed(runtime.rank())
    inputs, targets = (torch.randn(batch, width, device=device, generator=generator) for _ in range(2))
    return profiling.record_steps(training_step(wrapped, inputs, targets), steps=5, warmup=3)


def _wide_mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def anatomy_on_cuda() -> dict:
    """One GPU's step recorded with CUDA activities: its kernels are the compute, the parts add up."""
    context = runtime.init(backend="nccl")
    recorded = _anatomy_of(_wide_mlp(2048, 6).to(context.device), context.device, batch=1024, width=2048)
    summary = recorded.summary()
    typical = recorded.typical(0)
    parts = sum(
        getattr(typical, f"{part}_ms")
        for part in ("compute", "exposed_communication", "idle", "host_overhead", "unexplained")
    )
    runtime.shutdown()
    return {
        "device": summary["conditions"]["device"],
        "step_ms": typical.step_ms,
        "parts_ms": parts,
        "compute_share": summary["compute_share"],
        "unexplained_share": summary["unexplained_share"],
    }


def communication_hidden() -> dict:
    """Run under torchrun, a rank per GPU: how much of DDP's and FSDP's communication is hidden.

    A model large enough to hide it: 8 layers of 4096 x 4096 (134 M parameters, 537 MB of fp32
    gradients) on a batch of 4096 per GPU, so that backward's products outlast the collectives.
    """
    from course_lib.parallel.ddp import DataParallel
    from course_lib.parallel.fsdp import FullyShardedDataParallel

    context = runtime.init(backend="nccl")
    width, layers = 4096, 8
    result = {"ranks": context.world_size}
    for name in ("ddp", "fsdp"):
        model = _wide_mlp(width, layers).to(context.device)
        if name == "ddp":
            wrapped = DataParallel(model, bucket_mb=25)
        else:
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=nn.Linear)
        summary = _anatomy_of(wrapped, context.device, batch=4096, width=width).summary()
        result[name] = {
            key: summary[key]
            for key in (
                "step_ms",
                "communication_ms",
                "hidden_communication_ms",
                "exposed_communication_share",
                "unexplained_share",
            )
        } | {"device": summary["conditions"]["device"]}
        del wrapped, model
        torch.cuda.empty_cache()
    runtime.shutdown()
    return result


if __name__ == "__main__":
    result = globals()[sys.argv[1]]()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
