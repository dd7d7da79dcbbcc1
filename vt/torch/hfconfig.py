"""A Hugging Face config.json as a vt.torch.llama.LlamaConfig, read as transformers 5 reads it.

Anything the decoder does not implement is refused with a one-line ValueError naming the file
and the field, before any weight is read. RoPE follows transformers'
`RotaryEmbeddingConfigMixin`: `rope_scaling`, when set, replaces `rope_parameters`; the
block's own `rope_theta` wins over the top-level one (default 10000); `rope_type` wins over
the older `type`; a llama3 block takes `original_max_position_embeddings` from the top level
when the config has one there, else from the block, else `max_position_embeddings`. vt
implements the default, linear and llama3 types at `partial_rotary_factor` 1; any other type
or field of the block is refused.
"""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

from vt.torch.llama import LlamaConfig
from vt.validate import integer

FAMILIES = ("llama", "qwen2", "qwen3")
DEFAULT_ROPE_THETA = 10000.0   # transformers' RotaryEmbeddingConfigMixin.default_theta

# The fields of a rope block each type reads (the type itself and rope_theta aside).
ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_ALWAYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def read_config(path) -> LlamaConfig:
    """The LlamaConfig of a checkpoint directory's config.json (refusing what it cannot run)."""
    hf, where = _read_json(path)
    return config_from_hf(hf, where=where)


def read_max_position_embeddings(path) -> int | None:
    """config.json's max_position_embeddings, the context the checkpoint was trained for
    (None when it names none)."""
    hf, where = _read_json(path)
    if hf.get("max_position_embeddings") is None:
        return None
    return _positive_int(hf, "max_position_embeddings", where)


def _read_json(path) -> tuple[dict, str]:
    """A checkpoint directory's config.json as a dict, and the file's name for errors."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint path {str(path)!r} does not exist (vt.torch.hf loads a local "
                         f"directory with config.json and *.safetensors; it does not download "
                         f"hub ids: fetch one with huggingface_hub.snapshot_download first)")
    if not path.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} is not a directory (config.json and "
                         f"*.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"checkpoint path {str(path)!r} has no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(hf).__name__}")
    return hf, str(cfg_file)


def config_from_hf(hf: dict, where: str = "config.json") -> LlamaConfig:
    """The LlamaConfig of a config.json's contents; `where` names the file in errors."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{where}: model_type={family!r} is not supported; vt.torch.hf loads "
                         f"{', '.join(FAMILIES)}")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "silu")
    if not _is_one(hf.get("pretraining_tp")):
        _refuse(where, "pretraining_tp", hf["pretraining_tp"], "1")
    if _flag(hf, "use_sliding_window", where):
        _refuse(where, "use_sliding_window", True, "false (every layer full attention)")
    layer_types = hf.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ValueError(f"{where}: layer_types={layer_types!r} must be a list (one type per layer)")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        _refuse(where, "layer_types", sorted(set(map(str, layer_types))), "full_attention only")
    size = {f: _positive_int(hf, f, where) for f in
            ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")}
    heads = size["num_attention_heads"]
    kv_heads = _positive_int(hf, "num_key_value_heads", where, default=heads)
    head_dim = _positive_int(hf, "head_dim", where, default=size["hidden_size"] // heads or None)
    theta, linear, llama3 = rope_from_hf(hf, where)
    bias, mlp_bias = _flag(hf, "attention_bias", where), _flag(hf, "mlp_bias", where)
    tie = _flag(hf, "tie_word_embeddings", where)
    # transformers' default when missing; null is refused (its RMSNorm would add None)
    eps = _number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", where)
    try:
        return LlamaConfig(
            vocab=size["vocab_size"], hidden=size["hidden_size"],
            intermediate=size["intermediate_size"], layers=size["num_hidden_layers"], heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, rms_eps=eps,
            rope_theta=theta, rope_linear_factor=linear, rope_llama3=llama3,
            # Qwen2 always has q/k/v biases (and no flag); Llama has attention_bias on all four.
            qkv_bias=True if family == "qwen2" else bias, o_bias=bias if family != "qwen2" else False,
            mlp_bias=mlp_bias, qk_norm=family == "qwen3",
            tie_embeddings=tie)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def rope_from_hf(hf: dict, where: str = "config.json") -> tuple[float, float, tuple | None]:
    """(rope_theta, linear factor, llama3 (factor, low, high, original_max) or None)."""
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    field, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: {field}={rope!r} must be an object (rope_type, rope_theta, ...)")
    if isinstance(layer_types := hf.get("layer_types"), list) and set(rope) & set(layer_types):
        raise ValueError(f"{where}: {field} per layer type ({sorted(rope)}) is not supported; "
                         f"vt.torch.hf reads one rope block for every layer")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_FIELDS:
        raise ValueError(f"{where}: {field}.rope_type={kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_FIELDS)})")
    unknown = sorted(set(rope) - set(_ALWAYS) - set(ROPE_FIELDS[kind]))
    if unknown:
        raise ValueError(f"{where}: {field}.{unknown[0]} is not supported for rope_type={kind!r} "
                         f"(vt implements {', '.join(ROPE_FIELDS[kind]) or 'no field'} for it)")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if not _is_one(partial):
        _refuse(where, "partial_rotary_factor", partial, "1.0 (every head dimension rotates)")
    if "rope_theta" in rope:
        theta = _number(rope["rope_theta"], f"{field}.rope_theta", where)
    else:
        theta = _number(hf.get("rope_theta", DEFAULT_ROPE_THETA), "rope_theta", where)
    if kind == "default":
        return theta, 1.0, None
    block = dict(rope)
    if kind == "llama3":
        if "original_max_position_embeddings" in hf:
            block["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        elif "original_max_position_embeddings" not in block and "max_position_embeddings" in hf:
            block["original_max_position_embeddings"] = hf["max_position_embeddings"]
    missing = [f for f in ROPE_FIELDS[kind] if block.get(f) is None]
    if missing:
        raise ValueError(f"{where}: {field}.{missing[0]} is missing (rope_type={kind!r} needs "
                         f"{', '.join(ROPE_FIELDS[kind])})")
    values = tuple(_number(block[f], f"{field}.{f}", where) for f in ROPE_FIELDS[kind])
    if kind == "linear":
        return theta, values[0], None
    if values[1] == values[2]:
        raise ValueError(f"{where}: {field}.low_freq_factor and high_freq_factor are both "
                         f"{values[1]}: llama3 rope divides by their difference")
    return theta, 1.0, values


def _positive_int(hf: dict, field: str, where: str, default=None) -> int:
    value = hf.get(field)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"{where}: {field} is missing (a positive int)")
    try:
        return integer(f"{where}: {field}", value, 1)
    except TypeError as exc:   # a config.json field of the wrong type is a bad value of the file
        raise ValueError(str(exc)) from None


def _flag(hf: dict, field: str, where: str) -> bool:
    """A true/false field, false when missing or null (as transformers reads None)."""
    value = hf.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {field}={value!r} must be true or false")
    return value


def _is_one(value) -> bool:
    """Whether an optional factor is 1 or unset (true is not 1 here, though Python's == says
    so)."""
    return value is None or (not isinstance(value, bool) and isinstance(value, numbers.Real)
                             and value == 1)


def _number(value, field: str, where: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(f"{where}: {field}={value!r} must be a positive number")
    return float(value)


def _refuse(where: str, field: str, value, supported: str) -> None:
    raise ValueError(f"{where}: {field}={value!r} is not supported (supported: {supported})")
