"""Part 1 of the course: processes and the messages between them.

- ``runtime``: who am I (rank, world size), on which device and backend, under torchrun, srun
  or nothing;
- ``launch``: run a Python function on N local processes (what the notebooks and tests use);
- ``comm``: every collective through ``torch.distributed``, and the bytes each makes a rank send
  (``CommLog``);
- ``ring``: the ring all-reduce built from sends and receives, to see where 2(N-1)/N comes from;
- ``hooks``: where instrumentation (``course_lib.observe``) plugs into the collectives and the
  processes, without this package knowing it;
- ``collective_check``: every rank of a group must make the same call, checked before each
  collective wherever ``comm`` makes them on CPU (a silent wrong result otherwise).

Nothing here imports a layer above it. Importing the package is cheap: torch is imported by the
modules that need it.
"""
