"""The grading suite of lab 1: what ``python -m course_lib.tools.labs check lab1_ddp`` checks.

Every property runs your ``HandDDP`` on real processes (gloo) at 2, 3 and 4 ranks, on a model
whose parameters divide by none of them, with a frozen layer, a weight used twice and a buffer;
the references are one process on the whole batch and PyTorch's ``DistributedDataParallel``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.distributed import comm, runtime
from course_lib.parallel.ddp import make_buckets
from course_lib.tools.labs import Property, Question, case_seed, in_sandbox, on_ranks

WORLD_SIZES = (2, 3, 4)
GLOBAL_BATCH = 60  # divides by 2, 3 and 4: every rank's mean loss weighs the same
BUCKET_SIZES_MB = (0.001, 0.004, 25)  # a few parameters per bucket, about half the model, all of it


class LabModel(nn.Module):
    """Odd sizes, a frozen layer, a weight used twice (one parameter, two uses) and a buffer."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(7, 23)
        self.register_buffer("scale", torch.ones(23))  # state that is not a parameter
        self.shared = nn.Linear(23, 23)  # applied twice in forward: its gradient has two parts
        self.frozen = nn.Linear(23, 23)
        self.frozen.requires_grad_(False)
        self.last = nn.Linear(23, 5)

    def forward(self, x):
        h = torch.tanh(self.first(x) * self.scale)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.last(torch.tanh(self.frozen(h)))


def _model(seed: int) -> LabModel:
    torch.manual_seed(case_seed(seed))  # this grading's own weights: a recording of another cannot match
    model = LabModel()
    model.scale.uniform_(0.5, 1.5)  # buffers differ too, unless they are broadcast
    return model


def _batch(step: int):
    generator = torch.Generator().manual_seed(case_seed(1000 + step))
    return torch.randn(GLOBAL_BATCH, 7, generator=generator), torch.randint(
        0, 5, (GLOBAL_BATCH,), generator=generator
    )


def _my_share(step: int):
    inputs, targets = _batch(step)
    share = GLOBAL_BATCH // runtime.world_size()
    mine = slice(runtime.rank() * share, (runtime.rank() + 1) * share)
    return inputs[mine], targets[mine]


def _reference_gradients() -> dict[str, torch.Tensor]:
    """One process, the whole batch, rank 0's initial weights."""
    model = _model(seed=0)
    inputs, targets = _batch(0)
    F.cross_entropy(model(inputs), targets).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


# -- the properties, each run on every rank ---------------------------------------------------------


def _state(module: nn.Module) -> torch.Tensor:
    """A model's parameters and floating-point buffers, as one vector."""
    return torch.cat(
        [t.detach().reshape(-1) for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()]
    )


def _state_after_wrapping(lab) -> torch.Tensor:
    model = _model(seed=runtime.rank())  # every rank builds other weights on purpose
    lab.HandDDP(model)
    return _state(model)


def _gradients_after_one_step(lab, bucket_mb):
    model = lab.HandDDP(_model(seed=runtime.rank()), bucket_mb=bucket_mb)
    inputs, targets = _my_share(0)
    with comm.CommLog() as log:
        F.cross_entropy(model(inputs), targets).backward()
        launched_in_backward = log.count("all_reduce")
        # an asynchronous call's record gets its time when its handle is waited on, not before
        still_running = sum(
            1 for record in log.records if record.op == "all_reduce" and record.seconds is None
        )
        model.finish_gradient_sync()
    grads = {name: p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None}
    return grads, (launched_in_backward, still_running), log.count("all_reduce")


def _weights_after_training(lab, optimizer_name) -> torch.Tensor:
    """Three steps of ``optimizer_name`` under your HandDDP (``lab``), or under PyTorch's
    DistributedDataParallel where ``lab`` is None: a launch of the reference never loads your file."""
    from torch.nn.parallel import DistributedDataParallel

    module = _model(seed=runtime.rank())
    # DDP broadcasts rank 0's parameters and buffers, as HandDDP does
    model = lab.HandDDP(module, bucket_mb=0.004) if lab is not None else DistributedDataParallel(module)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if optimizer_name == "adamw"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    for step in range(3):
        optimizer.zero_grad()
        inputs, targets = _my_share(step)
        F.cross_entropy(model(inputs), targets).backward()
        if lab is not None:
            model.finish_gradient_sync()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# -- what the check prints ------------------------------------------------------------------------------


def check_starts_equal(lab) -> None:
    wanted = _state(_model(seed=0))
    for world in WORLD_SIZES:
        states = on_ranks(world, _state_after_wrapping, lab)
        assert all(torch.equal(state, wanted) for state in states), (
            f"on {world} ranks, some rank's parameters or buffers differ from rank 0's after HandDDP(...)"
        )


def _buckets_by_index(bucketing, bucket_mb) -> list[list[int]]:
    """How a bucketing groups the lab model's parameters, by their index (an identity, which only the
    process that made the parameters can tell)."""
    params = [p for p in _model(seed=0).parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in bucket] for bucket in bucketing(params, bucket_mb)]


def _your_buckets(lab, bucket_mb) -> list[list[int]]:
    return _buckets_by_index(lab.bucket_parameters, bucket_mb)


def check_buckets(lab) -> None:
    for bucket_mb in BUCKET_SIZES_MB:
        got = in_sandbox(_your_buckets, lab, bucket_mb)
        wanted = _buckets_by_index(make_buckets, bucket_mb)
        assert got == wanted, (
            f"bucket_parameters(params, {bucket_mb}) grouped the parameters (by index) as {got}, not {wanted}"
        )


def _check_gradients(lab, bucket_mb) -> None:
    reference = _reference_gradients()
    for world in WORLD_SIZES:
        for rank, (grads, _, _) in enumerate(on_ranks(world, _gradients_after_one_step, lab, bucket_mb)):
            assert "frozen.weight" not in grads, (
                "the frozen layer got a gradient: only sync what requires one"
            )
            for name, wanted in reference.items():
                assert name in grads, f"on {world} ranks, rank {rank} has no gradient for {name}"
                error = (grads[name] - wanted).abs().max().item()
                assert error < 1e-6, (
                    f"on {world} ranks, rank {rank}'s gradient of {name} differs from the whole batch's by "
                    f"{error:.2e}" + (f" (buckets of {bucket_mb} MB)" if bucket_mb else "")
                )


def check_per_parameter_gradients(lab) -> None:
    _check_gradients(lab, None)


def check_per_parameter_overlap(lab) -> None:
    trainable = sum(1 for p in _model(seed=0).parameters() if p.requires_grad)
    _, (during, waiting), total = on_ranks(2, _gradients_after_one_step, lab, None)[0]
    assert during == trainable, (
        f"{during} all-reduces had started when backward returned, not {trainable} (one per trainable "
        "parameter, each started from its gradient's hook)"
    )
    assert waiting == during, (
        f"only {waiting} of the {during} all-reduces started in backward were still in flight when it "
        "returned: the others blocked backward until they finished (start them asynchronously)"
    )
    assert total == trainable, f"{total} all-reduces in the step, not {trainable}: sync each gradient once"


def check_bucket_gradients(lab) -> None:
    for bucket_mb in BUCKET_SIZES_MB:
        _check_gradients(lab, bucket_mb)


def check_bucket_overlap(lab) -> None:
    params = [p for p in _model(seed=0).parameters() if p.requires_grad]
    for bucket_mb in BUCKET_SIZES_MB:
        buckets = len(make_buckets(params, bucket_mb))
        _, (during, _), total = on_ranks(2, _gradients_after_one_step, lab, bucket_mb)[0]
        assert (during, total) == (buckets, buckets), (
            f"with buckets of {bucket_mb} MB: {during} all-reduces started during backward and {total} in all, "
            f"not {buckets} and {buckets} (one per bucket, each started when its last gradient is ready)"
        )


def check_trains_like_torch_ddp(lab) -> None:
    for optimizer_name in ("adamw", "sgd"):
        for world in (2, 3):
            yours = on_ranks(world, _weights_after_training, lab, optimizer_name)[0]
            theirs = on_ranks(world, _weights_after_training, None, optimizer_name)[0]
            error = (yours - theirs).abs().max().item()
            assert error < 1e-5, (
                f"after 3 steps of {optimizer_name} on {world} ranks, your weights differ from "
                f"DistributedDataParallel's by {error:.2e}"
            )


TIMED_WIDTH, TIMED_LAYERS, TIMED_BATCH = 512, 4, 32  # an MLP whose step computes for milliseconds
TIMED_STEPS, TIMED_WARMUP = 10, 3
SLOWER_THAN_TORCH = 2.0
"""How many times PyTorch's DDP step yours may take: a generous bound on two shared cores, which only
an all-reduce that blocks backward, or one too many, reaches."""


def _timed_steps(lab) -> dict[str, float]:
    """Median ms of a training step of one MLP under your HandDDP (buckets of 25 MB), the course's DDP
    and PyTorch's, the three interleaved in one run (a busy moment slows all three alike)."""
    from torch.nn.parallel import DistributedDataParallel

    from course_lib.parallel.ddp import DataParallel
    from course_lib.tools.timing import interleaved_medians

    torch.manual_seed(case_seed(7))
    reference = nn.Sequential(
        *[layer for _ in range(TIMED_LAYERS) for layer in (nn.Linear(TIMED_WIDTH, TIMED_WIDTH), nn.Tanh())]
    )
    generator = torch.Generator().manual_seed(case_seed(8) + runtime.rank())
    inputs, targets = (torch.randn(TIMED_BATCH, TIMED_WIDTH, generator=generator) for _ in range(2))

    def stepper(wrap, finish):
        model = copy.deepcopy(reference)
        wrapped = wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(wrapped(inputs), targets).backward()
            finish(wrapped)
            optimizer.step()

        return step

    steps = {
        "yours": stepper(lambda m: lab.HandDDP(m, bucket_mb=25), lambda w: w.finish_gradient_sync()),
        "the course's": stepper(lambda m: DataParallel(m, bucket_mb=25), lambda w: None),
        "PyTorch's": stepper(lambda m: DistributedDataParallel(m, bucket_cap_mb=25), lambda w: None),
    }
    return interleaved_medians(steps, TIMED_STEPS, TIMED_WARMUP)


def check_timed_beside_the_course_and_torch(lab) -> None:
    milliseconds = on_ranks(2, _timed_steps, lab)[0]
    shown = ", ".join(f"{name} {ms:.1f} ms" for name, ms in milliseconds.items())
    print(f"      timed on 2 ranks (median step of {TIMED_STEPS} interleaved): {shown}", flush=True)
    ratio = milliseconds["yours"] / milliseconds["PyTorch's"]
    assert ratio < SLOWER_THAN_TORCH, (
        f"your step takes {ratio:.1f} times PyTorch's DDP's ({shown}): more than {SLOWER_THAN_TORCH:g} times"
    )


PROPERTIES = [
    Property(
        "every replica starts from rank 0's parameters and buffers",
        check_starts_equal,
        "Replicas stay equal only if they start equal: rank 0's tensors must reach the others. A broadcast "
        "writes into the tensor it is given on the receiving ranks, so give it the parameter's own storage; "
        "a model's state also has buffers (batch norm's statistics), which are not parameters.",
    ),
    Property(
        "buckets are filled from the last parameter and closed as PyTorch's DDP closes them",
        check_buckets,
        "Backward produces the last layer's gradients first, so buckets are filled walking the parameters "
        "backwards. PyTorch's reducer closes a bucket once it has reached the size, never before a "
        "parameter: a bucket then never waits for a gradient that will not fit, and a large parameter "
        "closes the bucket it lands in. Count a parameter's bytes as numel() x element_size().",
    ),
    Property(
        "per parameter: the averaged gradients equal the whole batch's (2, 3, 4 ranks)",
        check_per_parameter_gradients,
        "Each rank computed the mean loss of its share; the whole batch's gradient is the average of "
        "the ranks' gradients. An all-reduce sums; the average needs one more operation, after every "
        "handle has been waited on (the sum is not there before).",
    ),
    Property(
        "per parameter: every all-reduce starts during backward, from its gradient's hook",
        check_per_parameter_overlap,
        "Overlap means the message leaves while backward still computes earlier layers: start it inside "
        "the hook with async_op=True (which returns a handle at once) and only wait in "
        "finish_gradient_sync. A blocking call in the hook would stall backward instead.",
    ),
    Property(
        "buckets: the averaged gradients equal the whole batch's, at every bucket size",
        check_bucket_gradients,
        "A bucket is all-reduced as one flat tensor made of copies of its gradients: after waiting, the "
        "summed values must go back into each parameter's .grad, at the offset where you packed them.",
    ),
    Property(
        "buckets: one all-reduce per bucket, started during backward",
        check_bucket_overlap,
        "Count, per bucket, how many of its gradients are ready; the hook of the last one launches the "
        "bucket. Reset the count for the next backward.",
    ),
    Property(
        "training equals PyTorch's DistributedDataParallel (AdamW, SGD with momentum)",
        check_trains_like_torch_ddp,
        "If one step's gradients are right, training only goes wrong through state kept between steps: "
        "clear what is pending after each finish_gradient_sync.",
    ),
    Property(
        "timed: your step beside the course's DDP and PyTorch's, in one run (the line above it)",
        check_timed_beside_the_course_and_torch,
        "Compare your step with the others': what does your hook do that theirs do not? An all-reduce "
        "waited for inside backward stalls it; a bucket launched twice sends its bytes twice.",
    ),
]


# -- the README's questions, answered in answers.toml ---------------------------------------------------


def _digits_cnn_parameters() -> list[nn.Parameter]:
    return list(models.build_model("digits_cnn").parameters())


def _gradient_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in _digits_cnn_parameters())


QUESTIONS = [
    Question(
        "all_reduces_per_step_per_parameter",
        lambda: len(_digits_cnn_parameters()),
        "count the digits CNN's parameter tensors (model.parameters()): each is all-reduced once",
    ),
    Question(
        "all_reduces_per_step_buckets_of_0_05_mb",
        lambda: len(make_buckets(_digits_cnn_parameters(), 0.05)),
        "fill buckets from the last parameter, closing each once it reaches 0.05 MB = 52,429 bytes, as your "
        "bucket_parameters does",
    ),
    Question(
        "bytes_sent_per_rank_per_step_on_3_ranks",
        lambda: comm.ring_bytes("all_reduce", _gradient_bytes(), 3),
        "a ring all-reduce of S bytes makes each of N ranks send 2(N-1)/N x S (course_lib/distributed/comm.py); S is the "
        "gradients' bytes (4 per fp32 element)",
    ),
    Question(
        "bytes_sent_per_rank_per_step_on_1000_ranks",
        lambda: comm.ring_bytes("all_reduce", _gradient_bytes(), 1000),
        "the same formula at N = 1000: what does adding ranks do to each rank's traffic?",
    ),
]
