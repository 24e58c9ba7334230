"""The Llama module is the model the planner plans, and the course's verbs train it like one process."""

from __future__ import annotations

import json

import pytest
import torch

from course_lib import data
from course_lib.distributed import comm, runtime
from course_lib.distributed.launch import launch
from course_lib.errors import UserError
from course_lib.llama import Llama, LlamaAttention, rotate
from course_lib.models import count_parameters, lm_loss
from course_lib.plan import from_files
from course_lib.plan.specs import MODELS, ModelSpec

SEQ = 16
# 6 query heads sharing 2 key/value heads, a head width apart from d_model / heads, an MLP width
# and a vocabulary (the Zen of Python's characters) that make counts no world size divides
SMALL = dict(layers=3, d_model=30, heads=6, kv_heads=2, ffn_hidden=46, head_dim=6)


def _spec(vocab: int, **changes) -> ModelSpec:
    return ModelSpec("small-llama", **(SMALL | {"vocab": vocab} | changes))


@pytest.mark.parametrize("tied", [False, True])
def test_the_module_has_the_parameters_the_planner_counts(tied):
    spec = _spec(61, tied_embeddings=tied)
    model = Llama(spec)
    assert count_parameters(model) == spec.parameters()
    assert tied == (model[-1].proj.weight is model[0].tokens.weight)


def test_llama_3_8b_as_built_has_its_8_billion_parameters_on_the_meta_device():
    with torch.device("meta"):
        model = Llama(MODELS["llama3-8b"])
    assert count_parameters(model) == MODELS["llama3-8b"].parameters() == 8_030_261_248


def test_a_config_json_gives_the_spec_and_the_module(tmp_path):
    config = {
        "model_type": "llama", "hidden_size": 30, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 2, "intermediate_size": 46, "vocab_size": 61, "head_dim": 6,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec, model = from_files.model_from_config(path), from_files.module_from_config(path)
    assert count_parameters(model) == spec.parameters()
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 61)


def test_grouped_query_attention_is_each_key_head_repeated_for_its_query_heads():
    torch.manual_seed(0)
    attention = LlamaAttention(30, 6, 2, 6)
    x = torch.randn(3, SEQ, 30)
    batch, seq, _ = x.shape
    q, k, v = (t.view(batch, seq, -1, 6).transpose(1, 2) for t in attention.project(x))
    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)  # torchtitan's repeat_kv
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = attention.out(expected.transpose(1, 2).reshape(batch, seq, -1))
    torch.testing.assert_close(attention(x), expected)


def test_rotary_positions_make_a_query_key_product_depend_on_their_distance_alone():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 12, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 12, 8)
    scores = rotate(q) @ rotate(k).transpose(-1, -2)  # the same vectors at every position
    for distance in range(4):
        diagonal = torch.diagonal(scores[0, 0], offset=distance)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal))


def test_a_spec_with_experts_or_without_the_shapes_is_refused_with_what_to_use():
    with pytest.raises(UserError, match=r"build this one with parallel.expert.moe_llama\(spec\)"):
        Llama(MODELS["mixtral-8x7b"])
    with pytest.raises(UserError, match="lacks"):
        Llama(object())
    with pytest.raises(UserError, match="share 4 key/value heads"):
        LlamaAttention(30, 6, 4, 5)


def _train(layout_name: str, steps: int = 3) -> list[float] | None:
    """``parallelize``'s layout of the small Llama on this process group; each step's loss (the
    mean over the data replicas) on the rank that has it."""
    from course_lib.parallel.mesh import Mesh
    from course_lib.plan.layout import Layout
    from course_lib.plan.parallelize import parallelize

    layout = Layout.from_name(layout_name).with_(precision="fp32")
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=SEQ)
    dense = Llama(_spec(len(vocabulary)))
    mesh = Mesh(**{axis: layout.degree(axis) for axis in ("data", "tensor", "pipeline")})
    model = parallelize(dense, mesh, layout, seq_len=SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    executor = (
        model.executor(micro_batch=6 // layout.data // 2, microbatches=2) if layout.pipeline > 1 else None
    )
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (6,), generator=generator)
        mine = batch[mesh.coordinates.data :: layout.data]  # this replica's share of the global batch
        optimizer.zero_grad()
        loss = model.forward_backward(inputs[mine], targets[mine], executor)
        model.finish_gradients()
        optimizer.step()
        if loss is not None:
            comm.all_reduce(loss, op="mean", group=mesh.group("data"))
            losses.append(loss.item())
    return losses if losses and runtime.rank() == max(0, runtime.world_size() - 1) else None


def _one_process(steps: int = 3) -> list[float]:
    torch.manual_seed(0)
    inputs, targets, vocabulary = data.zen_windows(seq_len=SEQ)
    model = Llama(_spec(len(vocabulary)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        batch = torch.randint(0, len(inputs), (6,), generator=generator)
        optimizer.zero_grad()
        loss = lm_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    return _one_process()


@pytest.mark.parametrize(
    "layout, world",
    [
        ("d1 ddp ac", 1),
        ("d1 ddp sac", 1),
        ("d2 ddp", 2),
        ("d3 ddp", 3),
        ("d2 fsdp", 2),
        ("d3 fsdp", 3),
        ("d2 zero2", 2),
        ("t2 ddp no-sp no-loss-parallel", 2),
        ("d2.t2 fsdp ac no-sp no-loss-parallel", 4),
        ("p2 ddp", 2),
    ],
)
def test_the_courses_verbs_train_it_like_one_process(reference, layout, world):
    """The course's DDP, FSDP, ZeRO-2, tensor parallelism (grouped heads whole on each rank, the
    gated MLP's two up-projections by columns) and recomputation, alone and combined: the loss
    curve of one process."""
    losses = [result for result in launch(_train, world, layout) if result is not None]
    assert len(losses) == 1
    assert losses[0] == pytest.approx(reference, rel=1e-5)


def test_the_llama_layouts_the_module_cannot_run_are_refused_with_the_fix():
    from course_lib.plan.layout import Layout
    from course_lib.plan.parallelize import parallelize

    dense = Llama(_spec(61))
    for layout, message in (
        (Layout(context=2, sharding="ddp"), "use context=1"),
        (Layout(tensor=2, sharding="ddp"), "sequence_parallel=False and loss_parallel=False"),
    ):
        with pytest.raises(UserError, match=message):
            parallelize(dense, None, layout, seq_len=SEQ)


def test_a_spec_with_experts_builds_its_mixture_with_the_planners_parameters():
    """Mixtral 8x7B's shape (on the meta device) and a small one that trains: every block's MLP
    an MoE of SwiGLU experts, the parameters the planner counts."""
    from course_lib.parallel import expert

    with torch.device("meta"):
        mixtral = expert.moe_llama(MODELS["mixtral-8x7b"])
    assert count_parameters(mixtral) == MODELS["mixtral-8x7b"].parameters()
    spec = _spec(61, experts=4, top_k=2)
    torch.manual_seed(0)
    model = expert.moe_llama(spec)
    assert count_parameters(model) == spec.parameters()
    assert len(expert.moe_layers(model)) == spec.layers
    ids = torch.randint(0, 61, (3, SEQ))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(UserError, match="has no experts: build it with llama.Llama"):
        expert.moe_llama(_spec(61))
