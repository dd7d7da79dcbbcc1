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

FP8 (vt.torch.fp8): load(..., quantization="fp8") quantizes a bf16/fp32 checkpoint's
projections (q, k, v, o, gate, up, down) per output channel as they are read; the embedding,
the norms and the head keep `dtype`. A checkpoint whose config.json has a quantization_config
is read as it is stored (quantization None or "fp8"): compressed-tensors float8 with per-channel
or per-tensor weight scales (`weight_scale`), or the `fp8` format with weight_block_size
[128, 128] (`weight_scale_inv`, one scale per block; q, k, v and gate, up are fused, so their
row counts must be multiples of 128); activation scales (`input_scale`) are not used. Any
other quantization_config is refused by name (fp8.checkpoint_scheme), and so is a projection
stored in a dtype the config does not announce.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from vt.step import KVGeometry
from vt.torch import fp8, kv_fp8
from vt.torch.hfconfig import FAMILIES, config_from_hf, read_config  # noqa: F401 (re-exported)
from vt.torch.llama import LlamaConfig, LlamaDecoder, shard_state_dict
from vt.torch.tensor_parallel import TensorParallel

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
DENSE_DTYPES = ("F32", "F16", "BF16", "F64")   # safetensors' names of the float dtypes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load(path, geometry: KVGeometry, *, dtype=torch.bfloat16, device=None,
         tp: TensorParallel | None = None, progress=None, quantization: str | None = None,
         fp8_prompt_linear: str = fp8.PROMPT_LINEAR, kv_cache_dtype: str = "auto") -> LlamaDecoder:
    """A LlamaDecoder with the checkpoint's weights, its KV cache sized for `geometry`.
    device: where its tensors go; by default the device of the backend vt.backend.get_backend()
    picks here (cuda when a GPU is usable, else cpu: the sim's). tp: rank tp.rank's shard
    of a tensor-parallel decoder (vt.torch.llama.shard_state_dict): each parameter is read
    whole on the host and sliced there, one at a time (module docstring), so a rank needs
    device memory for its shard only. progress(done, total, name): called before the first
    parameter is read and after each (a fused parameter counts once), or None.
    quantization: None, or "fp8" (module docstring); fp8_prompt_linear: LlamaDecoder's.
    kv_cache_dtype: LlamaDecoder's ("auto" or "fp8": an e4m3 KV cache with scales of 1.0,
    vt.torch.kv_fp8); "fp8" refuses a checkpoint whose quantization_config has a
    kv_cache_scheme, whose calibrated KV scales vt does not read."""
    path = Path(path)
    cfg = read_config(path)
    quantization = fp8.check_quantization(quantization)
    kv_cache_dtype = kv_fp8.check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        _refuse_kv_cache_scheme(path)
    scheme = checkpoint_scheme(path)   # None: a dense checkpoint
    files = _read_safetensors(path)
    if cfg.tie_embeddings and HEAD in files:
        cfg = replace(cfg, tie_embeddings=False)
        if EMBED not in files:   # transformers ties the missing one to the one present
            files[EMBED] = files[HEAD]
    # every check of the files, before any allocation
    readers = _to_vt_names(cfg, files, path, scheme, quantize=quantization == "fp8")
    if progress is not None:
        progress(0, len(readers))
    fp8_args = {} if scheme is None and quantization is None else dict(
        quantization="fp8", fp8_scales="block" if scheme == "block" else "channel",
        fp8_prompt_linear=fp8_prompt_linear)
    model = LlamaDecoder(cfg, geometry, dtype=dtype, device=default_device() if device is None
                         else device, tp=tp, kv_cache_dtype=kv_cache_dtype, **fp8_args)
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


def _refuse_kv_cache_scheme(path: Path) -> None:
    where = path / "config.json"
    qc = json.loads(where.read_text()).get("quantization_config") or {}
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{where}: quantization_config has a kv_cache_scheme (calibrated KV "
                         f"scales), which vt does not read; kv_cache_dtype='fp8' runs with "
                         f"scales of 1.0 only")


def checkpoint_scheme(path) -> str | None:
    """config.json's quantization_config as fp8.checkpoint_scheme reads it; None when absent
    (read_config has already checked that the file is a JSON object)."""
    where = Path(path) / "config.json"
    qc = json.loads(where.read_text()).get("quantization_config")
    return None if qc is None else fp8.checkpoint_scheme(qc, str(where))


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
        part = handle.get_slice(name)
        self.shape, self.dtype = tuple(part.get_shape()), part.get_dtype()

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


def _to_vt_names(cfg: LlamaConfig, files: dict[str, _Tensor], path: Path,
                 scheme: str | None = None, quantize: bool = False) -> dict:
    """Hugging Face's parameter names to LlamaDecoder's, each tensor's shape checked against
    the config's: a reader (no arguments) per LlamaDecoder parameter that reads it from the
    files, q, k, v and gate, up concatenated into the fused projections. scheme: an FP8
    checkpoint's (fp8.checkpoint_scheme), whose projections are read with their scales into
    the decoder's qweight and weight_scale; quantize: a dense checkpoint's projections
    quantized per channel into them."""
    shapes = hf_shapes(cfg)
    if scheme is not None:
        shapes.update(_scale_shapes(cfg, shapes, scheme, path))
    for name, shape in shapes.items():
        if name not in files:
            raise ValueError(f"{path}: tensor {name!r} is missing from the safetensors files"
                             f"{_why(cfg, name)}")
        got = files[name].shape
        if got != shape and not (shape == (1,) and got == ()):   # a per-tensor scale: [1] or []
            raise ValueError(f"{files[name].file}: tensor {name!r} has shape {list(got)}; "
                             f"config.json implies {list(shape)}")
    _check_dtypes(files, shapes, scheme)
    # Rotary tables some exports keep as buffers carry nothing the config does not say; an
    # FP8 checkpoint's activation scales are not used (module docstring).
    left = sorted(k for k in files if k not in shapes and not k.endswith("rotary_emb.inv_freq")
                  and not (scheme is not None and k.endswith("_proj.input_scale")))
    if left:
        raise ValueError(f"{files[left[0]].file}: tensor {left[0]!r} is not used by the decoder "
                         f"(config.json does not imply it; {len(left)} such tensors)")
    hf = {k.removeprefix("model."): v for k, v in files.items()}

    def one(name):
        return hf[name].read

    def cat(*names):
        return lambda: torch.cat([hf[n].read() for n in names])

    def weight(vt_name: str, *parts: str):   # a projection's weight from its parts' (q, k, v)
        if scheme is not None:   # stored FP8: the codes, and the scales in vt's layout
            out[vt_name + ".qweight"] = cat(*(part + ".weight" for part in parts))
            out[vt_name + ".weight_scale"] = lambda: torch.cat([fp8.checkpoint_scale(
                scheme, hf[part + "." + fp8.SCALE_NAMES[scheme]].read(),
                hf[part + ".weight"].shape[0]) for part in parts])
        elif quantize:   # read and quantized once: the codes' reader keeps the scale for its own
            done = {}

            def codes():
                w = fp8.quantize_per_channel(cat(*(part + ".weight" for part in parts))())
                done["scale"] = w.scale
                return w.data
            out[vt_name + ".qweight"] = codes
            out[vt_name + ".weight_scale"] = lambda: done.pop("scale")
        else:
            out[vt_name + ".weight"] = cat(*(part + ".weight" for part in parts))
    out = {"embed.weight": one("embed_tokens.weight"), "norm.weight": one("norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = one(HEAD)
    for i in range(cfg.layers):
        p = f"layers.{i}."   # the same prefix in both namings
        att, mlp = p + "self_attn.", p + "mlp."
        weight(p + "attn.qkv", *(att + f"{n}_proj" for n in "qkv"))
        if cfg.qkv_bias:
            out[p + "attn.qkv.bias"] = cat(*(att + f"{n}_proj.bias" for n in "qkv"))
        weight(p + "attn.o", att + "o_proj")
        if cfg.o_bias:
            out[p + "attn.o.bias"] = one(att + "o_proj.bias")
        if cfg.qk_norm:
            out[p + "attn.q_norm.weight"] = one(att + "q_norm.weight")
            out[p + "attn.k_norm.weight"] = one(att + "k_norm.weight")
        weight(p + "mlp.gate_up", mlp + "gate_proj", mlp + "up_proj")
        weight(p + "mlp.down", mlp + "down_proj")
        if cfg.mlp_bias:
            out[p + "mlp.gate_up.bias"] = cat(mlp + "gate_proj.bias", mlp + "up_proj.bias")
            out[p + "mlp.down.bias"] = one(mlp + "down_proj.bias")
        out[p + "attn_norm.weight"] = one(p + "input_layernorm.weight")
        out[p + "mlp_norm.weight"] = one(p + "post_attention_layernorm.weight")
    return out


def _scale_shapes(cfg: LlamaConfig, shapes: dict, scheme: str, path: Path) -> dict:
    """Every projection's scale tensor an FP8 checkpoint of `scheme` must have, with its shape.
    With 128 x 128 blocks, the projections vt fuses (q, k, v; gate, up) must each have a row
    count that is a multiple of 128, so that their block rows stack."""
    if scheme == "block":
        for name, rows in (("heads * head_dim", cfg.heads * cfg.head_dim),
                           ("kv_heads * head_dim", cfg.kv_heads * cfg.head_dim),
                           ("intermediate_size", cfg.intermediate)):
            if rows % fp8.BLOCK:
                raise ValueError(f"{path / 'config.json'}: {name}={rows} is not a multiple of "
                                 f"128; vt fuses those projections, whose 128 x 128 weight "
                                 f"blocks would then not stack")
    out = {}
    for name, shape in shapes.items():
        base, _, kind = name.rpartition(".")
        if kind == "weight" and base.rpartition(".")[2] in PROJECTIONS:
            out[f"{base}.{fp8.SCALE_NAMES[scheme]}"] = fp8.scale_shape(scheme, *shape)
    return out


def _check_dtypes(files: dict[str, _Tensor], shapes: dict, scheme: str | None) -> None:
    """Projection weights in F8_E4M3 where the config announces FP8, every other tensor (and
    every tensor of a dense checkpoint) a float dtype: FP8 codes are never read as numbers."""
    for name in shapes:
        t = files[name]
        base, _, kind = name.rpartition(".")
        fp8_weight = (scheme is not None and kind == "weight"
                      and base.rpartition(".")[2] in PROJECTIONS)
        want = ("F8_E4M3",) if fp8_weight else DENSE_DTYPES
        if t.dtype not in want:
            announced = ("config.json's quantization_config announces FP8 weights"
                         if scheme is not None else "config.json has no quantization_config")
            raise ValueError(f"{t.file}: tensor {name!r} is {t.dtype}; expected "
                             f"{' or '.join(want)} ({announced})")


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
