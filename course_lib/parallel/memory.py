"""Where the memory goes: model states, and what sharding them saves (the ZeRO paper's model).

Training a model of Ψ parameters with mixed-precision Adam keeps, per parameter:

- 2 bytes of fp16/bf16 parameters (what forward and backward compute with),
- 2 bytes of fp16/bf16 gradients,
- K = 12 bytes of optimizer state: an fp32 master copy of the weights and Adam's two fp32
  moments (4 + 4 + 4).

That is 16Ψ bytes: 120 GB for a 7.5B-parameter model, before a single activation. Data
parallelism (DDP) keeps all of it on *every* rank. ZeRO removes the redundancy stage by stage,
each rank keeping 1/N of:

==========  =======  ============================  ====================================
sharding    stage    bytes per rank                7.5B parameters, N = 64, K = 12
==========  =======  ============================  ====================================
``ddp``     DDP      (2 + 2 + K) Ψ                 120 GB
``zero1``   ZeRO-1   (2 + 2) Ψ + K Ψ / N           31.4 GB  (optimizer states sharded)
``zero2``   ZeRO-2   2 Ψ + (2 + K) Ψ / N           16.6 GB  (+ gradients)
``fsdp``    ZeRO-3   (2 + 2 + K) Ψ / N             1.9 GB   (+ parameters)
==========  =======  ============================  ====================================

The first column is the course's one name for each (``SHARDINGS``): the same word in a
``Layout``, the trainer's ``--sharding``, the planner and the labs. ZeRO-3 goes by its
framework's name, FSDP, as in PyTorch and torchtitan.

Traffic per step and rank, in parameter-sized messages: DDP all-reduces the gradients, about
2Ψ elements (a reduce-scatter plus an all-gather); ZeRO-1 and ZeRO-2 move the same 2Ψ (a
reduce-scatter of gradients, an all-gather of updated parameters); ZeRO-3 gathers the
parameters twice (forward and backward) and reduce-scatters the gradients: 3Ψ, 1.5 times DDP.
Multiply by the element size of what travels (2 bytes in mixed precision, 4 in fp32) and by
(N-1)/N for the exact ring figure.

``measure_model_states`` counts what a rank really holds (the local shard of a sharded
parameter, gradients, optimizer state), so any wrapper can be checked against the model.

Paper: Rajbhandari, Rasley, Ruwase and He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020 (arXiv:1910.02054), section 3 (the 16Ψ and its table); the 7.5B
example is theirs.
"""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..checks import check_choice

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp")
"""What the data axis shards, in order: nothing, the optimizer state, and the gradients, and the
parameters (``fsdp`` is ZeRO stage 3). The course's one vocabulary for it (the table above)."""
MIXED_PRECISION_ADAM = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}  # two fp32 moments, no master copy


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state held by one rank."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


# #region zero-memory
def model_state_bytes(
    num_params: float,
    world_size: int,
    sharding: str,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> ModelStateBytes:
    """Bytes per rank for ``sharding`` with Ψ = ``num_params``: the table above, for any element sizes.

    Args:
        num_params: Ψ, the model's parameter count.
        world_size: N, the ranks the states are sharded over.
        sharding: ``"ddp"`` (nothing sharded), ``"zero1"`` (optimizer state), ``"zero2"``
            (+ gradients) or ``"fsdp"`` (+ parameters: ZeRO-3).
        param_bytes: bytes per parameter element (2 in bf16/fp16, 4 in fp32).
        grad_bytes: bytes per gradient element.
        optimizer_bytes: bytes of optimizer state per parameter, K (12 for mixed-precision Adam:
            fp32 master weights and two moments; 8 for fp32 Adam).
    """
    check_choice("sharding", sharding, SHARDINGS)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    shard = 1 / world_size
    sharded = {
        "ddp": (),
        "zero1": ("optimizer",),
        "zero2": ("optimizer", "grads"),
        "fsdp": ("optimizer", "grads", "params"),
    }[sharding]
    return ModelStateBytes(
        params=num_params * param_bytes * (shard if "params" in sharded else 1),
        grads=num_params * grad_bytes * (shard if "grads" in sharded else 1),
        optimizer=num_params * optimizer_bytes * (shard if "optimizer" in sharded else 1),
    )


def traffic_elements_per_rank(num_params: float, world_size: int, sharding: str) -> float:
    """Elements each rank sends per step with ring collectives: 2(N-1)/N Ψ, or 3(N-1)/N Ψ for FSDP.

    Args:
        num_params: Ψ, the model's parameter count.
        world_size: N, the data-parallel ranks.
        sharding: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
    """
    check_choice("sharding", sharding, SHARDINGS)
    passes = 3 if sharding == "fsdp" else 2
    return passes * (world_size - 1) / world_size * num_params


# #endregion zero-memory


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor stored on this rank (a DTensor's local shard, or the tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = _local(tensor)
    return local.numel() * local.element_size()


def _storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct memory blocks behind ``tensors``: views of a buffer count once, freed ones 0."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure_model_states(
    model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state that this rank holds right now.

    For a plain model (or DDP, FSDP2) that is its parameters and their gradients. The course's
    ZeRO and FSDP wrappers hide the full parameters from ``parameters()`` (the optimizer must only
    see the shards), so they list what they hold in ``memory_tensors()``, and the memory behind
    those tensors is counted.

    Args:
        model: a plain module, or one wrapped by DDP, FSDP2, or the course's ZeRO and FSDP.
        optimizer: its optimizer, whose state tensors are counted (None: count no optimizer state).
    """
    optimizer_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optimizer_bytes += sum(
                _bytes(value) for value in state.values() if isinstance(value, torch.Tensor)
            )
    if hasattr(model, "memory_tensors"):
        held = model.memory_tensors()
        return ModelStateBytes(_storage_bytes(held["params"]), _storage_bytes(held["grads"]), optimizer_bytes)
    params = list(model.parameters())
    return ModelStateBytes(
        params=sum(_bytes(p) for p in params),
        grads=sum(_bytes(p.grad) for p in params),
        optimizer=optimizer_bytes,
    )


def shardings_that_fit(
    num_params: float,
    gpu_memory_bytes: float,
    world_size: int,
    *,
    reserve_fraction: float = 0.2,
    **bytes_per_element,
) -> dict[str, bool]:
    """Which shardings keep the model states inside ``gpu_memory_bytes``, leaving ``reserve_fraction``
    of it for activations, temporary buffers and the framework itself.

    Args:
        num_params: Ψ, the model's parameter count.
        gpu_memory_bytes: the memory of one device.
        world_size: N, the ranks the states are sharded over.
        reserve_fraction: the part of the memory kept for everything but model states.
        bytes_per_element: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` as in
            ``model_state_bytes`` (mixed-precision Adam by default).
    """
    budget = gpu_memory_bytes * (1 - reserve_fraction)
    return {
        sharding: model_state_bytes(num_params, world_size, sharding, **bytes_per_element).total <= budget
        for sharding in SHARDINGS
    }


class saved_tensor_bytes:
    """Count the bytes autograd keeps for the backward of what runs inside the ``with`` block.

    Every tensor saved for backward (by PyTorch's operations or by a custom autograd function)
    is counted once per storage: the activation memory of that piece of the model.

    >>> with saved_tensor_bytes() as saved:
    ...     loss = model(x).sum()
    >>> saved.bytes

    Args:
        ignore: tensors not to count when saved (the parameters: they are held anyway; DTensors
            count by the local tensor they wrap).
    """

    def __init__(self, *, ignore=()):
        self._ignored = {_local(tensor).untyped_storage().data_ptr() for tensor in ignore}

    def __enter__(self) -> saved_tensor_bytes:
        import torch

        self.bytes, self._seen, self._held = 0, set(self._ignored), []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def _pack(self, tensor):
        with torch.no_grad():
            local = _local(tensor)  # a DTensor: count the tensor it wraps, give autograd the DTensor back
        storage = local.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
            self._held.append(local)  # so that its memory is not freed and reused by a later tensor
        return tensor

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._held.clear()


class live_tensor_bytes(TorchDispatchMode):
    """Bytes of the tensors created inside the ``with`` block that are still alive: now and at the peak.

    The CPU's stand-in for ``torch.cuda.memory_allocated`` and ``max_memory_allocated``. Every
    operation's result is seen as it is made (a ``TorchDispatchMode``); a result in new memory
    (not a view of, or written into, one of the operation's inputs) adds its bytes, and they are
    taken off again when that memory is freed. What it counts is what the allocator holds for
    this code, whoever keeps it alive: autograd's saved tensors, but also a checkpoint's stored
    inputs, a selective checkpoint's cache, a pipeline's in-flight micro-batches, and the
    temporaries that make the peak. Tensors made before the block (parameters, the batch) are
    not counted, and neither are views of them.

    >>> with live_tensor_bytes() as live:
    ...     loss = model(x).sum()        # live.now: what the forward left alive for backward
    ...     loss.backward()              # live.peak: the most held at any moment

    The count is exact but slow (a Python call per operation): measure with it, never time.

    Args:
        timeline: also keep every allocation and free as ``events``, ``(operation, "alloc" or
            "free", address, bytes)`` with ``operation`` the number of operations run so far, and
            ``mark(label)``'s labels in ``marks``: the CPU's stand-in for
            ``torch.cuda.memory._record_memory_history`` (what ``tools.evidence.gpu_check`` draws).
    """

    def __init__(self, *, timeline: bool = False):
        super().__init__()
        self.timeline = timeline
        self.events: list[tuple[int, str, int, int]] = []
        self.marks: list[tuple[int, str]] = []
        self._operations = 0

    def mark(self, label: str) -> None:
        """Note that the step reaches ``label`` here (a phase's start), for the timeline."""
        self.marks.append((self._operations, label))

    def __enter__(self) -> live_tensor_bytes:
        # Collect earlier code's cyclic garbage now (it costs ~0.2 s), not by chance in the middle
        # of the count, which measured up to one tensor more, on some runs only, when it did.
        gc.collect()
        self._alive = self.peak = 0
        self._counted: set[int] = set()
        self._collective_since_read = False
        return super().__enter__()

    @property
    def now(self) -> int:
        """Bytes alive now.

        Two things free memory a moment late, and the count waits for both, so that it does not
        depend on when they happen: a tensor only a reference cycle holds (Python's collector is
        run on the young objects), and a tensor a collective used (gloo's worker thread lets go of
        it just after the collective completes: after a collective, the count is read every 2 ms
        until it has held still for 20 ms, for at most a second).
        """
        gc.collect(1)  # the young generations, where this code's garbage is (a full collection: 0.2 s)
        if self._collective_since_read:
            self._collective_since_read = False
            still, before, deadline = 0, self._alive, time.monotonic() + 1.0
            while still < 10 and time.monotonic() < deadline:  # 20 ms without a change
                time.sleep(0.002)
                gc.collect(0)
                still = still + 1 if self._alive == before else 0
                before = self._alive
        return self._alive

    def reset_peak(self) -> None:
        """Start the peak again from what is alive now (as ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self._operations += 1
        if func.namespace in ("c10d", "_c10d_functional"):
            self._collective_since_read = True
        inputs = {
            _local(t).untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in pytree.tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                storage = _local(tensor).untyped_storage()
                address, size = storage.data_ptr(), storage.nbytes()
                if size and address not in inputs and address not in self._counted:
                    self._counted.add(address)
                    self._alive += size
                    self.peak = max(self.peak, self._alive)
                    weakref.finalize(storage, self._freed, address, size)
                    if self.timeline:
                        self.events.append((self._operations, "alloc", address, size))
        return result

    def _freed(self, address: int, size: int) -> None:
        if address in self._counted:
            self._counted.discard(address)
            self._alive -= size
            if self.timeline:
                self.events.append((self._operations, "free", address, size))
