"""What `vt serve` serves: a Hugging Face checkpoint directory (its weights through
vt.torch.hf into vt.torch's Llama decoder, its tokenizer, its EOS ids) or a bundled preset
(random weights, token ids only). Each becomes a ServedModel: the step model the engine
drives, its geometry, the text side when there is one, and what was chosen for it (the
context, the KV cache) in words for the start-up log.

A checkpoint's context is its config's max_position_embeddings (times a linear RoPE
factor, as vLLM derives it), at most DEFAULT_MAX_CONTEXT unless asked for; more than the
checkpoint's is refused, as vLLM refuses it: positions past it were never trained. Its KV
cache is sized by vt/serve/kv_cache.py.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vt.engine.progress import phase_reporter
from vt.serve import kv_cache
from vt.serve.text import TextCodec, eos_token_ids
from vt.step import KVGeometry

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The decoder takes a prompt chunk (or a whole mixed step) in one forward call: a prompt of P
# tokens costs ceil(P / max_prefill_tokens) calls, not P (docs/torch.md).
PREFILL = "flat"
# The context of a checkpoint whose max_position_embeddings is longer (or unknown), unless
# max_context says otherwise: a whole context per row is KV memory and, on the sim, attention
# time.
DEFAULT_MAX_CONTEXT = 4096


@dataclass
class ServedModel:
    name: str                    # what /v1/models lists and requests must name
    step_model: object           # what vt.engine.Engine drives
    geometry: KVGeometry
    vocab: int
    text: TextCodec | None       # None: token ids in and out (a preset)
    eos_ids: tuple[int, ...]
    close: Callable[[], None] = lambda: None
    notes: tuple[str, ...] = ()  # what was chosen (context, KV cache), a line each
    draft: object = None         # the draft model's step model (speculative decoding), or None


def geometry_for(max_seqs: int, max_context: int, block_size: int,
                 kv_blocks: int | None = None) -> KVGeometry:
    """Every row can hold a whole context unless `kv_blocks` says otherwise (+1: scratch)."""
    blocks = kv_blocks if kv_blocks is not None else max_seqs * -(-max_context // block_size) + 1
    return KVGeometry(max_seqs=max_seqs, num_kv_blocks=blocks, block_size=block_size,
                      max_context=max_context)


def load_checkpoint(be, path, *, max_seqs: int, max_context: int | None = None,
                    block_size: int = 16, kv_blocks: int | None = None, dtype: str = "auto",
                    name: str | None = None, wrap_forward=None, tensor_parallel: int = 1,
                    gpu_memory_utilization: float = kv_cache.DEFAULT_GPU_MEMORY_UTILIZATION,
                    progress=None, quantization: str | None = None,
                    token_table_rows: int | None = None,
                    kv_cache_dtype: str = "auto", draft=None) -> ServedModel:
    """The checkpoint at `path` on backend `be` (cuda: bfloat16 by default; sim: CPU float32).
    max_context None: the checkpoint's context (module docstring), at most
    DEFAULT_MAX_CONTEXT; more than the checkpoint's is a ValueError. kv_blocks None: sized
    by vt/serve/kv_cache.py (on cuda from gpu_memory_utilization, a fraction of the GPU
    memory free now). wrap_forward: called with the loaded module, returns the forward the
    engine runs (tests inject faults). tensor_parallel > 1: `step_model` is the builder
    Engine(..., tensor_parallel=N) takes, each rank loading its shard (docs/parallel.md);
    nothing is loaded here. progress: called with a vt.engine.progress.StartUpProgress of
    the phase "loading weights" (one piece per parameter), or None. quantization: None or
    "fp8" (vt.torch.hf.load's; one process only): the weights counted at their FP8 bytes
    where the KV cache is sized from GPU memory. kv_cache_dtype: "auto" (the served dtype)
    or "fp8" (e4m3, one byte an element, vt.torch.kv_fp8; one process only): the cache
    sized at that many bytes a token. token_table_rows: the
    token table's entries (None: one a row and the scratch row; speculative decoding needs
    vt.forward.speculative.verify_table_rows). draft: None, or a second checkpoint directory,
    the draft model of speculative decoding (one process only): its vocabulary must be the
    checkpoint's (ValueError naming both), it is loaded with the same backend and dtype (no
    quantization, its KV cache at the dtype) into a KV cache of the same geometry (both
    caches and both models' weights counted where the cache is sized), and `draft` of the
    ServedModel is its step model, with token_table_rows entries too."""
    import torch

    from vt.torch import TorchForwardModel, hf, torch_device
    from vt.torch.hfconfig import read_max_position_embeddings

    path = Path(path)
    cfg = hf.read_config(path)           # refuses an unsupported architecture before any weight
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} must be in (0, 1]")
    max_context, context_note = checkpoint_context(cfg, read_max_position_embeddings(path),
                                                   max_context)
    draft_cfg = None if draft is None else draft_config(cfg, path, Path(draft), tensor_parallel)
    text = TextCodec.from_dir(path)
    if dtype == "auto":
        dtype = "bfloat16" if be.name == "cuda" else "float32"
    torch_dtype = getattr(torch, dtype)
    if quantization is not None and tensor_parallel > 1:
        raise ValueError(f"quantization {quantization!r} runs in one process; tensor_parallel "
                         f"{tensor_parallel} is not implemented for it")
    from vt.torch.kv_fp8 import check_kv_cache_dtype
    kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "auto" and tensor_parallel > 1:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} runs in one process; "
                         f"tensor_parallel {tensor_parallel} is not implemented for it")
    if tensor_parallel > 1:   # before the KV cache is sized per rank, and before any spawn
        from vt.torch.llama import check_tensor_parallel
        from vt.torch.tensor_parallel import TensorParallel
        check_tensor_parallel(cfg, TensorParallel(0, tensor_parallel))
    size = checkpoint_kv_cache(be, cfg, torch_dtype, max_seqs=max_seqs, max_context=max_context,
                               block_size=block_size, kv_blocks=kv_blocks,
                               tensor_parallel=tensor_parallel,
                               utilization=gpu_memory_utilization, quantization=quantization,
                               kv_cache_dtype=kv_cache_dtype, draft_cfg=draft_cfg)
    geo = geometry_for(max_seqs, max_context, block_size, size.num_kv_blocks)
    notes = (context_note, size.describe())
    fp8_note = precision_note(hf.checkpoint_scheme(path), quantization, dtype, kv_cache_dtype)
    if fp8_note is not None:
        notes += (fp8_note,)
    if draft_cfg is not None:
        notes += (f"draft model {draft}: {draft_cfg.layers} layers (the target's "
                  f"{cfg.layers}), its own KV cache of the same {geo.num_kv_blocks:,} blocks",)
    if tensor_parallel > 1:
        if wrap_forward is not None:
            raise ValueError("wrap_forward and tensor_parallel together are not supported")
        build = functools.partial(checkpoint_shard, str(path), geo, dtype)
        return ServedModel(name or path.name, build, geo, cfg.vocab, text, eos_token_ids(path),
                           notes=notes)
    module = hf.load(path, geo, dtype=torch_dtype, device=torch_device(be),
                     progress=phase_reporter(progress, "loading weights"),
                     quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    forward = module if wrap_forward is None else wrap_forward(module)
    step = TorchForwardModel(be, forward, vocab=cfg.vocab, geometry=geo, prefill=PREFILL,
                             token_table=_token_table(be, token_table_rows))
    draft_step = None
    if draft_cfg is not None:
        draft_module = hf.load(Path(draft), geo, dtype=torch_dtype, device=torch_device(be),
                               progress=phase_reporter(progress, "loading the draft's weights"))
        draft_step = TorchForwardModel(be, draft_module, vocab=cfg.vocab, geometry=geo,
                                       prefill=PREFILL, token_table=_token_table(be, token_table_rows))
    return ServedModel(name or path.name, step, geo, cfg.vocab, text, eos_token_ids(path),
                       notes=notes, draft=draft_step)


SCALES_IN_WORDS = {"channel": "a scale per output channel", "tensor": "a scale per tensor",
                   "block": "a scale per 128 x 128 block"}


def precision_note(scheme: str | None, quantization: str | None, dtype: str,
                   kv_cache_dtype: str) -> str | None:
    """The start-up line that says what runs in FP8: the projections (a checkpoint's FP8
    `scheme`, or `quantization` "fp8" of a dense one at load) and the KV cache; None when
    nothing does (the model in `dtype` throughout, as --dtype says)."""
    parts = []
    if scheme is not None:
        parts.append(f"the checkpoint's FP8 (e4m3) projections, {SCALES_IN_WORDS[scheme]}")
    elif quantization == "fp8":
        parts.append(f"FP8 (e4m3) projections quantized at load, "
                     f"{SCALES_IN_WORDS['channel']}")
    if kv_cache_dtype == "fp8":
        parts.append("an FP8 (e4m3) KV cache, K and V scales 1.0 per layer")
    if not parts:
        return None
    return f"{' and '.join(parts)}; the rest in {dtype}"


def _token_table(be, rows: int | None):
    """A zeroed token table of `rows` entries, or None (the step model's own default)."""
    if rows is None:
        return None
    import numpy as np

    from vt.backend.zeros import zeros
    return zeros(be, (rows,), np.int32)


def draft_config(cfg, path: Path, draft: Path, tensor_parallel: int):
    """The draft checkpoint's config (load_checkpoint's draft), read before any weight:
    ValueError when its vocabulary is not the target's or tensor_parallel > 1."""
    from vt.torch import hf

    if tensor_parallel > 1:
        raise ValueError(f"a draft model runs in one process; tensor_parallel {tensor_parallel} "
                         f"is not implemented for it")
    draft_cfg = hf.read_config(draft)
    if draft_cfg.vocab != cfg.vocab:
        raise ValueError(f"the draft model {draft}'s vocab {draft_cfg.vocab:,} differs from "
                         f"{path}'s {cfg.vocab:,}: a draft must share the target's tokenizer")
    return draft_cfg


def checkpoint_context(cfg, max_position_embeddings: int | None,
                       max_context: int | None) -> tuple[int, str]:
    """(max_context, the line that says where it came from) for a checkpoint whose config.json
    gives `max_position_embeddings` (None: it names none); `max_context` None: the default.
    ValueError when max_context exceeds the checkpoint's context (module docstring)."""
    if max_position_embeddings is None:
        limit, source = None, "config.json names no max_position_embeddings"
    else:
        limit = int(max_position_embeddings * cfg.rope_linear_factor)
        source = f"config.json's max_position_embeddings {max_position_embeddings:,}"
        if cfg.rope_linear_factor != 1.0:
            source += f" x its linear RoPE factor {cfg.rope_linear_factor:g} = {limit:,}"
    if max_context is None:
        if limit is not None and limit <= DEFAULT_MAX_CONTEXT:
            return limit, f"max context {limit:,} tokens ({source})"
        return DEFAULT_MAX_CONTEXT, (f"max context {DEFAULT_MAX_CONTEXT:,} tokens, the default "
                                     f"cap ({source}; --max-context to change)")
    if limit is not None and max_context > limit:
        raise ValueError(f"max context {max_context:,} exceeds the checkpoint's {limit:,} "
                         f"({source}): positions past it were never trained; give at most "
                         f"{limit:,} (--max-context)")
    return max_context, f"max context {max_context:,} tokens (as given; {source})"


def checkpoint_kv_cache(be, cfg, torch_dtype, *, max_seqs: int, max_context: int,
                        block_size: int, kv_blocks: int | None, tensor_parallel: int,
                        utilization: float, quantization: str | None = None,
                        kv_cache_dtype: str = "auto", draft_cfg=None) -> kv_cache.KVCacheSize:
    """The KV cache of a checkpoint of `cfg` (vt/serve/kv_cache.py): on cuda from the GPU
    memory free now, less the weights (checkpoint_weight_bytes) and activations of one rank;
    on the sim SIM_KV_CACHE_BYTES. Each token's K and V at kv_cache_dtype's bytes. draft_cfg:
    a draft model's config, whose cache of the same blocks (at the dtype's bytes) and weights
    share the budget."""
    import torch

    from vt.torch import torch_device

    elem, tp = torch_dtype.itemsize, tensor_parallel
    per_token = kv_cache.kv_bytes_per_token(cfg, kv_cache.kv_element_bytes(elem, kv_cache_dtype),
                                            tp)
    if draft_cfg is not None:
        per_token += kv_cache.kv_bytes_per_token(draft_cfg, elem)
    if be.name != "cuda":
        budget = kv_cache.SIM_KV_CACHE_BYTES
        why = f"the sim's budget of {budget / 2**20:,.0f} MiB"
    else:
        free, _ = torch.cuda.mem_get_info(torch_device(be))
        weights = checkpoint_weight_bytes(cfg, elem, tp, quantization)
        if draft_cfg is not None:
            weights += checkpoint_weight_bytes(draft_cfg, elem)
        # The engine's default prompt budget for this decoder (chunked): max_context tokens.
        activations = kv_cache.prefill_activation_bytes(cfg, max_context, elem, tp)
        budget = kv_cache.kv_budget_bytes(free_bytes=free, utilization=utilization,
                                          weight_bytes=weights, activation_bytes=activations)
        why = (f"{utilization:g} of the {free / 2**30:,.1f} GiB of GPU memory free at start-up, "
               f"less {weights / 2**30:,.1f} GiB of weights and {activations / 2**30:,.1f} GiB "
               f"of activations")
    return kv_cache.size_kv_cache(bytes_per_token=per_token, block_size=block_size,
                                  max_seqs=max_seqs, max_context=max_context,
                                  budget_bytes=budget, budget_why=why, kv_blocks=kv_blocks)


def checkpoint_weight_bytes(cfg, elem: int, tensor_parallel: int = 1,
                            quantization: str | None = None) -> int:
    """The bytes of one rank's weights of a checkpoint of `cfg` at `elem` bytes an element:
    every rank holds the whole embedding, a 1/tensor_parallel share of the rest. With
    quantization "fp8" the projections are as LlamaDecoder holds them: one byte a weight and
    a float32 scale per output channel (a checkpoint's 128 x 128 block scales are fewer)."""
    from vt.torch.hf import EMBED, PROJECTIONS, hf_shapes

    shapes = hf_shapes(cfg)
    embed = math.prod(shapes[EMBED])
    total = 0
    for name, shape in shapes.items():
        if name == EMBED:
            continue
        projection = name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS
        if quantization == "fp8" and projection:
            total += math.prod(shape) + 4 * shape[0]
        else:
            total += math.prod(shape) * elem
    return embed * elem + total // tensor_parallel


def checkpoint_shard(path: str, geometry: KVGeometry, dtype: str, be, tp):
    """Rank tp.rank's step model of the checkpoint (Engine's tensor-parallel build)."""
    import torch

    from vt.torch import TorchForwardModel, hf, torch_device

    module = hf.load(path, geometry, dtype=getattr(torch, dtype), device=torch_device(be), tp=tp)
    return TorchForwardModel(be, module, vocab=module.cfg.vocab, geometry=geometry, prefill=PREFILL)


def load_preset(be, preset: str, *, max_seqs: int, max_context: int | None = None,
                seed: int = 0) -> ServedModel:
    """A bundled model (vt.bundled.PRESETS) with seeded random weights: token ids only."""
    from vt.bundled import PRESETS, HybridModel, init_weights

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    if max_context is not None:
        cfg = cfg.replace(max_context=max_context)
    blocks = max_seqs * cfg.max_blocks_per_seq
    model = HybridModel(be, cfg, init_weights(cfg, seed=seed), max_seqs=max_seqs,
                        num_kv_blocks=blocks)
    geo = KVGeometry(max_seqs=max_seqs, num_kv_blocks=blocks + 1, block_size=cfg.kv_block_size,
                     max_context=cfg.max_context)
    notes = (f"max context {cfg.max_context:,} tokens",
             f"KV cache {blocks:,} blocks of {cfg.kv_block_size} tokens: a whole context for "
             f"every row ({max_seqs} x {cfg.max_context} tokens)")
    return ServedModel(preset, model, geo, cfg.vocab, None, (), model.close, notes)
