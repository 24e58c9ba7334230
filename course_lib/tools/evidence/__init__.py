"""What holds the planner to measurements: the evidence behind every number it predicts.

Nothing here is a lesson; a student reads ``plan/`` for the model and comes here to see how far
to trust it. Each module sets the planner's predictions beside something measured:

- ``published``: training runs that their authors published (Llama 3, DeepSeek-V3, Megatron-LM,
  torchtitan...), each with its source, layout and measured throughput (``published_gpu_runs.csv``),
  and ``plan check-published``'s ratios;
- ``plan_validation``: the course's own transformer run on this machine's processes, layout by
  layout, its memory, bytes and step time against the prediction (``plan --validate``);
- ``gpu_record``: one command that measures a GPU's matmuls, attention, collectives and memory
  (``make gpu-record``), the record the planner's kernels are fitted to;
- ``gpu_check``: training steps on one GPU, each phase's peak memory and the step's time beside
  the prediction (``make gpu-check``);
- ``gpu_runs``: measured GPU training runs read back and checked (``plan check-gpu-runs``).
"""
