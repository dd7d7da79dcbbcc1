"""Shared by the vt.torch tests: a tiny seeded Llama on a backend, the eager torch reference,
engines per mode, and the torch benches on the tiny preset. Imported only after pytest.importorskip("torch")."""
from __future__ import annotations

import json

import numpy as np
import torch

from vt.engine import Engine
from vt.config import ExecutorConfig
from vt.hooks import Poison
from vt.step import KVGeometry
from vt.torch import TorchForwardModel, TorchInputs, torch_device
from vt.torch.llama import LlamaConfig, LlamaDecoder

GEO = KVGeometry(max_seqs=8, num_kv_blocks=48, block_size=4, max_context=32)
TINY = LlamaConfig(vocab=96, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                   head_dim=16, qk_norm=True)


def tiny_llama(be, cfg=TINY, geometry=GEO, seed=0, dtype=torch.float32,
               kernels="auto") -> LlamaDecoder:
    """Seeded random weights; embeddings and projections scaled so logits are well spread
    (greedy tokens then have clear winners: no near-ties for rounding to flip)."""
    torch.manual_seed(seed)
    model = LlamaDecoder(cfg, geometry, dtype=dtype, device=torch_device(be), kernels=kernels)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4)
    return model


def step_model(be, module, geometry=GEO) -> TorchForwardModel:
    return TorchForwardModel(be, module, vocab=module.cfg.vocab, geometry=geometry)


def prompts(n, seed, vocab=TINY.vocab, max_len=7):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, max_len + 1))).tolist() for _ in range(n)]


def generate(be, model, mode, ps, new, *, sampling=None, conc=4, poison=False, sizes=None):
    """Tokens of one generate() in `mode`; graphs of sizes 1, 2, 4, 8 up to `conc` unless given
    (no decode batch is larger than conc: a bigger graph would be captured, never replayed)."""
    if sizes is None:
        sizes = tuple(s for s in (1, 2, 4, 8) if s <= conc)
    cfg = ExecutorConfig(mode=mode, serving_conc=conc, capture_sizes=sizes)
    with Engine(be, model, cfg, hooks=Poison() if poison else None) as eng:
        res = eng.generate(ps, max_new_tokens=new, sampling=sampling)
        assert eng.stats()["graph_steps"] > 0
    return [list(map(int, r.tokens)) for r in res]


def eager_greedy(module: LlamaDecoder, prompt, new: int) -> list[int]:
    """The same module called directly by torch, one sequence, one position at a time, with
    argmax: the reference vt's tokens must equal."""
    g = module.geometry
    dev = module.k_cache.device
    table = torch.zeros(g.max_seqs + 1, dtype=torch.int32, device=dev)
    blocks = torch.arange(1, g.max_blocks + 1, dtype=torch.int32, device=dev)[None]   # block 0: scratch
    logits = torch.empty(1, module.cfg.vocab, dtype=torch.float32, device=dev)
    out, tok = [], None
    for p in range(len(prompt) + new - 1):
        table[0] = prompt[p] if p < len(prompt) else tok
        i32 = lambda v: torch.tensor([v], dtype=torch.int32, device=dev)   # noqa: E731
        slot = int(blocks[0, p // g.block_size]) * g.block_size + p % g.block_size
        module(TorchInputs.decode(table, i32(0), i32(p), i32(p + 1), i32(slot), blocks, i32(0)), logits)
        if p >= len(prompt) - 1:
            tok = int(logits[0].argmax())
            out.append(tok)
    return out


def tiny_bench(capsys, tmp_path, workload: str, *flags: str) -> tuple[str, dict]:
    """`vt bench --workload WORKLOAD --preset tiny --backend sim FLAGS --json FILE`, which must
    exit 0: (what it printed, the JSON it wrote)."""
    from vt.cli.main import main as vt_main
    out = tmp_path / f"{workload}.json"
    assert vt_main(["bench", "--workload", workload, "--preset", "tiny", "--backend", "sim",
                    *flags, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())
