"""The outer verb: ``apply_pipeline_parallel`` cuts a model into stages, keeps this rank's, and
returns them with the schedule that runs them.

Every other technique changes a module in place (``apply_tensor_parallel``, ``apply_recomputation``,
...). Pipelining cannot: it cuts the model into pieces that live on different ranks, and a step is
no longer ``loss(model(x)).backward()`` but a schedule of forwards, backwards, sends and receives.
So it comes first, and what it returns is what the other verbs then apply to, stage by stage, and
what a training step runs: torchtitan's ``pipeline_llm`` returns its stages and its schedule the
same way.

Cost: none of its own; the stages, their messages and the bubble are the lessons of
``executor.py`` and ``theory.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...checks import check_choice, check_group, check_int, check_module
from ...distributed import runtime
from ...errors import UserError
from .actions import SCHEDULES, placement_of, stages_on_rank
from .executor import PipelineExecutor, split_model


@dataclass
class Pipeline:
    """This rank's stages of a model cut into a pipeline, and the schedule that runs them.

    Args:
        stages: {stage index: module}, the stages this rank holds.
        num_stages: the stages of the whole pipeline (ranks x virtual stages).
        schedule: one of ``SCHEDULES``.
        group: the pipeline's ranks, in stage order (None: every rank).
    """

    stages: dict[int, nn.Module]
    num_stages: int
    schedule: str
    group: Any = None

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of every stage this rank holds: what its optimizer updates."""
        for stage in self.stages.values():
            yield from stage.parameters()

    def executor(
        self,
        *,
        microbatches: int,
        loss_fn: Callable,
        boundary_shape: tuple[int, ...],
        measure_memory: bool = False,
    ) -> PipelineExecutor:
        """What runs one step of the schedule on this rank's stages (``PipelineExecutor``).

        Args:
            microbatches: m, the pieces each batch is cut into.
            loss_fn: ``loss_fn(outputs, targets)`` on the last stage.
            boundary_shape: one micro-batch's activation between stages.
            measure_memory: count what every forward leaves alive for its backward (slow).
        """
        return PipelineExecutor(
            self.stages,
            self.num_stages,
            self.schedule,
            microbatches,
            loss_fn,
            boundary_shape,
            group=self.group,
            measure_memory=measure_memory,
        )


def apply_pipeline_parallel(
    model: nn.Module, group=None, *, schedule: str = "1f1b", virtual_stages: int = 1
) -> Pipeline:
    """Cut ``model`` into (pipeline ranks x ``virtual_stages``) stages and keep this rank's.

    Every rank cuts the same model the same way and keeps only its stages (the others are
    dropped with it): start every rank from the same weights. The V-shaped schedules place the
    stages in a V (``placement_of``), the others round the ranks in a loop.

    Args:
        model: the model as a sequence of layers (an ``nn.Sequential``), cut in place.
        group: the pipeline's ranks, in stage order (None: every rank).
        schedule: the schedule the stages will run, one of ``SCHEDULES``.
        virtual_stages: v, stages per rank (2 for the interleaved and V-shaped schedules).
    """
    check_module("model", model)
    if not isinstance(model, nn.Sequential):
        raise UserError(
            f"model must be an nn.Sequential of layers (the pipeline cuts between them), got "
            f"{type(model).__name__}: write the model as a sequence, as models.TinyTransformer is"
        )
    check_choice("schedule", schedule, SCHEDULES)
    check_int("virtual_stages", virtual_stages, minimum=1)
    check_group("group", group)
    size, rank = runtime.world_size(group=group), runtime.rank(group=group)
    pieces = split_model(model, size * virtual_stages)
    mine = stages_on_rank(rank, size, virtual_stages=virtual_stages, placement=placement_of(schedule))
    return Pipeline({index: pieces[index] for index in mine}, size * virtual_stages, schedule, group)
