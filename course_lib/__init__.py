"""course_lib: distributed deep-learning training in small, readable pieces.

Read it in this order:

- ``runtime``: how a process learns its rank, world size, device and backend.
- ``launch``: run a function on N local processes (notebooks and tests).
- ``data``, ``models``: the datasets and networks of the lab.
- ``strategies``: single process, DDP and FSDP, each as PyTorch's own or the course's version.
- ``trainer``, ``checkpoint``: the training loop, its metrics and its resumable checkpoints.
- ``train`` (command line), ``lab`` (the three-run lab), ``scaling`` (strong-scaling plots).

Importing the package is cheap on purpose: nothing here imports torch until a module needs it.
"""

__version__ = "0.1.0"
