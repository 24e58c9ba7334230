"""Models and clusters of one's own: a Hugging Face config.json gives the built-in model's exact
counts, a head size apart from d_model/heads and tied embeddings are counted as published, and a
cluster file gives the built-in cluster's predictions; a missing field is named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from course_lib.errors import UserError
from course_lib.plan import from_files, specs
from course_lib.plan.cost_model import predict
from course_lib.plan.layout import Layout
from course_lib.tools import plan as plan_tool

from conftest import call_main

LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B config.json, the fields the planner reads
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "vocab_size": 128256,
}  # fmt: skip


def _config(tmp_path, fields: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


def test_llama_3_8bs_config_is_the_built_in_model(tmp_path):
    model, built_in = from_files.model_from_config(_config(tmp_path, LLAMA3_8B)), specs.MODELS["llama3-8b"]
    assert model.parameters() == built_in.parameters() == 8_030_261_248  # the Hub's count
    assert model.flops_per_token(8192) == built_in.flops_per_token(8192)
    layout = Layout(data=8)
    assert predict(
        model, specs.CLUSTERS["alps"], layout, seq_len=8192, global_batch=16
    ).time == pytest.approx(
        predict(built_in, specs.CLUSTERS["alps"], layout, seq_len=8192, global_batch=16).time
    )


def test_tied_embeddings_are_kept_once_and_multiplied_once(tmp_path):
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters on the Hub, its projection the embedding's matrix
    tied = from_files.model_from_config(_config(tmp_path, LLAMA3_8B | {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
        "tie_word_embeddings": True,
    }))  # fmt: skip
    assert tied.tied_embeddings and tied.parameters() == 1_235_814_400
    untied = specs.ModelSpec(**{**tied.__dict__, "tied_embeddings": False})
    assert untied.parameters() - tied.parameters() == 128256 * 2048
    assert tied.flops_per_token(4096) == untied.flops_per_token(4096)  # the head's matmul still runs
    one = Layout(data=2, sharding="ddp")
    states = {
        model.tied_embeddings: predict(
            model, specs.CLUSTERS["alps"], one, seq_len=4096, global_batch=2
        ).memory
        for model in (tied, untied)
    }
    assert states[False]["parameters"] > states[True]["parameters"]


def test_a_head_size_apart_from_the_width_is_counted_as_published(tmp_path):
    # openai/gpt-oss-120b: width 2880 but 64 heads of 64; the model card: 116.83 B parameters,
    # 5.13 B active of which the embedding is no part
    oss = from_files.model_from_config(_config(tmp_path, {
        "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 36, "vocab_size": 201088,
        "num_local_experts": 128, "num_experts_per_tok": 4, "attention_bias": True, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
    }))  # fmt: skip
    assert oss.attention_width == 4096 != oss.d_model
    assert oss.parameters() == pytest.approx(116.83e9, rel=0.005)
    assert oss.active_parameters() - oss.embedding_parameters() == pytest.approx(5.13e9, rel=0.01)
    # attention's FLOPs follow the heads' width, not the model's
    wide = specs.ModelSpec(**{**oss.__dict__, "head_dim": 0, "heads": 64})
    assert oss.flops_per_token(4096) - wide.flops_per_token(4096) == pytest.approx(
        6 * 36 * (oss.attention_parameters() - wide.attention_parameters()) + 12 * 36 * (4096 - 2880) * 4096
    )


GPT_OSS_120B = {
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 36, "vocab_size": 201088,
    "num_local_experts": 128, "num_experts_per_tok": 4, "attention_bias": True, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}  # fmt: skip


def test_sliding_window_layers_pay_for_their_window_only(tmp_path):
    oss = from_files.model_from_config(_config(tmp_path, GPT_OSS_120B))
    built_in = specs.MODELS["gpt-oss-120b"]
    assert (oss.sliding_window, oss.sliding_layers) == (128, 18)
    assert (built_in.sliding_window, built_in.sliding_layers) == (128, 18)
    assert oss.flops_per_token(4096) == built_in.flops_per_token(4096)
    # 18 full layers see the whole 4096-token square, 18 windowed ones a 2 x 128-token band of it
    full = specs.ModelSpec(**{**oss.__dict__, "sliding_window": 0, "sliding_layers": 0})
    assert full.flops_per_token(4096) - oss.flops_per_token(4096) == 12 * 4096 * 18 * (4096 - 256)
    # a window as wide as the sequence changes nothing; Mistral's configs window every layer
    assert oss.attended_span(200) == full.attended_span(200) == 36 * 200
    mistral = from_files.model_from_config(_config(tmp_path, LLAMA3_8B | {"sliding_window": 4096}))
    assert mistral.sliding_layers == 32
    cluster, layout = specs.CLUSTERS["h100-node"], Layout(data=8, expert=8, sharding="zero1")
    fast, slow = (
        predict(m, cluster, layout, seq_len=16384, global_batch=8).tokens_per_s for m in (oss, full)
    )
    assert fast > slow


def test_bad_windows_are_named(tmp_path):
    with pytest.raises(UserError, match="one type for each of the 36 layers"):
        from_files.model_from_config(_config(tmp_path, GPT_OSS_120B | {"layer_types": ["full_attention"]}))
    with pytest.raises(UserError, match="set together with sliding_window"):
        specs.ModelSpec("x", 4, 64, 4, 4, 128, 100, sliding_layers=2)


@pytest.mark.parametrize(
    "dropped, message",
    [("vocab_size", "has no vocab_size"), ("num_hidden_layers", "has no num_hidden_layers")],
)
def test_a_config_missing_a_field_names_it(tmp_path, dropped, message):
    fields = {k: v for k, v in LLAMA3_8B.items() if k != dropped}
    with pytest.raises(UserError, match=message):
        from_files.model_from_config(_config(tmp_path, fields))


def _alps_toml(tmp_path, drop: str = "") -> str:
    alps = specs.CLUSTERS["alps"]
    lines = [
        f"{name} = {json.dumps(getattr(alps, name))}"
        for name in ("name", "gpus_per_node", "gpu_memory_bytes", "context_bytes", "peak_flops",
                     "achieved_flops", "memory_bandwidth", "source", "gpu")
        if name != drop
    ]  # fmt: skip
    for link in ("inside_node", "between_nodes"):
        value = getattr(alps, link)
        lines += [f"[{link}]", f"latency_s = {value.latency_s!r}", f"bandwidth = {value.bandwidth!r}"]
    path = tmp_path / "alps.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_cluster_file_is_the_built_in_cluster_and_a_missing_field_is_named(tmp_path):
    assert from_files.cluster_from_file(_alps_toml(tmp_path)) == specs.CLUSTERS["alps"]
    with pytest.raises(UserError, match="has no peak_flops"):
        from_files.cluster_from_file(_alps_toml(tmp_path, drop="peak_flops"))
    broken = tmp_path / "broken.toml"
    broken.write_text(_alps_toml(tmp_path).read_text().replace("\nbandwidth = ", "\nspeed = ", 1))
    with pytest.raises(UserError, match="inside_node needs bandwidth"):
        from_files.cluster_from_file(broken)
    unknown = tmp_path / "unknown_gpu.toml"
    unknown.write_text(_alps_toml(tmp_path).read_text().replace('gpu = "gh200"', 'gpu = "h300"'))
    with pytest.raises(UserError, match="unknown gpu 'h300': choose one of h100-sxm, "):
        from_files.cluster_from_file(unknown)


def test_the_planner_takes_both_files_and_names_an_unknown_model(tmp_path, capsys):
    def plan(*args):
        return call_main(plan_tool.main, ["--gpus", "8", "--top", "1", *args], capsys)

    shown = plan("--model", str(_config(tmp_path, LLAMA3_8B)), "--cluster", str(_alps_toml(tmp_path)))
    assert shown.returncode == 0, shown.stderr
    assert "8.03 B parameters" in shown.stdout and "layouts fit" in shown.stdout
    refused = plan("--model", "llama-3-8b", "--cluster", "alps")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "unknown --model 'llama-3-8b': choose one of gpt-oss-120b, llama3-70b, llama3-8b" in refused.stderr


def test_a_window_the_config_switches_off_is_not_planned(tmp_path):
    # Qwen/Qwen2.5-7B: a sliding_window of 131072 given, use_sliding_window false
    switched_off = from_files.model_from_config(
        _config(
            tmp_path, LLAMA3_8B | {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
        )
    )
    plain = from_files.model_from_config(_config(tmp_path, LLAMA3_8B | {"model_type": "qwen2"}))
    assert switched_off == plain and switched_off.sliding_window == 0
    # on, the layers from max_window_layers are windowed (Hugging Face's Qwen2)
    partial = from_files.model_from_config(
        _config(
            tmp_path,
            LLAMA3_8B | {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28},
        )
    )
    assert (partial.sliding_window, partial.sliding_layers) == (4096, 32 - 28)


def test_a_gated_mlp_is_read_from_the_family_not_the_activation(tmp_path):
    # google/gemma-7b: a GeGLU, three matrices, whose activation is not silu
    gemma = from_files.model_from_config(
        _config(tmp_path, LLAMA3_8B | {"model_type": "gemma", "hidden_act": "gelu_pytorch_tanh"})
    )
    assert gemma.gated_mlp and gemma.parameters() == specs.MODELS["llama3-8b"].parameters()
    two_matrices = from_files.model_from_config(
        _config(tmp_path, LLAMA3_8B | {"model_type": "starcoder2", "hidden_act": "gelu_pytorch_tanh"})
    )
    assert not two_matrices.gated_mlp
    with pytest.raises(UserError, match="model_type 'my-own' with hidden_act 'gelu' is gated"):
        from_files.model_from_config(
            _config(tmp_path, LLAMA3_8B | {"model_type": "my-own", "hidden_act": "gelu"})
        )


DEEPSEEK_V2_LITE = LLAMA3_8B | {  # deepseek-ai/DeepSeek-V2-Lite config.json: 15.7B parameters
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "moe_layer_freq": 1, "vocab_size": 102400,
}  # fmt: skip


@pytest.mark.parametrize(
    "changes, named",
    [
        ({}, ["kv_lora_rank = 512", "first_k_dense_replace = 1"]),
        ({"n_shared_experts": 0, "first_k_dense_replace": 0, "kv_lora_rank": None}, []),  # a plain MoE
        ({"first_k_dense_replace": 0, "kv_lora_rank": None}, []),  # and with its 2 shared experts
        ({"n_shared_experts": 0, "first_k_dense_replace": 0, "kv_lora_rank": None, "moe_layer_freq": 2},
         ["moe_layer_freq = 2"]),
        ({"n_shared_experts": 0, "first_k_dense_replace": 0, "kv_lora_rank": None,
          "shared_expert_intermediate_size": 5632}, ["shared_expert_intermediate_size = 5632"]),
    ],
)  # fmt: skip
def test_a_key_the_planner_does_not_model_is_refused_by_name(tmp_path, changes, named):
    path = _config(tmp_path, DEEPSEEK_V2_LITE | changes)
    if not named:
        moe = from_files.model_from_config(path)
        assert (moe.experts, moe.top_k, moe.ffn_hidden) == (64, 6, 1408)  # n_routed_experts read
        shared = (DEEPSEEK_V2_LITE | changes)["n_shared_experts"]
        assert moe.shared_experts == shared  # each a routed expert's width, every token through them
        routed_only = dataclasses.replace(moe, shared_experts=0)
        assert moe.parameters() - routed_only.parameters() == moe.layers * shared * moe.expert_parameters()
        assert (
            moe.active_parameters() - routed_only.active_parameters()
            == moe.layers * shared * moe.expert_parameters()
        )
        return
    with pytest.raises(UserError, match="the planner does not model") as raised:
        from_files.model_from_config(path)
    for key in named:
        assert key in str(raised.value)


@pytest.mark.parametrize(
    "line, replacement, message",
    [
        (
            "gpu_memory_bytes = ",
            "gpu_memory_bytes = 96\n#",
            "gpu_memory_bytes = 96 is not a figure of a real machine in bytes",
        ),
        (
            "peak_flops = ",
            "peak_flops = 989.4\n#",
            "peak_flops = 989.4 is not a figure of a real machine in FLOP/s",
        ),
        ("peak_flops = ", "peak_flops = nan\n#", "peak_flops must be a finite number"),
        (
            "context_bytes = ",
            "context_bytes = 2e12\n#",
            "context_bytes 2e+12 leaves nothing of gpu_memory_bytes",
        ),
        (
            "\nbandwidth = ",
            "\nbandwidth = 150\n#",
            "inside_node.bandwidth = 150 is not a figure of a real machine",
        ),
    ],
)
def test_a_cluster_figure_in_another_unit_is_refused_naming_the_unit(tmp_path, line, replacement, message):
    path = _alps_toml(tmp_path)
    path.write_text(path.read_text().replace(line, replacement, 1))
    with pytest.raises(UserError) as raised:
        from_files.cluster_from_file(path)
    assert message in str(raised.value)
