"""A layout: how one training job spreads a model over its GPUs, as one object.

Every parallelism of the course is one axis of a mesh of D x P x C x T x E ranks (``parallel.mesh``):
data (replicas, each with 1/D of the batch), pipeline (stages of layers), context (pieces of each
sequence), tensor (pieces of each matrix) and expert (experts of each MoE layer, over the data
and context ranks as in torchtitan, so E divides D·C and adds no GPUs). On the data axis the
model states are kept whole (DDP), or sharded by ZeRO stage 1, 2 or 3 (FSDP). Along them go the
choices that change memory and time but not the result: recomputation, the pipeline schedule and
its micro-batches, and the precision.

``plan.parallelize`` applies a layout to the course's transformer, one verb per technique.

The planner (``cost_model``) predicts a layout's memory, traffic and step time; the mesh's order
puts the tensor axis innermost, on the fastest links, then context, data and pipeline outermost:
the chattiest axis gets the NVLink of one node, the quietest crosses the network.

Paper: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), section 3: how the axes interact and in which order to
place them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

from ..checks import check_choice, check_fields
from ..errors import UserError
from ..parallel import memory, pipeline, recompute
from ..parallel.context_chunks import SequenceChunks

PRECISIONS = ("bf16", "fp32", "fp8")
"""``bf16``: mixed precision (bf16 products and activations, fp32 master weights); ``fp32``;
``fp8``: as bf16, with the blocks' linear layers' products in fp8 with tensorwise scaling
(torchao's Float8Linear, Transformer Engine): attention, the head and the activations stay bf16."""
FLOAT8_PRECISIONS = ("fp8",)
"""The precisions whose products need a GPU's float8 matmul (the trainer runs the others)."""
CONTEXT_ATTENTION = ("ring", "ulysses")
LETTERS = {"d": "data", "p": "pipeline", "c": "context", "t": "tensor", "e": "expert"}
"""The letter of each axis in a layout's name."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a job lays a model over ``data x pipeline x context x tensor`` GPUs.

    Args:
        data: D, the replicas (each takes 1/D of the global batch).
        pipeline: P, the stages the layers are cut into.
        context: C, the pieces each sequence is cut into (ring attention, or Ulysses: see
            ``context_attention``).
        tensor: T, the pieces each block's matrices are cut into (with sequence parallelism).
        expert: the ranks each MoE layer's experts are spread over (must divide D x C).
        sharding: what the data axis shards: ``"ddp"`` (nothing), ``"zero1"`` (optimizer
            state), ``"zero2"`` (and gradients), ``"fsdp"`` (and parameters).
        recomputation: ``"none"``, ``"full"`` or ``"selective"`` (``recompute``).
        recompute_every: apply ``recomputation`` to every k-th block only, the others keeping
            everything (1: every block; torchtitan's "selective layer" checkpointing is full on
            every 2nd).
        schedule: the pipeline schedule, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"gpipe"``.
        virtual_stages: stages per pipeline rank (the interleaved schedule's v).
        micro_batch: sequences per micro-batch.
        precision: ``"bf16"`` (mixed precision, fp32 master weights) or ``"fp32"``.
        sequence_parallel: with T > 1, the norms run on s/T tokens and the projections keep
            only their shard of the input (Megatron-LM's sequence parallelism); off: plain tensor
            parallelism (the course's ``parallel.tensor``).
        loss_parallel: with T > 1, the embedding, the output projection and the loss are split
            over the vocabulary (``parallel.vocab``; Megatron-LM's, DTensor's ``loss_parallel``):
            the model returns this rank's slice of the logits. Off: every tensor rank computes
            the whole head.
        context_attention: with C > 1, how attention sees the other ranks' tokens: ``"ring"``
            (``parallel.context``: K/V chunks passed around a ring, zig-zag chunks) or
            ``"ulysses"`` (``parallel.ulysses``: all-to-alls that trade the sequence split for a
            head split, contiguous chunks; the heads on a tensor rank must divide by C).
    """

    data: int = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    expert: int = 1
    sharding: str = "fsdp"
    recomputation: str = "none"
    recompute_every: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1
    precision: str = "bf16"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    context_attention: str = "ring"

    def __post_init__(self):
        whole = ("data", "pipeline", "context", "tensor", "expert", "virtual_stages", "micro_batch")
        check_fields(self, minimum=dict.fromkeys((*whole, "recompute_every"), 1))
        if self.tensor == 1:  # both split the tensor axis: without one they are moot, and read as on,
            object.__setattr__(self, "sequence_parallel", True)  # so that layouts that run alike are one
            object.__setattr__(self, "loss_parallel", True)
        if self.schedule in pipeline.SCHEDULES and self.schedule not in pipeline.WHOLE_BACKWARD:
            raise UserError(
                f"the planner does not lay out {self.schedule!r} yet: its bubble and memory are taught "
                "in parallel.pipeline (notebook 08), but the cost model prices only "
                f"{', '.join(pipeline.WHOLE_BACKWARD)}: choose one of them"
            )
        for name, choices in (
            ("sharding", memory.SHARDINGS),
            ("recomputation", recompute.POLICIES),
            ("schedule", pipeline.WHOLE_BACKWARD),
            ("precision", PRECISIONS),
            ("context_attention", CONTEXT_ATTENTION),
        ):
            check_choice(f"Layout {name}", getattr(self, name), choices)
        if (self.data * self.context) % self.expert:
            raise UserError(
                f"expert degree {self.expert} must divide data x context = {self.data * self.context}: "
                "the experts are spread over the data and context ranks"
            )
        if self.recompute_every > 1 and self.recomputation == "none":
            raise UserError(
                f"recompute_every {self.recompute_every} recomputes nothing with recomputation='none': "
                "choose recomputation='full' or 'selective', or leave recompute_every at 1"
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise UserError(
                f"virtual_stages {self.virtual_stages} needs schedule='interleaved_1f1b' (the others hold "
                "one stage per rank)"
            )

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element: 4 in fp32, else 2 (fp8 keeps its activations in bf16)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def gpus(self) -> int:
        """D x P x C x T: the GPUs the layout takes."""
        return self.data * self.pipeline * self.context * self.tensor

    def degree(self, axis: str) -> int:
        """The degree of one of ``AXES``."""
        return getattr(self, axis)

    def name(self) -> str:
        """A short label, e.g. ``d8.p2.t4 fsdp sac``: the degrees above 1, the sharding, and every
        other field that differs from its default, so that ``from_name`` reads back the same
        layout (a name that dropped the precision would price an fp32 run as bf16)."""
        parts = [
            f"{a[0]}{self.degree(a)}" for a in ("data", "pipeline", "context", "tensor") if self.degree(a) > 1
        ]
        if self.expert > 1:
            parts.append(f"e{self.expert}")
        label = ".".join(parts) or "single"
        extras = [self.sharding]
        if self.recomputation != "none":
            every = f"/{self.recompute_every}" if self.recompute_every > 1 else ""
            extras.append({"full": "ac", "selective": "sac"}[self.recomputation] + every)
        if self.pipeline > 1 or self.schedule != "1f1b" or self.virtual_stages > 1:
            extras.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.micro_batch > 1:
            extras.append(f"mb{self.micro_batch}")
        if self.context_attention != "ring":
            extras.append(self.context_attention)
        if self.precision != "bf16":
            extras.append(self.precision)
        if not self.sequence_parallel:
            extras.append("no-sp")
        if not self.loss_parallel:
            extras.append("no-loss-parallel")
        return f"{label} {' '.join(extras)}"

    @classmethod
    def from_name(cls, text: str, **defaults: Any) -> Layout:
        """The layout a ``name()`` describes, read back (``plan predict`` takes its layouts so).

        A grid, then words in any order; what a name leaves out is the default::

            grid    single | AXIS N[.AXIS N]...      AXIS: d data, p pipeline, c context, t tensor,
                                                     e expert
            words   ddp | zero1 | zero2 | fsdp       the data axis's sharding (default fsdp)
                    ac | sac                         full or selective recomputation (default none);
                    ac/2 | sac/2                     ... of every 2nd block only
                    1f1b | gpipe | interleaved_1f1bxV  the pipeline schedule, V stages a rank
                    mbN                              N sequences a micro-batch (default 1)
                    ring | ulysses                   the context axis's attention (default ring)
                    bf16 | fp32 | fp8                the matmuls' precision (default bf16)
                    no-sp | no-loss-parallel         sequence or loss parallelism off (default on)
                    sp                               sequence parallelism on

        Args:
            text: a layout's name, e.g. ``"d8.p2.c4 fsdp sac interleaved_1f1bx2 mb2"``.
            defaults: fields for what the name leaves out, instead of ``Layout``'s defaults (a
                3-D run's: ``train.three_d.RUN_DEFAULTS``).
        """
        if not text.split():
            raise UserError("an empty layout: write one as the planner prints it, e.g. 'd8.t8 fsdp sac'")
        grid, *words = text.split()
        given: dict[str, Any] = {}

        def give(part: str, **values):
            for key, value in values.items():
                if key in given:
                    raise UserError(f"layout {text!r}: {part!r} sets the {key} a second time")
                given[key] = value

        for part in grid.split(".") if grid != "single" else []:
            axis = re.fullmatch(r"([dpcte])([1-9]\d*)", part)
            if axis is None:
                raise UserError(
                    f"layout {text!r}: {part!r} is not an axis and its degree (d8, p2, c4, t8, e8, or "
                    "'single'): see Layout.from_name"
                )
            give(part, **{LETTERS[axis[1]]: int(axis[2])})
        for word in words:
            schedule = re.fullmatch(rf"({'|'.join(pipeline.WHOLE_BACKWARD)})(?:x([1-9]\d*))?", word)
            micro_batch = re.fullmatch(r"mb([1-9]\d*)", word)
            if word in memory.SHARDINGS:
                give(word, sharding=word)
            elif recomputed := re.fullmatch(r"(s?ac)(?:/([1-9]\d*))?", word):
                policy = "full" if recomputed[1] == "ac" else "selective"
                give(word, recomputation=policy, recompute_every=int(recomputed[2] or 1))
            elif schedule:
                give(word, schedule=schedule[1], virtual_stages=int(schedule[2] or 1))
            elif micro_batch:
                give(word, micro_batch=int(micro_batch[1]))
            elif word in CONTEXT_ATTENTION:
                give(word, context_attention=word)
            elif word in PRECISIONS:
                give(word, precision=word)
            elif word in ("sp", "no-sp", "no-loss-parallel"):
                give(word, **{"loss_parallel" if "loss" in word else "sequence_parallel": word == "sp"})
            else:
                raise UserError(
                    f"layout {text!r}: {word!r} is none of a sharding ({', '.join(memory.SHARDINGS)}), "
                    "ac or sac, "
                    "a schedule (1f1b, gpipe, interleaved_1f1bx2), mbN, ring or ulysses, bf16, fp32 or fp8, "
                    "sp, no-sp or no-loss-parallel: see Layout.from_name"
                )
        unknown = set(defaults) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"Layout has no field {', '.join(sorted(unknown))}")
        return cls(**{**defaults, **given})

    def sequence_chunks(self, seq_len: int):
        """Which tokens of a ``seq_len`` sequence each context rank holds (``context_chunks.SequenceChunks``):
        zig-zag chunks for the ring (each rank's causal work even), contiguous ones for Ulysses."""
        return SequenceChunks(seq_len, self.context, zigzag=self.context_attention == "ring")

    def with_(self, **changes) -> Layout:
        """A copy with some fields changed (checked again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise UserError(f"Layout has no field {', '.join(sorted(unknown))}")
        return replace(self, **changes)
