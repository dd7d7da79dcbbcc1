"""A Llama-shaped decoder served over N tensor-parallel ranks (Engine(..., tensor_parallel=N)),
its greedy tokens checked against the same weights in one process, and its decode speed.

Each rank builds the full model from the seed (on the host, float32 unless --dtype says
otherwise) and keeps its shard (vt.torch.llama.shard_state_dict), so every rank and the
one-process reference hold the same weights. Prompts of random lengths up to --prompt-len
are split into chunks of --max-prefill tokens. Printed: the tokens' agreement, and for each
engine its output tokens/s, TPOT (the median gap between a request's tokens), its decode
graph of all the requests' rows replayed back to back (the ceiling; over TPOT: how close
the ring runs to it), every rank's driver mallocs since its warm-up (0 expected), and on cuda
TPOT against the floor of one rank's weight bytes (the embedding's S rows aside) over the
faster of an eager device copy and read measured in the run. Exit 1 when the tokens differ.

  python3 tools/tp_generate.py --tensor-parallel 2                       # sim, tiny, ~10 s
  python3 tools/tp_generate.py --backend cuda --tensor-parallel 2 --preset small --dtype bfloat16
  python3 tools/tp_generate.py --backend cuda --tensor-parallel 2 --preset llama3-8b \
      --dtype bfloat16 --requests 1 --prompt-len 256 --new 128 --max-context 4096
  python3 tools/tp_generate.py --backend cuda --tensor-parallel 4 --preset llama3-70b \
      --dtype bfloat16 --requests 1 --new 128 --no-single
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import numpy as np
import torch

from vt.backend import get_backend
from vt.engine import Engine
from vt.config import MODES, ExecutorConfig
from vt.step import KVGeometry
from vt.torch import TorchForwardModel, torch_device
from vt.torch.llama import LlamaConfig, LlamaDecoder, shard_state_dict
from vt.torch.tensor_parallel import TensorParallel

PRESETS = {
    "tiny": LlamaConfig(vocab=97, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                        head_dim=16),
    "small": LlamaConfig(vocab=32000, hidden=1024, intermediate=2816, layers=8, heads=16,
                         kv_heads=8, head_dim=64, rope_theta=500000.0),
    # Timing shapes: each rank draws its shard's weights itself (no full model on the host),
    # so their tokens are compared between the ranks only (the engine does, every step).
    "llama3-8b": LlamaConfig(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32,
                             kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab=128256, hidden=8192, intermediate=28672, layers=80,
                              heads=64, kv_heads=8, head_dim=128, rope_theta=500000.0),
}
SHARED_WEIGHTS = ("tiny", "small")   # built whole and sharded: tokens comparable with one process


def build(preset: str, dtype: str, seed: int, geometry: KVGeometry, be, tp: TensorParallel):
    """Rank tp.rank's model: the shard of the full seeded decoder built on the host, or, for a
    timing shape, the rank's own seeded draw."""
    cfg = PRESETS[preset]
    model = LlamaDecoder(cfg, geometry, dtype=getattr(torch, dtype), device=torch_device(be),
                         tp=tp)
    if preset in SHARED_WEIGHTS:
        torch.manual_seed(seed)
        full = LlamaDecoder(cfg, geometry, dtype=torch.float32, device="cpu", kernels="torch")
        _spread(full)
        model.load_state_dict(shard_state_dict(full.state_dict(), cfg, tp))
    else:
        torch.manual_seed(seed + tp.rank)
        _spread(model)
    return TorchForwardModel(be, model, prefill="flat")


def _spread(module) -> None:
    """Random matrices scaled to spread the logits: greedy tokens with clear winners."""
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)


def weight_bytes_per_rank(cfg: LlamaConfig, size: int, itemsize: int) -> tuple[int, int]:
    """(what one rank's decode step reads of its weights, the embedding table it holds whole
    and reads S rows of): its share of every projection and of the head, the norms whole."""
    h, hd = cfg.hidden, cfg.head_dim
    layer = (h * (cfg.heads + 2 * cfg.kv_heads) * hd + h * cfg.heads * hd
             + 3 * h * cfg.intermediate) // size + 2 * h
    head = 0 if cfg.tie_embeddings else -(-cfg.vocab // size) * h
    return (cfg.layers * layer + h + head) * itemsize, cfg.vocab * h * itemsize


def serve(be, model, args, size: int) -> dict:
    cfg = ExecutorConfig(mode=args.mode, serving_conc=args.requests)
    rng = np.random.default_rng(args.seed)
    vocab = PRESETS[args.preset].vocab
    prompts = [rng.integers(0, vocab, int(rng.integers(1, args.prompt_len + 1))).tolist()
               for _ in range(args.requests)]
    with Engine(be, model, cfg, max_prefill_tokens=args.max_prefill,
                tensor_parallel=size) as eng:
        t0 = time.perf_counter()
        results = eng.generate(prompts, max_new_tokens=args.new)
        wall = time.perf_counter() - t0
        # the graph of all the requests' rows replayed back to back, on every rank
        ceiling_ms = eng.device_ceiling_us(len(prompts), replays=50) / 1e3
        mallocs = {0: eng.stats()["driver_mallocs_since_warm_up"]}
        group = getattr(eng.runner, "group", None)
    if group is not None:   # each worker's report, given at the close
        mallocs.update({r: rep["driver_mallocs_since_warm_up"]
                        for r, rep in group.worker_reports.items()})
    gaps = np.concatenate([np.diff(r.token_times) for r in results if len(r.token_times) > 1])
    tpot_ms = float(np.median(gaps)) * 1e3 if len(gaps) else None
    cfg = PRESETS[args.preset]
    itemsize = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    weights, _ = weight_bytes_per_rank(cfg, size, itemsize)
    return dict(tensor_parallel=size, tokens=[list(map(int, r.tokens)) for r in results],
                tokens_per_s=round(sum(len(r.tokens) for r in results) / wall, 1),
                tpot_ms_p50=round(tpot_ms, 3) if tpot_ms else None,
                ceiling_ms=round(ceiling_ms, 3),
                ceiling_over_tpot=round(ceiling_ms / tpot_ms, 3) if tpot_ms else None,
                mallocs_since_warm_up_by_rank=mallocs, weight_bytes_per_rank=weights)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--mode", choices=MODES, default="ring")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-prefill", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-single", action="store_true",
                    help="skip the one-process run (a model one GPU cannot hold)")
    ap.add_argument("--max-context", type=int, default=256)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    be = get_backend(args.backend)
    blocks = -(-args.max_context // 16)
    geometry = KVGeometry(max_seqs=max(args.requests, 1), num_kv_blocks=1 + args.requests * blocks,
                          block_size=16, max_context=args.max_context)
    make = functools.partial(build, args.preset, args.dtype, args.seed, geometry)
    sharded = serve(be, make, args, args.tensor_parallel)
    runs = [sharded]
    single = None if args.no_single else serve(be, make(be, TensorParallel(0, 1)), args, 1)
    if single is not None:
        runs.insert(0, single)
    rate = None
    if be.name == "cuda":   # the floor: a rank's weights over the faster eager copy or read
        from vt.bench.torch_decode import bandwidths
        rate = max(bandwidths().values())
    for r in runs:
        if rate and r["tpot_ms_p50"]:
            r["floor_ms"] = round(r["weight_bytes_per_rank"] / rate * 1e3, 3)
            r["tpot_over_floor"] = round(r["tpot_ms_p50"] / r["floor_ms"], 3)
            print(f"tensor_parallel={r['tensor_parallel']}: weights per GPU "
                  f"{r['weight_bytes_per_rank'] / 1e9:.2f} GB over {rate / 1e12:.2f} TB/s = "
                  f"{r['floor_ms']} ms; TPOT / that floor {r['tpot_over_floor']}")
        print(f"tensor_parallel={r['tensor_parallel']}: {r['tokens_per_s']} tokens/s, TPOT p50 "
              f"{r['tpot_ms_p50']} ms, its graph alone {r['ceiling_ms']} ms (ceiling / TPOT "
              f"{r['ceiling_over_tpot']}), driver mallocs since warm-up by rank "
              f"{r['mallocs_since_warm_up_by_rank']}")
    comparable = single is not None and args.preset in SHARED_WEIGHTS
    same = sharded["tokens"] == single["tokens"] if comparable else None
    if single is not None and single["tpot_ms_p50"] and sharded["tpot_ms_p50"]:
        print(f"TPOT ratio, {args.tensor_parallel} ranks / 1: "
              f"{sharded['tpot_ms_p50'] / single['tpot_ms_p50']:.3f}")
    what = {True: "equal", False: "DIFFER", None: "not compared (weights drawn per rank)"}[same]
    print(f"greedy tokens {what} ({args.requests} requests x {args.new} tokens, {be.name}, "
          f"{args.preset}, {args.dtype}, mode {args.mode})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), same=same, single=single, sharded=sharded), f, indent=1)
    return 1 if same is False else 0


if __name__ == "__main__":
    sys.exit(main())
