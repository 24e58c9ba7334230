"""memory: the ZeRO paper's table, and measured bytes that match the model."""

import pytest
import torch

from course_lib import models
from course_lib.distributed import runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.parallel import memory


@pytest.mark.parametrize(
    "sharding, gigabytes", [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("fsdp", 1.9)]
)
def test_zero_paper_table(sharding, gigabytes):
    """7.5B parameters on 64 GPUs with mixed-precision Adam (K = 12), as in the ZeRO paper's Figure 1."""
    total = memory.model_state_bytes(7.5e9, 64, sharding, **memory.MIXED_PRECISION_ADAM).total
    assert total / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_traffic_model():
    assert memory.traffic_elements_per_rank(1000, 4, "ddp") == 2 * 3 / 4 * 1000
    assert memory.traffic_elements_per_rank(1000, 4, "fsdp") == 1.5 * memory.traffic_elements_per_rank(
        1000, 4, "zero1"
    )
    with pytest.raises(UserError, match="unknown sharding 'zero4': choose one of ddp, zero1, zero2, fsdp"):
        memory.traffic_elements_per_rank(1000, 4, "zero4")


def test_which_sharding_fits():
    # 7.5B parameters on 64 GPUs of 80 GB, 20% kept for activations:
    # DDP's 120 GB cannot fit, ZeRO-1's 31.4 GB can
    fits = memory.shardings_that_fit(7.5e9, 80e9, 64)
    assert fits == {"ddp": False, "zero1": True, "zero2": True, "fsdp": True}
    assert memory.shardings_that_fit(7.5e9, 16e9, 64) == {
        "ddp": False,
        "zero1": False,
        "zero2": False,
        "fsdp": True,
    }


def test_measured_bytes_of_a_single_process_adam_match_fp32_adam():
    model = models.build_model("digits_cnn")
    optimizer = torch.optim.Adam(model.parameters())
    torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([1, 2, 3, 4])).backward()
    optimizer.step()
    measured = memory.measure_model_states(model, optimizer=optimizer)
    expected = memory.model_state_bytes(35_173, 1, "ddp", **memory.FP32_ADAM)
    assert (measured.params, measured.grads) == (expected.params, expected.grads)
    steps = len(optimizer.state) * 4  # Adam also keeps one fp32 step counter per parameter tensor
    assert measured.optimizer == expected.optimizer + steps


def _fsdp_measured():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = models.build_model("digits_cnn")
    for unit in models.sharding_units(model):
        fully_shard(unit)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    optimizer.step()
    return memory.measure_model_states(model, optimizer=optimizer), runtime.world_size()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_memory_per_rank_falls_as_fsdp_says(world_size):
    """FSDP2 shards every parameter on dim 0; padding makes a shard at most a few rows larger."""
    results = launch(_fsdp_measured, world_size)
    model_bytes = memory.model_state_bytes(35_173, world_size, "fsdp", **memory.FP32_ADAM)
    total_params = sum(measured.params for measured, _ in results)
    assert total_params == 4 * 35_173  # the shards add up to the whole model, nothing held twice
    for measured, _ in results:
        assert measured.params == pytest.approx(model_bytes.params, rel=0.1)
        assert measured.grads == measured.params
        assert measured.optimizer >= 2 * measured.params
