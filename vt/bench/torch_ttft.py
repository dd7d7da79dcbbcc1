"""`vt bench --workload torch-ttft`: time to first token and time per output token of a torch
Llama decoder (vt.torch.llama, random weights) served by vt, against transformers' own
`generate` on the same shape, in one run, printed as one table.

What is measured (each the median of --repeats runs, on a warm engine and a warm peer):
- TTFT, 1 request: a prompt of each --single length (default --prompt-len) submitted alone,
  to its first token on the host (the geometry's max_context fits the longest);
- TTFT, --conc requests submitted together: the last request's first token (and the median);
- TPOT at --conc requests, context --context: each request's (last token - first token) /
  (tokens - 1), the median over the requests;
- the peer: transformers `generate(do_sample=False)`, eager (its default attention, dynamic
  cache, no compile): TTFT = a generate of one new token, batch 1 and batch --conc;
  TPOT = (generate of N new tokens - generate of 1) / (N - 1), batch --conc; and the same
  with its static cache, with which generate compiles the decode forward on a GPU
  (torch.compile, CUDA graphs; --no-static leaves it out);
- on cuda, the bf16 GEMM throughput of one large matmul, the compute ceiling of a prefill:
  vt's prefill FLOP/s counts 2 x non-embedding parameters x prompt tokens over its TTFT (for
  the --conc requests, and for each --single prompt).

vt serves the decoder with TorchForwardModel(prefill="flat"): a step's prompt tokens (and a
mixed step's decode rows) run in one forward call; decode steps are captured graphs.
`--preset tiny` is a small fp32 decoder that runs anywhere (the sim too): the tool's own test.
"""
from __future__ import annotations

import gc
import itertools
import statistics
import time

from vt.bench.errors import CommandFailed


def add_arguments(p) -> None:
    """The workload's flags: the torch tools' shared ones and its own."""
    from vt.bench.torch_workload import add_precision_arguments, add_tool_arguments
    add_tool_arguments(p)
    p.add_argument("--conc", type=int, default=32, help="requests arriving together (default 32)")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="prompt tokens of the --conc requests (default 128)")
    p.add_argument("--single", type=int, nargs="+", default=None,
                   help="prompt lengths of the 1-request TTFT (default: --prompt-len)")
    p.add_argument("--context", type=int, default=512,
                   help="prompt + output tokens of the TPOT run (default 512)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-peer", action="store_true", help="leave transformers out")
    p.add_argument("--no-static", action="store_true",
                   help="leave out transformers with its static cache (compiled on a GPU)")
    add_precision_arguments(p)
    p.add_argument("--json", default=None, help="also write the results here")


def check_arguments(args, error) -> None:
    """Each value checked before any work; error(message) refuses one."""
    args.single = args.single or [args.prompt_len]
    if not 1 <= args.prompt_len < args.context:
        error(f"--prompt-len {args.prompt_len} must be in [1, --context {args.context})")
    if min(args.single) < 1:
        error(f"--single {args.single}: prompt lengths must be positive")
    if args.conc < 1 or args.repeats < 1:
        error("--conc and --repeats must be positive")


def run_and_report(args) -> int:
    """Run, print the table, write the JSON (and the PNG) when asked for."""
    from vt.bench.report import print_and_save
    result = run(args)
    print_and_save(format_table(result), result, args.json)
    return 0


def run(args) -> dict:
    import torch

    from vt.bench.torch_workload import tool_setup
    be, cfg, dtype, common = tool_setup(args.preset, args.backend)
    cuda = be.name == "cuda"
    out = dict(common, mode=args.mode, kernels=args.kernels, linear=args.linear,
               prompt_kernels=args.prompt_kernels, conc=args.conc,
               prompt_len=args.prompt_len, context=args.context,
               quantization=args.quantization, fp8_prompt_linear=args.fp8_prompt_linear,
               kv_cache_dtype=args.kv_cache_dtype)
    try:
        out["vt"] = _run_vt(be, cfg, dtype, args)
        out["params"] = out["vt"].pop("params")
        out["prompt_kernels"] = out["vt"].pop("prompt_kernels")   # "auto" resolved
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()   # the peer's weights need the memory
        out["peer"] = out["peer_static"] = None
        if not args.no_peer:
            caches = [None] if args.no_static else [None, "static"]
            peers = _run_peers(cfg, dtype, torch.device("cuda" if cuda else "cpu"), args, caches)
            out["peer"] = peers[0]
            if len(peers) > 1:
                out["peer_static"] = peers[1]
        out["gemm_tflops"] = _gemm_tflops() if cuda else None
    finally:
        be.close()
    return out


def _run_vt(be, cfg, dtype, args) -> dict:
    import torch

    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.bench.torch_workload import tool_decoder, whole_context_geometry
    from vt.torch import TorchForwardModel
    # a single prompt may be longer than --context
    geo = whole_context_geometry(args.conc, max(args.context, max(args.single) + 1))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    module = tool_decoder(cfg, geo, dtype, be, args, "torch_ttft")
    # the state dict: an FP8 decoder's codes are buffers, not parameters (scales not counted)
    params = sum(t.numel() for n, t in module.state_dict().items()
                 if not n.startswith("embed.") and not n.endswith(".weight_scale"))
    if module.lm_head is None:
        params += module.embed.weight.numel()
    model = TorchForwardModel(be, module, vocab=cfg.vocab, geometry=geo, prefill="flat")
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64) if s < args.conc) + (args.conc,)
    config = ExecutorConfig(mode=args.mode, serving_conc=args.conc, capture_sizes=sizes)
    # Every prompt submitted is new (its own seed): a repeat would be served from the prefix
    # cache, on by default, and time a cache hit instead of a prefill.
    seeds = itertools.count(2)

    def fresh(n: int, length: int) -> list[list[int]]:
        return seeded_prompts(cfg.vocab, n, length, seed=next(seeds))

    new = args.context - args.prompt_len
    with Engine(be, model, config, max_prefill_tokens=args.conc * args.prompt_len) as eng:
        setup_s = time.perf_counter() - t0
        _first_tokens(eng, fresh(args.conc, args.prompt_len))   # warm: every prompt shape
        single = {}
        for P in args.single:
            _first_tokens(eng, fresh(1, P))   # warm: this prompt's shape
            single[str(P)] = statistics.median(_first_tokens(eng, fresh(1, P))[0]
                                               for _ in range(args.repeats))
        many = [_first_tokens(eng, fresh(args.conc, args.prompt_len))
                for _ in range(args.repeats)]
        tpot = []
        for _ in range(args.repeats):
            res = [h.result() for h in [eng.submit(p, max_new_tokens=new)
                                        for p in fresh(args.conc, args.prompt_len)]]
            tpot.append(statistics.median((r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1)
                                          for r in res))
        stats = eng.stats()
    hit_rate = (stats.get("prefix_cache") or {}).get("hit_rate") or 0.0
    if hit_rate:
        raise CommandFailed(f"torch-ttft: the prefix cache served {hit_rate:.1%} of the prompt "
                            "tokens; every timed prompt must be computed")
    return dict(params=params, prompt_kernels=module.prompt_kernels, setup_s=setup_s,
                prefix_hit_rate=hit_rate,
                ttft_single_s=single,
                ttft_n_last_s=statistics.median(max(m) for m in many),
                ttft_n_median_s=statistics.median(statistics.median(m) for m in many),
                tpot_s=statistics.median(tpot),
                steps=dict(graph=stats["graph_steps"], prefill=stats["prefill_steps"],
                           mixed=stats["mixed_steps"], eager=stats["eager_steps"]))


def _first_tokens(eng, prompts) -> list[float]:
    """Seconds from submitting `prompts` together to each one's first token on the host."""
    t0 = time.perf_counter()
    handles = [eng.submit(p, max_new_tokens=1) for p in prompts]
    return [h.result().token_times[0] - t0 for h in handles]


def hf_llama(cfg, dtype, device, max_context: int):
    """transformers' LlamaForCausalLM of cfg's shape (random weights of its own, made in
    `dtype` on `device`), eval mode, and a one-line label; ImportError without transformers."""
    import torch
    try:
        import transformers
    except Exception as exc:   # the peer is optional
        raise ImportError(f"{type(exc).__name__}: {exc}") from exc
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=max(max_context, 2048),
        tie_word_embeddings=cfg.tie_embeddings, eos_token_id=None, bos_token_id=None,
        pad_token_id=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # made in its dtype: an fp32 8B model would not fit beside
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return model, (f"transformers {transformers.__version__} generate, eager "
                   f"({model.config._attn_implementation} attention)")


def hf_generate_s(model, ids, tokens: int, cache: str | None = None) -> float:
    """Seconds of one greedy transformers generate of exactly `tokens` new tokens after `ids`
    [batch, prompt] (the device synchronized on both sides). cache: None (its dynamic cache,
    eager) or "static": its static cache, with which generate compiles the decode forward on
    a GPU (torch.compile, mode reduce-overhead: CUDA graphs). The static cache is sized for
    the longest generate so far, so run the longest first and later ones reuse the compiled
    forward."""
    import torch
    extra = {} if cache is None else dict(cache_implementation=cache)
    _sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0, **extra)
    _sync(ids.device)
    return time.perf_counter() - t0


def _run_peers(cfg, dtype, device, args, caches: list) -> list:
    """transformers generate on the same shape (random weights of its own, one model for
    every cache): per cache of `caches`, None (eager, its dynamic cache) or "static"
    (compiled on a GPU), its times; or, for each, why there are none."""
    try:
        model, label = hf_llama(cfg, dtype, device, args.context)
    except ImportError as exc:
        return [f"transformers does not import ({exc})"] * len(caches)
    return [_time_peer(model, label, cfg, device, args, cache) for cache in caches]


def _time_peer(model, label: str, cfg, device, args, cache: str | None) -> dict:
    import torch
    if cache is not None:
        label = label.replace("eager", f"{cache} cache, compiled" if device.type == "cuda"
                              else f"{cache} cache (no compile off a GPU)")
    new = args.context - args.prompt_len
    generate_s = lambda ids, tokens: hf_generate_s(model, ids, tokens, cache)   # noqa: E731
    ids = torch.tensor(seeded_prompts(cfg.vocab, args.conc, args.prompt_len), device=device)
    # warm-up, the longest generate first (a static cache is sized by it, and compiled once)
    generate_s(ids, new), generate_s(ids[:1], 2), generate_s(ids, 2)
    single = {}
    for P in args.single:
        one_ids = torch.tensor(seeded_prompts(cfg.vocab, 1, P), device=device)
        generate_s(one_ids, 1)
        single[str(P)] = statistics.median(generate_s(one_ids, 1) for _ in range(args.repeats))
    many = statistics.median(generate_s(ids, 1) for _ in range(args.repeats))
    full = statistics.median(generate_s(ids, new) for _ in range(args.repeats))
    return dict(impl=label, ttft_single_s=single, ttft_n_last_s=many,
                tpot_s=(full - many) / max(1, new - 1))


def _gemm_tflops(m: int = 8192, k: int = 4096, n: int = 14336, reps: int = 20) -> float:
    """bf16 dense GEMM throughput of one [m, k] @ [k, n] matmul (cuBLAS through torch)."""
    import torch
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * m * k * n * reps / (start.elapsed_time(end) * 1e-3) / 1e12


def seeded_prompts(vocab: int, n: int, length: int, seed: int = 1) -> list[list[int]]:
    """n random prompts of `length` tokens, the same for a seed (vt's run and its peer's)."""
    import numpy as np

    from vt.bench.setup import random_prompts
    return random_prompts(np.random.default_rng(seed), vocab, n, length)


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def format_table(r: dict) -> str:
    vt, peers = r["vt"], [r["peer"], r.get("peer_static")]
    n, P = r["conc"], r["prompt_len"]

    def of(peer, key, sub=None):
        if not isinstance(peer, dict):
            return None
        return peer[key] if sub is None else peer[key][sub]
    rows = [(f"TTFT, 1 request of {L} tokens", vt["ttft_single_s"][L],
             [of(q, "ttft_single_s", L) for q in peers]) for L in vt["ttft_single_s"]]
    rows += [(f"TTFT, {n} requests of {P} tokens (last)", vt["ttft_n_last_s"],
              [of(q, "ttft_n_last_s") for q in peers]),
             (f"TPOT, {n} requests, context {r['context']}", vt["tpot_s"],
              [of(q, "tpot_s") for q in peers])]
    lines = [f"{r['preset']}: {r['params'] / 1e9:.2f} B parameters (non-embedding), {r['dtype']}, "
             f"on {r['device']} ({r['backend']}); vt mode {r['mode']}, prefill=flat, prompt "
             f"kernels {r.get('prompt_kernels', 'torch')}"
             + (f", {r['quantization']} weights (prompt linear {r['fp8_prompt_linear']})"
                if r.get("quantization") else "")
             + (", fp8 KV cache" if r.get("kv_cache_dtype") == "fp8" else ""),
             f"{'':44s} {'vt':>10s} {'peer':>10s} {'vt/peer':>8s} {'static':>10s} "
             f"{'vt/static':>9s}"]
    for label, mine, theirs in rows:
        cells = [f"{label:44s} {mine * 1e3:7.1f} ms"]
        for t, width in zip(theirs, (8, 9)):
            cells.append(f"{t * 1e3:7.1f} ms {mine / t:{width}.2f}" if t else
                         f"{'-':>10s} {'-':>{width}s}")
        lines.append(" ".join(cells))
    lines.append(f"{'TTFT, ' + str(n) + ' requests (median)':44s} {vt['ttft_n_median_s'] * 1e3:7.1f} ms")
    flops = 2 * r["params"] * n * P / vt["ttft_n_last_s"] / 1e12
    gemm = r.get("gemm_tflops")
    ceiling = f" = {100 * flops / gemm:.0f} % of the bf16 GEMM's {gemm:.0f} TFLOP/s" if gemm else ""
    lines.append(f"vt prefill of {n} x {P} tokens: {flops:.1f} TFLOP/s{ceiling}")
    for L, t in vt["ttft_single_s"].items():
        one = 2 * r["params"] * int(L) / t / 1e12
        share = f" = {100 * one / gemm:.0f} %" if gemm else ""
        lines.append(f"vt prefill of 1 x {L} tokens: {one:.1f} TFLOP/s{share}")
    for name, q in zip(("peer", "static"), peers):
        lines.append(f"{name}: {q['impl'] if isinstance(q, dict) else q or 'left out'}")
    lines.append(f"vt steps: {vt['steps']}; engine set up in {vt['setup_s']:.1f} s")
    return "\n".join(lines)

