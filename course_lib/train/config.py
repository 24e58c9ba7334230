"""What a training run is: one ``TrainConfig``, and every rule it follows, checked before the ranks meet.

Everything a run needs is checked by ``validate_config`` from the environment alone (the world
size, the ranks per node, the data's size): a bad flag then stops every rank at once, with the
same one-line message naming the fix, before any of them waits for another. The command line
(``cli.py``) is built from the same fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import checks, data, models
from ..errors import UserError
from ..observe import faults
from ..parallel import recompute
from ..parallel.fsdp_units import OFFLOAD_MODES, SHARDING_STRATEGIES, hybrid_shard_group_size
from ..plan import layout
from . import checkpoint, wrappers

OPTIMIZERS = ("adamw", "sgd")
TRAINER_PRECISIONS = tuple(
    precision for precision in layout.PRECISIONS if precision not in layout.FLOAT8_PRECISIONS
)
"""The precisions the trainer runs: the layouts' (``plan.layout.PRECISIONS``) but float8's, whose
products are the planner's and a GPU's (``parallel.float8``)."""
JSON_LINES = (".jsonl", ".json")
"""What the names of the files that get one JSON line per epoch or step end in."""


@dataclass(kw_only=True)
class TrainConfig:
    """Every knob of a run; the command-line flags map one to one onto these fields.

    Args:
        sharding: ``"single"`` (one process), or what the ranks shard (``parallel.memory.SHARDINGS``):
            ``"ddp"`` (nothing), ``"zero1"`` (optimizer state), ``"zero2"`` (and gradients) or
            ``"fsdp"`` (and parameters); zero1 and zero2 with ``--impl course``.
        impl: ``"torch"`` (PyTorch's own DDP and FSDP2) or ``"course"`` (``course_lib.parallel``).
        dataset: ``"digits"``, ``"synthetic"`` or ``"cifar10"``.
        data_dir: where CIFAR-10's files are.
        model: ``"digits_cnn"``, ``"cifar_cnn"`` or ``"resnet18"``.
        sharding_strategy: the course FSDP's, in PyTorch FSDP's names (``--sharding fsdp --impl
            course``): ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"`` or ``"NO_SHARD"``.
        hybrid_shard_size: ranks per shard group for HYBRID_SHARD (None: the ranks of a node).
        cpu_offload: the course FSDP's offload: ``"none"``, ``"params"`` or ``"full"``.
        epochs: passes over the training split.
        global_batch_size: samples per optimizer step over all ranks and accumulation steps.
        lr: the learning rate.
        optimizer: ``"adamw"`` or ``"sgd"`` (with momentum 0.9).
        weight_decay: the optimizer's weight decay.
        clip_grad_norm: clip the whole gradient's 2-norm to this before each step (None: never).
        seed: the seed of the weights and of the data order, the same on every rank.
        precision: ``"fp32"`` or ``"bf16"`` (autocast).
        recomputation: what each unit keeps for backward (``recompute.POLICIES``): ``"none"``
            (everything), ``"full"`` (its input; the rest is recomputed) or ``"selective"``; with
            any sharding.
        grad_accum: micro-batches each rank accumulates before a step.
        eval_batch_size: samples per forward when validating.
        max_steps: stop after this many optimizer steps in total (None: run every epoch).
        workers: data-loading processes per rank (started from a forkserver, ``data.LOADER_START``:
            a script that trains with them needs the ``if __name__ == "__main__":`` guard).
        checkpoint_dir: where checkpoints are written (None: none are).
        checkpoint_every: also save every N steps (0: only at the end of each epoch), or ``auto``:
            at Daly's interval (``checkpoint_interval``), from a first save after
            ``AUTO_FIRST_SAVE_STEP`` steps that measures what a save and a step cost, and ``mtbf_hours``.
        checkpoint_mode: ``blocking`` (training waits while a checkpoint is written) or ``async``
            (the state is copied to host memory and written in the background:
            ``async_checkpoint.AsyncSaves``).
        mtbf_hours: the job's mean time between failures in hours, for ``--checkpoint-every auto``
            (one GPU's, about 50,700 hours on Llama 3's run, over the job's GPUs).
        resume: ``"latest"`` (the newest in ``checkpoint_dir``) or a checkpoint folder.
        metrics: a JSON-lines file that gets one line per epoch.
        profile: record the anatomy of ``profile_steps`` steps (after ``PROFILE_WARMUP_STEPS``):
            each rank's trace and the budget (``anatomy.json``) go into this folder.
        profile_steps: how many steps to record with ``profile``.
        check_replicas: every this many steps, check that every rank holds the same weights
            (``replicas.check_replicas``; 0: never); with ``--sharding ddp``.
        straggler_report: a JSON-lines file that gets one line per step: every rank's lateness
            at the step's collectives, its time in them, the slowest rank and what it cost the
            others (``stragglers``); with the course's collectives (``--impl course``).
        progress: show a progress bar on rank 0.
    """

    sharding: str = "single"
    impl: str = "torch"
    dataset: str = "digits"
    data_dir: str = "data"
    model: str = "digits_cnn"
    sharding_strategy: str = "FULL_SHARD"
    hybrid_shard_size: int | None = None
    cpu_offload: str = "none"
    epochs: int = 5
    global_batch_size: int = 64
    lr: float = 3e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    seed: int = 0
    precision: str = "fp32"
    recomputation: str = "none"
    grad_accum: int = 1
    eval_batch_size: int = 256
    max_steps: int | None = None
    workers: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int | str = 0
    checkpoint_mode: str = "blocking"
    mtbf_hours: float | None = None
    resume: str | None = None
    metrics: str | None = None
    profile: str | None = None
    profile_steps: int = 3
    check_replicas: int = 0
    straggler_report: str | None = None
    progress: bool = True

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CHECKPOINT_MODES = ("blocking", "async")
"""How a checkpoint is written: the training waiting, or in the background
(``async_checkpoint.AsyncSaves``)."""

CHOICES = {
    "sharding": wrappers.TRAINER_SHARDINGS,
    "impl": wrappers.IMPLEMENTATIONS,
    "sharding_strategy": SHARDING_STRATEGIES,
    "cpu_offload": OFFLOAD_MODES,
    "recomputation": recompute.POLICIES,
    "dataset": data.DATASETS,
    "model": models.IMAGE_MODELS,
    "optimizer": OPTIMIZERS,
    "precision": TRAINER_PRECISIONS,
    "checkpoint_mode": CHECKPOINT_MODES,
}
"""The fields that take one of a few values, and those values, each defined by the module that owns
it; the command line offers exactly these (``cli.build_parser``)."""


def resolve_resume_path(config: TrainConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start."""
    if config.resume is None:
        return None
    if config.resume == "latest":
        if not config.checkpoint_dir:
            raise UserError("--resume latest needs --checkpoint-dir (where to look for checkpoints)")
        return checkpoint.latest_checkpoint(config.checkpoint_dir)  # None: nothing saved yet, start afresh
    return Path(config.resume)


AUTO_FIRST_SAVE_STEP = 3
"""With ``--checkpoint-every auto``, the step after which a first save measures what saving costs."""


MAX_MTBF_HOURS = 1e6
"""The longest mean time between failures ``--mtbf-hours`` takes: 114 years, beyond any job."""


def _check_checkpoint_interval(config: TrainConfig) -> None:
    """``--checkpoint-every`` is N >= 0, or ``auto`` with ``--mtbf-hours`` above 0 (and only then)."""
    if config.checkpoint_every == "auto":
        if config.mtbf_hours is None:
            raise UserError(
                "--checkpoint-every auto needs --mtbf-hours (the job's mean time between failures, e.g. "
                "50700 / the job's GPUs at Llama 3's failure rate)"
            )
        # a century and more between failures: beyond it the interval overflows (hours to seconds)
        checks.check_number("--mtbf-hours", config.mtbf_hours, above=0, maximum=MAX_MTBF_HOURS)
        return
    if isinstance(config.checkpoint_every, str):
        raise UserError(
            f"--checkpoint-every must be a whole number of steps or auto, got {config.checkpoint_every!r}"
        )
    checks.check_int("--checkpoint-every", config.checkpoint_every, minimum=0)
    if config.mtbf_hours is not None:
        raise UserError(
            "--mtbf-hours is used by --checkpoint-every auto only: add it, or leave --mtbf-hours out"
        )


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
    faults.check_environment(world_size)  # a fault for a rank the run lacks would never fire
    checks.check_int("--epochs", config.epochs, minimum=1)
    checks.check_int("--global-batch-size", config.global_batch_size, minimum=1)
    checks.check_int("--grad-accum", config.grad_accum, minimum=1)
    checks.check_int("eval_batch_size", config.eval_batch_size, minimum=1)
    checks.check_number("--lr", config.lr, above=0, maximum=checks.MAX_LEARNING_RATE)
    checks.check_number("--weight-decay", config.weight_decay, minimum=0)
    if config.lr * config.weight_decay > 1:  # AdamW and SGD scale every weight by 1 - lr x weight decay
        raise UserError(
            f"--weight-decay {config.weight_decay:g} with --lr {config.lr:g} takes more than the whole "
            f"weight each step (lr x weight decay = {config.lr * config.weight_decay:g} > 1): choose at "
            f"most {1 / config.lr:g}"
        )
    if config.clip_grad_norm is not None:
        checks.check_number("--clip-grad-norm", config.clip_grad_norm, above=0)
    checks.check_int("--seed", config.seed, minimum=0, maximum=checks.MAX_SEED)
    if config.max_steps is not None:
        checks.check_int("--max-steps", config.max_steps, minimum=1)
    checks.check_int("--workers", config.workers, minimum=0, maximum=MAX_LOADER_WORKERS)
    _check_checkpoint_interval(config)
    if config.hybrid_shard_size is not None:
        checks.check_int("--hybrid-shard-size", config.hybrid_shard_size, minimum=1, maximum=world_size)
    wrappers.check_sharding(config.sharding, config.impl, world_size)
    checks.check_folder_to_read("--data-dir", config.data_dir)
    data.check_data_available(config.dataset, config.data_dir)
    models.check_model_fits_data(config.model, config.dataset, data.INPUT_SHAPES[config.dataset])
    data.per_rank_batch_size(config.global_batch_size, world_size, grad_accum_steps=config.grad_accum)
    steps_per_epoch(config)
    checks.check_choice("--recomputation", config.recomputation, recompute.POLICIES)
    checks.check_choice("precision", config.precision, TRAINER_PRECISIONS)
    checks.check_choice("optimizer", config.optimizer, OPTIMIZERS)
    _check_fsdp_flags(config)
    if (config.sharding, config.impl, config.sharding_strategy) == ("fsdp", "course", "HYBRID_SHARD"):
        hybrid_shard_group_size(config.hybrid_shard_size, world_size, ranks_per_node or world_size)
    if config.checkpoint_every and not config.checkpoint_dir:
        raise UserError("--checkpoint-every needs --checkpoint-dir (where to write the checkpoints)")
    if config.checkpoint_mode != "blocking" and not config.checkpoint_dir:
        raise UserError(
            f"--checkpoint-mode {config.checkpoint_mode} changes how checkpoints are written, and this run "
            "writes none: add --checkpoint-dir, or leave --checkpoint-mode out"
        )
    _check_observers(config)
    if config.resume not in (None, "latest"):
        checks.check_folder_to_read("--resume", config.resume)
    resume_path = resolve_resume_path(config)
    if resume_path is not None:
        meta = checkpoint.read_meta(resume_path)
        checkpoint.check_compatible(meta, config.as_dict(), resume_path)
        checkpoint.check_layout(meta, checkpoint.layout_kind(config.as_dict()), resume_path)
    if config.checkpoint_dir:
        checkpoint.check_folder_for_run(config.checkpoint_dir, resume_path)


def steps_per_epoch(config: TrainConfig) -> int:
    """Optimizer steps in one pass over the training split (the last, incomplete global batch is dropped)."""
    samples = data.train_samples(config.dataset)
    if config.global_batch_size > samples:
        raise UserError(
            f"--global-batch-size {config.global_batch_size} is larger than the {samples} training samples "
            f"of {config.dataset}: use at most {samples}"
        )
    return samples // config.global_batch_size


MAX_LOADER_WORKERS = 64
"""Data-loader processes per rank; more would spend the machine's memory on copies of the dataset."""


FSDP_FLAGS = ("sharding_strategy", "hybrid_shard_size", "cpu_offload")


def _check_observers(config: TrainConfig) -> None:
    """The files and folders a run writes beside its training (checkpoints, metrics, traces,
    reports), and the observers' flags that need one another."""
    # "" is a path given and mistyped, not the absence of one: each is checked when given at all
    if config.checkpoint_dir is not None:
        checks.check_folder_to_write("--checkpoint-dir", config.checkpoint_dir)
    if config.metrics is not None:
        checks.check_file_to_write("--metrics", config.metrics)
        checks.check_suffix("--metrics", config.metrics, JSON_LINES, "data")
    if config.profile is not None:
        checks.check_folder_to_write("--profile", config.profile)
    checks.check_int("--profile-steps", config.profile_steps, minimum=1)
    if config.profile is None and config.profile_steps != TrainConfig.profile_steps:
        raise UserError(
            "--profile-steps says how many steps --profile records: add --profile DIR, or leave it out"
        )
    checks.check_int("--check-replicas", config.check_replicas, minimum=0)
    if config.check_replicas and config.sharding != "ddp":
        raise UserError(
            "--check-replicas compares whole replicas: use it with --sharding ddp (ZeRO and FSDP shard the "
            "training state, so the ranks hold different pieces by design)"
        )
    if config.straggler_report is not None:
        if config.sharding == "single" or config.impl != "course":
            raise UserError(
                "--straggler-report times the collectives the course's own code makes: add --sharding ddp "
                "(or zero1, zero2, fsdp) --impl course (PyTorch's DDP and FSDP call the transport directly)"
            )
        checks.check_file_to_write("--straggler-report", config.straggler_report)
        checks.check_suffix("--straggler-report", config.straggler_report, JSON_LINES, "data")


def _check_fsdp_flags(config: TrainConfig) -> None:
    """FSDP's own flags configure the course's FSDP: refuse them anywhere else."""
    defaults = TrainConfig()
    changed = [name for name in FSDP_FLAGS if getattr(config, name) != getattr(defaults, name)]
    if changed and (config.sharding, config.impl) != ("fsdp", "course"):
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise UserError(f"{flags} configure(s) the course's FSDP: use --sharding fsdp --impl course")
    checks.check_choice("--sharding-strategy", config.sharding_strategy, SHARDING_STRATEGIES)
    checks.check_choice("--cpu-offload", config.cpu_offload, OFFLOAD_MODES)
    if config.hybrid_shard_size is not None and config.sharding_strategy != "HYBRID_SHARD":
        raise UserError("--hybrid-shard-size needs --sharding-strategy HYBRID_SHARD")


def autocast(device: torch.device, precision: str):
    """bf16 autocast runs matrix products in bfloat16 while the weights stay fp32."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
