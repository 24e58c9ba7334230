"""Checkpoints written in the background: training pauses only to copy the state to host memory.

A blocking save (``checkpoint.save``) holds training while every byte goes to disk. Here the
state is first copied into host memory (``torch.distributed.checkpoint.async_save`` stages it),
a thread writes it while the next steps run, and the checkpoint is put in place as a blocking
save puts it (``meta.pt`` last, then a rename): the same checkpoints, as atomic. torchtitan's
``async_mode="async"`` does the same.

Cost: a copy of the state in host memory, held until the write ends; a save while a write is in
flight first waits for it (one at a time). ``python -m course_lib.tools.bench checkpoint``
measures what each way holds the training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..distributed import runtime
from .checkpoint import meta_of, prepare, put_in_place, refuse, state_dict_of


# #region async-save
class AsyncSaves:
    """Checkpoints written in the background: training pauses only to copy the state to host memory.

    ``start`` copies this rank's state into CPU memory and hands the writing to a thread
    (``torch.distributed.checkpoint.async_save``); the next step runs while the bytes go to disk.
    The checkpoint stays in its temporary folder until the write is done; then rank 0 writes
    ``meta.pt`` and renames it into place, as a blocking save does. A kill during the write
    leaves the temporary folder and the previous checkpoint, which a rerun resumes from.

    One write is in flight at a time: ``start`` first waits for the previous one. The writer's
    own collectives (its plan, the index) run on a gloo group of their own, so that they never
    interleave with the training's collectives on the other thread (torchtitan does the same).
    Cost: a copy of the state in host memory, held until the write ends.
    """

    def __init__(self):
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None  # every rank
        self._pending: dict[str, Any] | None = None

    def start(
        self, directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, position
    ) -> Path:
        """Copy the state of this step and write it in the background (every rank must call this)."""
        import torch.distributed.checkpoint as dcp

        self.finish()
        directory = Path(directory)
        final, temporary = prepare(directory, position)
        future = dcp.async_save(
            state_dict_of(model, optimizer), checkpoint_id=str(temporary), process_group=self.group
        )
        meta = meta_of(model, position)  # this step's, copied now
        self._pending = dict(future=future, directory=directory, final=final, temporary=temporary,
                             meta=meta, run_id=position.run_id, failure=None, renamed=False)  # fmt: skip
        return final

    def poll(self) -> None:
        """Rank 0, between steps: rename a finished write into place at once (no other rank waits)."""
        pending = self._pending
        if pending is None or runtime.rank() != 0 or pending["renamed"] or not pending["future"].done():
            return
        self._rename(pending)

    def finish(self) -> None:
        """Wait for the write in flight and put it in place (every rank, at the same step)."""
        from torch.distributed.checkpoint.api import CheckpointException

        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending["future"].result()
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - the writer's: one line below
            pending["failure"] = pending["failure"] or error  # (DCP's exception derives from BaseException)
        if runtime.rank() == 0 and not pending["renamed"]:
            self._rename(pending)
        if runtime.from_rank0(pending["failure"] is not None):
            refuse(pending["failure"], pending["directory"], pending["final"], pending["temporary"])

    @staticmethod
    def _rename(pending: dict) -> None:
        error = pending["future"].exception()
        if error is None:
            try:
                put_in_place(pending["directory"], pending["temporary"], pending["final"], pending["meta"],
                        pending["run_id"])  # fmt: skip
            except OSError as failure:
                error = failure
        pending["failure"], pending["renamed"] = error, True


# #endregion async-save
