"""Part 3 of the course: composing the techniques, and predicting what a layout costs.

- ``layout``: a ``Layout`` (the degrees and choices of one run) and ``parallelize``, which applies
  it to a model on a mesh, one technique after the other;
- ``activations``, ``flops``: what one step keeps for backward and how much arithmetic it does;
- ``scaling``: speedup and efficiency from measured runs, and the alpha-beta model of a network;
- ``cost_model``: a layout's memory, bytes and seconds predicted before anything runs, the
  planner's ranking built on it.
"""
