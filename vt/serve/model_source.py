"""What `vt serve` serves: a Hugging Face checkpoint directory (its weights through
vt.torch.hf into vt.torch's Llama decoder, its tokenizer, its EOS ids) or a bundled preset
(random weights, token ids only). Each becomes a ServedModel: the step model the engine
drives, its geometry, and the text side when there is one."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vt.serve.text import TextCodec, eos_token_ids
from vt.step import KVGeometry

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The decoder takes a prompt chunk (or a whole mixed step) in one forward call: a prompt of P
# tokens costs ceil(P / max_prefill_tokens) calls, not P (docs/torch.md).
PREFILL = "flat"


@dataclass
class ServedModel:
    name: str                    # what /v1/models lists and requests must name
    step_model: object           # what vt.engine.Engine drives
    geometry: KVGeometry
    vocab: int
    text: TextCodec | None       # None: token ids in and out (a preset)
    eos_ids: tuple[int, ...]
    close: Callable[[], None] = lambda: None


def geometry_for(max_seqs: int, max_context: int, block_size: int,
                 kv_blocks: int | None = None) -> KVGeometry:
    """Every row can hold a whole context unless `kv_blocks` says otherwise (+1: scratch)."""
    blocks = kv_blocks if kv_blocks is not None else max_seqs * -(-max_context // block_size) + 1
    return KVGeometry(max_seqs=max_seqs, num_kv_blocks=blocks, block_size=block_size,
                      max_context=max_context)


def load_checkpoint(be, path, *, max_seqs: int, max_context: int | None = None,
                    block_size: int = 16, kv_blocks: int | None = None, dtype: str = "auto",
                    name: str | None = None, wrap_forward=None,
                    tensor_parallel: int = 1) -> ServedModel:
    """The checkpoint at `path` on backend `be` (cuda: bfloat16 by default; sim: CPU float32).
    max_context None: the config's max_position_embeddings, at most 4096. wrap_forward:
    called with the loaded module, returns the forward the engine runs (tests inject faults).
    tensor_parallel > 1: `step_model` is the builder Engine(..., tensor_parallel=N) takes,
    each rank loading its shard (docs/parallel.md); nothing is loaded here."""
    import torch

    from vt.torch import TorchForwardModel, hf, torch_device
    from vt.torch.hfconfig import read_max_position_embeddings

    path = Path(path)
    cfg = hf.read_config(path)           # refuses an unsupported architecture before any weight
    if max_context is None:
        max_context = min(read_max_position_embeddings(path) or 4096, 4096)
    text = TextCodec.from_dir(path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if dtype == "auto":
        dtype = "bfloat16" if be.name == "cuda" else "float32"
    geo = geometry_for(max_seqs, max_context, block_size, kv_blocks)
    if tensor_parallel > 1:
        if wrap_forward is not None:
            raise ValueError("wrap_forward and tensor_parallel together are not supported")
        from vt.torch.llama import check_tensor_parallel
        from vt.torch.tensor_parallel import TensorParallel
        check_tensor_parallel(cfg, TensorParallel(0, tensor_parallel))   # before any spawn
        build = functools.partial(checkpoint_shard, str(path), geo, dtype)
        return ServedModel(name or path.name, build, geo, cfg.vocab, text, eos_token_ids(path))
    module = hf.load(path, geo, dtype=getattr(torch, dtype), device=torch_device(be))
    forward = module if wrap_forward is None else wrap_forward(module)
    step = TorchForwardModel(be, forward, vocab=cfg.vocab, geometry=geo, prefill=PREFILL)
    return ServedModel(name or path.name, step, geo, cfg.vocab, text, eos_token_ids(path))


def checkpoint_shard(path: str, geometry: KVGeometry, dtype: str, be, tp):
    """Rank tp.rank's step model of the checkpoint (Engine's tensor-parallel build)."""
    import torch

    from vt.torch import TorchForwardModel, hf, torch_device

    module = hf.load(path, geometry, dtype=getattr(torch, dtype), device=torch_device(be), tp=tp)
    return TorchForwardModel(be, module, vocab=module.cfg.vocab, geometry=geometry, prefill=PREFILL)


def load_preset(be, preset: str, *, max_seqs: int, max_context: int | None = None,
                seed: int = 0) -> ServedModel:
    """A bundled model (vt.model.PRESETS) with seeded random weights: token ids only."""
    from vt.model import PRESETS, HybridModel, init_weights

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
    return ServedModel(preset, model, geo, cfg.vocab, None, (), model.close)
