"""One training loop for every strategy: single process, DDP, FSDP.

The loop is the one a student writes on a single GPU; distribution changes only three lines:

1. the model is wrapped (``strategies.wrap_model``) before the optimizer is built;
2. the data loader's ``DistributedSampler`` gives each rank its slice of every global batch,
   and ``set_epoch`` reshuffles it each epoch;
3. metrics computed on a slice (loss, accuracy) are summed over ranks with one all-reduce.

Per step and rank: ``--grad-accum`` forward/backward passes on micro-batches of
``global_batch / (world_size * grad_accum)`` samples, then one optimizer step. Per epoch:
validation on every sample exactly once, one JSON line of metrics, one checkpoint.

Everything a run needs is checked by ``validate_config`` from the environment alone, *before*
the processes meet: a bad flag then stops every rank at once with the same message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from .. import checks, data, models
from ..distributed import comm, runtime
from ..errors import Diverged, UserError
from ..observe import anatomy, faults, flight_recorder, replicas, stragglers
from ..parallel import memory, recompute
from ..parallel.fsdp import OFFLOAD_MODES, SHARDING_STRATEGIES, hybrid_shard_group_size
from ..plan import flops
from . import checkpoint, strategies
from .preemption import Preempted, StopRequests

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


@dataclass(kw_only=True)
class TrainConfig:
    """Every knob of a run; the command-line flags map one to one onto these fields.

    Args:
        strategy: ``"single"`` (one process), ``"ddp"`` or ``"fsdp"``.
        impl: ``"torch"`` (PyTorch's own DDP and FSDP2) or ``"course"`` (``course_lib.parallel``).
        zero_stage: with ``--strategy fsdp --impl course``: 1 or 2 shard the optimizer state (and
            the gradients) with ZeRO, 3 is FSDP.
        sharding: the FSDP sharding strategy (stage 3, ``--impl course``): ``"FULL_SHARD"``,
            ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"`` or ``"NO_SHARD"``.
        hybrid_shard_size: ranks per shard group for HYBRID_SHARD (None: the ranks of a node).
        cpu_offload: the course FSDP's offload: ``"none"``, ``"params"`` or ``"full"``.
        recompute: what each unit keeps for backward (``recompute.POLICIES``): ``"none"``
            (everything), ``"full"`` (its input; the rest is recomputed) or ``"selective"``; with
            any strategy.
        dataset: ``"digits"``, ``"synthetic"`` or ``"cifar10"``.
        data_dir: where CIFAR-10's files are.
        model: ``"digits_cnn"``, ``"cifar_cnn"`` or ``"resnet18"``.
        epochs: passes over the training split.
        global_batch_size: samples per optimizer step over all ranks and accumulation steps.
        lr: the learning rate.
        optimizer: ``"adamw"`` or ``"sgd"`` (with momentum 0.9).
        weight_decay: the optimizer's weight decay.
        clip_grad_norm: clip the whole gradient's 2-norm to this before each step (None: never).
        seed: the seed of the weights and of the data order, the same on every rank.
        precision: ``"fp32"`` or ``"bf16"`` (autocast).
        grad_accum: micro-batches each rank accumulates before a step.
        eval_batch_size: samples per forward when validating.
        checkpoint_dir: where checkpoints are written (None: none are).
        checkpoint_every: also save every N steps (0: only at the end of each epoch).
        resume: ``"latest"`` (the newest in ``checkpoint_dir``) or a checkpoint folder.
        metrics: a JSON-lines file that gets one line per epoch.
        max_steps: stop after this many optimizer steps in total (None: run every epoch).
        workers: data-loading processes per rank.
        progress: show a progress bar on rank 0.
        profile: record the anatomy of ``profile_steps`` steps (after ``PROFILE_WARMUP_STEPS``):
            each rank's trace and the budget (``anatomy.json``) go into this folder.
        profile_steps: how many steps to record with ``profile``.
        check_replicas: every this many steps, check that every rank holds the same weights
            (``replicas.check_replicas``; 0: never); with ``--strategy ddp``.
        straggler_report: a JSON-lines file that gets one line per step: every rank's lateness
            at the step's collectives, its time in them, the slowest rank and what it cost the
            others (``stragglers``); with the course's collectives (``--impl course``).
    """

    strategy: str = "single"
    impl: str = "torch"
    zero_stage: int = 3
    sharding: str = "FULL_SHARD"
    hybrid_shard_size: int | None = None
    cpu_offload: str = "none"
    recompute: str = "none"
    dataset: str = "digits"
    data_dir: str = "data"
    model: str = "digits_cnn"
    epochs: int = 5
    global_batch_size: int = 64
    lr: float = 3e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    seed: int = 0
    precision: str = "fp32"
    grad_accum: int = 1
    eval_batch_size: int = 256
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    metrics: str | None = None
    max_steps: int | None = None
    workers: int = 0
    progress: bool = True
    profile: str | None = None
    profile_steps: int = 3
    straggler_report: str | None = None
    check_replicas: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainResult:
    history: list[dict[str, Any]] = field(default_factory=list)
    global_step: int = 0
    state_dict: dict[str, torch.Tensor] | None = None  # full model weights on rank 0, if requested


def resolve_resume_path(config: TrainConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start."""
    if config.resume is None:
        return None
    if config.resume == "latest":
        if not config.checkpoint_dir:
            raise UserError("--resume latest needs --checkpoint-dir (where to look for checkpoints)")
        return checkpoint.latest_checkpoint(config.checkpoint_dir)  # None: nothing saved yet, start afresh
    return Path(config.resume)


def validate_config(config: TrainConfig, world_size: int, ranks_per_node: int | None = None) -> None:
    """Every check that needs no other process: run it on every rank before they meet.

    Each number must be finite and in its meaningful range, each path must be a folder or a
    file as expected and writable where the run will write: a mistake then stops every rank at
    once with the same one-line message, instead of a traceback from deep inside torch. What a
    run would refuse later (a batch larger than the data, shard groups that do not cut the
    ranks, a checkpoint of another layout) is refused here too, so that ``--dry-run`` refuses
    everything the run itself would.

    Args:
        config: the run.
        world_size: the processes it runs on.
        ranks_per_node: the processes of one node (None: all of them).
    """
    checks.check_int("--epochs", config.epochs, minimum=1)
    checks.check_int("--global-batch-size", config.global_batch_size, minimum=1)
    checks.check_int("--grad-accum", config.grad_accum, minimum=1)
    checks.check_int("eval_batch_size", config.eval_batch_size, minimum=1)
    checks.check_number("--lr", config.lr, above=0, maximum=MAX_LEARNING_RATE)
    checks.check_number("--weight-decay", config.weight_decay, minimum=0)
    if config.clip_grad_norm is not None:
        checks.check_number("--clip-grad-norm", config.clip_grad_norm, above=0)
    checks.check_int("--seed", config.seed, minimum=0, maximum=MAX_SEED)
    if config.max_steps is not None:
        checks.check_int("--max-steps", config.max_steps, minimum=1)
    checks.check_int("--workers", config.workers, minimum=0, maximum=MAX_LOADER_WORKERS)
    checks.check_int("--checkpoint-every", config.checkpoint_every, minimum=0)
    if config.hybrid_shard_size is not None:
        checks.check_int("--hybrid-shard-size", config.hybrid_shard_size, minimum=1, maximum=world_size)
    strategies.check_strategy(config.strategy, config.impl, world_size)
    checks.check_folder_to_read("--data-dir", config.data_dir)
    data.check_data_available(config.dataset, config.data_dir)
    models.check_model_fits_data(config.model, config.dataset, data.INPUT_SHAPES[config.dataset])
    data.per_rank_batch_size(config.global_batch_size, world_size, grad_accum_steps=config.grad_accum)
    steps_per_epoch(config)
    if config.recompute not in recompute.POLICIES:
        raise UserError(
            f"unknown --recompute {config.recompute!r}: choose one of {', '.join(recompute.POLICIES)}"
        )
    if config.precision not in PRECISIONS:
        raise UserError(f"unknown precision {config.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if config.optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {config.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    _check_sharding_flags(config)
    hybrid = ("fsdp", "course", 3, "HYBRID_SHARD")
    if (config.strategy, config.impl, config.zero_stage, config.sharding) == hybrid:
        hybrid_shard_group_size(config.hybrid_shard_size, world_size, ranks_per_node or world_size)
    if config.checkpoint_every and not config.checkpoint_dir:
        raise UserError("--checkpoint-every needs --checkpoint-dir (where to write the checkpoints)")
    if config.checkpoint_dir:
        checks.check_folder_to_write("--checkpoint-dir", config.checkpoint_dir)
    if config.metrics:
        checks.check_file_to_write("--metrics", config.metrics)
    if config.profile:
        checks.check_folder_to_write("--profile", config.profile)
    checks.check_int("--profile-steps", config.profile_steps, minimum=1)
    checks.check_int("--check-replicas", config.check_replicas, minimum=0)
    if config.check_replicas and config.strategy != "ddp":
        raise UserError(
            "--check-replicas compares whole replicas: use it with --strategy ddp (FSDP and ZeRO shard the "
            "weights, so the ranks hold different pieces by design)"
        )
    if config.straggler_report:
        if config.strategy == "single" or config.impl != "course":
            raise UserError(
                "--straggler-report times the collectives the course's own code makes: add --strategy ddp "
                "(or fsdp) --impl course (PyTorch's DDP and FSDP call the transport directly)"
            )
        checks.check_file_to_write("--straggler-report", config.straggler_report)
    if config.resume not in (None, "latest"):
        checks.check_folder_to_read("--resume", config.resume)
    resume_path = resolve_resume_path(config)
    if resume_path is not None:
        meta = checkpoint.read_meta(resume_path)
        checkpoint.check_compatible(meta, config.as_dict(), resume_path)
        checkpoint.check_layout(meta, checkpoint.layout_kind(config.as_dict()), resume_path)
    if config.checkpoint_dir:
        checkpoint.check_folder_for_run(config.checkpoint_dir, resume_path)


EMPTY_EPOCH_SUMS = {"loss_sum": 0.0, "samples": 0.0, "steps": 0, "seconds": 0.0}
"""What an epoch's record adds up over its steps, before the first one."""


def steps_per_epoch(config: TrainConfig) -> int:
    """Optimizer steps in one pass over the training split (the last, incomplete global batch is dropped)."""
    samples = data.train_samples(config.dataset)
    if config.global_batch_size > samples:
        raise UserError(
            f"--global-batch-size {config.global_batch_size} is larger than the {samples} training samples "
            f"of {config.dataset}: use at most {samples}"
        )
    return samples // config.global_batch_size


PROFILE_WARMUP_STEPS = 2
"""Steps a run takes before ``--profile`` records: the first ones pay for allocations and set-up."""

MAX_LEARNING_RATE = 1e6
"""Far above any learning rate that trains; a larger one is a typo (a missing minus in 1e-3)."""
MAX_SEED = 2**32 - 1
"""numpy and Python's ``random`` take seeds up to this; torch's generator takes them too."""
MAX_LOADER_WORKERS = 64
"""Data-loader processes per rank; more would spend the machine's memory on copies of the dataset."""


SHARDING_FLAGS = ("zero_stage", "sharding", "hybrid_shard_size", "cpu_offload")


def _check_sharding_flags(config: TrainConfig) -> None:
    """The sharding flags choose among the course's own implementations: refuse them anywhere else."""
    defaults = TrainConfig()
    changed = [name for name in SHARDING_FLAGS if getattr(config, name) != getattr(defaults, name)]
    if changed and (config.strategy, config.impl) != ("fsdp", "course"):
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise UserError(
            f"{flags} choose(s) among the course's sharded implementations: add --strategy fsdp --impl course"
        )

    if config.zero_stage not in (1, 2, 3):
        raise UserError(
            "--zero-stage must be 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters: FSDP), got "
            f"{config.zero_stage}"
        )
    if config.sharding not in SHARDING_STRATEGIES:
        raise UserError(
            f"unknown --sharding {config.sharding!r}: choose one of {', '.join(SHARDING_STRATEGIES)}"
        )
    if config.cpu_offload not in OFFLOAD_MODES:
        raise UserError(
            f"unknown --cpu-offload {config.cpu_offload!r}: choose one of {', '.join(OFFLOAD_MODES)}"
        )
    fsdp_only = [name for name in changed if name not in ("zero_stage",)]
    if config.zero_stage != 3 and fsdp_only:
        flags = ", ".join("--" + name.replace("_", "-") for name in fsdp_only)
        raise UserError(
            f"{flags} configure FSDP (ZeRO stage 3), but --zero-stage is {config.zero_stage}: drop them or "
            "use --zero-stage 3"
        )
    if config.hybrid_shard_size is not None and config.sharding != "HYBRID_SHARD":
        raise UserError("--hybrid-shard-size needs --sharding HYBRID_SHARD")


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=config.lr, momentum=0.9, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def autocast(device: torch.device, precision: str):
    """bf16 autocast runs matrix products in bfloat16 while the weights stay fp32."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader, device: torch.device, *, precision: str = "fp32"
) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, every sample counted exactly once.

    ``DistributedSampler`` pads the dataset to a multiple of the world size by repeating its first
    samples, and deals positions round-robin: this rank's i-th sample sits at position
    ``rank + i * world_size`` of the padded order, and it is padding if that position is past
    the end of the dataset. Those samples still run through the model (with FSDP every rank
    must run the same number of forwards) but are left out of the sums.

    Args:
        model: the (wrapped) model, the same on every rank.
        loader: this rank's ``data.validation_loader``.
        device: where the model computes.
        precision: ``"fp32"`` or ``"bf16"`` (autocast), as in training.
    """
    was_training = model.training
    model.eval()
    sampler = loader.sampler
    dataset_size = len(loader.dataset)
    position = sampler.rank
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct predictions, samples
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(device, precision):
            logits = model(inputs)
        losses = F.cross_entropy(logits.float(), targets, reduction="none")
        positions = position + sampler.num_replicas * torch.arange(len(targets), device=device)
        real = positions < dataset_size
        position += sampler.num_replicas * len(targets)
        correct = (logits.argmax(dim=1) == targets) & real
        totals += torch.stack([losses[real].double().sum(), correct.double().sum(), real.double().sum()])
    if dist.is_initialized() and runtime.world_size() > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    loss_sum, correct, samples = totals.tolist()
    return {"val_loss": loss_sum / samples, "val_acc": correct / samples, "val_samples": int(samples)}


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process: tensors allocated on the GPU, or the resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10), "cpu_max_rss"


def _reduce_max(value: float, device: torch.device | str = "cpu") -> float:
    if not (dist.is_initialized() and runtime.world_size() > 1):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces only GPU tensors
    comm.all_reduce(tensor, op="max")
    return tensor.item()


def _reduce_sum(tensor: torch.Tensor) -> list[float]:
    """The sum over ranks of ``tensor``, read back as numbers."""
    if dist.is_initialized() and runtime.world_size() > 1:
        comm.all_reduce(tensor)
    return tensor.tolist()


def _gradients_finite(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """Whether every gradient this rank holds is finite (a shard's, for a sharded model), on the device."""
    gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    gradients = [
        grad.to_local() if hasattr(grad, "to_local") else grad for grad in gradients
    ]  # FSDP2's DTensors
    if not gradients:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([torch.isfinite(grad).all().to(device) for grad in gradients]).all()


def _append_metrics(path: str, record: dict[str, Any]) -> None:
    """Append one JSON line, whole or not at all: a line cut short by a full disk is taken back."""
    line = (json.dumps(record) + "\n").encode()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as handle:
            start = handle.tell()
            try:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
            except OSError:
                with contextlib.suppress(OSError):  # a device such as /dev/full cannot be truncated
                    handle.truncate(start)
                raise
    except OSError as error:
        raise UserError(
            f"could not write the metrics to {path} ({error.strerror or error}); the lines written before "
            "are intact: free some space or choose another --metrics file, then rerun with --resume latest"
        ) from None


def _on_first_rank(action) -> None:
    """Run ``action`` on rank 0 only, and stop every rank with its error if it raises ``UserError``.

    Without this, rank 0 would stop alone and the others would wait for it in their next
    collective until the timeout.
    """
    problem = None
    if runtime.is_main():
        try:
            action()
        except UserError as error:
            problem = str(error)
    problem = runtime.from_rank0(problem)
    if problem is not None:
        raise UserError(problem)


class Trainer:
    """Owns the model, optimizer and data of one run; ``fit()`` trains it."""

    def __init__(self, config: TrainConfig, stop_requests: StopRequests | None = None):
        self.config = config
        self.stop_requests = stop_requests  # if given, a stop signal ends training at a step boundary
        self._profiler = (  # --profile: the anatomy of a few warm steps
            anatomy.LoopProfiler(
                config.profile,
                steps=config.profile_steps,
                warmup=PROFILE_WARMUP_STEPS,
                strategy=config.strategy,
                impl=config.impl,
            )
            if config.profile
            else None
        )
        self.process = runtime.process_info()
        validate_config(config, self.process.world_size, self.process.local_world_size)
        self._stragglers = stragglers.StragglerMeter() if config.straggler_report else None
        self.micro_batch = data.per_rank_batch_size(
            config.global_batch_size, self.process.world_size, grad_accum_steps=config.grad_accum
        )

        # The same seed on every rank gives every replica the same initial weights.
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.data = data.load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed)
        model = models.build_model(config.model, num_classes=self.data.num_classes).to(self.process.device)
        # The model's arithmetic per sample, counted once on a shape-only copy: throughput x this
        # is the achieved FLOP/s, and over the GPUs' peak it is MFU (course_lib.plan.flops).
        self.flops_per_sample = flops.training_flops_per_sample(model, tuple(self.data.train[0][0].shape))
        # Recompute before wrapping: the wrappers' hooks then run around the recomputed forward.
        recompute.apply_recomputation(model, policy=config.recompute)
        course_sharded = (config.strategy, config.impl) == ("fsdp", "course")
        # What is sharded, for the metrics: zero1, zero2, or the FSDP sharding strategy.
        self.sharding_label = (
            None
            if config.strategy != "fsdp"
            else (
                f"zero{config.zero_stage}"
                if course_sharded and config.zero_stage < 3
                else config.sharding
                if course_sharded
                else "FULL_SHARD"
            )
        )
        # The sharding flags are only ever set with --strategy fsdp --impl course (validate_config).
        self.model = strategies.wrap_model(
            model,
            strategy=config.strategy,
            impl=config.impl,
            process=self.process,
            zero_stage=config.zero_stage,
            sharding=config.sharding,
            hybrid_shard_size=config.hybrid_shard_size,
            cpu_offload=config.cpu_offload,
        )
        self.optimizer = build_optimizer(self.model, config)
        if config.strategy == "ddp":  # replicas: a flight record, if one is kept, holds their fingerprints
            flight_recorder.watch_replicas(lambda: replicas.fingerprints(strategies.unwrap(self.model)))

        pin = self.process.device.type == "cuda"
        self.train_loader = data.train_loader(
            self.data.train,
            self.micro_batch,
            self.process.rank,
            self.process.world_size,
            faults.sampler_seed(config.seed),  # the run's seed, but under a fault on purpose
            config.workers,
            pin,
        )
        self._last_share: list[int] | None = None  # this rank's samples last epoch (check_epoch_order)
        self.val_loader = data.validation_loader(
            self.data.val,
            config.eval_batch_size,
            self.process.rank,
            self.process.world_size,
            workers=config.workers,
            pin_memory=pin,
        )
        self.steps_per_epoch = steps_per_epoch(config)
        # A fresh run's id, the same on every rank: it names the run's temporary checkpoint folders.
        run_id = runtime.from_rank0(checkpoint.new_run_id())
        self.position = checkpoint.TrainingPosition(config=config.as_dict(), run_id=run_id)
        resume_path = resolve_resume_path(config)
        if resume_path is not None:
            self.position = checkpoint.load(resume_path, self.model, self.optimizer, config.as_dict())
            for group in self.optimizer.param_groups:  # this run's flags, not the saved ones (a lower --lr
                group["lr"], group["weight_decay"] = config.lr, config.weight_decay  # after a divergence)
            self.position.config = config.as_dict()
            runtime.print0(
                f"resumed from {resume_path} at epoch {self.position.epoch + 1}, step "
                f"{self.position.step_in_epoch} of {self.steps_per_epoch}"
            )

    # -- one optimizer step ------------------------------------------------------------------
    def _train_step(self, batches) -> tuple[float, float, bool]:
        """Forward and backward over ``grad_accum`` micro-batches, then one update.

        Returns the loss summed over the global batch's samples, their number (the same on every
        rank) and whether any rank asked to stop. Raises ``Diverged`` on every rank, before the
        update, if any rank's loss or gradient is not finite.

        What a step costs beyond the strategy's own communication: one all-reduce of four numbers
        and one wait for the device (reading its result). The loss stays on the device during the
        micro-batches; reading it after each one would stall a GPU once per micro-batch.
        """
        config, device = self.config, self.process.device
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        samples = 0
        for micro_step in range(config.grad_accum):
            with anatomy.phase("data"):
                inputs, targets = next(batches)
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            last = micro_step == config.grad_accum - 1
            with contextlib.nullcontext() if last else strategies.gradient_sync_skipped(self.model):
                with anatomy.phase("forward"), autocast(device, config.precision):
                    loss = F.cross_entropy(self.model(inputs).float(), targets)
                    loss = faults.poisoned_loss(loss, self.position.global_step)
                with anatomy.phase("backward"):
                    (loss / config.grad_accum).backward()
            loss_sum += loss.detach().double() * len(targets)
            samples += len(targets)
        with anatomy.phase("agree"):  # clipping, finiteness, and the step's one all-reduce
            grad_norm = None
            if config.clip_grad_norm is not None:
                grad_norm = strategies.clip_grad_norm_(self.model, config.clip_grad_norm)
            non_finite = ~_gradients_finite(self.model, device)
            loss_total, samples_total, diverged, stop = self._agree_on_step(loss_sum, samples, non_finite)
        if diverged:
            grad = None if grad_norm is None else float(grad_norm)
            self._stop_diverged(loss_total / samples_total, grad, local_loss=float(loss_sum))
        with anatomy.phase("optimizer"):
            self.optimizer.step()
        faults.corrupt_after(self.model, self.position.global_step)  # a fault on purpose, if one is set
        step = self.position.global_step + 1
        if config.check_replicas and step % config.check_replicas == 0:
            replicas.check_replicas(strategies.unwrap(self.model), step=step)
        return loss_total, samples_total, stop

    def _agree_on_step(
        self, loss_sum: torch.Tensor, samples: int, non_finite: torch.Tensor
    ) -> tuple[float, float, bool, bool]:
        """One all-reduce of four numbers per step, so that every rank takes the same decision at once.

        It sums, over ranks: the loss (a NaN anywhere makes the sum NaN), the samples, the ranks
        that saw a non-finite gradient, and the ranks that received a stop signal (the signal may
        reach them milliseconds apart). Reading the result is the step's one wait for the device.
        Returns (the global batch's loss sum, its samples, diverged, stop).
        """
        stop = self.stop_requests is not None and self.stop_requests.received is not None
        summary = torch.stack(
            [
                loss_sum,
                torch.tensor(float(samples), dtype=torch.float64, device=loss_sum.device),
                non_finite.to(torch.float64),
                torch.tensor(1.0 if stop else 0.0, dtype=torch.float64, device=loss_sum.device),
            ]
        )
        loss_total, samples_total, non_finite_ranks, stopping_ranks = _reduce_sum(summary)
        diverged = non_finite_ranks > 0 or not math.isfinite(loss_total / samples_total)
        return loss_total, samples_total, diverged, stopping_ranks > 0

    def _stop_diverged(self, step_loss: float, grad_norm: float | None, *, local_loss: float) -> None:
        """Record the divergence, tell the user what to try, and stop (no update, no checkpoint).

        ``local_loss``: this rank's own loss, before any rank's was summed: the ranks compare them
        (one all-gather, on this path only) to say where a non-finite loss came from.
        """
        config, position = self.config, self.position
        step = position.global_step + 1
        what = (
            f"the loss is {step_loss}"
            if not math.isfinite(step_loss)
            else f"the loss is {step_loss:.4g} but a gradient is not finite"
        )
        if self.process.world_size > 1:
            finite = [None] * self.process.world_size
            torch.distributed.all_gather_object(finite, math.isfinite(local_loss))
            if not all(finite) and any(finite):
                bad = [rank for rank, ok in enumerate(finite) if not ok]
                what += (
                    f", first on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} (the others' "
                    "losses were finite: look at the batch that rank drew)"
                )
        if grad_norm is not None:
            what += f" (gradient norm {grad_norm:.4g})"
        tries = [f"a lower --lr (this run: {config.lr:g})"]
        tries.append(
            f"a smaller --clip-grad-norm (this run: {config.clip_grad_norm:g})"
            if config.clip_grad_norm
            else "--clip-grad-norm 1.0"
        )
        if config.precision != "fp32":
            tries.append("--precision fp32")
        saved = checkpoint.latest_checkpoint(config.checkpoint_dir) if config.checkpoint_dir else None
        # Resuming the newest checkpoint replays the same batch, so an older one may be the way back;
        # its run then needs a folder of its own, where the newer checkpoint cannot be taken for its own.
        resume = (
            f"; the checkpoints from before it are kept: the newest is {saved} (--resume latest), an older "
            f"one resumes with --resume {saved.parent}/step-XXXXXXXX and a new --checkpoint-dir"
            if saved
            else ""
        )
        if config.metrics:
            record = {
                "event": "diverged",
                "epoch": position.epoch + 1,
                "step": step,
                "loss": repr(step_loss),
                "grad_norm": grad_norm,
                "lr": config.lr,
            }
            _on_first_rank(lambda: _append_metrics(config.metrics, record))
        raise Diverged(
            f"training diverged at step {step} (epoch {position.epoch + 1}): {what}; try "
            f"{', '.join(tries[:-1])} or {tries[-1]}{resume}"
        )

    def _save(self) -> None:
        if self.config.checkpoint_dir:
            checkpoint.save(self.config.checkpoint_dir, self.model, self.optimizer, self.position)

    def _stop_for_requeue(self) -> None:
        """A stop signal arrived: checkpoint this step (if there is somewhere to) and leave."""
        if self.config.checkpoint_dir:
            self._save()
            where = (
                f"checkpoint written to {self.config.checkpoint_dir}; rerun with --resume latest to continue"
            )
        else:
            where = "no --checkpoint-dir, so nothing was saved"
        raise Preempted(
            f"stopped by {self.stop_requests.name()} after step {self.position.global_step}: {where}"
        )

    def _steps_left(self) -> int:
        if self.config.max_steps is None:
            return math.inf
        return self.config.max_steps - self.position.global_step

    def _train_epoch(self, epoch: int) -> dict[str, Any] | None:
        """Train the rest of ``epoch``; return its metrics record (None if nothing was left to do)."""
        config, position = self.config, self.position
        first_step = position.step_in_epoch
        last_step = min(self.steps_per_epoch, first_step + self._steps_left())
        if last_step <= first_step:
            return None
        sampler = self.train_loader.sampler
        if not faults.skips_set_epoch(epoch):  # a fault on purpose leaves it out
            sampler.set_epoch(epoch, skip=first_step * self.micro_batch * config.grad_accum)
        if self.process.world_size > 1:  # disjoint shares, a new order: one all-gather of indices
            self._last_share = data.check_epoch_order(sampler, epoch=epoch, previous=self._last_share)
        batches = iter(self.train_loader)
        bar = tqdm(
            total=self.steps_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch + 1}/{config.epochs}",
            disable=not (self.process.is_main and config.progress),
            leave=False,
            dynamic_ncols=True,
            mininterval=0.5,
            file=sys.stderr,
        )
        if self.process.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.process.device)
        # What the epoch's metrics add up; a resumed epoch goes on from what the checkpoint had summed.
        sums = dict(EMPTY_EPOCH_SUMS) | (position.epoch_sums if first_step else {})
        seconds_before = sums["seconds"]
        started = time.perf_counter()
        for step in range(first_step, last_step):
            with (
                self._profiler.step() if self._profiler else contextlib.nullcontext(),
                self._stragglers.step(position.global_step) if self._stragglers else contextlib.nullcontext(),
            ):
                step_loss, step_samples, stop = self._train_step(batches)
            if self._stragglers is not None and self._stragglers.reports:  # rank 0: this step's line
                _append_metrics(self.config.straggler_report, self._stragglers.reports[-1].as_dict())
            if self._profiler is not None and self._profiler.complete:
                self._finish_profile()
            sums["loss_sum"] += step_loss
            sums["samples"] += step_samples
            sums["steps"] += 1
            sums["seconds"] = seconds_before + time.perf_counter() - started
            position.epoch_sums = dict(sums)
            position.step_in_epoch, position.global_step = step + 1, position.global_step + 1
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss / step_samples:.4f}", refresh=False)
            if (
                config.checkpoint_every
                and position.global_step % config.checkpoint_every == 0
                and step + 1 < last_step
            ):
                self._save()
            if stop:
                bar.close()
                self._stop_for_requeue()
        if self.process.device.type == "cuda":
            torch.cuda.synchronize(self.process.device)
        # the slowest rank sets the pace (a resumed epoch: the time before the stop, plus this part)
        epoch_time = _reduce_max(seconds_before + time.perf_counter() - started, self.process.device)
        bar.close()
        steps = int(sums["steps"])
        peak_mb, peak_kind = peak_memory_mb(self.process.device)
        record = {
            "epoch": epoch + 1,
            "strategy": config.strategy,
            "impl": config.impl,
            "sharding": self.sharding_label,
            "world_size": self.process.world_size,
            "global_batch_size": config.global_batch_size,
            "micro_batch_size": self.micro_batch,
            "grad_accum": config.grad_accum,
            "dataset": config.dataset,
            "model": config.model,
            "precision": config.precision,
            "device": self.process.device.type,
            "backend": self.process.backend,
            "steps": steps,
            # False when --max-steps ended it early: its numbers then describe only those steps
            "epoch_complete": position.step_in_epoch == self.steps_per_epoch,
            "epoch_time_s": epoch_time,
            "samples_per_s": steps * config.global_batch_size / epoch_time,
            "train_loss": sums["loss_sum"] / sums["samples"],
        }
        if first_step:  # stopped and resumed inside this epoch: the sums above still cover all of it
            record["resumed_at_step"] = first_step
        record["model_tflops"] = self.flops_per_sample * record["samples_per_s"] / 1e12
        peak = flops.peak_tflops(self.process.device, flops.matmul_precision(config.precision))
        record["mfu"] = (
            None
            if peak is None
            else flops.model_flops_utilization(
                flops_per_sample=self.flops_per_sample,
                samples_per_s=record["samples_per_s"],
                gpus=self.process.world_size,
                peak_tflops_per_gpu=peak,
            )
        )
        record.update(evaluate(self.model, self.val_loader, self.process.device, precision=config.precision))
        record["peak_mem_mb"] = _reduce_max(peak_mb, self.process.device)
        record["peak_mem_kind"] = peak_kind
        # What sharding divides by N, on any device: on a CPU the peak above is the process's
        # resident memory, mostly PyTorch's own runtime, and hardly moves with N.
        held = memory.measure_model_states(self.model, optimizer=self.optimizer).total
        record["model_state_mb"] = _reduce_max(held / 2**20, self.process.device)
        if position.step_in_epoch == self.steps_per_epoch:
            position.epoch, position.step_in_epoch, position.epoch_sums = epoch + 1, 0, {}
        return record

    def _finish_profile(self) -> None:
        """Every rank: the budgets of the steps ``--profile`` recorded; rank 0 says where they are."""
        if self._profiler is None:
            return
        result = self._profiler.finish()
        if result is not None and self.process.is_main:
            tqdm.write(result.table(), file=sys.stdout)
            tqdm.write(
                f"the anatomy of {len(result.budgets[0])} steps is in {self.config.profile}/anatomy.json, "
                "each rank's trace beside it (open it in https://ui.perfetto.dev or chrome://tracing)",
                file=sys.stdout,
            )

    def fit(self, collect_state: bool = False) -> TrainResult:
        config, position = self.config, self.position
        runtime.print0(
            f"training {config.model} on {config.dataset}: strategy {config.strategy} "
            f"({config.impl}{', ' + self.sharding_label if self.sharding_label else ''}), "
            f"{self.process.world_size} rank(s) on {self.process.device.type}/{self.process.backend}, "
            f"global batch {config.global_batch_size} = {self.process.world_size} x {config.grad_accum} "
            f"x {self.micro_batch}, "
            f"{self.steps_per_epoch} steps per epoch"
        )
        for epoch in range(position.epoch, config.epochs):
            record = self._train_epoch(epoch)
            if record is None:
                break
            position.history.append(record)
            if config.metrics:
                _on_first_rank(lambda: _append_metrics(config.metrics, record))
            if self.process.is_main:
                tqdm.write(
                    f"epoch {record['epoch']}/{config.epochs}: train loss {record['train_loss']:.4f}, val "
                    f"loss {record['val_loss']:.4f}, val acc {record['val_acc']:.2%}, "
                    f"{record['epoch_time_s']:.2f} s, {record['samples_per_s']:.0f} samples/s",
                    file=sys.stdout,
                )
                sys.stdout.flush()
            self._save()
            if self._steps_left() <= 0:
                break
        self._finish_profile()  # a run shorter than the steps asked for: what was recorded
        if self._stragglers is not None and self.process.is_main:
            report = config.straggler_report
            tqdm.write(
                f"{stragglers.describe(self._stragglers.reports)} (every step: {report}; plot: "
                f"python -m course_lib.tools.stragglers {report} --plot stragglers.png)",
                file=sys.stdout,
            )
        result = TrainResult(history=list(position.history), global_step=position.global_step)
        if collect_state:
            if hasattr(self.model, "full_state_dict"):  # the course's ZeRO and FSDP
                result.state_dict = self.model.full_state_dict()
            else:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

                options = StateDictOptions(full_state_dict=True, cpu_offload=True)
                result.state_dict = get_model_state_dict(strategies.unwrap(self.model), options=options)
        return result


def train(config: TrainConfig, *, collect_state: bool = False, stop_on_signals: bool = False) -> TrainResult:
    """Train with ``config`` inside an initialised process group (see ``runtime.init``).

    The model and optimizer live only inside this call, so they are freed when it returns,
    before ``runtime.shutdown()`` destroys the process group. With ``stop_on_signals``, SIGUSR1 or
    SIGTERM stop training at the next step boundary with a checkpoint (``preemption.Preempted``).

    Args:
        config: the run.
        collect_state: also return the full trained weights (on rank 0), for comparisons.
        stop_on_signals: stop at a step boundary, checkpointed, on SIGUSR1 or SIGTERM.
    """
    stop_requests = StopRequests() if stop_on_signals else None
    try:
        return Trainer(config, stop_requests).fit(collect_state=collect_state)
    finally:
        if stop_requests is not None:
            stop_requests.restore()
