"""The from-scratch implementations, one idea per file, each proven equal to its PyTorch twin.

``course_lib.parallel.ShardedOptimizer`` is ZeRO-1 in the optimizer form PyTorch and the
literature use (``zero_optimizer.py``); it is looked up on first use, so that importing the
package stays cheap.
"""


def __getattr__(name: str):
    if name == "ShardedOptimizer":
        from .zero_optimizer import ShardedOptimizer

        return ShardedOptimizer
    raise AttributeError(f"module 'course_lib.parallel' has no attribute {name!r}")
