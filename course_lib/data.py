"""Datasets, and how a global batch is split across ranks.

Three datasets, all of them usable on a machine without internet:

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes). It ships
  inside the package, so it is the default: the lab runs anywhere in seconds.
- ``cifar10``: 32x32 colour images, read from ``--data-dir``. Compute nodes usually have no
  internet, so it is never downloaded during training: fetch it once on a login node with
  ``python -m course_lib.data download cifar10 --data-dir DIR``.
- ``synthetic``: CIFAR-shaped noise from a seed (each class with its own faint pattern, so
  there is something to learn), for throughput studies without any files.

Splitting the batch (data parallelism). With a *global* batch of B samples and N ranks, each
rank computes on B / N samples per step. A ``DistributedSampler`` gives every rank a disjoint
slice of the same shuffled order (``set_epoch`` reshuffles it each epoch; forgetting it repeats
the first epoch's order forever). Rank r takes positions r, r + N, r + 2N, ... so the union of
the N per-rank batches of step k is exactly the single-process batch k. That is why a fixed
global batch gives the same training on 1, 2, 3 or 4 ranks: the strong-scaling invariant.

Two details keep that invariant exact:

- An epoch has ``len(train) // B`` steps on every world size, so no step ever contains the
  padding that ``DistributedSampler`` adds to make the dataset divide by N.
- Validation keeps the padding (every rank must run the same number of batches: with FSDP each
  forward is a collective), but the padded samples are masked out of the metrics, so each
  validation sample is counted exactly once. See ``trainer.evaluate``.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from . import checks
from .errors import STOP_SIGNALS, UserError

DATASETS = ("digits", "cifar10", "synthetic")
INPUT_SHAPES = {"digits": (1, 8, 8), "cifar10": (3, 32, 32), "synthetic": (3, 32, 32)}
VALIDATION_FRACTION = 0.2
SPLIT_SEED = 1234  # the train/validation split does not change with --seed
SYNTHETIC_SIZES = (2048, 512)  # train, validation
DIGITS_SAMPLES, CIFAR10_TRAIN_SAMPLES = 1797, 50_000
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@dataclass
class DataBundle:
    """A dataset ready for training: both splits and the shape of one sample."""

    name: str
    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, int, int]  # channels, height, width


def _split(images: torch.Tensor, labels: torch.Tensor) -> tuple[TensorDataset, TensorDataset]:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = int(round(len(labels) * VALIDATION_FRACTION))
    val_idx, train_idx = order[:n_val], order[n_val:]
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(
        images[val_idx], labels[val_idx]
    )


def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1797 handwritten digits: (1797, 8, 8) pixels from 0 to 16, and their labels.

    Read straight from the CSV file scikit-learn ships (what ``sklearn.datasets.load_digits``
    reads): importing scikit-learn would add two seconds to every process that trains.
    """
    import gzip
    import importlib.util

    package = importlib.util.find_spec("sklearn")
    if package is None:
        raise UserError("the digits dataset comes with scikit-learn: pip install scikit-learn")
    path = Path(package.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as handle:
        rows = torch.tensor([[int(value) for value in line.split(",")] for line in handle if line.strip()])
    return rows[:, :64].reshape(-1, 8, 8), rows[:, 64]


def load_digits_bundle() -> DataBundle:
    pixels, target = digits_arrays()
    images = pixels.to(torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    images = (images - 0.5) / 0.5
    labels = target.to(torch.long)
    train, val = _split(images, labels)
    return DataBundle("digits", train, val, num_classes=10, input_shape=(1, 8, 8))


def load_synthetic_bundle(seed: int = 0) -> DataBundle:
    """Noise images with a faint pattern per class, so the loss still falls during a throughput run."""
    generator = torch.Generator().manual_seed(seed)
    n_train, n_val = SYNTHETIC_SIZES
    labels = torch.randint(0, 10, (n_train + n_val,), generator=generator)
    class_patterns = torch.randn(10, 3, 32, 32, generator=generator)
    images = torch.randn(n_train + n_val, 3, 32, 32, generator=generator) + 0.5 * class_patterns[labels]
    train = TensorDataset(images[:n_train], labels[:n_train])
    val = TensorDataset(images[n_train:], labels[n_train:])
    return DataBundle("synthetic", train, val, num_classes=10, input_shape=(3, 32, 32))


def cifar10_missing_message(data_dir: Path) -> str:
    return (
        f"CIFAR-10 was not found in {data_dir} (compute nodes have no internet, so it is never downloaded "
        "during training): on a login node run `python -m course_lib.data download cifar10 --data-dir "
        f"{data_dir}`, then pass the same --data-dir"
    )


def load_cifar10_bundle(data_dir: str | Path) -> DataBundle:
    import torchvision
    from torchvision import transforms

    data_dir = Path(data_dir)
    if not (data_dir / "cifar-10-batches-py").is_dir():
        raise UserError(cifar10_missing_message(data_dir))
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    augment = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    plain = transforms.Compose([transforms.ToTensor(), normalize])
    try:
        train = torchvision.datasets.CIFAR10(str(data_dir), train=True, transform=augment, download=False)
        val = torchvision.datasets.CIFAR10(str(data_dir), train=False, transform=plain, download=False)
    except RuntimeError as error:  # torchvision checks the files' checksums
        raise UserError(f"{cifar10_missing_message(data_dir)} ({error})") from None
    return DataBundle("cifar10", train, val, num_classes=10, input_shape=(3, 32, 32))


def load_dataset(name: str, *, data_dir: str | Path = "data", seed: int = 0) -> DataBundle:
    """Both splits of a dataset, ready for training, from files on this machine (nothing is downloaded).

    Args:
        name: ``"digits"`` (scikit-learn's 8x8 digits, bundled: works offline), ``"synthetic"``
            (noise images with a class pattern, for throughput) or ``"cifar10"`` (its files must be
            in ``data_dir``: ``python -m course_lib.data download cifar10`` on a login node).
        data_dir: the folder that holds ``cifar-10-batches-py``; unused by the other datasets.
        seed: the seed of the synthetic images; unused by the other datasets.
    """
    checks.check_choice("dataset", name, DATASETS)
    if name == "digits":
        return load_digits_bundle()
    if name == "synthetic":
        return load_synthetic_bundle(seed)
    return load_cifar10_bundle(data_dir)


def train_samples(name: str) -> int:
    """Samples in a dataset's training split, known without loading it (for the checks before a run).

    Args:
        name: ``"digits"``, ``"synthetic"`` or ``"cifar10"``.
    """
    return {
        "digits": DIGITS_SAMPLES - int(round(DIGITS_SAMPLES * VALIDATION_FRACTION)),
        "synthetic": SYNTHETIC_SIZES[0],
        "cifar10": CIFAR10_TRAIN_SAMPLES,
    }[name]


def check_data_available(name: str, data_dir: str | Path) -> None:
    """Fail fast, before any rank waits for another, when a dataset is unknown or its files are missing."""
    checks.check_choice("dataset", name, DATASETS)
    if name == "cifar10" and not (Path(data_dir) / "cifar-10-batches-py").is_dir():
        raise UserError(cifar10_missing_message(Path(data_dir)))


def per_rank_batch_size(global_batch_size: int, world_size: int, *, grad_accum_steps: int = 1) -> int:
    """Samples one rank feeds through the model in one forward (a *micro-batch*).

    The global batch is what one optimizer step sees, summed over ranks and accumulation steps; it
    must divide evenly, or ranks would train on different amounts and the runs at different world
    sizes would no longer be the same experiment.

    Args:
        global_batch_size: samples per optimizer step, over all ranks.
        world_size: how many ranks share each step.
        grad_accum_steps: micro-batches each rank accumulates before the step.
    """
    if global_batch_size < 1:
        raise UserError(f"--global-batch-size must be positive, got {global_batch_size}")
    if grad_accum_steps < 1:
        raise UserError(f"--grad-accum must be at least 1, got {grad_accum_steps}")
    shards = world_size * grad_accum_steps
    if global_batch_size % shards:
        lower = max(shards, global_batch_size // shards * shards)
        raise UserError(
            f"global batch size {global_batch_size} does not divide into {world_size} rank(s) x "
            f"{grad_accum_steps} accumulation step(s): use a multiple of {shards}, e.g. --global-batch-size "
            f"{lower} or {lower + shards}"
        )
    return global_batch_size // shards


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start an epoch part-way through.

    After a resume from a checkpoint written mid-epoch, the first ``skip`` samples of this rank's
    share of the epoch are the ones already trained on; skipping them (instead of replaying the
    data loader) costs nothing.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class DataOrderError(UserError):
    """The ranks' samplers do not split the data as data parallelism needs."""


def check_epoch_order(
    sampler: DistributedSampler, *, epoch: int, previous: list[int] | None = None, group=None
) -> list[int]:
    """Refuse, on every rank at once, an epoch whose samples the ranks do not split between them.

    Data parallelism needs each epoch's samples cut into disjoint shares, a new order every epoch:
    every rank's ``DistributedSampler`` with the same seed (the same permutation, cut N ways) and
    ``set_epoch(epoch)`` called before each epoch (a new permutation). Both mistakes train without
    an error, on duplicated samples or the same order every epoch; the only sign is a loss a little
    worse than it should be. Checked here: the ranks exchange their shares (one all-gather of the
    indices at the epoch's start) and compare them with each other and with the last epoch's.
    Returns this rank's share, for the next epoch's call.

    Args:
        sampler: this rank's sampler, after ``set_epoch`` (or its omission).
        epoch: the epoch about to start, from 0.
        previous: what this call returned at the previous epoch (None: the first epoch).
        group: the data-parallel ranks (None: every rank).
    """
    import torch.distributed as dist

    share = list(DistributedSampler.__iter__(sampler))  # the whole share, whatever is skipped on resume
    mine = (sampler.seed, sampler.epoch, share, share == previous)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    seeds = [seed for seed, _, _, _ in everyone]
    epochs = [epoch for _, epoch, _, _ in everyone]
    drawn = sum(len(indices) for _, _, indices, _ in everyone)
    distinct = len({index for _, _, indices, _ in everyone for index in indices})
    padding = sampler.total_size - len(sampler.dataset)  # DistributedSampler repeats a few to even out
    if len(set(seeds)) > 1:
        raise DataOrderError(
            f"the ranks' samplers have different seeds ({_by_rank(seeds)}): their shares overlap "
            f"({drawn - distinct} samples drawn twice this epoch); give every rank's DistributedSampler "
            "the same seed"
        )
    if len(set(epochs)) > 1:
        raise DataOrderError(
            f"the ranks' samplers are at different epochs ({_by_rank(epochs)}): call "
            "sampler.set_epoch(epoch) on every rank before each epoch"
        )
    if drawn - distinct > padding:
        raise DataOrderError(
            f"the ranks' shares overlap: {drawn - distinct} samples are drawn twice this epoch"
        )
    if previous is not None and all(same for _, _, _, same in everyone):
        raise DataOrderError(
            f"epoch {epoch} draws its samples in epoch {epoch - 1}'s order on every rank: call "
            "sampler.set_epoch(epoch) before each epoch (without it every epoch repeats the first's order)"
        )
    return share


def _by_rank(values: list) -> str:
    return ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))


LOADER_START = "forkserver"
"""How the data-loading processes start: forked from a small server process, never from the
training process itself. A rank runs threads (the process group's, the loaders' queue feeders),
and Python 3.11 can deadlock a child forked while one of them is being created or deleted: the
child waits forever in ``PyOS_AfterFork_Child`` for a lock that thread held (measured here: a
validation loader's process stuck so, its rank waiting for its batch, the other rank timing out).
Python 3.12 warns of fork in a threaded process; 3.14 makes forkserver the default on Linux."""

LOADER_SERVER_PRELOAD = "course_lib.loader_server"
"""What the loaders' server process imports before it forks any loader process (torch, and stop
signals ignored while a loader process starts: see ``loader_server``)."""


def loader_processes():
    """The multiprocessing context every loader here starts its processes in (``LOADER_START``)."""
    context = multiprocessing.get_context(LOADER_START)
    context.set_forkserver_preload([LOADER_SERVER_PRELOAD])  # read when the server starts, once
    return context


def close_loaders(*loaders: DataLoader) -> None:
    """Stop the loaders' processes now, whatever stopped training (the end, a signal, an error).

    A persistent loader keeps its processes between epochs, and they ignore stop signals
    (``leave_stop_signals_to_the_trainer``); left running at the interpreter's exit, the exit
    would wait for them forever (multiprocessing terminates them with SIGTERM, then joins them).
    So the trainer closes them itself, through the iterator's own shutdown (PyTorch's, private:
    the DataLoader has no public close).

    Args:
        loaders: the run's loaders (those without processes are left alone).
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        loader._iterator = None


def leave_stop_signals_to_the_trainer(_worker_id: int) -> None:
    """A data-loading process ignores SIGTERM and SIGUSR1 (``worker_init_fn`` of every loader here).

    ``scancel``, a preemption and the time limit send them to *every* process of a job. A loader
    that died of one would make the training process fail with "DataLoader worker is killed by
    signal" before it could checkpoint; ignoring them leaves the stop to the training process,
    which finishes its step, checkpoints, and shuts its loaders down itself.
    """
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def train_loader(
    dataset: Dataset,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        worker_init_fn=leave_stop_signals_to_the_trainer,
        multiprocessing_context=loader_processes() if workers > 0 else None,
    )


def validation_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """This rank's share of ``dataset`` for evaluation: no shuffling, every sample seen once overall.

    ``DistributedSampler`` pads the dataset to a multiple of ``world_size`` by repeating a few
    samples; ``trainer.evaluate`` leaves those repeats out of the metrics.

    Args:
        dataset: the validation split.
        batch_size: samples per forward on this rank.
        rank: this rank's index among ``world_size`` (``runtime.rank()``).
        world_size: how many ranks share the evaluation (``runtime.world_size()``).
        workers: data-loading processes per rank (0: load in the training process).
        pin_memory: page-locked batches, for faster copies to a GPU.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,  # started once, not at every evaluation; closed by close_loaders
        worker_init_fn=leave_stop_signals_to_the_trainer,
        multiprocessing_context=loader_processes() if workers > 0 else None,
    )


# -- text for the transformer ------------------------------------------------------------------


def zen_of_python() -> str:
    """The Zen of Python, read from the ``this`` module's source (importing it would print it)."""
    import ast
    import codecs
    import importlib.util

    source = open(importlib.util.find_spec("this").origin, encoding="utf-8").read()
    encoded = next(
        node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and node.targets[0].id == "s"
    )
    return codecs.decode(encoded, "rot13")


def check_window(seq_len: int) -> None:
    """Refuse a window that the Zen of Python cannot fill: it has one character fewer windows of
    ``seq_len`` than it has characters beyond ``seq_len``, and none past its length."""
    longest = len(zen_of_python()) - 1
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 1 <= seq_len <= longest:
        raise UserError(
            f"a sequence of {seq_len} characters does not fit the course's text (the Zen of Python, "
            f"{longest + 1} characters): choose a sequence length from 1 to {longest}"
        )


def zen_windows(*, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Character-level language modelling on the Zen of Python, available offline everywhere.

    Returns (inputs, targets, vocabulary): every window of ``seq_len`` characters as token ids,
    and the same window shifted by one character (the next-character targets).

    Args:
        seq_len: characters per window (the transformer's sequence length).
    """
    check_window(seq_len)
    text = zen_of_python()
    vocabulary = sorted(set(text))
    ids = torch.tensor([vocabulary.index(c) for c in text])
    starts = torch.arange(len(ids) - seq_len)
    window = starts[:, None] + torch.arange(seq_len)[None, :]
    return ids[window], ids[window + 1], vocabulary


def download(name: str, data_dir: str | Path) -> Path:
    """Fetch a dataset's files (needs internet: run it on a login node, not in a job)."""
    if name != "cifar10":
        raise UserError(f"only cifar10 is downloaded; {name!r} needs no files")
    import torchvision

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        for train in (True, False):
            torchvision.datasets.CIFAR10(str(data_dir), train=train, download=True)
    except (OSError, RuntimeError) as error:  # URLError is an OSError; a bad checksum a RuntimeError
        reason = getattr(error, "reason", None) or str(error).strip().splitlines()[0][:120]
        raise DownloadFailed(
            f"could not download {name} ({reason}): this machine cannot reach the internet, or the site "
            "is down; download it on a machine that can (a cluster's login node) into the same --data-dir"
        ) from None
    return data_dir


class DownloadFailed(Exception):
    """The files could not be fetched (no network, a site down): not a mistake in the input."""


def main(argv: list[str] | None = None) -> int:
    parser = checks.CommandParser(prog="python -m course_lib.data", description=download.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("download", help="download a dataset into --data-dir")
    fetch.add_argument("dataset", choices=["cifar10"])
    fetch.add_argument("--data-dir", type=checks.folder_to_write, default="data")
    args = parser.parse_args(argv)
    try:
        path = download(args.dataset, args.data_dir)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except DownloadFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.dataset} is in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
