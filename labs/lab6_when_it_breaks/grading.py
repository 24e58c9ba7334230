"""The grading suite of lab 6: what ``python -m course_lib.tools.labs check lab6_when_it_breaks`` checks.

Your fixed scripts on 2 and 3 real processes, each keeping a flight record: every rank must end
with the weights one process reaches on all the data (the same rows, the same steps), and the
diagnosis of their records must find no problem. The questions are answered from ``broken.py``'s
records: the grader breaks the scripts itself and reads what you should have read.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from course_lib.distributed.launch import launch
from course_lib.observe import flight_recorder
from course_lib.tools import diagnose
from course_lib.tools.labs import Property, Question, case_seed, load, on_ranks
from course_lib.train import checkpoint_interval

BROKEN = Path(__file__).resolve().parent / "broken.py"


def _seed() -> int:
    """The run's seed for this grading (your scripts' ``SEED``): the weights and the order it gives
    are this grading's own, so a recording of another grading's results cannot match."""
    return case_seed(8)


def _seeded(lab, name: str) -> list[float]:
    """On a rank: your script ``name``, run with this grading's seed as its ``SEED``."""
    module = lab.module()
    module.SEED = _seed()
    return getattr(module, name)()


def _run(world_size: int, lab, name: str):
    """Every rank's result of your script ``name`` on ``world_size`` ranks, and the diagnosis of their
    records."""
    folder = tempfile.mkdtemp(prefix="lab8-records-")
    os.environ[flight_recorder.FOLDER_VARIABLE] = folder
    try:
        results = on_ranks(world_size, _seeded, lab, name)
    finally:
        del os.environ[flight_recorder.FOLDER_VARIABLE]
    return results, diagnose.diagnose(diagnose.load(folder))


def _check_like_one_process(lab, what: str, reference) -> None:
    for world_size in (2, 3):
        results, found = _run(world_size, lab, what)
        expected = reference(world_size)
        for rank, weights in enumerate(results):
            assert torch.allclose(torch.tensor(weights), torch.tensor(expected), atol=1e-5), (
                f"{what} on {world_size} ranks: rank {rank} ended with weights {weights[:3]}..., one process on "
                f"all the data with {expected[:3]}..."
            )
        assert not found.problem, f"{what} on {world_size} ranks: the diagnosis of the records: {found.cause}"


def _one_process(model: nn.Module, lr: float, losses) -> list[float]:
    """SGD on one process: each step, the mean of the ranks' losses (``losses(step)`` yields them)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step_losses in losses(model):
        optimizer.zero_grad()
        (sum(step_losses) / len(step_losses)).backward()
        optimizer.step()
    return [value for param in model.parameters() for value in param.detach().flatten().tolist()]


def check_report(lab) -> None:
    def reference(world_size):
        x, y = lab.regression_rows(world_size)
        torch.manual_seed(_seed())
        model = nn.Linear(4, 1)
        return _one_process(model, 0.02, lambda m: ([nn.functional.mse_loss(m(x), y)] for _ in range(4)))

    _check_like_one_process(lab, "train_and_report", reference)


def check_classifier(lab) -> None:
    def reference(world_size):
        x, labels = lab.labelled_rows(world_size)
        torch.manual_seed(_seed())
        model = nn.Linear(4, int(labels.max()) + 1)
        return _one_process(
            model, 0.1, lambda m: ([nn.functional.cross_entropy(m(x), labels)] for _ in range(4))
        )

    _check_like_one_process(lab, "train_classifier", reference)


def check_epochs(lab) -> None:
    def reference(world_size, epochs=3, batch=2):
        dataset = TensorDataset(*lab.regression_rows(world_size))
        samplers = [
            DistributedSampler(dataset, world_size, rank, shuffle=True, seed=_seed())
            for rank in range(world_size)
        ]
        torch.manual_seed(_seed())
        model = nn.Linear(4, 1)

        def losses(m):
            for epoch in range(epochs):
                shares = []
                for sampler in samplers:
                    sampler.set_epoch(epoch)
                    shares.append(list(sampler))
                for start in range(0, len(shares[0]), batch):
                    yield [
                        nn.functional.mse_loss(
                            m(dataset[s[start : start + batch]][0]), dataset[s[start : start + batch]][1]
                        )
                        for s in shares
                    ]

        return _one_process(model, 0.02, losses)

    _check_like_one_process(lab, "train_epochs", reference)


PROPERTIES = [
    Property(
        "train_and_report: on 2 and 3 ranks, trains like one process, and its records show no problem",
        check_report,
        "Every rank must make the same collectives in the same order. A branch around a collective is safe "
        "only when every rank takes it the same way: decide from a value all ranks share.",
    ),
    Property(
        "train_classifier: on 2 and 3 ranks, trains like one process, and its records show no problem",
        check_classifier,
        "A model's shape must not depend on the rank's share of the data: what decides it (here, the number "
        "of classes) is a property of all the data, which the ranks can agree on with one collective.",
    ),
    Property(
        "train_epochs: on 2 and 3 ranks, trains like one process, and every epoch passes check_epoch_order",
        check_epochs,
        "DistributedSampler cuts one permutation N ways: every rank must draw the same permutation (the "
        "run's seed, SEED, which the grader sets for each grading), and a new one each epoch (the "
        "sampler must be told the epoch).",
    ),
]


# -- the README's questions: read from broken.py's records, as you did ------------------------------


def _broken_records(name: str, world_size: int = 2) -> tuple[diagnose.Diagnosis, dict, str]:
    broken = load(BROKEN)
    folder = tempfile.mkdtemp(prefix="lab8-broken-")
    os.environ[flight_recorder.FOLDER_VARIABLE] = folder
    error = ""
    try:
        launch(broken.SCRIPTS[name], world_size, timeout_s=60, collective_timeout_s=10)
    except Exception as raised:  # noqa: BLE001 (each script breaks its own way)
        error = str(raised)
    finally:
        del os.environ[flight_recorder.FOLDER_VARIABLE]
    records = diagnose.load(folder)
    return diagnose.diagnose(records), records, error


def _first_different_collective() -> int:
    return int(re.search(r"collective #(\d+)", _broken_records("report")[0].cause).group(1))


def _outputs_on_rank_1() -> int:
    _, records, _ = _broken_records("classifier")
    return int(records[1].entries[-1]["shape"][0])


def _samples_drawn_twice() -> int:
    return int(re.search(r"(\d+) samples drawn twice", _broken_records("epochs")[2]).group(1))


QUESTIONS = [
    Question(
        "report_first_collective_where_the_ranks_differ",
        _first_different_collective,
        "run broken.py report, then diagnose: its first line names the collective's number",
    ),
    Question(
        "classifier_outputs_of_rank_1s_model",
        _outputs_on_rank_1,
        "run broken.py classifier, then diagnose: the evidence gives each rank's gradient shape",
    ),
    Question(
        "epochs_samples_drawn_twice_in_epoch_0",
        _samples_drawn_twice,
        "run broken.py epochs: the error names how many samples two ranks both drew",
    ),
    Question(
        "checkpoint_minutes_2048_gpus",
        lambda: checkpoint_interval.interval_table(30.0, [2048])[0]["interval_minutes"],
        "the job's MTBF is one GPU's (Llama 3's run: GPUs x days x 24 / interruptions) over 2,048; "
        "then Daly's interval for a save of 30 s (checkpoint_interval.daly_interval_s), in minutes",
        rel_tol=0.02,
    ),
]
