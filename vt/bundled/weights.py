"""Weights: HF-style tensor names, seeded random init, safetensors save/load (shape-checked).

Matrices are stored [out, in] like HF Linear weights. The GDN input projection is
`linear_attn.in_proj_qkvz` laid out as [q | k | v | z] blocks (Qwen3-Next interleaves them
per head group; ours is blocked so a kernel slices it without a permutation), and
`linear_attn.in_proj_ba` as [a | b]. A_log and dt_bias are fp32, everything else is the
storage dtype (bf16 as raw uint16 bits, numpy having no bfloat16).
"""
from __future__ import annotations

import json
import struct

import numpy as np

from .config import ModelConfig
from .kernels._common import to_storage


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every tensor the model reads: name -> (shape, numpy dtype)."""
    st, f4 = cfg.storage_dtype, np.dtype(np.float32)
    H, hd = cfg.hidden, cfg.head_dim
    out = {"model.embed_tokens.weight": ((cfg.vocab, H), st)}
    for i, kind in enumerate(cfg.kinds):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), st)
        out[p + "post_attention_layernorm.weight"] = ((H,), st)
        if kind == "A":
            out[p + "self_attn.q_proj.weight"] = ((cfg.heads * hd, H), st)
            out[p + "self_attn.k_proj.weight"] = ((cfg.kv_heads * hd, H), st)
            out[p + "self_attn.v_proj.weight"] = ((cfg.kv_heads * hd, H), st)
            out[p + "self_attn.o_proj.weight"] = ((H, cfg.heads * hd), st)
        else:
            g, dk, dv = cfg.gdn_heads, cfg.gdn_dk, cfg.gdn_dv
            out[p + "linear_attn.in_proj_qkvz.weight"] = ((2 * g * dk + 2 * g * dv, H), st)
            out[p + "linear_attn.in_proj_ba.weight"] = ((2 * g, H), st)
            out[p + "linear_attn.A_log"] = ((g,), f4)
            out[p + "linear_attn.dt_bias"] = ((g,), f4)
            out[p + "linear_attn.norm.weight"] = ((dv,), st)
            out[p + "linear_attn.out_proj.weight"] = ((H, g * dv), st)
        mlps = [("mlp.", cfg.ffn)] if not cfg.moe else \
            [(f"mlp.experts.{e}.", cfg.expert_ffn) for e in range(cfg.experts)]
        if cfg.moe:
            out[p + "mlp.gate.weight"] = ((cfg.experts, H), st)
            if cfg.shared_ffn:
                mlps.append(("mlp.shared_expert.", cfg.shared_ffn))
        for m, f in mlps:
            out[p + m + "gate_proj.weight"] = ((f, H), st)
            out[p + m + "up_proj.weight"] = ((f, H), st)
            out[p + m + "down_proj.weight"] = ((H, f), st)
    out["model.norm.weight"] = ((H,), st)
    out["lm_head.weight"] = ((cfg.vocab, H), st)
    return out


def init_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights scaled so activations stay O(1) through every layer: inputs to
    the residual (o_proj, out_proj, down_proj) are scaled by 1/sqrt(2 * layers)."""
    rng = np.random.default_rng(seed)
    res_scale = 1.0 / np.sqrt(2 * cfg.layers)
    w = {}
    for name, (shape, dt) in weight_shapes(cfg).items():
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            dt_ = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
            v = dt_ + np.log(-np.expm1(-dt_))  # softplus^-1(dt)
        elif len(shape) == 1:
            v = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif "embed_tokens" in name:
            v = rng.standard_normal(shape, dtype=np.float32)
        else:
            gain = res_scale if name.split(".")[-2] in ("o_proj", "out_proj", "down_proj") else 1.0
            v = rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(shape[1]))
        w[name] = to_storage(v, dt)
    return w


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Raise ValueError naming every missing, unexpected, mis-shaped or mis-typed tensor."""
    want = weight_shapes(cfg)
    problems = [f"missing {n} {s}" for n, (s, _) in want.items() if n not in weights]
    problems += [f"unexpected {n}" for n in weights if n not in want]
    for n, (s, dt) in want.items():
        if n in weights:
            a = weights[n]
            if tuple(a.shape) != s:
                problems.append(f"{n}: shape {tuple(a.shape)}, expected {s}")
            elif a.dtype != dt:
                problems.append(f"{n}: dtype {a.dtype}, expected {dt} ({cfg.dtype} storage)")
    if problems:
        more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
        raise ValueError(f"weights do not match the config: {'; '.join(problems[:20])}{more}")


def save_weights(weights: dict[str, np.ndarray], path: str) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, path)


def load_weights(path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Load a safetensors file and check it against `cfg`. BF16 tensors (which numpy cannot
    represent) are read as their raw uint16 bits."""
    from safetensors.numpy import load_file

    try:
        w = load_file(path)
    except (TypeError, ValueError, KeyError) as e:
        if "bf16" not in str(e).lower() and "bfloat16" not in str(e).lower():
            raise
        w = _load_raw(path)
    if cfg.dtype == "bfloat16":
        w = {k: v if v.dtype != np.float16 else to_storage(v.astype(np.float32), np.uint16)
             for k, v in w.items()}
    check_weights(cfg, w)
    return w


_RAW = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32, "U16": np.uint16,
        "I32": np.int32, "I64": np.int64}


def _load_raw(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _RAW:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[a:b], _RAW[meta["dtype"]]).reshape(meta["shape"]).copy()
    return out
