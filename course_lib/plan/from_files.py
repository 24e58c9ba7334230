"""Your own model and cluster, from files: a Hugging Face ``config.json`` and a TOML or JSON cluster.

The planner's built-in models (``specs.MODELS``) and clusters (``specs.CLUSTERS``) are a few
well-known ones; the job you plan is rarely one of them. ``model_from_config`` reads the shapes the
planner needs from the ``config.json`` that every model on the Hugging Face Hub ships with:

=========================  =====================================================================
config.json                ModelSpec
=========================  =====================================================================
hidden_size                d_model
num_hidden_layers          layers
num_attention_heads        heads
num_key_value_heads        kv_heads (absent: heads, multi-head attention)
head_dim                   head_dim (absent: hidden_size / num_attention_heads)
intermediate_size          ffn_hidden (``moe_intermediate_size`` first, for an MoE that has it)
vocab_size                 vocab
tie_word_embeddings        tied_embeddings (absent: untied, as Llama, Mistral and Qwen default)
num_local_experts /        experts (absent: a dense MLP)
num_experts /
n_routed_experts
num_experts_per_tok        top_k
n_shared_experts           shared_experts (DeepSeek's: each ``moe_intermediate_size`` wide)
rms_norm_eps /             norm: RMSNorm where the config has ``rms_norm_eps``, else LayerNorm
layer_norm_eps
model_type, hidden_act     gated_mlp: three matrices in the families that gate their MLP
                           (``GATED_FAMILIES``: Llama, Mistral, Qwen, Gemma, ...) whatever the
                           activation; two in ``UNGATED_FAMILIES``; elsewhere gated for ``silu``
                           (SwiGLU), and any other activation refused as unknown
sliding_window,            sliding_window, and sliding_layers: the layers ``layer_types`` calls
layer_types,               ``sliding_attention`` (absent: every layer from ``max_window_layers``
use_sliding_window,        on, where a window is given); no window where ``use_sliding_window``
max_window_layers          is false (Qwen's configs give a window they switch off)
=========================  =====================================================================

A key that changes the model's shape in a way the planner does not model (``UNMODELLED``: a
shared expert of its own width (Qwen's), latent attention, dense layers among the MoE ones) is
refused by name: planned without them, a DeepSeek-V2-Lite (15.7B) would be priced as a smaller model.

``cluster_from_file`` reads a ``ClusterSpec``'s fields from TOML or JSON, its two links as tables::

    name = "my-cluster"
    gpus_per_node = 8
    gpu_memory_bytes = 85017493504   # as the device reports it: torch.cuda.mem_get_info()[1]
    context_bytes = 753729536        # optional: the CUDA context (gpu_record measures both)
    peak_flops = 989.4e12
    achieved_flops = 692.6e12
    memory_bandwidth = 2.68e12
    source = "where each figure comes from"
    gpu = "h100-sxm"   # optional: time each matmul by its shape (plan.kernels.GPUS)
    [inside_node]
    latency_s = 10e-6
    bandwidth = 436e9
    [between_nodes]
    latency_s = 20e-6
    bandwidth = 50e9

A field the planner needs and the file lacks is named, with the file.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

from ..checks import check_choice, check_int, check_number
from ..errors import UserError
from ..llama import ROPE_THETA, Llama
from .kernels import GPUS
from .specs import CLUSTERS, MODELS, ClusterSpec, Link, ModelSpec


def _read(path: Path, what: str) -> dict:
    """A JSON or TOML file's top-level table."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read the {what} {path}: {error}") from error
    try:
        content = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise UserError(f"the {what} {path} is not valid {kind}: {error}") from error
    if not isinstance(content, dict):
        raise UserError(f"the {what} {path} must hold a table of fields, not a {type(content).__name__}")
    return content


GATED_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3", "gemma3_text", "phi3", "olmo", "olmo2", "granite", "gpt_oss", "cohere", "deepseek_v2",
    "deepseek_v3",
})  # fmt: skip
"""``model_type``s whose MLP is gated (three matrices) whatever ``hidden_act`` names: Gemma's
GeGLU (``gelu_pytorch_tanh``) as much as Llama's SwiGLU (``silu``)."""
UNGATED_FAMILIES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "opt", "falcon", "bloom", "phi", "starcoder2", "mpt"}
)
"""``model_type``s whose MLP is two matrices with an activation between."""
UNMODELLED = {
    "num_shared_experts": "shared experts, which every token uses beside its routed ones",
    "shared_expert_intermediate_size": "a shared expert, which every token uses beside its routed ones",
    "kv_lora_rank": "multi-head latent attention (keys and values through a low-rank latent)",
    "q_lora_rank": "multi-head latent attention (queries through a low-rank latent)",
    "first_k_dense_replace": "dense MLPs in the first layers of an MoE",
    "mlp_only_layers": "dense MLPs in some layers of an MoE",
}
"""Keys that change a model's shape in a way ``ModelSpec`` does not describe, with what they mean:
refused where set (to anything but 0, null or empty), never silently planned as another model."""
TRIVIAL = {"moe_layer_freq": 1, "decoder_sparse_step": 1}
"""Keys the planner reads only at their usual value (an MoE layer in every layer)."""


def _refuse_unmodelled(config: dict, path: Path) -> None:
    """A config key the planner cannot model, named with what it means."""
    found = [f"{key} = {config[key]!r} ({what})" for key, what in UNMODELLED.items() if config.get(key)]
    found += [
        f"{key} = {config[key]!r} (an MoE layer only every {config[key]} layers; the planner models {usual})"
        for key, usual in TRIVIAL.items()
        if config.get(key, usual) != usual
    ]
    if found:
        raise UserError(
            f"{path}: the planner does not model {'; '.join(found)}: planned without it, this would be "
            "another model. Plan the nearest model it does describe (a built-in one, or a config.json "
            "without these keys) and say so"
        )


def _gated(config: dict, path: Path) -> bool:
    """Whether the MLP is gated: by the model's family where the course knows it, else SwiGLU's
    ``silu``; another activation in an unknown family is refused rather than guessed."""
    family, activation = config.get("model_type"), config.get("hidden_act", "silu")
    if family in GATED_FAMILIES:
        return True
    if family in UNGATED_FAMILIES:
        return False
    if activation == "silu":
        return True
    raise UserError(
        f"{path}: cannot tell whether the MLP of model_type {family!r} with hidden_act {activation!r} "
        "is gated (three matrices) or not (two): plan.from_files knows the families in GATED_FAMILIES and "
        "UNGATED_FAMILIES; set model_type to the family it belongs to"
    )


def _whole(config: dict, key: str, path: Path, default: int | None = None) -> int:
    """A positive whole number from the config, or the default where there is one."""
    value = config.get(key, default)
    if value is None:
        raise UserError(f"{path} has no {key}: a model's config.json names it (see plan.from_files)")
    return check_int(f"{path}: {key}", value, minimum=1)


def model_from_config(path: Path) -> ModelSpec:
    """The shapes of a Hugging Face ``config.json`` (see the table above).

    Args:
        path: the ``config.json`` (or any JSON with those fields).
    """
    path = Path(path)
    config = _read(path, "model config")
    _refuse_unmodelled(config, path)
    heads = _whole(config, "num_attention_heads", path)
    hidden = _whole(config, "hidden_size", path)
    experts_key = next(
        (key for key in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(key)), None
    )
    experts = _whole(config, experts_key, path) if experts_key else 1
    ffn_key = (
        "moe_intermediate_size"
        if experts > 1 and config.get("moe_intermediate_size")
        else "intermediate_size"
    )
    kv_heads = _whole(config, "num_key_value_heads", path, default=heads)
    head_dim = _whole(config, "head_dim", path, default=hidden // heads if hidden % heads == 0 else None)
    if heads % kv_heads:
        raise UserError(f"{path}: {heads} attention heads do not share out over {kv_heads} key/value heads")
    return ModelSpec(
        name=config.get("_name_or_path") or path.parent.name or path.stem,
        layers=_whole(config, "num_hidden_layers", path),
        d_model=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn_hidden=_whole(config, ffn_key, path),
        vocab=_whole(config, "vocab_size", path),
        gated_mlp=_gated(config, path),
        experts=experts,
        top_k=_whole(config, "num_experts_per_tok", path) if experts > 1 else 1,
        norm="rms" if "rms_norm_eps" in config or "layer_norm_eps" not in config else "layer",
        bias=bool(config.get("attention_bias", False)),
        source=f"{path} ({config.get('model_type', 'a config.json')})",
        head_dim=head_dim,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        shared_experts=check_int(f"{path}: n_shared_experts", config.get("n_shared_experts") or 0, minimum=0)
        if experts > 1
        else 0,
        **_sliding_window(config, path),
    )


def module_from_config(path: Path) -> Llama:
    """The module a ``config.json`` describes (``llama.Llama``), with its norms' epsilon and rotary
    base; the spec of ``model_from_config`` is what the planner plans of it.

    Args:
        path: the ``config.json``.
    """
    path = Path(path)
    config = _read(path, "model config")
    eps = check_number(f"{path}: rms_norm_eps", config.get("rms_norm_eps", 1e-5), above=0)
    theta = check_number(f"{path}: rope_theta", config.get("rope_theta", ROPE_THETA), above=0)
    return Llama(model_from_config(path), eps=eps, theta=theta)


def _sliding_window(config: dict, path: Path) -> dict:
    """``sliding_window`` and ``sliding_layers`` from a config: the window where one is set and not
    switched off (``use_sliding_window``), over the layers ``layer_types`` calls
    ``sliding_attention``, or else those from ``max_window_layers`` on (Mistral's configs window
    every layer; Qwen's give a window and switch it off)."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return {}
    window = _whole(config, "sliding_window", path)
    types = config.get("layer_types")
    layers = config.get("num_hidden_layers")
    if types is None:
        full = check_int(f"{path}: max_window_layers", config.get("max_window_layers", 0), minimum=0)
        return {"sliding_window": window, "sliding_layers": max(layers - full, 0)} if layers > full else {}
    if not isinstance(types, list) or len(types) != layers:
        raise UserError(f"{path}: layer_types must list one type for each of the {layers} layers")
    return {"sliding_window": window, "sliding_layers": types.count("sliding_attention")}


def cluster_from_file(path: Path) -> ClusterSpec:
    """A cluster's fields from TOML or JSON (``ClusterSpec``'s names; the links as tables).

    Args:
        path: a ``.toml`` file, or JSON under any other name.
    """
    path = Path(path)
    content = _read(path, "cluster file")
    fields = {field.name: field for field in dataclasses.fields(ClusterSpec)}
    unknown = sorted(set(content) - set(fields))
    if "reserved_bytes" in unknown:
        raise UserError(
            f"{path}: reserved_bytes is no longer a cluster's field: give context_bytes (the CUDA context, "
            "which make gpu-record measures) and gpu_memory_bytes as the device reports it; NCCL's "
            "buffers and the allocator's fragmentation are predicted from the layout"
        )
    if unknown:
        raise UserError(
            f"{path} has fields a cluster does not have: {', '.join(unknown)} (see plan.from_files)"
        )
    required = [f.name for f in fields.values() if f.default is dataclasses.MISSING and f.name not in content]
    if required:
        raise UserError(f"{path} has no {', '.join(required)}: a cluster needs them (see plan.from_files)")
    values = dict(content)
    for name in ("inside_node", "between_nodes"):
        link = values[name]
        missing = [key for key in ("latency_s", "bandwidth") if not isinstance(link, dict) or key not in link]
        if missing:
            raise UserError(f"{path}: {name} needs {' and '.join(missing)} (a table: latency_s, bandwidth)")
        latency = check_number(f"{path}: {name}.latency_s", link["latency_s"], minimum=0)
        values[name] = Link(latency, check_number(f"{path}: {name}.bandwidth", link["bandwidth"], above=0))
    for name in ("gpu_memory_bytes", "peak_flops", "achieved_flops", "memory_bandwidth"):
        values[name] = _plausible(path, name, values[name])
    for name in ("inside_node", "between_nodes"):
        _plausible(path, f"{name}.bandwidth", values[name].bandwidth)
    if "context_bytes" in values:
        values["context_bytes"] = check_number(f"{path}: context_bytes", values["context_bytes"], minimum=0)
        if values["context_bytes"] >= values["gpu_memory_bytes"]:
            raise UserError(
                f"{path}: context_bytes {values['context_bytes']:g} leaves nothing of gpu_memory_bytes "
                f"{values['gpu_memory_bytes']:g}: the context is a small part of the memory "
                "(under 1 GiB on an H100)"
            )
    values["gpus_per_node"] = _whole(values, "gpus_per_node", path)
    if values.get("gpu"):
        check_choice("gpu", values["gpu"], tuple(GPUS))
    if values["achieved_flops"] > values["peak_flops"]:
        raise UserError(f"{path}: achieved_flops is above peak_flops: the peak is the most a GPU does")
    return ClusterSpec(**values)


PLAUSIBLE = {
    "gpu_memory_bytes": (2**30, 2**42, "bytes, as torch.cuda.mem_get_info()[1] reports them (80 GB is 80e9)"),
    "peak_flops": (1e9, 1e17, "FLOP/s (989 TFLOP/s is 989e12)"),
    "achieved_flops": (1e9, 1e17, "FLOP/s (692 TFLOP/s is 692e12)"),
    "memory_bandwidth": (1e9, 1e14, "bytes/s (3.35 TB/s is 3.35e12)"),
    "inside_node.bandwidth": (1e6, 1e13, "bytes/s (436 GB/s is 436e9)"),
    "between_nodes.bandwidth": (1e6, 1e13, "bytes/s (50 GB/s is 50e9)"),
}
"""The range each of a cluster file's figures can take on a real machine (a laptop's CPU to a GPU
ten times an H200's), with its unit: a figure outside it is in another unit (GB for bytes)."""


def _plausible(path: Path, name: str, value) -> float:
    """A cluster figure, finite and within ``PLAUSIBLE``'s range, or refused naming its unit."""
    low, high, unit = PLAUSIBLE[name]
    value = check_number(f"{path}: {name}", value, above=0)
    if not low <= value <= high:
        raise UserError(
            f"{path}: {name} = {value:g} is not a figure of a real machine in {unit}; "
            f"between {low:g} and {high:g}"
        )
    return value


def model_named(name: str, *, others: tuple[str, ...] = ()) -> ModelSpec:
    """A built-in model by name, or the model a ``config.json`` describes.

    Args:
        name: a name of ``MODELS``, or a file's path.
        others: names the caller takes itself, listed in the message for an unknown name.
    """
    return _named("model", name, MODELS, (".json",), model_from_config, others, "a Hugging Face config.json")


def cluster_named(name: str, *, others: tuple[str, ...] = ()) -> ClusterSpec:
    """A built-in cluster by name, or the cluster a TOML or JSON file describes.

    Args:
        name: a name of ``CLUSTERS``, or a file's path.
        others: names the caller takes itself, listed in the message for an unknown name.
    """
    return _named(
        "cluster",
        name,
        CLUSTERS,
        (".toml", ".json"),
        cluster_from_file,
        others,
        "a TOML or JSON file of its fields",
    )


def _named(option: str, name: str, built_in: dict, suffixes: tuple, read, others: tuple, file: str):
    """``built_in[name]``, or what ``read`` makes of the file ``name``; an unknown name listed with
    the names there are."""
    if name in built_in:
        return built_in[name]
    if name.endswith(suffixes) or Path(name).is_file():
        return read(Path(name))
    raise UserError(
        f"unknown --{option} {name!r}: choose one of {', '.join([*sorted(built_in), *others])}, or give the "
        f"path of {file}"
    )
