"""One training loop for every sharding: single process, DDP, FSDP.

The loop is the one a student writes on a single GPU; distribution changes only three lines:

1. the model is wrapped (``wrappers.wrap_model``) before the optimizer is built;
2. the data loader's ``DistributedSampler`` gives each rank its slice of every global batch,
   and ``set_epoch`` reshuffles it each epoch;
3. metrics computed on a slice (loss, accuracy) are summed over ranks with one all-reduce.

Per step and rank: ``--grad-accum`` forward/backward passes on micro-batches of
``global_batch / (world_size * grad_accum)`` samples, then one optimizer step. Per epoch:
validation on every sample exactly once, one JSON line of metrics, one checkpoint.

Everything a run needs is checked before the processes meet (``config.py``); what a run
measures (validation, memory, the metrics file) is in ``metrics.py``.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import data, models
from ..distributed import runtime
from ..observe import faults, flight_recorder, profiling, replicas, stragglers
from ..parallel import recompute
from ..plan import flops
from . import async_checkpoint, checkpoint, checkpoint_interval, divergence, wrappers
from .config import (
    AUTO_FIRST_SAVE_STEP,
    TrainConfig,
    autocast,
    resolve_resume_path,
    steps_per_epoch,
    validate_config,
)
from .metrics import (
    EMPTY_EPOCH_SUMS,
    append_metrics,
    epoch_record,
    on_first_rank,
    reduce_max,
    reduce_sum,
)
from .preemption import Preempted, StopRequests
from .step_callbacks import StepCallbacks


@dataclass
class TrainResult:
    history: list[dict[str, Any]] = field(default_factory=list)
    global_step: int = 0
    state_dict: dict[str, torch.Tensor] | None = None  # full model weights on rank 0, if requested


PROFILE_WARMUP_STEPS = 2
"""Steps a run takes before ``--profile`` records: the first ones pay for allocations and set-up."""


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=config.lr, momentum=0.9, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


class Trainer:
    """Owns the model, optimizer and data of one run; ``fit()`` trains it."""

    def __init__(self, config: TrainConfig, stop_requests: StopRequests | None = None):
        self.config = config
        self.stop_requests = stop_requests  # if given, a stop signal ends training at a step boundary
        self._profiler = (  # --profile: the anatomy of a few warm steps
            profiling.LoopProfiler(
                config.profile,
                steps=config.profile_steps,
                warmup=PROFILE_WARMUP_STEPS,
                sharding=config.sharding,
                impl=config.impl,
            )
            if config.profile
            else None
        )
        self.process = runtime.process_info()
        validate_config(config, self.process.world_size, self.process.local_world_size)
        self._stragglers = stragglers.StragglerMeter() if config.straggler_report else None
        self._auto_every: int | None = None  # --checkpoint-every auto: steps between saves, once measured
        asynchronous = config.checkpoint_mode == "async" and config.checkpoint_dir
        self._async_saves = async_checkpoint.AsyncSaves() if asynchronous else None
        self._auto_from = 0  # the step of the save that measured it
        self.micro_batch = data.per_rank_batch_size(
            config.global_batch_size, self.process.world_size, grad_accum_steps=config.grad_accum
        )

        self._build_model(config)
        self._build_loaders(config)
        self.steps_per_epoch = steps_per_epoch(config)
        # A fresh run's id, the same on every rank: it names the run's temporary checkpoint folders.
        run_id = runtime.from_rank0(checkpoint.new_run_id())
        self.position = checkpoint.TrainingPosition(config=config.as_dict(), run_id=run_id)
        self._resume(config)
        # what listens to each step: its anatomy, a fault on purpose, the replica check
        self.callbacks = StepCallbacks(check_replicas=config.check_replicas)

    def _build_model(self, config: TrainConfig) -> None:
        """The model, the same on every rank, wrapped for its sharding; its optimizer."""
        # The same seed on every rank gives every replica the same initial weights.
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.data = data.load_dataset(config.dataset, data_dir=config.data_dir, seed=config.seed)
        model = models.build_model(config.model, num_classes=self.data.num_classes).to(self.process.device)
        # The model's arithmetic per sample, counted once on a shape-only copy: throughput x this
        # is the achieved FLOP/s, and over the GPUs' peak it is MFU (course_lib.plan.flops).
        self.flops_per_sample = flops.training_flops_per_sample(model, tuple(self.data.train[0][0].shape))
        # Recompute before wrapping: the wrappers' hooks then run around the recomputed forward.
        recompute.apply_recomputation(model, policy=config.recomputation)
        # FSDP's sharding strategy, for the metrics (PyTorch's fully_shard always shards fully).
        self.sharding_strategy = None
        if config.sharding == "fsdp":
            self.sharding_strategy = config.sharding_strategy if config.impl == "course" else "FULL_SHARD"
        # FSDP's flags are only ever set with --sharding fsdp --impl course (validate_config).
        self.model = wrappers.wrap_model(
            model,
            sharding=config.sharding,
            impl=config.impl,
            process=self.process,
            sharding_strategy=config.sharding_strategy,
            hybrid_shard_size=config.hybrid_shard_size,
            cpu_offload=config.cpu_offload,
        )
        self.optimizer = build_optimizer(self.model, config)
        if config.sharding == "ddp":  # replicas: a flight record, if one is kept, holds their fingerprints
            flight_recorder.watch_replicas(lambda: replicas.fingerprints(wrappers.unwrap(self.model)))

    def _build_loaders(self, config: TrainConfig) -> None:
        """This rank's slice of every training batch, and its share of the validation set."""
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

    def _resume(self, config: TrainConfig) -> None:
        """Go on from ``--resume``'s checkpoint, if one is asked for, with this run's flags."""
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
    # #region train-step
    def _train_step(self, batches) -> tuple[float, float, bool]:
        """Forward and backward over ``grad_accum`` micro-batches, then one update.

        Returns the loss summed over the global batch's samples, their number (the same on every
        rank) and whether any rank asked to stop. Raises ``Diverged`` on every rank, before the
        update, if any rank's loss or gradient is not finite.

        What a step costs beyond the sharding's own communication: one all-reduce of four numbers
        and one wait for the device (reading its result). The loss stays on the device during the
        micro-batches; reading it after each one would stall a GPU once per micro-batch.
        """
        config, device, hooks = self.config, self.process.device, self.callbacks
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        samples = 0
        for micro_step in range(config.grad_accum):
            with hooks.phase("data"):
                inputs, targets = next(batches)
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            last = micro_step == config.grad_accum - 1
            with contextlib.nullcontext() if last else wrappers.gradient_sync_skipped(self.model):
                with hooks.phase("forward"), autocast(device, config.precision):
                    loss = F.cross_entropy(self.model(inputs).float(), targets)
                    loss = hooks.loss(loss, self.position.global_step)
                with hooks.phase("backward"):
                    (loss / config.grad_accum).backward()
            loss_sum += loss.detach().double() * len(targets)
            samples += len(targets)
        with hooks.phase("agree"):  # clipping, finiteness, and the step's one all-reduce
            grad_norm = None
            if config.clip_grad_norm is not None:
                grad_norm = wrappers.clip_grad_norm_(self.model, config.clip_grad_norm)
            non_finite = ~divergence.gradients_finite(self.model, device)
            loss_total, samples_total, diverged, stop = self._agree_on_step(loss_sum, samples, non_finite)
        if diverged:
            grad = None if grad_norm is None else float(grad_norm)
            self._stop_diverged(loss_total / samples_total, grad, local_loss=float(loss_sum))
        with hooks.phase("optimizer"):
            self.optimizer.step()
        hooks.updated(self.model, self.position.global_step)
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
        loss_total, samples_total, non_finite_ranks, stopping_ranks = reduce_sum(summary)
        diverged = non_finite_ranks > 0 or not math.isfinite(loss_total / samples_total)
        return loss_total, samples_total, diverged, stopping_ranks > 0

    # #endregion train-step

    def _stop_diverged(self, step_loss: float, grad_norm: float | None, *, local_loss: float) -> None:
        """Stop every rank with what to try (``divergence.stop``): no update, no checkpoint."""
        divergence.stop(self.config, self.position, self.process.world_size, step_loss, grad_norm, local_loss)

    def _save(self) -> None:
        if not self.config.checkpoint_dir:
            return
        if self._async_saves is not None:  # copied now, written while the next steps run
            self._async_saves.start(self.config.checkpoint_dir, self.model, self.optimizer, self.position)
        else:
            checkpoint.save(self.config.checkpoint_dir, self.model, self.optimizer, self.position)

    def _finish_saves(self) -> None:
        """Wait for a checkpoint still being written in the background, and put it in place."""
        if self._async_saves is not None:
            self._async_saves.finish()

    def _checkpoint_due(self, global_step: int, sums: dict) -> bool:
        """Whether to save after this step: every N steps, or (``auto``) once to measure, then at
        Daly's interval. A measuring save is made here, and answers False."""
        every = self.config.checkpoint_every
        if every != "auto":
            return bool(every) and global_step % every == 0
        if self._auto_every is None:
            if sums["steps"] < AUTO_FIRST_SAVE_STEP:
                return False
            started = time.perf_counter()
            self._save()
            # every rank must agree: the slowest rank's save and step set the interval
            save_s = reduce_max(time.perf_counter() - started, self.process.device)
            step_s = reduce_max(sums["seconds"] / sums["steps"], self.process.device)
            self._auto_every = checkpoint_interval.steps_between_saves(save_s, self.config.mtbf_hours, step_s)
            self._auto_from = global_step
            if self.process.is_main:
                interval = checkpoint_interval.daly_interval_s(save_s, 3600 * self.config.mtbf_hours)
                mtbf = self.config.mtbf_hours
                tqdm.write(
                    f"checkpoint interval: every {self._auto_every} steps (Daly: {interval:.3g} s for a save "
                    f"of {save_s:.3g} s and an MTBF of {mtbf:g} h, at {step_s:.3g} s a step)",
                    file=sys.stdout,
                )
            return False
        return (global_step - self._auto_from) % self._auto_every == 0

    def _stop_for_requeue(self) -> None:
        """A stop signal arrived: checkpoint this step (if there is somewhere to) and leave."""
        if self.config.checkpoint_dir:
            self._save()
            self._finish_saves()  # whole on disk before this process exits
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

    def _progress_bar(self, epoch: int, first_step: int) -> tqdm:
        """The epoch's bar on rank 0 (``--no-progress``: none), on stderr so the metrics stay clean."""
        return tqdm(
            total=self.steps_per_epoch,
            initial=first_step,
            desc=f"epoch {epoch + 1}/{self.config.epochs}",
            disable=not (self.process.is_main and self.config.progress),
            leave=False,
            dynamic_ncols=True,
            mininterval=0.5,
            file=sys.stderr,
        )

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
        bar = self._progress_bar(epoch, first_step)
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
                append_metrics(self.config.straggler_report, self._stragglers.reports[-1].as_dict())
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
            if step + 1 < last_step and self._checkpoint_due(position.global_step, sums):
                self._save()
            elif self._async_saves is not None:
                self._async_saves.poll()  # rank 0: a finished background write, renamed into place
            if stop:
                bar.close()
                self._stop_for_requeue()
        if self.process.device.type == "cuda":
            torch.cuda.synchronize(self.process.device)
        # the slowest rank sets the pace (a resumed epoch: the time before the stop, plus this part)
        epoch_time = reduce_max(seconds_before + time.perf_counter() - started, self.process.device)
        bar.close()
        record = epoch_record(self, epoch=epoch, sums=sums, first_step=first_step, epoch_time_s=epoch_time)
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
            f"training {config.model} on {config.dataset}: sharding {config.sharding} "
            f"({config.impl}{', ' + self.sharding_strategy if self.sharding_strategy else ''}), "
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
                on_first_rank(lambda: append_metrics(config.metrics, record))
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
        self._finish_saves()
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
                result.state_dict = get_model_state_dict(wrappers.unwrap(self.model), options=options)
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
    stop_requests, trainer = StopRequests() if stop_on_signals else None, None
    try:
        trainer = Trainer(config, stop_requests)
        return trainer.fit(collect_state=collect_state)
    finally:
        if trainer is not None:  # whatever ended the run: its loaders' processes end with it
            data.close_loaders(trainer.train_loader, trainer.val_loader)
        if stop_requests is not None:
            stop_requests.restore()
