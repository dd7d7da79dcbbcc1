"""Load a Hugging Face checkpoint directory (config.json + safetensors) of the Llama, Qwen2 or
Qwen3 family into vt.torch.llama.LlamaDecoder. Anything the decoder does not implement is
refused with a ValueError naming the config field, before any weight is read."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vt.step import KVGeometry
from vt.torch.llama import LlamaConfig, LlamaDecoder

FAMILIES = ("llama", "qwen2", "qwen3")


def read_config(path) -> LlamaConfig:
    """The LlamaConfig of a checkpoint directory's config.json (refusing what it cannot run)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"checkpoint path {str(path)!r} has no config.json")
    hf = json.loads(cfg_file.read_text())
    return config_from_hf(hf)


def config_from_hf(hf: dict) -> LlamaConfig:
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json: model_type={family!r} is not supported; vt.torch.hf loads "
                         f"{', '.join(FAMILIES)}")
    _require(hf, "hidden_act", ("silu",))
    if hf.get("pretraining_tp", 1) != 1:
        _refuse("pretraining_tp", hf["pretraining_tp"], "1")
    if hf.get("use_sliding_window", False):
        _refuse("use_sliding_window", True, "false (every layer full attention)")
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        _refuse("layer_types", sorted(set(layer_types)), "full_attention only")
    heads = hf["num_attention_heads"]
    theta, llama3 = _rope(hf)
    bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        vocab=hf["vocab_size"], hidden=hf["hidden_size"], intermediate=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_llama3=llama3,
        # Qwen2 always has q/k/v biases (and no flag); Llama has attention_bias on all four.
        qkv_bias=True if family == "qwen2" else bias, o_bias=bias if family != "qwen2" else False,
        mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=family == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def load(path, geometry: KVGeometry, *, dtype=torch.bfloat16, device="cuda") -> LlamaDecoder:
    """A LlamaDecoder with the checkpoint's weights, its KV cache sized for `geometry`."""
    path = Path(path)
    cfg = read_config(path)
    model = LlamaDecoder(cfg, geometry, dtype=dtype, device=device)
    tensors = _read_safetensors(path)
    model.load_state_dict(_to_vt_names(cfg, tensors), strict=True)
    return model


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint path {str(path)!r} has no *.safetensors file")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _to_vt_names(cfg: LlamaConfig, hf: dict) -> dict[str, torch.Tensor]:
    """Hugging Face's parameter names to LlamaDecoder's: q, k, v and gate, up concatenated into
    the fused projections."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    out = {"embed.weight": hf.pop("embed_tokens.weight"), "norm.weight": hf.pop("norm.weight")}
    head = hf.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:
        if head is None:
            raise ValueError("checkpoint: lm_head.weight is missing and tie_word_embeddings is false")
        out["lm_head.weight"] = head
    for i in range(cfg.layers):
        p = q = f"layers.{i}."   # the same prefix in both namings
        att = p + "self_attn."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[q + f"attn.qkv.{kind}"] = torch.cat([hf.pop(att + f"{n}_proj.{kind}")
                                                     for n in ("q", "k", "v")])
        out[q + "attn.o.weight"] = hf.pop(att + "o_proj.weight")
        if cfg.o_bias:
            out[q + "attn.o.bias"] = hf.pop(att + "o_proj.bias")
        if cfg.qk_norm:
            out[q + "attn.q_norm.weight"] = hf.pop(att + "q_norm.weight")
            out[q + "attn.k_norm.weight"] = hf.pop(att + "k_norm.weight")
        mlp = p + "mlp."
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            out[q + f"mlp.gate_up.{kind}"] = torch.cat([hf.pop(mlp + f"gate_proj.{kind}"),
                                                        hf.pop(mlp + f"up_proj.{kind}")])
            out[q + f"mlp.down.{kind}"] = hf.pop(mlp + f"down_proj.{kind}")
        out[q + "attn_norm.weight"] = hf.pop(p + "input_layernorm.weight")
        out[q + "mlp_norm.weight"] = hf.pop(p + "post_attention_layernorm.weight")
    # Rotary tables some exports keep as buffers carry nothing the config does not say.
    left = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if left:
        raise ValueError(f"checkpoint has tensors the decoder does not use: {left[:5]}")
    return out


def _rope(hf: dict) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling or None) from `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (earlier exports)."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 10000.0))
        field = "rope_scaling"
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, (float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]),
                       float(params["original_max_position_embeddings"]))
    raise ValueError(f"config.json: {field}.rope_type={kind!r} is not supported (default, llama3)")


def _require(hf: dict, field: str, allowed: tuple) -> None:
    if hf.get(field) not in allowed:
        _refuse(field, hf.get(field), " or ".join(map(str, allowed)))


def _refuse(field: str, value, supported: str) -> None:
    raise ValueError(f"config.json: {field}={value!r} is not supported (supported: {supported})")
