"""Part 4 of the course: the training harness a student launches (``python -m course_lib.train``).

- ``loop``: ``TrainConfig`` and the training loop (DistributedSampler, evaluation reduced across
  ranks, metrics, checkpoints, divergence stops the run);
- ``wrappers``: one process, DDP or FSDP, each as PyTorch's own or the course's;
- ``checkpoint``, ``preemption``: resumable checkpoints, and a clean stop when the cluster asks;
- ``cli``: the command line;
- ``three_d``: the transformer trained on a grid of data, pipeline and tensor ranks.
"""
