"""The cost of LlamaDecoder(batch_invariant=True) on CUDA at Llama-3-8B's shape, and a check
of it, in one run on one GPU (random bf16 weights, every part against the default decoder in
the same run).

    vt bench --workload invariance [--parts linear attention step]
        [--rows 1 8 32] [--live 256 2048] [--prompts 128 512 2048] [--json F]

linear:    each of the 8B shape's linears (qkv, o, gate_up, down, the head) at --m rows: F.linear
           (cuBLAS), the decoder's default decode linear (vt.torch.fused.linear), the invariant
           one (vt.torch.triton_invariant.linear) with its block shape and with each candidate
           of CANDIDATES, and cuBLAS run in fixed blocks of 32 and 128 rows on a padded copy
           (the other invariant design): us per call, a graph of 20 calls over weight copies
           that L2 cannot hold (replay_ms).
attention: one layer's decode attention (--rows x --live, max_context 4096), the default
           kernels against the invariant ones (and --spans), and a prompt's varlen attention
           (--prompts): us per layer over 32 layers' caches.
step:      the whole decoder: a decode step of S rows (--rows) at --live tokens, captured in a
           torch.cuda.CUDAGraph, ms per replay (median), batch_invariant off and on with the
           same weights; a prompt of P tokens (--prompts) through the eager forward (what a
           TTFT pays, host included), ms; and the check: each of 4 rows' logits alone against
           among 32 rows, mismatching rows (0 expected with the switch on).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from vt.bench.torch_workload import model_config
from vt.step import KVGeometry
from vt.torch import fused, triton_invariant as ti
from vt.torch import paged_attention as pa
from vt.torch.llama import LlamaDecoder
from vt.torch.views import TorchInputs

BS = 16
WIDTH = 4096 // BS     # the block tables' width: max_context 4096
PER_ROW = 2048 // BS   # blocks a row may hold: vt/bench/invariance.py's MAX_TOKENS
CANDIDATES = {   # block shapes timed beside linear_config's (the row-invariance holds for each)
    "m16n32k128": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    "m16n64k128": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    "m16n32k256": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),
    "m16n64k256": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
    "m64n64k64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    "m64n128k64": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    "m128n128k64": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
}


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(fn, replays=20):
    """Median ms of a captured graph of fn (warmed up on a side stream first)."""
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """w and clones of it, worth >= 256 MB together: calls that rotate over them read each
    from HBM, since L2 (50-60 MB) holds none by the time it comes round again."""
    return [w] + [w.clone() for _ in range(-(-2**28 // (w.numel() * w.element_size())) - 1)]


def cublas_blocks(x, w, B: int):
    """F.linear in blocks of exactly B rows over a zero-padded copy of x: every row goes
    through cuBLAS's kernel for one shape, whatever M is."""
    M = x.shape[0]
    pad = torch.zeros(-(-M // B) * B, x.shape[1], dtype=x.dtype, device=x.device)
    pad[:M] = x
    out = torch.empty(pad.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for c in range(0, pad.shape[0], B):
        torch.mm(pad[c:c + B], w.T, out=out[c:c + B])
    return out[:M]


def part_linear(ms, out):
    cfg = model_config("torch-llama3-8b")
    h, i = cfg.hidden, cfg.intermediate
    shapes = {"qkv": (h + 2 * cfg.kv_heads * cfg.head_dim, h), "o": (h, h),
              "gate_up": (2 * i, h), "down": (h, i), "head": (cfg.vocab, h)}
    impls = {"cublas": F.linear, "default": fused.linear, "invariant": ti.linear,
             "cublas-b32": lambda x, w: cublas_blocks(x, w, 32),
             "cublas-b128": lambda x, w: cublas_blocks(x, w, 128)}
    impls.update({f"inv-{n}": (lambda c: lambda x, w: ti.linear(x, w, config=c))(c)
                  for n, c in CANDIDATES.items()})
    rows = out.setdefault("linear_us", {})
    print(f"\nlinear: us per call ({', '.join(impls)})", flush=True)
    for name, (N, K) in shapes.items():
        copies = weight_copies(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cell = rows.setdefault(f"{name} M={M}", {})
            calls = 20 if M <= 128 else 4
            for impl, fn in impls.items():
                cell[impl] = 1e3 * replay_ms(lambda: [fn(x, copies[j % len(copies)])
                                                      for j in range(calls)]) / calls
            best = min((v, k) for k, v in cell.items() if k.startswith("inv"))
            print(f"{name:>7} M={M:<5} cublas {cell['cublas']:8.1f}  default "
                  f"{cell['default']:8.1f}  invariant {cell['invariant']:8.1f}  best inv "
                  f"{best[1]} {best[0]:8.1f}  cublas-b32 {cell['cublas-b32']:8.1f}  b128 "
                  f"{cell['cublas-b128']:8.1f}", flush=True)
        del copies


def _layer_caches(S, live, layers=32):
    """Per layer, K and V caches holding S rows of `live` tokens, and the rows' block tables
    (4096 positions wide, the entries past live pointing at block 0)."""
    per = -(-live // BS)
    caches = [(torch.randn(S * per * BS, 8, 128, device="cuda", dtype=torch.bfloat16),
               torch.randn(S * per * BS, 8, 128, device="cuda", dtype=torch.bfloat16))
              for _ in range(layers)]
    tables = torch.zeros(S, WIDTH, dtype=torch.int32, device="cuda")
    tables[:, :per] = torch.arange(S * per, dtype=torch.int32, device="cuda").view(S, per)
    return caches, tables


def part_attention(rows, lives, spans, prompts, out):
    res = out.setdefault("attention_us", {})
    print("\nattention: us per layer (32 layers' caches)", flush=True)
    for S in rows:
        for live in lives:
            caches, tables = _layer_caches(S, live)
            q = torch.randn(S, 32, 128, device="cuda", dtype=torch.bfloat16)
            lens = torch.full((S,), live, dtype=torch.int32, device="cuda")
            impls = {"default": lambda k, v: pa.paged_decode_attention(q, k, v, tables, lens,
                                                                       block_size=BS),
                     "invariant": lambda k, v: pa.paged_decode_attention(
                         q, k, v, tables, lens, block_size=BS, invariant=True)}
            impls.update({f"span{s}": (lambda s: lambda k, v: ti.paged_decode(
                q, k, v, tables, lens, block_size=BS, span=s))(s) for s in spans})
            cell = res.setdefault(f"decode S={S} live={live}", {})
            for name, fn in impls.items():
                cell[name] = 1e3 * replay_ms(lambda: [fn(k, v) for k, v in caches]) / len(caches)
            print(f"  decode S={S:<3} live={live:<5} " + "  ".join(
                f"{k} {v:7.1f}" for k, v in cell.items()), flush=True)
            del caches
    for P in prompts:
        caches, tables = _layer_caches(1, P)
        q = torch.randn(P, 32, 128, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, P], dtype=torch.int32, device="cuda")
        lens = torch.tensor([P], dtype=torch.int32, device="cuda")
        cell = res.setdefault(f"prompt P={P}", {})
        for name, inv in (("default", False), ("invariant", True)):
            cell[name] = 1e3 * replay_ms(lambda: [pa.paged_varlen_attention(
                q, k, v, qsl, lens, tables, block_size=BS, max_query_len=P, invariant=inv)
                for k, v in caches]) / len(caches)
        print(f"  prompt P={P:<5} default {cell['default']:8.1f}  invariant "
              f"{cell['invariant']:8.1f}", flush=True)
        del caches


def _decode_inputs(S, live, vocab):
    """A decode step of S rows, row r at position live[r] - 1 (live: an int or [S]) of its
    own PER_ROW blocks (block 0 is the scratch block)."""
    dev = "cuda"
    i32 = dict(dtype=torch.int32, device=dev)
    table = torch.randint(0, vocab, (S + 1,), generator=torch.Generator(dev).manual_seed(S),
                          **i32)
    tables = torch.zeros(S, WIDTH, **i32)
    tables[:, :PER_ROW] = 1 + torch.arange(S * PER_ROW, **i32).view(S, PER_ROW)
    pos = (torch.zeros(S, **i32) + torch.as_tensor(live, device=dev).int()) - 1
    slots = (tables.gather(1, (pos // BS).long()[:, None])[:, 0] * BS + pos % BS).int()
    rows = torch.arange(S, **i32)
    return TorchInputs.decode(table, rows, pos, pos + 1, slots, tables, rows)


def _prompt_inputs(P, vocab):
    """One sequence's whole prompt of P tokens as one eager step."""
    dev = "cuda"
    i32 = dict(dtype=torch.int32, device=dev)
    tables = torch.zeros(1, WIDTH, **i32)
    tables[0, :-(-P // BS)] = 1 + torch.arange(-(-P // BS), **i32)
    pos = torch.arange(P, **i32)
    slots = (tables[0, pos.long() // BS] * BS + pos % BS).int()
    zero = torch.zeros(1, **i32)
    return TorchInputs(torch.randint(0, vocab, (P,), **i32), pos, slots,
                       torch.tensor([0, P], **i32), torch.tensor([P], **i32), tables,
                       torch.tensor([P - 1], **i32), zero, zero, torch.zeros(2, **i32),
                       (0, P), (P,))


def part_step(rows, lives, prompts, out):
    cfg = model_config("torch-llama3-8b")
    S_max = max(rows + [32])
    geo = KVGeometry(max_seqs=S_max, num_kv_blocks=S_max * PER_ROW + 1, block_size=BS,
                     max_context=WIDTH * BS)
    torch.manual_seed(0)
    base = LlamaDecoder(cfg, geo, dtype=torch.bfloat16, device="cuda", batch_invariant=False)
    inv = LlamaDecoder(cfg, geo, dtype=torch.bfloat16, device="cuda", batch_invariant=True)
    inv.load_state_dict(base.state_dict(), assign=True)   # the same weights, held once
    torch.cuda.empty_cache()
    modules = {"default": base, "invariant": inv}
    for m in modules.values():
        m.k_cache.normal_()
        m.v_cache.normal_()
    res = out.setdefault("step_ms", {})
    print("\nstep: ms (decode: a captured step's replay; prompt: the eager forward)", flush=True)
    for live in lives:
        for S in rows:
            inputs = _decode_inputs(S, live, cfg.vocab)
            cell = res.setdefault(f"decode S={S} live={live}", {})
            for name, m in modules.items():
                logits = torch.empty(S, cfg.vocab, device="cuda")
                cell[name] = replay_ms(lambda: m(inputs, logits), replays=30)
            cell["cost_pct"] = 100 * (cell["invariant"] / cell["default"] - 1)
            print(f"  decode S={S:<3} live={live:<5} default {cell['default']:7.3f}  invariant "
                  f"{cell['invariant']:7.3f}  cost {cell['cost_pct']:+.1f}%", flush=True)
    for P in prompts:
        inputs = _prompt_inputs(P, cfg.vocab)
        cell = res.setdefault(f"prompt P={P}", {})
        for name, m in modules.items():
            logits = torch.empty(1, cfg.vocab, device="cuda")
            cell[name] = _eager_ms(lambda: m(inputs, logits))
        cell["cost_pct"] = 100 * (cell["invariant"] / cell["default"] - 1)
        print(f"  prompt P={P:<5} default {cell['default']:7.2f}  invariant "
              f"{cell['invariant']:7.2f}  cost {cell['cost_pct']:+.1f}%", flush=True)
    out["check"] = {name: _row_check(m, cfg.vocab) for name, m in modules.items()}
    print(f"  logits of 4 rows alone vs among 32, rows differing: {out['check']}", flush=True)


def _eager_ms(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _row_check(module, vocab):
    """Rows 0, 7, 19 and 31 of a 32-row decode step (row r at 300 + 37 r live tokens) alone
    (one-row steps) against in the step: how many rows' logits bytes differ."""
    S = 32
    live = 300 + 37 * torch.arange(S, device="cuda")
    together = torch.empty(S, vocab, device="cuda")
    step = _decode_inputs(S, live, vocab)
    module(step, together)
    bad = 0
    for r in (0, 7, 19, 31):
        alone = torch.empty(1, vocab, device="cuda")
        one = slice(r, r + 1)
        module(TorchInputs.decode(step.token_table, step.token_rows[one], step.positions[one],
                                  step.seq_lens[one], step.slot_mapping[one],
                                  step.block_tables[one], step.state_idx[one]), alone)
        bad += not torch.equal(alone[0].view(torch.int32), together[r].view(torch.int32))
    return bad


def run(parts, rows, lives, ms, spans, prompts) -> dict:
    """The parts asked for (each prints its lines as it goes): the results by part."""
    out = {"device": torch.cuda.get_device_name(), "span": ti.SPAN}
    if "linear" in parts:
        part_linear(ms, out)
    if "attention" in parts:
        part_attention(rows, lives, spans, prompts, out)
    if "step" in parts:
        part_step(rows, lives, prompts, out)
    return out
