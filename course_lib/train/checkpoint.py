"""Checkpoints that survive a kill, and load on any number of ranks.

A long job on a cluster *will* be interrupted: a time limit, a preemption, a node failure.
Two properties make that harmless:

1. **Atomic.** Every rank writes into ``step-00000120.<run>.tmp/``; only when all have finished
   does rank 0 rename it to ``step-00000120/``. A rename is atomic on POSIX file systems, so a
   kill, or a disk that fills up, at any moment leaves either the complete new checkpoint or
   none, and the previous one is always intact. Leftover ``.tmp`` directories are ignored and
   cleaned up later by the run that wrote them.
2. **Resharding.** Model and optimizer state are written with ``torch.distributed.checkpoint``
   (DCP): each rank writes the pieces it holds, plus a global index of where every piece of
   every tensor lives. Loading reads, on each rank, exactly the pieces the *new* layout needs.
   So a checkpoint saved by FSDP on 2 ranks resumes on 1 or 3, and a DDP checkpoint can resume
   under FSDP: ``get_state_dict`` gives every sharding the same parameter names.

The course's own ZeRO and FSDP (``--impl course``) keep each unit as one flat parameter, not as
the model's named tensors, so they save their *flat* shards (each a DTensor over the ranks; see
``course_lib.parallel.zero``). DCP reshards those just the same, to any number of ranks, but
only the same layout (same sharding, stage and units) can read them; ``meta.pt`` records the
layout and a mismatch is refused with the flags to use.

Beside the tensors, ``meta.pt`` (written last, read with ``torch.load(weights_only=True)``, which
cannot execute code) records where training stood: the epoch, the step inside it (and what the
epoch's metrics had summed so far), the run's configuration, each rank's random-number-generator
state, and the run it belongs to.

One folder, one run. A run has an id, kept when it is resumed. Only the newest ``KEEP_LAST``
checkpoints *of this run* are kept; a checkpoint another run wrote is never deleted. So that
``--resume latest`` can never pick up another run's checkpoint, a fresh run refuses a folder
that already holds checkpoints, and a run resumed from an older checkpoint refuses a folder that
holds a newer one (``check_folder_for_run``).

Cost: a save writes the model and optimizer state once in total (not once per rank), i.e. about
12 bytes per parameter with Adam (fp32 weights + two moments: 4 + 4 + 4; gradients are not saved),
and pauses training meanwhile. ``async_checkpoint`` (``--checkpoint-mode async``) pauses it only to copy
the state into host memory and writes in the background (``python -m course_lib.tools.bench
checkpoint`` measures both); how often to save is ``checkpoint_interval``'s lesson.
"""

from __future__ import annotations

import copy
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import runtime
from ..errors import UserError
from .wrappers import unwrap

FORMAT_VERSION = 1
KEEP_LAST = 2
META_FILE = "meta.pt"
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index of where every piece of every tensor is
CHECKPOINT_NAME = re.compile(r"^step-(\d{8})$")

MUST_MATCH = ("model", "dataset", "optimizer", "global_batch_size", "seed")
"""Configuration that a resumed run must share with the checkpoint: the model and optimizer state
only fit the same model and optimizer, and the position inside an epoch only means something
for the same data order (dataset, seed) and the same steps (global batch size)."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class TrainingPosition:
    """Where training stands: the next epoch to run and how many of its steps are done.

    ``epoch_sums`` holds what the running epoch's metrics have added up so far over every rank
    (the loss summed over samples, the samples, the steps, the seconds spent training), so that
    an epoch interrupted and resumed is reported whole, as if it had run in one go.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    run_id: str = field(default_factory=new_run_id)
    epoch_sums: dict[str, float] = field(default_factory=dict)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _all_gather_objects(obj: Any) -> list[Any]:
    gathered = [None] * runtime.world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def checkpoint_dirs(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [path for path in directory.iterdir() if CHECKPOINT_NAME.match(path.name) and path.is_dir()]
    return sorted(found, key=lambda path: path.name)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = checkpoint_dirs(directory)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    """The step a checkpoint folder ``step-XXXXXXXX`` was written at."""
    return int(CHECKPOINT_NAME.match(path.name).group(1))


def check_folder_for_run(directory: str | Path, resume_path: Path | None) -> None:
    """Refuse a folder where this run's checkpoints could be mistaken for another run's, or the reverse.

    Args:
        directory: the run's ``--checkpoint-dir``.
        resume_path: the checkpoint it resumes from (None: a fresh start).
    """
    found = checkpoint_dirs(directory)
    if resume_path is None:
        if found:
            raise UserError(
                f"--checkpoint-dir {directory} already holds another run's checkpoints (the newest is "
                f"{found[-1].name}): continue that run with --resume latest, or give this one an empty "
                "--checkpoint-dir"
            )
        return
    resumed_step = read_meta(resume_path)["global_step"]
    newer = [path for path in found if step_of(path) > resumed_step]
    if newer:
        raise UserError(
            f"--checkpoint-dir {directory} holds {newer[-1].name}, later than the step {resumed_step} you "
            "resume from: this run's checkpoints would sit beside it and --resume latest could take either; "
            f"keep this run apart with a new --checkpoint-dir (it still resumes from {resume_path})"
        )


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    temporary = path.with_suffix(".partial")
    with open(temporary, "wb") as handle:
        torch.save(meta, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _layout(model: torch.nn.Module) -> str:
    """How the tensors are named: by parameter (every torch wrapper, course DDP) or by flat shard."""
    return getattr(model, "state_layout", "named parameters")


def state_dict_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state DCP writes, or fills in place when loading."""
    # DCP is imported where it is used: it costs a second at the start of every run, saving or not
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if hasattr(model, "sharded_state_dict"):  # the course's ZeRO and FSDP: flat shards
        return {
            "model": model.sharded_state_dict(),
            "optimizer": model.sharded_optimizer_state_dict(optimizer),
        }
    model_state, optimizer_state = get_state_dict(unwrap(model), optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _first_failure(error: BaseException) -> BaseException:
    """The error itself, or the first rank's, when DCP wrapped one (exception, traceback) per rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        failure = next(iter(error.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return error


def _folder_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _why_not_written(error: BaseException, directory: Path) -> str:
    """The operating system's reason, in words. A full disk often reaches Python only as a short
    write inside torch.save ("unexpected pos"), so the free space is measured to name it."""
    error = _first_failure(error)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    free = shutil.disk_usage(directory).free
    previous = latest_checkpoint(directory)
    if previous is not None and free < _folder_bytes(previous):
        return (
            f"No space left on device: {free / 1e6:.1f} MB free, and a checkpoint takes "
            f"{_folder_bytes(previous) / 1e6:.1f} MB"
        )
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


def prepare(directory: Path, position: TrainingPosition) -> tuple[Path, Path]:
    """Rank 0 makes the checkpoint's temporary folder; every rank hears whether it could.

    Returns (the final folder, the temporary one)."""
    final = directory / f"step-{position.global_step:08d}"
    temporary = directory / f"{final.name}.{position.run_id}.tmp"
    failure: BaseException | None = None  # this rank's
    if runtime.rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir()
        except OSError as error:
            failure = error
    # Rank 0 alone names the folders; what it met, every rank must hear of before the next step.
    if runtime.from_rank0(failure is not None):
        refuse(failure, directory, final, temporary)
    return final, temporary


def refuse(failure: BaseException | None, directory: Path, final: Path, temporary: Path) -> None:
    """Every rank: remove the half-written checkpoint and raise one ``UserError`` saying why."""
    reason = None
    if runtime.rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        reason = _why_not_written(failure, directory)
    reason = runtime.from_rank0(reason)
    previous = latest_checkpoint(directory)
    kept = f"the newest checkpoint, {previous.name}, is intact" if previous else "no checkpoint was kept"
    raise UserError(
        f"could not write checkpoint {final.name} in {directory} ({reason}); {kept}: free some space or "
        "choose another --checkpoint-dir, then rerun with --resume latest"
    )


def save(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    position: TrainingPosition,
) -> Path:
    """Write a checkpoint of the current step (every rank must call this). Returns its path.

    If the file system refuses (full, a name too long, gone read-only), every rank raises the
    same ``UserError``, the half-written checkpoint is removed, and the previous one is intact.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    final, temporary = prepare(directory, position)
    failure: BaseException | None = None
    try:  # DCP gathers every rank's outcome: if one rank's write fails, all of them raise
        dcp.save(state_dict_of(model, optimizer), checkpoint_id=str(temporary))
    except (OSError, CheckpointException) as error:
        failure = error
    if failure is None:
        meta = meta_of(model, position)
        if runtime.rank() == 0:
            try:
                put_in_place(directory, temporary, final, meta, position.run_id)
            except OSError as error:
                failure = error
    if runtime.from_rank0(failure is not None):
        refuse(failure, directory, final, temporary)
    return final


def meta_of(model: torch.nn.Module, position: TrainingPosition) -> dict[str, Any] | None:
    """What ``meta.pt`` holds, copied now (every rank calls it: the generators' states are gathered;
    rank 0 gets the record, the others None). A background write stores it steps later, when the
    run's history and sums have moved on: a copy by reference would record an epoch not finished."""
    rng_states = _all_gather_objects(_rng_state())
    if runtime.rank() != 0:
        return None
    return copy.deepcopy(
        {
            "format_version": FORMAT_VERSION,
            "epoch": position.epoch,
            "step_in_epoch": position.step_in_epoch,
            "global_step": position.global_step,
            "config": position.config,
            "history": position.history,
            "run_id": position.run_id,
            "epoch_sums": dict(position.epoch_sums),
            "world_size": runtime.world_size(),
            "layout": _layout(model),
            "rng": rng_states,
        }
    )


def put_in_place(directory: Path, temporary: Path, final: Path, meta: dict[str, Any], run_id: str) -> None:
    """Rank 0: write ``meta.pt`` last, rename the checkpoint into place, drop this run's old ones."""
    _write_meta(temporary / META_FILE, meta)
    if final.exists():  # the same step saved twice (e.g. end of epoch and on request): keep the first
        shutil.rmtree(temporary)
    else:
        os.rename(temporary, final)
    _prune(directory, run_id)


def _run_of(path: Path) -> str | None:
    try:
        return read_meta(path).get("run_id")
    except UserError:
        return None


def _prune(directory: Path, run_id: str) -> None:
    """Keep this run's ``KEEP_LAST`` newest checkpoints; never touch what another run wrote."""
    own = [path for path in checkpoint_dirs(directory) if _run_of(path) == run_id]
    for old in own[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in directory.glob(f"step-*.{run_id}.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)


META_FIELDS = (
    "epoch",
    "step_in_epoch",
    "global_step",
    "config",
    "history",
    "run_id",
    "world_size",
    "layout",
    "rng",
)
"""What every ``meta.pt`` holds (``_meta``): a resume reads them all."""


def read_meta(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint's ``meta.pt`` (no process group needed), or explain what is wrong with it."""
    path = Path(path)
    meta_file = path / META_FILE
    if not path.is_dir():
        raise UserError(
            f"checkpoint {path} does not exist: pass a step-XXXXXXXX directory or --resume latest"
        )
    held = sorted(child.name for child in path.iterdir() if CHECKPOINT_NAME.match(child.name))
    if held and not (path / META_FILE).exists():  # the folder of the checkpoints, not one of them
        raise UserError(
            f"{path} holds checkpoints ({held[0]} ... {held[-1]}), it is not one: pass --resume latest "
            f"with --checkpoint-dir {path}, or --resume {path / held[-1]}"
        )
    for needed in (META_FILE, DCP_INDEX):
        if not (path / needed).is_file():
            raise UserError(
                f"checkpoint {path} is incomplete ({needed} is missing): resume from an older one or start "
                "afresh"
            )
    try:
        meta = torch.load(meta_file, weights_only=True)
    except Exception as error:  # truncated, overwritten, not a torch file...
        raise UserError(
            f"checkpoint {path} is corrupt ({type(error).__name__}: {str(error).splitlines()[0][:120]}): "
            "delete it to resume from the previous one, or start afresh with a new --checkpoint-dir"
        ) from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"checkpoint {path} was not written by this version of course_lib: start afresh")
    missing = [name for name in META_FIELDS if name not in meta]
    if missing or not isinstance(meta["config"], dict) or not isinstance(meta["history"], list):
        what = f"has no {', '.join(missing)}" if missing else "holds a config or history of the wrong kind"
        raise UserError(
            f"checkpoint {path}: its {META_FILE} {what} (edited, or written by another version): resume "
            "from an older checkpoint, or start afresh with a new --checkpoint-dir"
        )
    return meta


def check_compatible(meta: dict[str, Any], config: dict[str, Any], path: str | Path) -> None:
    """Refuse to resume a run whose configuration contradicts the checkpoint's."""
    saved = meta["config"]
    for key in MUST_MATCH:
        if saved.get(key) != config.get(key):
            flag = "--" + key.replace("_", "-")
            raise UserError(
                f"checkpoint {path} was written with {flag} {saved.get(key)} but this run uses {flag} "
                f"{config.get(key)}: pass {flag} {saved.get(key)} to resume it, or use a new "
                "--checkpoint-dir to start afresh"
            )


def layout_kind(config: dict[str, Any]) -> str:
    """How a run's checkpoint names its tensors, from its flags alone: the start of ``_layout``."""
    if config.get("sharding") in ("zero1", "zero2"):
        return "ZeroDataParallel"
    if (config.get("sharding"), config.get("impl")) == ("fsdp", "course"):
        return "FullyShardedDataParallel"
    return "named parameters"


def check_layout(meta: dict[str, Any], layout: str, path: str | Path) -> None:
    """Refuse a checkpoint whose tensors are laid out otherwise than ``layout`` (or starts so)."""
    saved = meta.get("layout", "named parameters")
    if not saved.startswith(layout):
        raise UserError(
            f"checkpoint {path} holds {saved}, but this run lays its model out as {layout}: resume with the "
            f"--sharding, --impl and model of the run that wrote it (its flags: --sharding "
            f"{meta['config'].get('sharding')} --impl {meta['config'].get('impl')}), or start afresh with a "
            "new --checkpoint-dir"
        )


def load(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]
) -> TrainingPosition:
    """Restore model, optimizer and RNG state in place (every rank must call this)."""
    path = Path(path)
    meta = read_meta(path)
    check_compatible(meta, config, path)
    check_layout(meta, _layout(model), path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = state_dict_of(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as error:  # DCP's exception derives from BaseException
        error = _first_failure(error)
        first_line = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise UserError(
            f"checkpoint {path} cannot be loaded into this model ({first_line}): it is corrupt or from "
            "another model; delete it to resume from the previous one, or start afresh with a new "
            "--checkpoint-dir"
        ) from None
    if not hasattr(model, "sharded_state_dict"):  # the course's wrappers were filled in place
        set_state_dict(
            unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    if meta["world_size"] == runtime.world_size():
        _set_rng_state(meta["rng"][runtime.rank()])
    else:
        # A different number of ranks has no per-rank generator to inherit: derive one from the step.
        torch.manual_seed(config["seed"] * 1_000_003 + meta["global_step"] * 101 + runtime.rank())
    return TrainingPosition(
        epoch=meta["epoch"],
        step_in_epoch=meta["step_in_epoch"],
        global_step=meta["global_step"],
        config=meta["config"],
        history=list(meta.get("history", [])),
        run_id=meta.get("run_id") or new_run_id(),
        epoch_sums=dict(meta.get("epoch_sums", {})),
    )
