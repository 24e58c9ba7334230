"""data and models: the split, the batch arithmetic, offline errors, parameter counts."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib import data, models
from course_lib.errors import UserError


def test_digits_split_is_fixed_and_disjoint():
    first, second = data.load_digits_bundle(), data.load_digits_bundle()
    assert (len(first.train), len(first.val)) == (1438, 359)  # 359 validation samples divide by no world size
    assert torch.equal(first.val.tensors[0], second.val.tensors[0])
    train_rows = {tuple(x.flatten().tolist()) for x in first.train.tensors[0]}
    val_rows = [tuple(x.flatten().tolist()) for x in first.val.tensors[0]]
    assert sum(row in train_rows for row in val_rows) < 5  # only digits drawn identically by two writers
    assert first.input_shape == (1, 8, 8) == tuple(first.train[0][0].shape)


def test_synthetic_is_seeded():
    assert torch.equal(
        data.load_synthetic_bundle(3).train.tensors[0], data.load_synthetic_bundle(3).train.tensors[0]
    )
    assert not torch.equal(
        data.load_synthetic_bundle(3).train.tensors[0][:5], data.load_synthetic_bundle(4).train.tensors[0][:5]
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_union_of_rank_batches_is_the_single_process_batch(world_size):
    """The strong-scaling invariant at the data level: step k sees the same samples on any world size."""
    dataset = TensorDataset(torch.arange(101))  # 101 does not divide by 2, 3 or 4
    global_batch = 12
    reference = next(iter(data.train_loader(dataset, global_batch, 0, 1, seed=5)))[0]
    for step in range(101 // global_batch):
        expected = None
        union = []
        for rank in range(world_size):
            loader = data.train_loader(dataset, global_batch // world_size, rank, world_size, seed=5)
            loader.sampler.set_epoch(2)
            union.append(list(loader)[step][0])
        single = data.train_loader(dataset, global_batch, 0, 1, seed=5)
        single.sampler.set_epoch(2)
        expected = list(single)[step][0]
        assert sorted(torch.cat(union).tolist()) == sorted(expected.tolist())
    assert len(reference) == global_batch


def test_set_epoch_reshuffles_and_skip_resumes_mid_epoch():
    dataset = TensorDataset(torch.arange(40))
    loader = data.train_loader(dataset, 4, rank=1, world_size=2, seed=0)
    loader.sampler.set_epoch(0)
    epoch0 = torch.cat([batch[0] for batch in loader]).tolist()
    loader.sampler.set_epoch(1)
    epoch1 = torch.cat([batch[0] for batch in loader]).tolist()
    assert epoch0 != epoch1
    loader.sampler.set_epoch(1, skip=8)
    assert torch.cat([batch[0] for batch in loader]).tolist() == epoch1[8:]


@pytest.mark.parametrize(
    "batch, world, accum, ok", [(64, 2, 1, 32), (60, 3, 2, 10), (64, 3, 1, None), (64, 2, 3, None)]
)
def test_per_rank_batch_size(batch, world, accum, ok):
    if ok is not None:
        assert data.per_rank_batch_size(batch, world, grad_accum_steps=accum) == ok
    else:
        with pytest.raises(
            UserError,
            match=rf"does not divide into {world} rank\(s\) x {accum} .*multiple of {world * accum}",
        ):
            data.per_rank_batch_size(batch, world, grad_accum_steps=accum)


def test_cifar10_missing_offline_says_how_to_download(tmp_path):
    with pytest.raises(
        UserError,
        match=r"not found in .* on a login node run `python -m course_lib.data download cifar10 --data-dir",
    ):
        data.load_dataset("cifar10", data_dir=tmp_path)
    with pytest.raises(UserError, match="download cifar10"):
        data.check_data_available("cifar10", tmp_path)
    (tmp_path / "cifar-10-batches-py").mkdir()  # present but empty: torchvision's checksum fails
    with pytest.raises(UserError, match="download cifar10"):
        data.load_dataset("cifar10", data_dir=tmp_path)


def test_unknown_dataset():
    with pytest.raises(UserError, match="unknown dataset 'mnist': choose one of digits, cifar10, synthetic"):
        data.load_dataset("mnist")


def test_download_command_refuses_datasets_without_files():
    with pytest.raises(UserError, match="needs no files"):
        data.download("digits", "unused")


@pytest.mark.parametrize(
    "name, shape, expected_params",
    [
        ("digits_cnn", (1, 8, 8), 35_173),
        ("cifar_cnn", (3, 32, 32), 765_887),
        ("resnet18", (3, 32, 32), 11_173_962),
    ],
)
def test_models(name, shape, expected_params):
    model = models.build_model(name, num_classes=10)
    assert models.count_parameters(model) == expected_params
    if name != "resnet18":  # torchvision's architecture, as published; ours are sized to leave remainders
        assert all(expected_params % n for n in (2, 3, 4)), (
            "parameter counts must not divide evenly by world sizes"
        )
    assert model(torch.randn(3, *shape)).shape == (3, 10)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert models.model_input_shape(name) == shape
    units = models.sharding_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    assert len(units) >= 4 and len(in_units) >= 0.9 * len(list(model.parameters()))


def test_model_that_does_not_fit_the_data():
    with pytest.raises(
        UserError,
        match="model digits_cnn expects 1x8x8 images but dataset cifar10 has 3x32x32: "
        "use --model cifar_cnn or --model resnet18",
    ):
        models.check_model_fits_data("digits_cnn", "cifar10", (3, 32, 32))
    with pytest.raises(UserError, match="unknown model"):
        models.build_model("vgg")


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_the_training_split_size_known_before_loading_is_the_loaded_one(name):
    assert data.train_samples(name) == len(data.load_dataset(name).train)


def _ignored_signals(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)


def test_loader_processes_come_from_the_server_ignore_stop_signals_and_end_when_closed():
    """Never forked from the training process (its threads could hold a lock the child then waits
    for: ``data.LOADER_START``), deaf to SIGTERM and SIGUSR1 once started, and stopped by
    ``close_loaders`` (the trainer's, whatever ended the run). Each process is read after it has
    made a batch: its start ends in ``worker_init_fn``, after torch's ``_worker_loop`` has set a
    SIGTERM handler of its own."""
    import os
    import signal

    dataset = TensorDataset(torch.randn(64, 3), torch.arange(64))
    loader = data.train_loader(dataset, 8, 0, 1, seed=0, workers=2)
    iterator = iter(loader)
    processes = iterator._workers
    for _ in processes:  # the batches come from the processes in turn: one from each
        next(iterator)
    for process in processes:
        assert (
            process.is_alive()
            and open(f"/proc/{process.pid}/status").read().count(f"PPid:\t{os.getpid()}\n") == 0
        )
        ignored = _ignored_signals(process.pid)
        assert all(ignored & (1 << (number - 1)) for number in (signal.SIGTERM, signal.SIGUSR1))
    data.close_loaders(loader)
    assert not any(process.is_alive() for process in processes) and loader._iterator is None
