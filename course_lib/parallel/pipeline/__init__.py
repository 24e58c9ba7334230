"""Pipeline parallelism: the model cut into stages, micro-batches flowing through them.

Stage s (a run of consecutive layers) lives on rank s. A batch is cut into m micro-batches; a
micro-batch's activation goes forward from stage to stage (send/recv), and its gradient comes
back the same way. Each rank holds 1/p of the model; only the activations at the cuts travel,
point to point.

The bubble. Rank s can only start once s micro-batches' forwards have reached it, and the last
backwards drain the same way, so each rank idles for p - 1 forward-plus-backward slots out of
m + p - 1: the bubble fraction is **(p - 1) / (m + p - 1)**. More micro-batches, smaller bubble.

The schedules (pure functions below: they return each rank's ordered list of actions, so a
schedule can be printed, checked and drawn without running anything):

- **GPipe**: all m forwards, then all m backwards. Simple; every rank keeps the activations of
  all m micro-batches until their backward: peak m.
- **1F1B**: rank s runs p - s - 1 warm-up forwards, then alternates one forward, one backward,
  then drains. The same bubble, but at most p - s micro-batches are in flight on rank s: the
  activation memory no longer grows with m.
- **Interleaved 1F1B** (Megatron-LM): each rank holds v smaller *virtual* stages (rank r holds
  stages r, r + p, r + 2p...), so a micro-batch crosses every rank v times. Each slot is v times
  shorter, so the bubble shrinks to **(p - 1) / (v·m + p - 1)**, for v times more messages. It
  needs m to be a multiple of p.

The executor runs a rank's actions in order: a forward stores its input and output until the
backward, a send is non-blocking (``isend``), a receive blocks. Because every schedule here is
checked (``check_schedule``) to complete when sends never block and receives wait for their
send, the run cannot deadlock. Each loss is divided by m, so the gradients are the average over
micro-batches: exactly the gradient of the whole batch.

Papers: GPipe, Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", NeurIPS 2019 (arXiv:1811.06965); 1F1B, Narayanan et al., "PipeDream: Generalized
Pipeline Parallelism for DNN Training", SOSP 2019, in its synchronous form (PipeDream-Flush:
Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021,
arXiv:2006.09503); the interleaved schedule, Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC 2021 (arXiv:2104.04473), section 2.2.

The zero-bubble schedules (``zero_bubble.py``) split each backward into B, the input's
gradient, which the previous stage waits for, and W, the weights', which nobody needs before the
optimizer step, and move the W's into the bubble: ZB-H1 (1F1B with W's put off), ZB-V and
DualPipeV (two chunks per rank placed in a V). Paper: Qi, Wan, Huang and Lin, "Zero Bubble
Pipeline Parallelism", ICLR 2024 (arXiv:2401.10241); DualPipe, DeepSeek-V3 Technical Report, 2024.

Read in this order: ``actions.py`` (what a schedule is made of, and which rank holds which
stage), ``schedules.py`` (each rank's list of actions, and the checker that replays them),
``zero_bubble.py`` (the split backward and its three schedules), ``theory.py`` (the bubble and
the memory in closed form, and a simulator), ``executor.py`` (the model cut into stages, and one
rank's schedule run with real sends and receives), ``tracing.py`` (what a step did, measured
for the lessons: its actions on a clock and its memory), ``apply.py`` (the outer verb,
``apply_pipeline_parallel``: this rank's stages and the schedule that runs them).
``torch.distributed.pipelining`` is PyTorch's twin; the tests hold the two equal.
"""

from .actions import (
    COMPUTE,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    WHOLE_BACKWARD,
    Action,
    check_schedule_arguments,
    placement_of,
    rank_of_stage,
    splits_backward,
    stages_on_rank,
)
from .apply import Pipeline, apply_pipeline_parallel
from .executor import PipelineExecutor, split_model
from .schedules import (
    ORDERS,
    build_schedule,
    check_schedule,
    compute_order,
)
from .theory import (
    bubble_fraction,
    bubble_fraction_theory,
    bubble_overhead_theory,
    bubble_time_theory,
    peak_activations_theory,
    peak_in_flight,
    simulate_timeline,
)
from .tracing import PipelineStats, StepTracer, message_latencies, on_one_clock
from .zero_bubble import (
    BackwardSplitter,
    dualpipe_v_order,
    zb_h1_order,
    zb_v_order,
)

__all__ = [
    "Action",
    "BackwardSplitter",
    "COMPUTE",
    "ORDERS",
    "Pipeline",
    "PipelineExecutor",
    "PipelineStats",
    "StepTracer",
    "SCHEDULES",
    "WHOLE_BACKWARD",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "bubble_fraction",
    "bubble_fraction_theory",
    "bubble_overhead_theory",
    "bubble_time_theory",
    "apply_pipeline_parallel",
    "build_schedule",
    "check_schedule",
    "check_schedule_arguments",
    "compute_order",
    "dualpipe_v_order",
    "message_latencies",
    "on_one_clock",
    "peak_activations_theory",
    "peak_in_flight",
    "placement_of",
    "rank_of_stage",
    "simulate_timeline",
    "split_model",
    "splits_backward",
    "stages_on_rank",
    "zb_h1_order",
    "zb_v_order",
]
