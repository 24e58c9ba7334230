"""course_lib: distributed deep-learning training in small, readable pieces.

The package is cut into layers, one sub-package per part of the course; a module imports only
from its own layer or the layers below (``tests/test_architecture.py`` checks it from the source):

- leaves: ``errors`` (exit statuses), ``checks`` (every argument checked at the front door),
  ``data`` (offline datasets, ``DistributedSampler``), ``models`` (the CNNs and a tiny GPT);
- ``distributed``: who am I (``environment``, ``runtime``), N processes on this machine
  (``launch``), every collective and the bytes it sends (``comm``, ``p2p``, ``ledger``,
  ``calls``), the ring all-reduce by hand (``ring``), and ``hooks``, where instruments plug in;
- ``parallel``: one technique per file (DDP, ZeRO, FSDP, tensor, vocabulary, sequence, context,
  Ulysses, experts, recomputation, the pipeline's schedules and executor, the mesh), each
  applied by one verb ``apply_x(model, *, group, options)`` or one wrapper, each proven equal to
  PyTorch's own by the tests;
- ``observe``, beside ``parallel`` and never imported by it: a step's anatomy, stragglers, the
  replicas' check, the flight recorder, faults on purpose, the cross-rank check of every call;
- ``plan``: a whole layout applied (``plan.parallelize``), and its memory, bytes and seconds
  predicted before anything runs (``cost_model``, ``planner``);
- ``train``: the training harness (``python -m course_lib.train``) and the 3-D driver;
- ``tools``: what serves the course (benchmarks, pictures, the planner's commands, labs, slides);
  it may import everything, nothing imports it.

The README's syllabus and reading list say which regions of which files a student reads, week by
week. Importing the package is cheap on purpose: nothing here imports torch until a module needs
it.
"""

__version__ = "0.1.0"
