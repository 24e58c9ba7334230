"""course_lib: distributed deep-learning training in small, readable pieces.

Read it in this order:

- ``runtime``: how a process learns its rank, world size, device and backend.
- ``launch``: run a function on N local processes (notebooks and tests).
- ``data``, ``models``: the datasets and networks of the lab.
- ``comm``: every collective, the bytes each one sends (``CommLog``), a ring all-reduce by hand.
- ``parallel.ddp``: data parallelism written out, proven equal to PyTorch's DDP.
- ``memory``: what model states cost per rank under DDP and ZeRO-1/2/3, and what a rank really holds.
- ``parallel.zero``: ZeRO-1/2, sharding the optimizer state and gradients over a flat parameter.
- ``parallel.fsdp``: ZeRO-3 as FSDP, parameters gathered only while a unit computes.
- ``parallel.tensor``: layers split over ranks (Megatron); ``parallel.pipeline``: stages and schedules;
  ``parallel.mesh`` and ``parallel.three_d``: all three at once on a grid of ranks.
- ``strategies``: single process, DDP and FSDP, each as PyTorch's own or the course's version.
- ``trainer``, ``checkpoint``: the training loop, its metrics and its resumable checkpoints.
- ``train`` (command line), ``lab`` (the three-run lab), ``scaling`` (strong-scaling plots),
  ``bench`` (the course against PyTorch, as JSON).

Importing the package is cheap on purpose: nothing here imports torch until a module needs it.
"""

__version__ = "0.1.0"
