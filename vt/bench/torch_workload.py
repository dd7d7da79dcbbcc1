"""`vt bench --workload torch`: the torch Llama decoder (vt.torch.llama, random bf16 weights)
run by vt's engines, against the same module in a hand-written torch.cuda.CUDAGraph loop.

The peer is what a PyTorch engineer writes for speed around this module (as torch_peer.py
does for the synthetic forward): static device inputs, two pinned input blocks and two
pinned token buffers, one graph per pair (the inputs' H2D, the forward, argmax, the token
table fed back, the tokens' D2H), depth 2 with one event per step, step N's tokens read
after step N+1 is launched. `torch_sync` waits for every step. Its prefill replays the graph
once per prompt position with the prompt's token written into the table (untimed).
"""
from __future__ import annotations

import time

import numpy as np

from vt.bench import cells
from vt.bench.torch_peer import VARIANTS, GraphLoop, TorchEvents, unavailable_reason as _peer_reason
from vt.backend.timing import timed_ms

PRESET = "torch-llama-10x2048"
DEFAULT_MODES = ("sync", "drain", "ring")


def model_config(preset: str = PRESET):
    """The LlamaConfig of a torch preset (PRESETS)."""
    from vt.torch.llama import LlamaConfig
    if preset not in PRESETS:
        raise ValueError(f"unknown torch preset {preset!r}; choose from {', '.join(PRESETS)}")
    return LlamaConfig(**PRESETS[preset][1])


# name -> (what it is, in one line; its LlamaConfig's fields)
PRESETS = {
    # TinyLlama's layer shape with 10 of its 22 layers. The step is launch-bound (~60 small
    # kernels a layer): all 22 layers measured 2.9 ms (S=1) and 3.7 ms (S=32) per step on an
    # H200; 10 layers bring it into 1-2 ms.
    "torch-llama-10x2048": (
        "TinyLlama's layers, 10 of 22: hidden 2048, GQA 32/4, SwiGLU 5632, vocab 32000 (0.6B)",
        dict(vocab=32000, hidden=2048, intermediate=5632, layers=10, heads=32, kv_heads=4,
             head_dim=64)),
    # The serve workload's test size: runs on the sim (CPU torch) in a second.
    "torch-tiny": (
        "a tiny Llama for tests: 2 layers, hidden 64, GQA 4/2, vocab 256 (runs on the sim)",
        dict(vocab=256, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16)),
    "torch-llama3-8b": (
        "Llama-3-8B's shape: 32 layers, hidden 4096, GQA 32/8, SwiGLU 14336, vocab 128256 (8.0B)",
        dict(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
             head_dim=128, rope_theta=500000.0)),
}


def add_tool_arguments(p) -> None:
    """The torch tools' shared flags: the model, the backend, vt's mode, the decoder's kernels
    (decode and prompt steps) and linears."""
    p.add_argument("--preset", default="torch-llama3-8b",
                   choices=["tiny"] + [n for n in PRESETS if n != "torch-tiny"],
                   help="the decoder's shape (default torch-llama3-8b; tiny: a test size)")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--mode", default="ring", help="vt's executor mode (default ring)")
    p.add_argument("--kernels", default="auto", choices=["auto", "vt", "torch"],
                   help="LlamaDecoder's decode attention and layer ops (default auto: vt's on CUDA)")
    p.add_argument("--linear", default="auto", choices=["auto", "torch", "triton"],
                   help="LlamaDecoder's linears in decode steps: auto (the default: triton "
                        "where --kernels resolves to vt, else torch), torch (cuBLAS) or triton "
                        "(vt.torch.triton_gemv at <= 16 rows; needs kernels vt)")
    p.add_argument("--prompt-kernels", default="auto", choices=["auto", "torch", "vt"],
                   help="LlamaDecoder's ops in steps with prompt tokens: auto (the default: as "
                        "--kernels), torch, or vt (the decode step's fused ops; needs kernels vt)")


def add_precision_arguments(p) -> None:
    """The flags of the decoder's element types that torch_decode and torch_ttft take (the
    weights' quantization and the KV cache's dtype); tool_decoder reads them."""
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="FP8 (e4m3) projection weights, per output channel (docs/torch.md)")
    p.add_argument("--fp8-prompt-linear", default="scaled_mm",
                   choices=["scaled_mm", "dequantize"],
                   help="with --quantization fp8: what computes steps of more than 256 rows "
                        "(default scaled_mm: FP8 tensor cores, each token's activations "
                        "quantized; dequantize: the weights dequantized, then cuBLAS)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's element type (auto: the model dtype; fp8: e4m3 codes "
                        "with a scale of 1.0 per layer's K and V; docs/torch.md)")

def tool_setup(preset: str, backend: str):
    """What the torch tools (torch_ttft, torch_decode) start with: (the open backend, the
    preset's LlamaConfig, the dtype, the result's common fields). "tiny" is torch-tiny; the
    weights are bf16 on cuda, float32 elsewhere."""
    import torch

    from vt.backend import get_backend
    be = get_backend(backend)
    cuda = be.name == "cuda"
    cfg = model_config("torch-tiny" if preset == "tiny" else preset)
    dtype = torch.bfloat16 if cuda else torch.float32
    common = dict(preset=preset, backend=be.name, dtype=str(dtype).split(".")[-1],
                  device=torch.cuda.get_device_name() if cuda else "cpu")
    return be, cfg, dtype, common


def tool_decoder(cfg, geometry, dtype, be, args, tool: str, batch_invariant: bool | None = None):
    """The torch tools' LlamaDecoder of --kernels, --linear and --prompt-kernels on `be`'s
    device (batch_invariant: LlamaDecoder's; None reads VT_BATCH_INVARIANT); a choice the
    device cannot take exits with one line that names it."""
    from vt.torch import torch_device
    from vt.torch.llama import LlamaDecoder
    try:
        return LlamaDecoder(cfg, geometry, dtype=dtype, device=torch_device(be),
                            kernels=args.kernels, linear=args.linear,
                            prompt_kernels=args.prompt_kernels,
                            quantization=getattr(args, "quantization", None),
                            fp8_prompt_linear=getattr(args, "fp8_prompt_linear", "scaled_mm"),
                            kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                            batch_invariant=batch_invariant)
    except ValueError as exc:
        raise SystemExit(f"{tool}: {exc}") from None


def describe() -> list[str]:
    """Each preset and what it is, one line each."""
    return [f"{name}: {what}" for name, (what, _) in PRESETS.items()]


def checked_presets(given, error) -> list[str]:
    """--preset of the torch workload: the default one when none is given; error(...) for an
    unknown name, listing each preset with what it is."""
    unknown = [p for p in given or () if p not in PRESETS]
    if unknown:
        error(f"--workload torch: unknown preset(s) {unknown}; choose from: " + "; ".join(describe()))
    return list(given or [PRESET])


def unavailable_reason(be) -> str | None:
    if be.name != "cuda":
        return f"the {be.name} backend: the torch workload needs a CUDA device"
    return _peer_reason()


def whole_context_geometry(max_seqs: int, context: int, block_size: int = 16):
    """The KVGeometry of the torch tools: every one of max_seqs rows may hold `context` tokens
    (rounded up to whole blocks) at once, plus the scratch block."""
    from vt.step import KVGeometry
    blocks = -(-context // block_size)
    return KVGeometry(max_seqs=max_seqs, num_kv_blocks=max_seqs * blocks + 1,
                      block_size=block_size, max_context=blocks * block_size)

def build(be, max_seqs: int, context: int, seed: int, block_size: int = 16, cfg=None,
          prefill: str = "flat", prompt_kernels: str = "auto"):
    """(the LlamaDecoder with seeded random weights, its TorchForwardModel); cfg: default
    model_config(). prefill: TorchForwardModel's (the decoder takes the flattened batch);
    prompt_kernels: the decoder's."""
    import torch

    from vt.torch import TorchForwardModel, torch_device
    from vt.torch.llama import LlamaDecoder
    cfg = cfg or model_config()
    geo = whole_context_geometry(max_seqs, context, block_size)
    torch.manual_seed(seed)
    module = LlamaDecoder(cfg, geo, dtype=torch.bfloat16, device=torch_device(be),
                          prompt_kernels=prompt_kernels)
    return module, TorchForwardModel(be, module, vocab=cfg.vocab, geometry=geo, prefill=prefill)


class TorchLlamaPeer(GraphLoop):
    """Two captured graphs of the module for S rows, one per pinned buffer pair (docstring)."""

    def __init__(self, module, S: int, warmup: int = 3):
        import torch
        self.torch, self.module, self.S = torch, module, S
        g = module.geometry
        dev = module.k_cache.device
        self.bs = g.block_size
        self.stream = torch.cuda.Stream(dev)
        self.table = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        # rows, positions, seq_lens, slot_mapping: what changes per step, one H2D per step
        self.inputs = torch.zeros(4, S, dtype=torch.int32, device=dev)
        # Block tables of S sequences (block 0 is the scratch block): written once.
        self.np_blocks = 1 + np.arange(S * g.max_blocks, dtype=np.int32).reshape(S, g.max_blocks)
        self.block_tables = torch.from_numpy(self.np_blocks).to(dev)
        self.state_idx = torch.arange(S, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(S, module.cfg.vocab, dtype=torch.float32, device=dev)
        self.tokens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.pinned_in = [torch.zeros(4, S, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.pinned_tok = [torch.zeros(S, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.np_in = [p.numpy() for p in self.pinned_in]
        self.np_tok = [p.numpy() for p in self.pinned_tok]
        self.tok_ready = [torch.cuda.Event() for _ in range(2)]
        for h in self.np_in:
            self._fill(h, np.zeros(S, np.int32), 0)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            for i in range(warmup):   # on a side stream before capture, as torch asks
                self._body(i % 2)
        self.stream.synchronize()
        self.graphs = []
        pool = None
        for b in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream, pool=pool):
                self._body(b)
            pool = graph.pool()   # both graphs in one pool: they replay in turn on one stream
            self.graphs.append(graph)
        self.stream.synchronize()

    def _fill(self, h, start, n: int) -> None:
        """The step's host inputs for positions start + n [S] into pinned block h."""
        pos = start + n
        h[0] = np.arange(self.S, dtype=np.int32)
        h[1] = pos
        h[2] = pos + 1
        h[3] = self.np_blocks[h[0], pos // self.bs] * self.bs + pos % self.bs

    def _body(self, b: int) -> None:
        from vt.torch.views import TorchInputs
        self.inputs.copy_(self.pinned_in[b], non_blocking=True)
        rows, pos, lens, slots = self.inputs
        self.module(TorchInputs.decode(self.table, rows, pos, lens, slots, self.block_tables,
                                       self.state_idx), self.logits)
        self.tokens.copy_(self.torch.argmax(self.logits, dim=1))
        self.table.index_put_((rows,), self.tokens)
        self.pinned_tok[b].copy_(self.tokens, non_blocking=True)

    def ceiling_us(self, replays: int = 200) -> float:
        with self.torch.cuda.stream(self.stream):
            ms = timed_ms(TorchEvents(), self.stream, self.graphs[0].replay, replays, 3, warmup=3)
        return 1e3 * ms

    def run(self, variant: str, prompts, steps: int) -> dict:
        """Prefill (untimed), then `steps` timed decode steps; wall_s, wait_s, tokens."""
        torch, S = self.torch, self.S
        if variant not in VARIANTS:
            raise ValueError(f"unknown torch variant {variant!r}; choose from {VARIANTS}")
        P = np.array(prompts, np.int32)     # [S, L]: the bench's prompts have one length
        L = P.shape[1]
        out = np.zeros((steps + 1, S), np.int32)
        start = np.full(S, L - 1, np.int32)
        with torch.cuda.stream(self.stream):
            for p in range(L):                   # prefill: the graph with teacher forcing
                self.table[:S].copy_(torch.from_numpy(P[:, p]).to(self.table.device))
                self._fill(self.np_in[0], np.full(S, p, np.int32), 0)
                self.graphs[0].replay()
                self.stream.synchronize()
            out[0] = self.np_tok[0]
            loop = self._sync_steps if variant == "torch_sync" else self._async_steps
            t0 = time.perf_counter()
            wait_s = loop(start, out, 1, steps + 1)
            wall_s = time.perf_counter() - t0
        return dict(wall_s=wall_s, wait_s=wait_s, tokens=out.T.tolist())

    def time_decode(self, variant: str, start: int, steps: int) -> float:
        """Seconds per step of `steps` decode steps of every row from position `start`, with
        no prefill: the cache holds whatever it holds (a step's cost does not depend on the
        cached values), so only the timing means anything."""
        torch = self.torch
        if variant not in VARIANTS:
            raise ValueError(f"unknown torch variant {variant!r}; choose from {VARIANTS}")
        out = np.zeros((steps + 1, self.S), np.int32)
        first = np.full(self.S, start, np.int32)
        loop = self._sync_steps if variant == "torch_sync" else self._async_steps
        with torch.cuda.stream(self.stream):
            loop(first, out, 0, 2)               # warm: both graphs once
            t0 = time.perf_counter()
            loop(first, out, 0, steps)
            return (time.perf_counter() - t0) / steps



def run_torch(be, args, progress, reason: str | None,
              prompt_kernels: dict | None = None) -> list[dict]:
    """Per preset and conc: vt's engines of every mode on the module, then the peer on the
    same module. prompt_kernels, if given, gets {preset: what its decoder's steps with prompt
    tokens ran} ("auto" as the decoder resolved it), for the record."""
    import gc
    from vt.bench.measure import mode_cell
    rows = []
    ctx = args.prompt_len + args.steps + 2
    for preset in args.preset:
        t0 = time.perf_counter()
        module, model = build(be, max(args.conc), ctx, args.seed, cfg=model_config(preset),
                              prompt_kernels=args.prompt_kernels)
        progress.step(f"{preset}: model set up in {time.perf_counter() - t0:.1f} s")
        if prompt_kernels is not None:
            prompt_kernels[preset] = module.prompt_kernels
        for conc in args.conc:
            rng = np.random.default_rng(args.seed + conc)
            prompts = rng.integers(0, module.cfg.vocab, size=(conc, args.prompt_len)).tolist()
            ident = dict(workload="torch", preset=preset, conc=conc)
            for mode in args.modes:
                rows.append(mode_cell(be, model, mode, conc, ident, prompts, args, progress, ""))
            rows += _peer_rows(module, conc, prompts, args, ident, progress, reason)
        del module, model
        gc.collect()   # the next preset's weights need the memory
    return rows


def _peer_rows(module, conc, prompts, args, ident, progress, reason) -> list[dict]:
    from vt.bench.measure import done_line, median_run
    if reason is not None:
        return [cells.absent_row(reason, impl="torch", mode=v, **ident) for v in VARIANTS]
    try:
        peer = TorchLlamaPeer(module, conc)
    except Exception as exc:   # keep the vt cells; the peer's rows say why
        why = f"the torch peer failed to set up: {type(exc).__name__}: {exc}"
        progress.log(f"vt bench: {why}")
        return [cells.absent_row(why, impl="torch", mode=v, **ident) for v in VARIANTS]
    rows = []
    try:
        ceiling = peer.ceiling_us(args.ceiling_replays)
        for variant in VARIANTS:
            runs = [peer.run(variant, prompts, args.steps) for _ in range(args.repeats)]
            res, times = median_run(runs, lambda r: r["wall_s"] / args.steps)
            rows.append(cells.torch_row(dict(ident, mode=variant), res, conc=conc,
                                        steps=args.steps, ceiling_us=ceiling, tokens_ok=None))
            rows[-1]["step_us_runs"] = times
            progress.step(done_line(rows[-1]))
    finally:
        peer.close()
    return rows
