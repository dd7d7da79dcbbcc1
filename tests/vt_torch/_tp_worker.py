"""One rank of tests/vt_torch/test_tensor_parallel.py, run as a process of its own:

    python _tp_worker.py JOB RANK PORT OUT_DIR [ARG ...]

It joins a 2-rank gloo group at 127.0.0.1:PORT, runs JOB (a function below) and saves what
JOB returns to OUT_DIR/rank{RANK}.pt for the test to compare; an exception is printed and
exits the process non-zero (the test fails with that output). Every rank builds the same
full model from the same seed, so the unsharded reference is computed in each process.
"""
from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from vt.step import DecodeInputs, PrefillSeq, flatten, kv_slot
from vt.torch import TorchInputs
from vt.torch.llama import LlamaDecoder, shard_state_dict
from vt.torch.tensor_parallel import TensorParallel
from vt.torch.views import FLAT_ARRAYS, torch_inputs

from _torch_util import GEO, TINY

WORLD = 2
LLAMA = dataclasses.replace(TINY, qk_norm=False)
# name -> (config, kernels): what the forward job runs, sharded over 2 ranks.
CASES = {
    "llama-torch": (LLAMA, "torch"),
    "llama-vt": (LLAMA, "vt"),
    "qwen2-biases-vt": (dataclasses.replace(LLAMA, qkv_bias=True, o_bias=True, mlp_bias=True),
                        "vt"),
    "qwen3-qk-norm": (TINY, "torch"),
    "qwen3-qk-norm-vt": (TINY, "vt"),
    "tied-vocab-97": (dataclasses.replace(LLAMA, vocab=97, tie_embeddings=True), "torch"),
    "untied-vocab-97-vt": (dataclasses.replace(LLAMA, vocab=97), "vt"),
}
# The steps' prompts: sequence 3's is prefilled in two chunks (4 tokens, then 7 more).
PROMPTS = [[5, 17, 3, 88, 40], [61], [9, 9, 2, 71, 33, 50, 12, 8, 90],
           [44, 1, 67, 23, 5, 80, 31, 19, 2, 56, 70]]
FIRST_CHUNK = 4
DECODE_STEPS = 4


def seeded(cfg, kernels, seed=0, tp=None) -> LlamaDecoder:
    """The full fp32 model with seeded random weights (every process draws the same): the
    projections scaled so that logits are well spread, norms and biases off their defaults."""
    torch.manual_seed(seed)
    model = LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu", kernels=kernels, tp=tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
            else:
                p.normal_(0.0, 0.2)
    return model


def sharded(full: LlamaDecoder, tp: TensorParallel) -> LlamaDecoder:
    """The TP model of rank tp.rank holding its shard of `full`'s weights."""
    model = LlamaDecoder(full.cfg, full.geometry, dtype=torch.float32, device="cpu",
                         kernels=full.kernels, tp=tp)
    model.load_state_dict(shard_state_dict(full.state_dict(), full.cfg, tp), strict=True)
    return model


def shapes(model: LlamaDecoder) -> dict:
    return {"qkv": tuple(model.layers[0].attn.qkv.weight.shape),
            "o": tuple(model.layers[0].attn.o.weight.shape),
            "gate_up": tuple(model.layers[0].mlp.gate_up.weight.shape),
            "down": tuple(model.layers[0].mlp.down.weight.shape),
            "head": tuple(model.head_weight().shape),
            "k_cache": tuple(model.k_cache.shape)}


def flat_step(decode, seqs, table) -> TorchInputs:
    """A flat step (decode rows, then prompt chunks) as TorchInputs, the decode rows' input
    ids gathered from the token table (what vt's flat forward does before the call)."""
    f = flatten(decode, seqs, GEO.block_size)
    arrays = [torch.from_numpy(np.asarray(getattr(f, name))) for name in FLAT_ARRAYS]
    inputs = torch_inputs(table, f, arrays)
    n = f.num_decode
    inputs.input_ids[:n] = table[inputs.token_rows[:n].long()]
    return inputs


def script(models) -> list[list[torch.Tensor]]:
    """The same steps on every model: a flat prefill step (three whole prompts of 5, 1, 9
    tokens and sequence 3's first chunk), a mixed step (their decode rows and sequence 3's
    second chunk over its cached prefix), then DECODE_STEPS decode steps of the 4 sequences.
    Returns each model's logits of every step; the tokens fed back are models[0]'s greedy."""
    bs, mb = GEO.block_size, GEO.max_blocks
    tables = np.arange(1, 1 + 4 * mb, dtype=np.int32).reshape(4, mb)   # block 0: scratch
    table = torch.zeros(GEO.max_seqs + 1, dtype=torch.int32)
    outs = [[] for _ in models]

    def run(inputs):
        for model, out in zip(models, outs):
            logits = torch.full((inputs.batch, model.cfg.vocab), float("nan"))
            model(inputs, logits)
            out.append(logits)
        return outs[0][-1].argmax(-1).int()

    seqs = [PrefillSeq(i, np.array(p, np.int32), tables[i], i) for i, p in enumerate(PROMPTS[:3])]
    seqs.append(PrefillSeq(3, np.array(PROMPTS[3][:FIRST_CHUNK], np.int32), tables[3], 3))
    table[:3] = run(flat_step(None, seqs, table))[:3]
    pos = np.array([len(p) for p in PROMPTS[:3]], np.int32)
    dec = DecodeInputs(token_rows=np.arange(3, dtype=np.int32), positions=pos, seq_lens=pos + 1,
                       slot_mapping=kv_slot(tables[:3], pos, bs).astype(np.int32),
                       block_tables=tables[:3], state_idx=np.arange(3, dtype=np.int32))
    rest = PrefillSeq(3, np.array(PROMPTS[3], np.int32), tables[3], 3, start=FIRST_CHUNK)
    table[:4] = run(flat_step(dec, [rest], table))
    pos = np.array([len(p) for p in PROMPTS], np.int32) + np.array([1, 1, 1, 0], np.int32)
    rows = torch.arange(4, dtype=torch.int32)
    for _ in range(DECODE_STEPS):
        i32 = lambda a: torch.from_numpy(np.asarray(a, np.int32))   # noqa: E731
        table[:4] = run(TorchInputs.decode(table, rows, i32(pos), i32(pos + 1),
                                           i32(kv_slot(tables, pos, bs)), i32(tables), rows))
        pos = pos + 1
    return outs


def forward_job(rank):
    """Every case of CASES: the full model's and this rank's TP model's logits of script()."""
    tp = TensorParallel(rank, WORLD)
    out = {}
    for name, (cfg, kernels) in CASES.items():
        full = seeded(cfg, kernels)
        model = sharded(full, tp)
        ref, got = script([full, model])
        out[name] = {"full": ref, "tp": got, "shapes": shapes(model), "vocab": cfg.vocab}
    return out


def hf_job(rank, *paths):
    """Each checkpoint directory loaded whole and with tp=(rank, 2): script()'s logits."""
    from vt.torch import hf
    tp = TensorParallel(rank, WORLD)
    out = {}
    for path in paths:
        full = hf.load(path, GEO, dtype=torch.float32, device="cpu")
        model = hf.load(path, GEO, dtype=torch.float32, device="cpu", tp=tp)
        ref, got = script([full, model])
        out[Path(path).name] = {"full": ref, "tp": got, "shapes": shapes(model),
                                "vocab": full.cfg.vocab}
    return out


def engine_job(rank, *modes):
    """Tokens of vt.Engine.generate on the sim (prefill="flat", captured decode steps) in
    each mode, greedy: the TP model of this rank, and the full model; and the TP model's
    sampled tokens (temperature 1, seeded) in the last mode."""
    from vt.backend import get_backend
    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.sampling import SamplingParams
    from vt.torch import TorchForwardModel, forward

    # The collectives each sim capture recorded (vt.torch.forward records through `record`).
    collectives, record = [], forward.record

    def counting_record(*args):
        recording = record(*args)
        collectives.append(sum(str(step[0]).startswith("_c10d_functional.")
                               for step in recording.steps))
        return recording
    forward.record = counting_record
    cfg = dataclasses.replace(TINY, vocab=97)   # Qwen3's qk_norm, a vocab split unevenly
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab, size=n).tolist() for n in (1, 7, 12, 3, 20, 5)]
    be = get_backend("sim")
    out = {}
    try:
        full = seeded(cfg, "torch")
        models = {"tp": sharded(full, TensorParallel(rank, WORLD)), "full": full}
        runs = [(mode, name, None) for mode in modes for name in models]
        runs.append((modes[-1], "tp", SamplingParams(temperature=1.0, seed=11)))
        for mode, name, sampling in runs:
            fm = TorchForwardModel(be, models[name], prefill="flat")
            ec = ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=(1, 2, 4))
            collectives.clear()
            with Engine(be, fm, ec, max_prefill_tokens=8) as eng:
                res = eng.generate(prompts, max_new_tokens=6, sampling=sampling)
                stats = eng.stats()
            key = (mode, name) if sampling is None else (mode, "tp-sampled")
            out[key] = {"tokens": [list(map(int, r.tokens)) for r in res],
                        "graph_steps": stats["graph_steps"], "mixed_steps": stats["mixed_steps"],
                        "collectives": list(collectives)}
    finally:
        forward.record = record
        be.close()
    return out


JOBS = {"forward": forward_job, "hf": hf_job, "engine": engine_job}


def main(job, rank, port, out_dir, *args):
    rank = int(rank)
    torch.set_num_threads(1)   # two ranks share the test machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        result = JOBS[job](rank, *args)
        dist.barrier()   # both ranks finished every collective
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
