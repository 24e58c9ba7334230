"""The planner: every layout of a job, predicted and ranked.

``candidate_layouts`` is the product of the axes' choices for a number of GPUs; ``plan`` predicts
each (``cost_model.predict``) and ranks those that fit by step time. ``tools.plan`` prints the
ranking, and ``tools.plan --validate`` holds the predictions against this machine.
"""

from __future__ import annotations

import itertools
import math

from ..checks import check_instance, check_int
from ..errors import UserError
from . import calibration
from .calibration import CalibrationProfile
from .cost_model import Prediction, predict
from .frameworks import COURSE_PROFILE, Framework
from .layout import CONTEXT_ATTENTION, Layout
from .specs import ClusterSpec, ModelSpec

MAX_GPUS = 2**18
"""The most GPUs a job is planned on: 262,144, beyond the largest clusters reported (xAI's
Colossus, 200,000 H100s and H200s, 2025; Llama 3's 16,384 H100s per job, arXiv:2407.21783)."""
MAX_GLOBAL_BATCH_TOKENS = 2**27
"""The most tokens an optimizer step is planned with: 134 M, twice the largest published batch
(DeepSeek-V3's 15,360 sequences of 4,096 tokens, 63 M, arXiv:2412.19437; Llama 3 405B's 16 M)."""


def check_job_size(*, gpus: int, global_batch_tokens: int, gpus_name: str = "--gpus") -> None:
    """Refuse, before anything is enumerated, a job no cluster holds: it would compute for minutes
    before saying anything (a typo such as 4G for 4M tokens).

    Args:
        gpus: the job's GPUs.
        global_batch_tokens: the tokens of one optimizer step.
        gpus_name: how the caller named the GPUs (a flag, an argument).
    """
    check_int(gpus_name, gpus, minimum=1, maximum=MAX_GPUS)
    if global_batch_tokens > MAX_GLOBAL_BATCH_TOKENS:
        raise UserError(
            f"--global-batch-tokens {global_batch_tokens:,} is more than any published run steps on "
            f"(at most {MAX_GLOBAL_BATCH_TOKENS:,}: twice DeepSeek-V3's 63 M): did you mean M, not G?"
        )


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found up to its square root."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def candidate_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    gpus: int,
    template: Layout | None = None,
    context_attention: tuple[str, ...] = CONTEXT_ATTENTION,
) -> list[Layout]:
    """Every layout the planner considers for ``gpus`` GPUs: the product of the axes' choices.

    Tensor degree up to two nodes' worth (to show why it stops at one), pipeline and context
    degrees that are powers of two, with a context degree ring attention and Ulysses, three
    shardings, three recomputation policies, 1F1B and interleaved 1F1B (v = 2), micro-batches of
    1 and 2 sequences; with a mixture of experts, the experts spread over as many data x context
    ranks as divide them. Everything else (precision, sequence and loss parallelism) is
    ``template``'s.

    Args:
        model: the shapes (the experts).
        cluster: the machine (GPUs per node).
        gpus: the GPUs of the job.
        template: the choices every candidate shares.
        context_attention: the methods tried where the context degree is above 1.
    """
    layouts, template = [], template or Layout()
    for t in [k for k in divisors(gpus) if k <= 2 * cluster.gpus_per_node]:
        for p in [k for k in divisors(gpus // t) if k & (k - 1) == 0]:
            for c in [k for k in divisors(gpus // (t * p)) if k & (k - 1) == 0 and k <= 8]:
                d = gpus // (t * p * c)
                experts = [1]
                if model.experts > 1:
                    experts += [e for e in divisors(d * c) if e > 1 and model.experts % e == 0]
                schedules = [("1f1b", 1)] + ([("interleaved_1f1b", 2)] if p > 1 else [])
                methods = context_attention if c > 1 else (template.context_attention,)
                for e, attention in itertools.product(experts, methods):
                    for sharding in ("ddp", "zero1", "fsdp"):
                        for recomputation in ("none", "selective", "full"):
                            for schedule, v in schedules:
                                for micro_batch in (1, 2):
                                    layouts.append(
                                        template.with_(
                                            data=d, pipeline=p, context=c, tensor=t, expert=e,
                                            sharding=sharding, recomputation=recomputation,
                                            schedule=schedule, virtual_stages=v, micro_batch=micro_batch,
                                            context_attention=attention,
                                        )
                                    )  # fmt: skip
    return layouts


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    gpus: int,
    seq_len: int,
    global_batch: int,
    template: Layout | None = None,
    context_attention: tuple[str, ...] = CONTEXT_ATTENTION,
    framework: Framework = COURSE_PROFILE,
    profile: CalibrationProfile | None = None,
) -> tuple[list[Prediction], list[Prediction]]:
    """Every candidate layout predicted: (those that fit, fastest first; those that do not).

    Args:
        model: the shapes (``MODELS``).
        cluster: the machine (``CLUSTERS``).
        gpus: the GPUs of the job.
        seq_len: s, tokens per sequence.
        global_batch: sequences per optimizer step.
        template: the choices every candidate shares (precision, sequence and loss parallelism).
        context_attention: the methods tried where the context degree is above 1 (ring, Ulysses).
        framework: the training stack's profile (``frameworks.FRAMEWORKS``).
        profile: a calibration of this cluster and stack (``calibration.calibrate``), applied to
            every prediction before they are ranked (None: none).
    """
    check_instance("plan's model", model, ModelSpec)
    check_instance("plan's cluster", cluster, ClusterSpec)
    check_int("plan's seq_len", seq_len, minimum=1)
    check_int("plan's global_batch", global_batch, minimum=1)
    check_job_size(gpus=gpus, global_batch_tokens=seq_len * global_batch, gpus_name="plan's gpus")
    candidates = candidate_layouts(
        model, cluster, gpus=gpus, template=template, context_attention=context_attention
    )
    predictions = [
        predict(model, cluster, layout, seq_len=seq_len, global_batch=global_batch, framework=framework)
        for layout in candidates
    ]
    if profile is not None:
        predictions = [calibration.apply(p, profile, cluster) for p in predictions]
    fitting = sorted((p for p in predictions if p.fits), key=lambda p: (-p.tokens_per_s, p.memory["total"]))
    return fitting, [p for p in predictions if not p.fits]
