"""trainer: the same model on 1, 2, 3 and 4 ranks; exact validation; resumable checkpoints.

Every multi-rank run goes through ``course_lib.distributed.launch`` (real processes, gloo) and returns the
full weights gathered on rank 0, which are compared with a single-process run.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from course_lib import data, models
from course_lib.distributed import runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.train import checkpoint, wrappers
from course_lib.train.config import TrainConfig, validate_config
from course_lib.train.loop import Trainer, train
from course_lib.train.metrics import evaluate

# Global batch 60 divides by 1, 2, 3 and 4 ranks; digits gives 23 steps per epoch.
BASE = TrainConfig(global_batch_size=60, epochs=1, max_steps=4, progress=False, lr=3e-3)
# Adam divides by sqrt(second moment): rounding differences from summing gradients in another
# order grow a little with each step. Measured: at most ~1e-6 apart after 4 steps.
TOLERANCE = dict(rtol=1e-4, atol=2e-5)


def _train_and_collect(config: TrainConfig):
    result = train(config, collect_state=True)
    if runtime.is_main():
        return models.flat_parameters(result.state_dict), result.history
    return None


def run_training(config: TrainConfig, nprocs: int):
    """Train on ``nprocs`` processes; return (flat weights, metrics history) from rank 0."""
    return launch(_train_and_collect, nprocs, config)[0]


@pytest.fixture(scope="module")
def single_reference():
    return run_training(dataclasses.replace(BASE, sharding="single"), 1)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_same_weights_on_any_world_size(sharding, world_size, single_reference):
    """The strong-scaling invariant: same global batch and seed, same weights after k steps."""
    reference, reference_history = single_reference
    weights, history = run_training(dataclasses.replace(BASE, sharding=sharding), world_size)
    assert weights.numel() == 35_173
    torch.testing.assert_close(weights, reference, **TOLERANCE)
    assert history[-1]["world_size"] == world_size and history[-1]["steps"] == 4
    assert history[-1]["val_samples"] == 359
    assert history[-1]["train_loss"] == pytest.approx(reference_history[-1]["train_loss"], rel=1e-5)
    # the model states a rank holds (the largest rank's): whole under DDP, about 1/N under FSDP
    held, whole = history[-1]["model_state_mb"], reference_history[-1]["model_state_mb"]
    if sharding == "ddp":
        assert held == whole
    else:  # uneven shards: the first ranks hold up to one row more of each parameter
        assert whole / world_size <= held < 1.25 * whole / world_size


def test_training_moves_the_weights_and_learns(single_reference):
    torch.manual_seed(BASE.seed)
    initial = models.flat_parameters(models.build_model("digits_cnn").state_dict())
    reference, _ = single_reference
    assert (reference - initial).abs().max() > 1e-3
    _, history = run_training(dataclasses.replace(BASE, sharding="ddp", max_steps=None, epochs=3), 2)
    assert history[-1]["val_acc"] > 0.9 and history[-1]["train_loss"] < history[0]["train_loss"]


def test_gradient_accumulation_equals_the_full_batch(single_reference):
    reference, _ = single_reference
    weights, history = run_training(dataclasses.replace(BASE, sharding="ddp", grad_accum=3), 2)
    assert history[-1]["micro_batch_size"] == 10
    torch.testing.assert_close(weights, reference, **TOLERANCE)
    weights, _ = run_training(dataclasses.replace(BASE, sharding="fsdp", grad_accum=2), 3)
    torch.testing.assert_close(weights, reference, **TOLERANCE)


def test_bf16_autocast_stays_close_to_fp32(single_reference):
    reference, _ = single_reference
    weights, history = run_training(dataclasses.replace(BASE, sharding="ddp", precision="bf16"), 2)
    assert history[-1]["precision"] == "bf16"
    # bfloat16 keeps 8 bits of mantissa: the update directions agree, the digits do not.
    assert (weights - reference).abs().max() < 5e-2
    assert torch.nn.functional.cosine_similarity(weights, reference, dim=0) > 0.999


# -- validation -----------------------------------------------------------------------------

ODD_VALIDATION = TensorDataset(
    torch.randn(37, 1, 8, 8, generator=torch.Generator().manual_seed(1)),
    torch.randint(0, 10, (37,), generator=torch.Generator().manual_seed(2)),
)


def _evaluate_on_odd_dataset(sharding: str):
    process = runtime.process_info()
    torch.manual_seed(0)
    model = wrappers.wrap_model(
        models.build_model("digits_cnn"), sharding=sharding, impl="torch", process=process
    )
    loader = data.validation_loader(
        ODD_VALIDATION, batch_size=4, rank=process.rank, world_size=process.world_size
    )
    return evaluate(model, loader, process.device)


@pytest.mark.parametrize(
    "world_size, sharding", [(1, "single"), (2, "ddp"), (3, "fsdp"), (4, "ddp"), (4, "fsdp")]
)
def test_validation_counts_every_sample_exactly_once(world_size, sharding):
    reference = launch(_evaluate_on_odd_dataset, 1, "single")[0]
    metrics = launch(_evaluate_on_odd_dataset, world_size, sharding)
    assert all(m == metrics[0] for m in metrics), "every rank must report the same reduced metrics"
    assert metrics[0]["val_samples"] == reference["val_samples"] == 37  # no padded sample counted
    assert metrics[0]["val_acc"] == reference["val_acc"]  # exact: a count of correct predictions
    assert metrics[0]["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6)


# -- checkpoints and resume -----------------------------------------------------------------


def test_resume_gives_identical_weights(tmp_path):
    straight, _ = run_training(dataclasses.replace(BASE, sharding="ddp", epochs=2, max_steps=None), 2)
    first = dataclasses.replace(BASE, sharding="ddp", epochs=1, max_steps=None, checkpoint_dir=str(tmp_path))
    run_training(first, 2)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-00000023"]
    resumed, history = run_training(dataclasses.replace(first, epochs=2, resume="latest"), 2)
    assert torch.equal(resumed, straight)  # bit for bit: same ranks, same order of every operation
    assert [record["epoch"] for record in history] == [1, 2]


def test_resume_mid_epoch_gives_identical_weights_and_metrics_of_the_whole_epoch(tmp_path):
    straight, straight_history = run_training(dataclasses.replace(BASE, sharding="fsdp", max_steps=None), 2)
    interrupted = dataclasses.replace(
        BASE, sharding="fsdp", max_steps=5, checkpoint_dir=str(tmp_path), checkpoint_every=2
    )
    _, partial = run_training(interrupted, 2)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-00000004", "step-00000005"]
    meta = checkpoint.read_meta(tmp_path / "step-00000005")
    assert (meta["epoch"], meta["step_in_epoch"], meta["global_step"]) == (0, 5, 5)
    assert partial[-1]["steps"] == 5 and partial[-1]["epoch_complete"] is False  # says it is a part
    resumed, history = run_training(dataclasses.replace(interrupted, max_steps=None, resume="latest"), 2)
    assert torch.equal(resumed, straight)
    whole, reference = history[-1], straight_history[-1]
    assert whole["resumed_at_step"] == 5 and whole["epoch_complete"] is True
    assert whole["steps"] == reference["steps"] == 23
    assert whole["train_loss"] == reference["train_loss"]  # every step's loss, summed in the same order
    assert whole["epoch_time_s"] > partial[-1]["epoch_time_s"]  # the time before the stop counts too


def test_a_fresh_run_refuses_a_folder_that_holds_another_runs_checkpoints(saved_checkpoint):
    fresh = dataclasses.replace(BASE, sharding="single", checkpoint_dir=str(saved_checkpoint.parent))
    with pytest.raises(UserError, match="already holds another run's checkpoints .* continue that run with"):
        validate_config(fresh, 1)
    validate_config(dataclasses.replace(fresh, sharding="ddp", resume="latest"), 2)  # continuing it is fine


def test_an_older_checkpoint_resumes_only_into_a_folder_of_its_own_and_no_run_deletes_anothers(tmp_path):
    first = dataclasses.replace(
        BASE, sharding="single", max_steps=3, checkpoint_every=1, checkpoint_dir=str(tmp_path / "first")
    )
    run_training(first, 1)
    older = tmp_path / "first" / "step-00000002"
    back = dataclasses.replace(first, max_steps=5, resume=str(older))
    with pytest.raises(UserError, match="holds step-00000003, later than the step 2 you resume from"):
        validate_config(back, 1)
    # In a folder holding another run's older checkpoint, the branch prunes only its own.
    run_training(dataclasses.replace(first, max_steps=1, checkpoint_dir=str(tmp_path / "other")), 1)
    branch = tmp_path / "branch"
    branch.mkdir()
    shutil.copytree(tmp_path / "other" / "step-00000001", branch / "step-00000001")
    run_training(dataclasses.replace(back, checkpoint_dir=str(branch)), 1)
    assert [p.name for p in checkpoint.checkpoint_dirs(branch)] == [
        "step-00000001",  # another run's: kept
        "step-00000004",
        "step-00000005",
    ]
    assert checkpoint.latest_checkpoint(branch).name == "step-00000005"
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path / "first")] == [
        "step-00000002",
        "step-00000003",
    ]


@pytest.mark.parametrize("new_world_size", [1, 3])
def test_fsdp_checkpoint_from_two_ranks_resumes_on_another_world_size(tmp_path, new_world_size):
    straight, _ = run_training(dataclasses.replace(BASE, sharding="fsdp", max_steps=8), 2)
    saved = dataclasses.replace(BASE, sharding="fsdp", max_steps=4, checkpoint_dir=str(tmp_path))
    run_training(saved, 2)
    resumed, history = run_training(dataclasses.replace(saved, max_steps=8, resume="latest"), new_world_size)
    assert history[-1]["world_size"] == new_world_size
    torch.testing.assert_close(resumed, straight, **TOLERANCE)


def test_ddp_checkpoint_resumes_under_fsdp(tmp_path):
    straight, _ = run_training(dataclasses.replace(BASE, sharding="ddp", max_steps=6), 2)
    saved = dataclasses.replace(BASE, sharding="ddp", max_steps=3, checkpoint_dir=str(tmp_path))
    run_training(saved, 2)
    resumed, _ = run_training(dataclasses.replace(saved, sharding="fsdp", max_steps=6, resume="latest"), 2)
    torch.testing.assert_close(resumed, straight, **TOLERANCE)


def test_checkpoints_keep_the_last_two(tmp_path):
    run_training(
        dataclasses.replace(
            BASE, sharding="single", max_steps=4, checkpoint_every=1, checkpoint_dir=str(tmp_path)
        ),
        1,
    )
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-00000003", "step-00000004"]
    assert not list(tmp_path.glob("*.tmp"))


def _save_then_get_killed_while_saving(directory: str, ready_flag: str):
    """Rank 0 of a world of one: save a good checkpoint, then hang half-way through the next."""
    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1")
    runtime.init(num_threads=1)
    config = dataclasses.replace(BASE, sharding="single", max_steps=2, checkpoint_dir=directory)
    trainer = Trainer(config)
    trainer.fit()  # writes step-00000002
    import torch.distributed.checkpoint as dcp  # what checkpoint.save calls

    real_save = dcp.save

    def slow_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # the tensors are on disk, meta.pt is not yet
        open(ready_flag, "w").close()
        time.sleep(600)

    dcp.save = slow_save
    trainer.position.global_step = 3
    checkpoint.save(directory, trainer.model, trainer.optimizer, trainer.position)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    ready = tmp_path / "writing"
    child = multiprocessing.get_context("fork").Process(
        target=_save_then_get_killed_while_saving, args=(str(tmp_path / "ckpt"), str(ready))
    )
    child.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the child never reached the middle of its second save"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    [half_written] = (tmp_path / "ckpt").glob("step-00000003.*.tmp")
    assert half_written.is_dir()
    assert checkpoint.latest_checkpoint(tmp_path / "ckpt").name == "step-00000002"
    resumed, history = run_training(
        dataclasses.replace(
            BASE, sharding="single", max_steps=4, resume="latest", checkpoint_dir=str(tmp_path / "ckpt")
        ),
        1,
    )
    straight, _ = run_training(dataclasses.replace(BASE, sharding="single", max_steps=4), 1)
    assert torch.equal(resumed, straight)
    assert not half_written.exists()  # cleaned up by the next save of the run that wrote it


# -- checkpoints that must be refused --------------------------------------------------------


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    run_training(dataclasses.replace(BASE, sharding="ddp", max_steps=2, checkpoint_dir=str(directory)), 2)
    return checkpoint.latest_checkpoint(directory)


def _resume(config):
    train(config)


def test_refuses_a_checkpoint_from_another_model(saved_checkpoint):
    config = dataclasses.replace(
        BASE, sharding="ddp", dataset="synthetic", model="cifar_cnn", resume=str(saved_checkpoint)
    )
    with pytest.raises(
        UserError,
        match=r"was written with --model digits_cnn but this run uses --model cifar_cnn: "
        r"pass --model digits_cnn to resume it, or use a new --checkpoint-dir",
    ):
        launch(_resume, 2, config)


def test_refuses_an_incompatible_config(saved_checkpoint):
    config = dataclasses.replace(BASE, sharding="ddp", global_batch_size=120, resume=str(saved_checkpoint))
    with pytest.raises(UserError, match="--global-batch-size 60 but this run uses --global-batch-size 120"):
        launch(_resume, 2, config)


def test_the_folder_of_the_checkpoints_given_as_one_names_resume_latest(tmp_path):
    (tmp_path / "step-00000005").mkdir()
    (tmp_path / "step-00000010").mkdir()
    with pytest.raises(
        UserError,
        match=r"holds checkpoints \(step-00000005 ... step-00000010\), it is not one: "
        r"pass --resume latest",
    ):
        checkpoint.read_meta(tmp_path)


def test_refuses_a_corrupt_checkpoint(saved_checkpoint, tmp_path):
    import shutil

    broken_meta = tmp_path / "broken_meta"
    shutil.copytree(saved_checkpoint, broken_meta)
    (broken_meta / "meta.pt").write_bytes((broken_meta / "meta.pt").read_bytes()[:100])
    with pytest.raises(UserError, match=r"checkpoint .*broken_meta is corrupt .* delete it"):
        checkpoint.read_meta(broken_meta)

    broken_tensors = tmp_path / "broken_tensors"
    shutil.copytree(saved_checkpoint, broken_tensors)
    for shard in broken_tensors.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    config = dataclasses.replace(BASE, sharding="ddp", resume=str(broken_tensors))
    with pytest.raises(UserError, match=r"cannot be loaded into this model .* corrupt or from another model"):
        launch(_resume, 2, config)

    with pytest.raises(UserError, match="does not exist"):
        checkpoint.read_meta(tmp_path / "nowhere")

    import torch

    for field in ("config", "history"):  # a meta.pt edited or of another version: the field named
        edited = tmp_path / f"without_{field}"
        shutil.copytree(saved_checkpoint, edited)
        meta = torch.load(edited / "meta.pt", weights_only=True)
        del meta[field]
        torch.save(meta, edited / "meta.pt")
        with pytest.raises(UserError, match=f"its meta.pt has no {field} \\(edited, or written by another"):
            checkpoint.read_meta(edited)


@pytest.mark.parametrize(
    "sharding, impl, policy",
    [("ddp", "torch", "selective"), ("fsdp", "torch", "full"), ("fsdp", "course", "selective")],
)
def test_recomputation_trains_like_one_process_under_every_wrapper(sharding, impl, policy, single_reference):
    reference, _ = single_reference
    config = dataclasses.replace(BASE, sharding=sharding, impl=impl, recomputation=policy)
    weights, history = run_training(config, 2)
    torch.testing.assert_close(weights, reference, **TOLERANCE)


# -- the course's sharded implementations in the harness --------------------------------------

COURSE_SHARDED = {
    "zero1": dict(sharding="zero1"),
    "zero2": dict(sharding="zero2"),
    "FULL_SHARD": dict(sharding="fsdp"),
    "SHARD_GRAD_OP": dict(
        sharding="fsdp", sharding_strategy="SHARD_GRAD_OP", cpu_offload="full", recomputation="full"
    ),
}


@pytest.mark.parametrize("variant", COURSE_SHARDED)
def test_course_sharded_implementations_train_like_one_process(variant, single_reference):
    reference, reference_history = single_reference
    config = dataclasses.replace(BASE, impl="course", **COURSE_SHARDED[variant])
    weights, history = run_training(config, 3)
    torch.testing.assert_close(weights, reference, **TOLERANCE)
    assert history[-1]["sharding"] == config.sharding
    assert history[-1]["sharding_strategy"] == (None if variant.startswith("zero") else variant)
    assert history[-1]["train_loss"] == pytest.approx(reference_history[-1]["train_loss"], rel=1e-5)


@pytest.mark.parametrize("sharding", ["zero2", "fsdp"])
def test_course_sharded_checkpoint_from_two_ranks_resumes_on_four_and_refuses_another_layout(
    tmp_path, sharding
):
    course = dataclasses.replace(BASE, sharding=sharding, impl="course", clip_grad_norm=0.5)
    straight, _ = run_training(dataclasses.replace(course, max_steps=8), 2)
    saved = dataclasses.replace(course, max_steps=4, checkpoint_dir=str(tmp_path))
    run_training(saved, 2)
    assert "flat parameters" in checkpoint.read_meta(checkpoint.latest_checkpoint(tmp_path))["layout"]
    resumed, history = run_training(dataclasses.replace(saved, max_steps=8, resume="latest"), 4)
    assert history[-1]["world_size"] == 4
    torch.testing.assert_close(resumed, straight, **TOLERANCE)
    with pytest.raises(
        UserError,
        match=r"resume with the --sharding, --impl and model of the run "
        rf"that wrote it \(its flags: --sharding {sharding} --impl course\)",
    ):
        other_layout = dict(sharding="fsdp") if sharding == "zero2" else dict(impl="torch")
        launch(_resume, 2, dataclasses.replace(saved, max_steps=9, resume="latest", **other_layout))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(sharding="ddp", sharding_strategy="SHARD_GRAD_OP"),
            "--sharding-strategy configure(s) the course's FSDP: use --sharding fsdp --impl course",
        ),
        (
            dict(sharding="fsdp", impl="torch", sharding_strategy="NO_SHARD"),
            "use --sharding fsdp --impl course",
        ),
        (
            dict(sharding="zero1", impl="course", cpu_offload="params"),
            "--cpu-offload configure(s) the course's FSDP: use --sharding fsdp --impl course",
        ),
        (
            dict(sharding="fsdp", impl="course", hybrid_shard_size=2),
            "--hybrid-shard-size needs --sharding-strategy HYBRID_SHARD",
        ),
        (
            dict(sharding="zero2", impl="torch"),
            "--sharding zero2 runs the course's ZeroDataParallel: add --impl course",
        ),
        (
            dict(sharding="fsdp", impl="course", clip_grad_norm=0.0),
            "--clip-grad-norm must be a finite number above 0, got 0.0",
        ),
    ],
)
def test_sharding_flags_are_checked_before_any_rank_waits(changes, message):
    from course_lib.train.config import validate_config

    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(dataclasses.replace(BASE, **changes), 2)


# -- what one step costs beyond the sharding's own communication -------------------------------------


def _one_step(sharding: str, impl: str, extra: dict) -> tuple[dict, int, int]:
    """The collectives of one warm training step, and the sharding's units and buckets."""
    from course_lib.distributed import comm

    trainer = Trainer(dataclasses.replace(BASE, sharding=sharding, impl=impl, **extra))
    batches = iter(trainer.train_loader)
    trainer._train_step(batches)  # the first step builds what is built once
    with comm.CommLog() as log:
        trainer._train_step(batches)
    counts = {op: log.count(op) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
    model = trainer.model
    return counts, len(getattr(model, "units", [])), len(getattr(model, "buckets", []))


STEP_COLLECTIVES = {
    # sharding, impl, flags -> what the course's communication adds to the trainer's one all-reduce
    "torch DDP": ("ddp", "torch", {}, lambda units, buckets: {}),  # PyTorch's own calls are not logged
    "torch FSDP2": ("fsdp", "torch", {}, lambda units, buckets: {}),
    "course DDP": ("ddp", "course", {}, lambda units, buckets: {"all_reduce": buckets}),
    "course ZeRO-2": (
        "zero2",
        "course",
        {},
        lambda units, buckets: {"reduce_scatter": buckets, "all_gather": 1},  # one per gradient bucket
    ),
    "course FSDP": (
        "fsdp",
        "course",
        {},
        lambda units, buckets: {"all_gather": 2 * units, "reduce_scatter": units},
    ),
}


@pytest.mark.parametrize("case", STEP_COLLECTIVES)
def test_a_step_makes_one_collective_of_its_own_beside_the_shardings(case):
    sharding, impl, extra, wrapper_calls = STEP_COLLECTIVES[case]
    counts, units, buckets = launch(_one_step, 2, sharding, impl, extra)[0]
    expected = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "broadcast": 0}
    expected.update(wrapper_calls(units, buckets))
    expected["all_reduce"] += 1  # the trainer's: loss, samples, finiteness and stop, together
    assert counts == expected


def _host_reads_per_step(grad_accum: int) -> int:
    """How often the trainer's own code reads a tensor back to the host during one step."""
    import inspect

    trainer = Trainer(dataclasses.replace(BASE, sharding="single", grad_accum=grad_accum))
    batches = iter(trainer.train_loader)
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__")}

    def counting(name):
        def read(tensor, *args, **kwargs):
            if "course_lib/train/" in inspect.stack()[1].filename:  # the loop and its metrics
                reads.append(name)
            return originals[name](tensor, *args, **kwargs)

        return read

    try:
        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        trainer._train_step(batches)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return len(reads)


def test_a_step_waits_for_the_device_once_however_many_micro_batches():
    assert launch(_host_reads_per_step, 1, 1) == [1]
    assert launch(_host_reads_per_step, 1, 4) == [1]
