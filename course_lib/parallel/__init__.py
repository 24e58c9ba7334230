"""Part 2 of the course: the techniques, one idea per file, each proven equal to its PyTorch twin.

Data parallelism (``ddp``), its memory (``memory``), the sharded parameter (``flat_param``),
ZeRO (``zero``, ``zero_optimizer``) and FSDP (``fsdp``); tensor (``tensor``, ``vocab``), sequence
(``sequence``), context (``context``, ``ulysses``) and expert (``expert``) parallelism;
activation recomputation (``recompute``); pipelines (``pipeline/``: the schedules, the
zero-bubble split backward, the theory and the executor); and the grid of ranks they share
(``mesh``). None of them imports the instruments (``course_lib.observe``) nor the harness above
them.
"""
