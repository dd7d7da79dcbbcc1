"""Load a Hugging Face checkpoint directory (config.json + safetensors) of the Llama, Qwen2 or
Qwen3 family into vt.torch.llama.LlamaDecoder.

vt.torch.hfconfig reads config.json (refusing what the decoder does not implement). Every
tensor the config implies must be in the safetensors files with the shape the config gives
it; a broken checkpoint (an unreadable file, a missing tensor, a bias the config asks for and
the files lack, a wrong shape, a tensor the decoder does not use) is a one-line ValueError
naming the file and the tensor. Tied embeddings follow transformers: with
`tie_word_embeddings` true and an `lm_head.weight` in the files, the files' head is used
(transformers ties only what is missing, and keeps both when both are present).

The files are read lazily: the names and shapes first (every check above runs before any
weight is read), then one parameter at a time, which goes (sliced to the rank's shard under
tensor parallelism) into the module at once. The host holds one parameter of the full model
at a time (a fused q/k/v or gate/up of one layer at most), not the checkpoint, so the ranks
of a tensor-parallel engine can each load their shard of a model larger than host memory.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from vt.step import KVGeometry
from vt.torch.hfconfig import FAMILIES, config_from_hf, read_config  # noqa: F401 (re-exported)
from vt.torch.llama import LlamaConfig, LlamaDecoder, shard_state_dict
from vt.torch.tensor_parallel import TensorParallel

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def load(path, geometry: KVGeometry, *, dtype=torch.bfloat16, device=None,
         tp: TensorParallel | None = None, progress=None) -> LlamaDecoder:
    """A LlamaDecoder with the checkpoint's weights, its KV cache sized for `geometry`.
    device: where its tensors go; by default the device of the backend vt.backend.get_backend()
    picks here (cuda when a GPU is usable, else cpu: the sim's). tp: rank tp.rank's shard
    of a tensor-parallel decoder (vt.torch.llama.shard_state_dict): each parameter is read
    whole on the host and sliced there, one at a time (module docstring), so a rank needs
    device memory for its shard only. progress(done, total, name): called before the first
    parameter is read and after each (a fused parameter counts once), or None."""
    path = Path(path)
    cfg = read_config(path)
    files = _read_safetensors(path)
    if cfg.tie_embeddings and HEAD in files:
        cfg = replace(cfg, tie_embeddings=False)
        if EMBED not in files:   # transformers ties the missing one to the one present
            files[EMBED] = files[HEAD]
    readers = _to_vt_names(cfg, files, path)   # every check of the files, before any allocation
    if progress is not None:
        progress(0, len(readers))
    model = LlamaDecoder(cfg, geometry, dtype=dtype, device=default_device() if device is None
                         else device, tp=tp)
    params = model.state_dict()
    if set(readers) != set(params):   # a bug here, not in the checkpoint: say both sides
        raise RuntimeError(f"vt.torch.hf: the names read {sorted(set(readers) - set(params))} "
                           f"and the module's {sorted(set(params) - set(readers))} differ")
    with torch.no_grad():
        for done, (name, read) in enumerate(readers.items(), 1):
            t = read()
            if tp is not None:
                t = shard_state_dict({name: t}, cfg, tp)[name]
            if t.shape != params[name].shape:
                raise RuntimeError(f"vt.torch.hf: {name} read as {list(t.shape)}, the module "
                                   f"holds {list(params[name].shape)}")
            params[name].copy_(t)
            del t
            if progress is not None:
                progress(done, len(readers), name)
    return model


def default_device() -> torch.device:
    """cuda when the cuda backend can run here, else cpu (get_backend()'s choice, no backend made)."""
    from vt.backend import available_backends
    return torch.device("cuda" if "cuda" in available_backends() else "cpu")


def hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` must have, by its Hugging Face name, with its shape."""
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {EMBED: (cfg.vocab, h), "model.norm.weight": (h,)}
    if not cfg.tie_embeddings:
        out[HEAD] = (cfg.vocab, h)
    for i in range(cfg.layers):
        att, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out[att + f"{name}_proj.weight"] = (rows, h)
            if cfg.qkv_bias:
                out[att + f"{name}_proj.bias"] = (rows,)
        out[att + "o_proj.weight"] = (h, q)
        if cfg.o_bias:
            out[att + "o_proj.bias"] = (h,)
        if cfg.qk_norm:
            out[att + "q_norm.weight"] = out[att + "k_norm.weight"] = (cfg.head_dim,)
        for name, shape in (("gate", (cfg.intermediate, h)), ("up", (cfg.intermediate, h)),
                            ("down", (h, cfg.intermediate))):
            out[mlp + f"{name}_proj.weight"] = shape
            if cfg.mlp_bias:
                out[mlp + f"{name}_proj.bias"] = shape[:1]
        out[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
    return out


class _Tensor:
    """A checkpoint tensor by name: its file and shape, read only by read()."""

    def __init__(self, handle, name: str, file: Path):
        self.handle, self.name, self.file = handle, name, file
        self.shape = tuple(handle.get_slice(name).get_shape())

    def read(self) -> torch.Tensor:
        from safetensors import SafetensorError
        try:
            return self.handle.get_tensor(self.name)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{self.file}: tensor {self.name!r} cannot be read "
                             f"({type(exc).__name__}: {_first_line(exc)})") from None


def _read_safetensors(path: Path) -> dict[str, _Tensor]:
    """Every tensor of the directory's safetensors files by name (headers only: no data)."""
    from safetensors import SafetensorError, safe_open
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint path {str(path)!r} has no *.safetensors file")
    out: dict[str, _Tensor] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
            names = list(handle.keys())
            tensors = [_Tensor(handle, name, f) for name in names]
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{f}: not a readable safetensors file ({type(exc).__name__}: "
                             f"{_first_line(exc)})") from None
        for t in tensors:
            if t.name in out:
                raise ValueError(f"{f}: tensor {t.name!r} is also in {out[t.name].file.name}")
            out[t.name] = t
    return out


def _to_vt_names(cfg: LlamaConfig, files: dict[str, _Tensor], path: Path) -> dict:
    """Hugging Face's parameter names to LlamaDecoder's, each tensor's shape checked against
    the config's: a reader (no arguments) per LlamaDecoder parameter that reads it from the
    files, q, k, v and gate, up concatenated into the fused projections."""
    shapes = hf_shapes(cfg)
    for name, shape in shapes.items():
        if name not in files:
            raise ValueError(f"{path}: tensor {name!r} is missing from the safetensors files"
                             f"{_why(cfg, name)}")
        got = files[name].shape
        if got != shape:
            raise ValueError(f"{files[name].file}: tensor {name!r} has shape {list(got)}; "
                             f"config.json implies {list(shape)}")
    # Rotary tables some exports keep as buffers carry nothing the config does not say.
    left = sorted(k for k in files if k not in shapes and not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{files[left[0]].file}: tensor {left[0]!r} is not used by the decoder "
                         f"(config.json does not imply it; {len(left)} such tensors)")
    hf = {k.removeprefix("model."): v for k, v in files.items()}

    def one(name):
        return hf[name].read

    def cat(*names):
        return lambda: torch.cat([hf[n].read() for n in names])
    out = {"embed.weight": one("embed_tokens.weight"), "norm.weight": one("norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = one(HEAD)
    for i in range(cfg.layers):
        p = f"layers.{i}."   # the same prefix in both namings
        att, mlp = p + "self_attn.", p + "mlp."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[p + f"attn.qkv.{kind}"] = cat(*(att + f"{n}_proj.{kind}" for n in "qkv"))
        out[p + "attn.o.weight"] = one(att + "o_proj.weight")
        if cfg.o_bias:
            out[p + "attn.o.bias"] = one(att + "o_proj.bias")
        if cfg.qk_norm:
            out[p + "attn.q_norm.weight"] = one(att + "q_norm.weight")
            out[p + "attn.k_norm.weight"] = one(att + "k_norm.weight")
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            out[p + f"mlp.gate_up.{kind}"] = cat(mlp + f"gate_proj.{kind}", mlp + f"up_proj.{kind}")
            out[p + f"mlp.down.{kind}"] = one(mlp + f"down_proj.{kind}")
        out[p + "attn_norm.weight"] = one(p + "input_layernorm.weight")
        out[p + "mlp_norm.weight"] = one(p + "post_attention_layernorm.weight")
    return out


def _why(cfg: LlamaConfig, name: str) -> str:
    if name == HEAD:
        return " (config.json: tie_word_embeddings is false)"
    if name.endswith("_proj.bias"):
        return " (config.json asks for biases: attention_bias / mlp_bias, or model_type qwen2)"
    if name.endswith("_norm.weight") and "self_attn" in name:
        return " (model_type qwen3 has q_norm and k_norm)"
    return ""


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
