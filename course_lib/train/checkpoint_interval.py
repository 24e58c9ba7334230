"""How often to checkpoint: the interval that loses the least work to failures and to saving.

Saving every τ seconds costs δ seconds per save (the step pauses, or, asynchronous, the copy to
host memory), a share δ/τ of the run. A failure, which comes on average every M seconds (the
job's mean time between failures), loses the work since the last save: τ/2 on average, a share
τ/(2M). The sum δ/τ + τ/(2M) is smallest at

    τ = sqrt(2 δ M)                         (Young, 1974)

Daly (2006) adds the higher-order terms, which matter once δ is not small against M:

    τ = sqrt(2 δ M) (1 + sqrt(δ / 2M) / 3 + (δ / 2M) / 9) - δ     for δ < 2M, else τ = M

A job's M falls with its size: N GPUs fail N times as often as one. Meta's Llama 3 run saw 419
unexpected interruptions in 54 days on 16,384 H100s (Grattafiori et al., "The Llama 3 Herd of
Models", 2024, section 3.3.4, table 5): one per 3.1 hours for the job, about 50,700 hours per GPU.
At that rate 8 GPUs fail about every 9 months, 16,384 every 3 hours, where a 30-second save is
best made about every 13 minutes.

Each failure also costs the restart R: the job requeued, thousands of processes and their NCCL
communicators started again, the checkpoint read back. It does not move the best interval (R is
paid once a failure whatever τ is), but it adds R/M to what the run loses, and at large scale it
is not small: ``RESTART_S``, an assumption of a few minutes, is the course's default.

Papers: J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 1974;
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 2006.
"""

from __future__ import annotations

import math

from ..errors import UserError

LLAMA3_INTERRUPTIONS = 419
"""Unexpected interruptions of Meta's Llama 3 405B pre-training (Grattafiori et al., 2024, table 5)."""
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
PER_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
"""Hours between failures of one GPU (with its share of host, network and software), from that run."""
RESTART_S = 300.0
"""Seconds a failure costs to restart (requeue, processes and NCCL started, checkpoint read): an
assumption, not a measurement. Meta reports no number for Llama 3's restarts; a few minutes is
what a job of thousands of GPUs takes to be scheduled and rendezvous again."""


def _check(save_s: float, mtbf_s: float) -> None:
    for name, value in (("save_s", save_s), ("mtbf_s", mtbf_s)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise UserError(f"{name} must be a finite number of seconds, got {value!r}")
    if save_s < 0 or mtbf_s <= 0:
        raise UserError(
            f"a checkpoint interval needs a save time of 0 s or more and an MTBF above 0 s, got "
            f"save {save_s} s and MTBF {mtbf_s} s"
        )


# #region interval
def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's interval, sqrt(2 δ M): seconds of training between two saves.

    Args:
        save_s: δ, the seconds one save costs the run.
        mtbf_s: M, the job's mean time between failures, in seconds.
    """
    _check(save_s, mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's interval: Young's with the higher-order terms (M itself once δ reaches 2M).

    Args:
        save_s: δ, the seconds one save costs the run.
        mtbf_s: M, the job's mean time between failures, in seconds.
    """
    _check(save_s, mtbf_s)
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


def lost_share(interval_s: float, save_s: float, mtbf_s: float, *, restart_s: float = 0.0) -> float:
    """The share of the run lost to saving, to redoing work after failures and to restarting, to
    first order: δ/τ + (τ/2 + R)/M.

    Args:
        interval_s: τ, seconds of training between saves.
        save_s: δ.
        mtbf_s: M.
        restart_s: R, the seconds each failure costs before training resumes.
    """
    _check(save_s, mtbf_s)
    if interval_s <= 0:
        raise UserError(f"the interval must be above 0 s, got {interval_s}")
    if not isinstance(restart_s, int | float) or not math.isfinite(restart_s) or restart_s < 0:
        raise UserError(f"restart_s must be a finite number of seconds, 0 or more, got {restart_s!r}")
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


# #endregion interval


def job_mtbf_hours(gpus: int, *, per_gpu_hours: float = PER_GPU_MTBF_HOURS) -> float:
    """A job's mean time between failures: one GPU's, divided by the GPUs (failures add up).

    Args:
        gpus: the job's GPUs.
        per_gpu_hours: one GPU's MTBF in hours (default: Llama 3's run).
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise UserError(f"gpus must be a whole number of at least 1, got {gpus!r}")
    return per_gpu_hours / gpus


def interval_table(
    save_s: float,
    gpus: list[int],
    *,
    per_gpu_hours: float = PER_GPU_MTBF_HOURS,
    restart_s: float = RESTART_S,
) -> list[dict]:
    """For each job size: its MTBF, Daly's interval for a save of ``save_s``, and the share lost to
    saving and rework (``lost_share``) and with the restarts too (``lost_with_restarts``).

    Args:
        save_s: δ, the seconds one save costs.
        gpus: the job sizes.
        per_gpu_hours: one GPU's MTBF in hours.
        restart_s: R, the seconds each failure costs to restart (``RESTART_S``: an assumption).
    """
    rows = []
    for count in gpus:
        mtbf_s = 3600 * job_mtbf_hours(count, per_gpu_hours=per_gpu_hours)
        interval = daly_interval_s(save_s, mtbf_s)
        rows.append(
            {
                "gpus": count,
                "mtbf_hours": mtbf_s / 3600,
                "interval_minutes": interval / 60,
                "lost_share": lost_share(interval, save_s, mtbf_s),
                "lost_with_restarts": lost_share(interval, save_s, mtbf_s, restart_s=restart_s),
            }
        )
    return rows


def steps_between_saves(save_s: float, mtbf_hours: float, step_s: float) -> int:
    """Daly's interval in whole steps (at least one): what ``--checkpoint-every auto`` uses.

    Args:
        save_s: δ, one save's measured seconds.
        mtbf_hours: the job's MTBF in hours (``--mtbf-hours``).
        step_s: one training step's measured seconds.
    """
    if step_s <= 0:
        raise UserError(f"a step must take some time, got {step_s} s")
    return max(1, round(daly_interval_s(save_s, 3600 * mtbf_hours) / step_s))
