"""course_lib: distributed deep-learning training in small, readable pieces.

The package has two halves. The **lessons** are what a student reads, top to bottom; each file
holds one idea, its cost and the paper it follows, and each parallelism is proven equal to
PyTorch's own by the tests. The **tools** (``course_lib.tools``) serve the course: they run,
measure and draw the lessons, but teach nothing new. Data flows down: tools import lessons, a
lesson never imports a tool, never draws a picture, and no two modules import each other
(``tests/test_architecture.py`` checks all three from the source).

Lessons, in reading order:

- ``runtime``: who am I (``rank``, ``world_size``, ``is_main``), on which device and backend,
  under torchrun, srun or nothing; ``launch``: run a function on N local processes.
- ``data``, ``models``: the datasets (offline) and networks of the lab.
- ``comm``: every collective, the bytes each makes a rank send (``CommLog``), the ring
  all-reduce by hand.
- ``parallel.ddp``: data parallelism written out (buckets, overlap, ``no_sync``).
- ``memory``: what model states cost per rank under DDP and ZeRO-1/2/3, and what a rank holds.
- ``parallel.flat_param``: the flat, padded, sharded parameter that ZeRO and FSDP are built on.
- ``parallel.zero``: ZeRO-1/2, the optimizer state and the gradients sharded;
  ``parallel.zero_optimizer``: ZeRO-1 as an optimizer (``ShardedOptimizer(params, torch.optim.AdamW,
  lr=...)``), PyTorch's ``ZeroRedundancyOptimizer`` written out.
- ``parallel.fsdp``: ZeRO-3 as FSDP, parameters gathered only while a unit computes, on a
  group or a device mesh.
- ``parallel.tensor``: layers split over ranks (Megatron); ``parallel.pipeline``: stages and
  their schedules; ``parallel.mesh`` and ``parallel.three_d``: all of them on a grid of ranks.
- ``strategies``: one process, DDP or FSDP, each as PyTorch's own or the course's, chosen by
  explicit branches.
- ``trainer``, ``checkpoint``, ``preemption``: the training loop, its resumable checkpoints, a
  clean stop when the cluster asks; ``train``: its command line; ``scaling``: speedup and
  efficiency from a run's metrics, and the alpha-beta model of the network; ``flops``: model
  FLOPs utilization (MFU), how much of a GPU's arithmetic training uses.
- ``checks``, ``errors``: every argument checked at the front door, and the exit statuses.

Tools: ``tools.lab`` (``make lab``), ``tools.study`` (the strong-scaling study on Slurm),
``tools.bench`` (the course against PyTorch, and the network, as JSON), ``tools.jobcheck``
(what the Slurm jobs check before they spend GPU time), ``tools.three_d`` (a 3-D run),
``tools.plots`` and ``tools.figures`` (every picture, as a matplotlib ``Figure``), ``tools.labs``
(exercises generated from solutions, and their check), ``tools.slides`` (the slide checker),
``tools.system_deps`` (what ``make test`` needs from the system).

Importing the package is cheap on purpose: nothing here imports torch until a module needs it.
"""

__version__ = "0.1.0"
