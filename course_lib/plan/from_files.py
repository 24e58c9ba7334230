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
num_experts
num_experts_per_tok        top_k
rms_norm_eps /             norm: RMSNorm where the config has ``rms_norm_eps``, else LayerNorm
layer_norm_eps
hidden_act                 gated_mlp: a SwiGLU (three matrices) for ``silu``, else two matrices
sliding_window,            sliding_window, and sliding_layers: the layers ``layer_types`` calls
layer_types                ``sliding_attention`` (absent: every layer, where a window is given)
=========================  =====================================================================

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
    heads = _whole(config, "num_attention_heads", path)
    hidden = _whole(config, "hidden_size", path)
    experts_key = next((key for key in ("num_local_experts", "num_experts") if config.get(key)), None)
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
        gated_mlp=config.get("hidden_act", "silu") == "silu",
        experts=experts,
        top_k=_whole(config, "num_experts_per_tok", path) if experts > 1 else 1,
        norm="rms" if "rms_norm_eps" in config or "layer_norm_eps" not in config else "layer",
        bias=bool(config.get("attention_bias", False)),
        source=f"{path} ({config.get('model_type', 'a config.json')})",
        head_dim=head_dim,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
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
    """``sliding_window`` and ``sliding_layers`` from a config: the window where one is set, over the
    layers ``layer_types`` calls ``sliding_attention`` (Mistral's configs set a window for all)."""
    window = config.get("sliding_window")
    if not window:
        return {}
    window = _whole(config, "sliding_window", path)
    types = config.get("layer_types")
    layers = config.get("num_hidden_layers")
    if types is None:
        return {"sliding_window": window, "sliding_layers": layers}
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
        values[name] = check_number(f"{path}: {name}", values[name], above=0)
    if "context_bytes" in values:
        values["context_bytes"] = check_number(f"{path}: context_bytes", values["context_bytes"], minimum=0)
    values["gpus_per_node"] = _whole(values, "gpus_per_node", path)
    if values.get("gpu"):
        check_choice("gpu", values["gpu"], tuple(GPUS))
    if values["achieved_flops"] > values["peak_flops"]:
        raise UserError(f"{path}: achieved_flops is above peak_flops: the peak is the most a GPU does")
    return ClusterSpec(**values)


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
