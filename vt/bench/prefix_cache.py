"""`vt bench --workload prefix-cache`: automatic prefix caching (vt/engine/kv_blocks.py) under
the traffic it is for, on a torch Llama decoder (vt.torch.llama, random weights) served by vt,
with caching on and off in the same run (two engines over the one decoder, one after the
other, each warmed first).

Shapes (--shapes; every one by default):
  chat: --conversations conversations (4 per client by default) of --turns turns each
    (uniform in [min, max]), served by --clients clients: a client holds one conversation at
    a time, sends its next turn when the previous answer is complete and, when its
    conversation ends, takes the next one, so --clients conversations run at once until the
    last ones. Each turn appends --turn-tokens new user tokens (uniform) to the whole history
    (every earlier prompt and answer) and asks for --output-len tokens. With caching on, a
    turn finds the history cached, the previous answers included. The clients start one
    after another, spread evenly over one answer's time (--output-len decode steps of
    --clients rows, timed in the first engine's warm-up; both engines get the same offsets):
    every answer has the same length and no client waits between turns, so clients started
    together would stay in step for the whole run, every turn arriving in the same step as
    every other client's and waiting for all of their prefills (--lockstep: that way).
  system: --requests requests from --clients closed-loop clients; every prompt is the same
    system prompt of --system-len tokens (drawn once, uniform) then --turn-tokens tokens of
    its own; --output-len tokens each.
  long-prefix: TTFT of one request alone: a --long-prompt prompt whose first --long-cached
    tokens are cached (a request with that prefix ran before), against an uncached
    --short-prompt prompt, on the caching engine; the ratio is the first over the second
    (the same prompt uncached, on the other engine, is reported too). Medians of --repeats,
    each with a fresh uncached tail.
  no-hit: --requests random prompts (--no-hit-len tokens, never a shared block) from
    --clients clients: output tokens/s with caching on over off (what the bookkeeping costs).

Per shape and engine: TTFT, TPOT and ITL percentiles (vt/bench/serve.py's latency_metrics,
the engine's token times), output tokens/s over the shape's wall, the hit rate (prompt tokens
served from cached blocks over prompt tokens admitted) and evictions, and how many requests'
tokens differ between the two engines (0 where the decoder's KV bits depend on the sequence
alone: the sim, or VT_BATCH_INVARIANT=1 on CUDA). Every shape serves the same requests with
caching on and off: the prompts are drawn once, seeded (a chat turn's history holds that
engine's answers; requests make exactly --output-len tokens, no stop token).

`--preset tiny` with small flags runs on the sim in seconds (the test's); on a GPU the default
preset is Llama-3-8B's shape (docs/cli.md gives the command).

`--http DIR`: the same shapes through HTTP, against `vt serve --model DIR` started by the
bench (--backend, --mode, --clients rows, the context and KV blocks the in-process engines
get), once with caching on and once with --no-prefix-cache, one after the other. Each request
is a streamed POST /v1/completions of token ids (vt/bench/serve_http.py's client: greedy,
ignore_eos, exactly --output-len tokens); TTFT/TPOT/ITL come from the client's arrival times,
the cached tokens and evictions from the server's /metrics, the hit rate is cached tokens
over the prompt tokens sent. --preset and the kernel flags do not apply: the checkpoint is
the model.
"""
from __future__ import annotations

import queue
import statistics
import threading
import time

import numpy as np

SHAPES = ("chat", "system", "long-prefix", "no-hit")
BLOCK = 16
CONVERSATIONS_PER_CLIENT = 4   # chat's default: the clients stay busy for most of the run


def add_arguments(p) -> None:
    from vt.bench.torch_workload import add_tool_arguments
    add_tool_arguments(p)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                   help="the traffic shapes to run (default: all)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--conversations", type=int, default=None,
                   help="chat: conversations the clients serve, one at a time each "
                        "(default 4 per client)")
    p.add_argument("--lockstep", action="store_true",
                   help="chat: every client starts at once (their turns then arrive together "
                        "all run long) instead of one after another over one answer's time")
    p.add_argument("--turns", type=int, nargs=2, default=[4, 8], metavar=("MIN", "MAX"),
                   help="chat: turns per conversation (default 4 8)")
    p.add_argument("--turn-tokens", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"),
                   help="new user tokens per chat turn / per system-prompt request (default 64 256)")
    p.add_argument("--output-len", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--system-len", type=int, nargs=2, default=[1024, 2048], metavar=("MIN", "MAX"),
                   help="system: the shared prompt's length (default 1024 2048)")
    p.add_argument("--requests", type=int, default=64,
                   help="system and no-hit: requests per engine (default 64)")
    p.add_argument("--long-prompt", type=int, default=4096, help="long-prefix: its prompt (default 4096)")
    p.add_argument("--long-cached", type=int, default=3968,
                   help=f"long-prefix: its cached tokens (default 3968; a multiple of {BLOCK})")
    p.add_argument("--short-prompt", type=int, default=128,
                   help="long-prefix: the uncached prompt it is compared with (default 128)")
    p.add_argument("--no-hit-len", type=int, default=512, help="no-hit: prompt tokens (default 512)")
    p.add_argument("--repeats", type=int, default=5, help="long-prefix: TTFT samples (default 5)")
    p.add_argument("--max-prefill-tokens", type=int, default=4096,
                   help="prompt tokens per step (default 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--http", default=None, metavar="DIR",
                   help="run the shapes through HTTP against `vt serve --model DIR`, started "
                        "with caching on, then with --no-prefix-cache")


def check_arguments(args, error) -> None:
    for name in ("clients", "output_len", "requests", "repeats", "max_prefill_tokens",
                 "short_prompt", "no_hit_len"):
        if getattr(args, name) < 1:
            error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    for name in ("turns", "turn_tokens", "system_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            error(f"--{name.replace('_', '-')} {lo} {hi}: need 1 <= MIN <= MAX")
    if args.long_cached % BLOCK or not 0 < args.long_cached < args.long_prompt:
        error(f"--long-cached {args.long_cached}: a positive multiple of {BLOCK} below "
              f"--long-prompt {args.long_prompt}")
    if args.output_len < 2:
        error(f"--output-len {args.output_len}: at least 2 (TPOT needs two tokens)")
    if args.conversations is not None and args.conversations < 1:
        error(f"--conversations {args.conversations} must be positive")


def run_and_report(args) -> int:
    from vt.bench.report import print_and_save
    result = run_http(args) if args.http else run(args)
    print_and_save(format_table(result), result, args.json)
    return 0


# -- the requests ----------------------------------------------------------------------
def conversations(args) -> int:
    """chat's conversations: --conversations, else CONVERSATIONS_PER_CLIENT per client."""
    return args.conversations if args.conversations is not None else \
        CONVERSATIONS_PER_CLIENT * args.clients


def _max_context(args) -> int:
    """The longest sequence any shape makes, rounded up to whole blocks."""
    chat = args.turns[1] * (args.turn_tokens[1] + args.output_len) if "chat" in args.shapes else 0
    system = args.system_len[1] + args.turn_tokens[1] + args.output_len
    longest = max(chat, system, args.long_prompt + 1, args.no_hit_len + args.output_len)
    return -(-longest // BLOCK) * BLOCK


def draw(args, vocab: int) -> dict:
    """Every shape's prompts, seeded: both engines serve these."""
    rng = np.random.default_rng(args.seed)

    def toks(n):
        return rng.integers(0, vocab, int(n)).astype(np.int32)

    def between(lo_hi):
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    chat = [[toks(between(args.turn_tokens)) for _ in range(between(args.turns))]
            for _ in range(conversations(args))]
    system = toks(between(args.system_len))
    sys_reqs = [np.concatenate([system, toks(between(args.turn_tokens))]) for _ in range(args.requests)]
    long_prefix = toks(args.long_cached)
    tails = [toks(args.long_prompt - args.long_cached) for _ in range(args.repeats + 1)]
    shorts = [toks(args.short_prompt) for _ in range(args.repeats + 1)]
    no_hit = [toks(args.no_hit_len) for _ in range(args.requests)]
    return dict(chat=chat, system=sys_reqs, long_prefix=long_prefix, tails=tails,
                shorts=shorts, no_hit=no_hit)


# -- serving one shape on one engine ---------------------------------------------------
def chat_offsets(clients: int, output_len: int, step_s: float, lockstep: bool) -> list[float]:
    """When each chat client starts, in seconds after the first: spread evenly over one
    answer's time (output_len steps of step_s), or all at once (lockstep)."""
    return [0.0 if lockstep else c * output_len * step_s / clients for c in range(clients)]


def _chat(eng, conversations, offsets, output_len: int, timeout_s: float):
    """The conversations served by len(offsets) clients, client c starting at offsets[c] s: a
    client takes the next conversation, sends a turn when the previous answer is complete,
    and takes the next conversation when its own ends; (handles by conversation, then turn;
    wall)."""
    done_q: queue.Queue = queue.Queue()
    history = [np.zeros(0, np.int32) for _ in conversations]
    turn = [0] * len(conversations)
    waiting = iter(range(len(conversations)))
    sent = {}

    def send(k):
        prompt = np.concatenate([history[k], conversations[k][turn[k]]])
        history[k] = prompt
        h = eng.submit(prompt, max_new_tokens=output_len)
        sent[k, turn[k]] = h
        h.add_done_callback(lambda _h, k=k: done_q.put((k, _h)))

    def take_next():
        k = next(waiting, None)
        if k is not None:
            send(k)

    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    starts = sorted(t0 + o for o in offsets)
    total = left = sum(len(c) for c in conversations)
    while left:
        while starts and starts[0] <= time.perf_counter():
            starts.pop(0)
            take_next()
        until = min(starts[0], deadline) if starts else deadline
        try:
            k, h = done_q.get(timeout=max(until - time.perf_counter(), 0.0))
        except queue.Empty:
            if time.perf_counter() >= deadline:
                raise _late("chat", total - left, timeout_s) from None
            continue
        left -= 1
        history[k] = np.concatenate([history[k], np.asarray(h.result(timeout=0).tokens, np.int32)])
        turn[k] += 1
        if turn[k] < len(conversations[k]):
            send(k)
        else:
            take_next()
    return [sent[k] for k in sorted(sent)], time.perf_counter() - t0


def _closed(eng, prompts, clients: int, output_len: int, timeout_s: float):
    from vt.bench.serve import closed_loop
    return closed_loop(eng, [(p, output_len) for p in prompts], clients, timeout_s)


def _late(what, finished, timeout_s):
    from vt.bench.errors import CommandFailed
    return CommandFailed(f"vt bench: prefix-cache {what} not served within its {timeout_s:g} s "
                         f"deadline: {finished} requests finished")


def _measure(eng, serve) -> tuple[dict, list]:
    """Run serve() -> (handles, wall) on eng: the cell's metrics and its requests' tokens."""
    before = eng.stats()["prefix_cache"]
    handles, wall = serve()
    results = [h.result(timeout=0) for h in handles]
    after = eng.stats()["prefix_cache"]
    return _cell_metrics([r.tokens for r in results], wall,
                         prompt=after["prompt_tokens"] - before["prompt_tokens"],
                         cached=after["cached_tokens"] - before["cached_tokens"],
                         evictions=after["evictions"] - before["evictions"],
                         sent_at=[h.submitted_at for h in handles],
                         token_times=[r.token_times for r in results])


def _cell_metrics(tokens: list, wall: float, *, prompt: int, cached: int, evictions: int,
                  sent_at: list, token_times: list) -> tuple[dict, list]:
    """A cell's metrics (in process and over HTTP alike) from its requests' output tokens,
    the cache's counts over the cell and each request's times; and the tokens."""
    from vt.bench.serve import latency_metrics
    n = sum(len(t) for t in tokens)
    out = dict(requests=len(tokens), output_tokens=n, wall_s=wall, output_tok_per_s=n / wall,
               prompt_tokens=prompt, cached_tokens=cached,
               hit_rate=cached / prompt if prompt else 0.0, evictions=evictions)
    out.update(latency_metrics(sent_at, token_times))
    return out, tokens


def _ttft(eng, prompt) -> float:
    t0 = time.perf_counter()
    r = eng.submit(prompt, max_new_tokens=1).result()
    return float(r.token_times[0] - t0)


def _serve_shapes(eng, args, work, offsets, timeout_s: float) -> tuple[dict, dict]:
    """Every asked shape on one warm engine, chat's clients starting at `offsets`:
    ({shape: metrics}, {shape: tokens})."""
    cells, tokens = {}, {}
    if "chat" in args.shapes:
        cells["chat"], tokens["chat"] = _measure(
            eng, lambda: _chat(eng, work["chat"], offsets, args.output_len, timeout_s))
    if "system" in args.shapes:
        cells["system"], tokens["system"] = _measure(
            eng, lambda: _closed(eng, work["system"], args.clients, args.output_len, timeout_s))
    if "no-hit" in args.shapes:
        cells["no-hit"], tokens["no-hit"] = _measure(
            eng, lambda: _closed(eng, work["no_hit"], args.clients, args.output_len, timeout_s))
    if "long-prefix" in args.shapes:
        prefix = work["long_prefix"]
        # a request whose prompt is the prefix and one more token caches every block of it
        eng.submit(np.concatenate([prefix, work["tails"][0][:1]]), max_new_tokens=1).result()
        before = eng.stats()["prefix_cache"]
        longs, shorts = [], []
        for tail, short in zip(work["tails"][1:], work["shorts"][1:]):
            longs.append(_ttft(eng, np.concatenate([prefix, tail])))
            shorts.append(_ttft(eng, short))
        after = eng.stats()["prefix_cache"]
        cells["long-prefix"] = dict(
            ttft_long_ms=statistics.median(longs) * 1e3, ttft_short_ms=statistics.median(shorts) * 1e3,
            cached_tokens_per_long=(after["cached_tokens"] - before["cached_tokens"]) / len(longs))
    return cells, tokens


STEP_TIMING_TOKENS = 8   # the warm-up's tokens per client: its decode steps are timed


def _warm(eng, args, vocab: int) -> float:
    """Every kind of step once, outside the timing: prompts of each shape's lengths, a turn
    that hits the cache, decode at every batch size the clients make. Returns the median
    time between two tokens of a request while every client decodes (chat_offsets' step)."""
    rng = np.random.default_rng(args.seed + 1)
    lengths = {args.short_prompt, args.long_prompt, args.no_hit_len, args.turn_tokens[1],
               args.long_prompt - args.long_cached}
    for n in sorted(lengths):
        eng.submit(rng.integers(0, vocab, n).astype(np.int32), max_new_tokens=2).result()
    prompts = [rng.integers(0, vocab, args.turn_tokens[0]).astype(np.int32) for _ in range(args.clients)]
    res = [h.result() for h in [eng.submit(p, max_new_tokens=STEP_TIMING_TOKENS) for p in prompts]]
    again = [np.concatenate([p, np.asarray(r.tokens, np.int32), p[:8]]) for p, r in zip(prompts, res)]
    for h in [eng.submit(p, max_new_tokens=2) for p in again]:
        h.result()
    return _step_s([r.token_times for r in res])


def _step_s(token_times) -> float:
    """The median time between two tokens of these requests, their first two left out (a
    step that also prefills another client's prompt may take them)."""
    return float(np.median(np.concatenate([np.diff(np.asarray(t, float)[2:]) for t in token_times])))


def run(args, timeout_s: float = 600.0) -> dict:
    import torch

    from vt.bench.torch_workload import tool_decoder, tool_setup
    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.step import KVGeometry
    from vt.torch import TorchForwardModel
    be, cfg, dtype, common = tool_setup(args.preset, args.backend)
    out = dict(common, workload="prefix-cache", mode=args.mode, shapes=list(args.shapes),
               clients=args.clients, conversations=conversations(args), lockstep=args.lockstep,
               turns=list(args.turns), turn_tokens=list(args.turn_tokens),
               output_len=args.output_len, system_len=list(args.system_len),
               requests=args.requests, long_prompt=args.long_prompt, long_cached=args.long_cached,
               short_prompt=args.short_prompt, no_hit_len=args.no_hit_len, seed=args.seed,
               batch_invariant=None)
    try:
        max_context = _max_context(args)
        rows = args.clients
        # every running sequence at its longest, and as much again for cached prefixes
        blocks = 2 * rows * (max_context // BLOCK) + 1
        geo = KVGeometry(max_seqs=rows, num_kv_blocks=blocks, block_size=BLOCK,
                         max_context=max_context)
        torch.manual_seed(0)
        module = tool_decoder(cfg, geo, dtype, be, args, "prefix-cache")
        out["batch_invariant"] = bool(getattr(module, "batch_invariant", False))
        out["kv_blocks"], out["max_context"] = blocks, max_context
        model = TorchForwardModel(be, module, vocab=cfg.vocab, geometry=geo, prefill="flat")
        sizes = tuple(s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64) if s < rows) + (rows,)
        config = ExecutorConfig(mode=args.mode, serving_conc=rows, capture_sizes=sizes)
        work = draw(args, cfg.vocab)
        runs, tokens, offsets = {}, {}, None
        for caching in (True, False):
            key = "on" if caching else "off"
            t0 = time.perf_counter()
            with Engine(be, model, config, max_prefill_tokens=args.max_prefill_tokens,
                        prefix_caching=caching) as eng:
                step_s = _warm(eng, args, cfg.vocab)
                setup_s = time.perf_counter() - t0
                if offsets is None:   # the first engine's: both get the same
                    offsets = out["chat_offsets_s"] = chat_offsets(
                        args.clients, args.output_len, step_s, args.lockstep)
                runs[key], tokens[key] = _serve_shapes(eng, args, work, offsets, timeout_s)
                runs[key]["setup_s"] = setup_s
        out["on"], out["off"] = runs["on"], runs["off"]
        out["tokens_differ"] = {s: sum(a != b for a, b in zip(tokens["on"][s], tokens["off"][s]))
                                for s in tokens["on"]}
        out["ratios"] = ratios(runs["on"], runs["off"])
    finally:
        be.close()
    return out


def ratios(on: dict, off: dict) -> dict:
    """The acceptance's numbers: off over on for TTFT p50, on over off for tokens/s; the
    long-prefix TTFT over the short prompt's."""
    out = {}
    for shape in ("chat", "system", "no-hit"):
        if shape in on:
            a, b = on[shape], off[shape]
            out[shape] = dict(ttft_p50_off_over_on=b["ttft_ms_p50"] / a["ttft_ms_p50"],
                              tok_per_s_on_over_off=a["output_tok_per_s"] / b["output_tok_per_s"])
    if "long-prefix" in on:
        lp = on["long-prefix"]
        out["long-prefix"] = dict(
            ttft_long_cached_over_short=lp["ttft_long_ms"] / lp["ttft_short_ms"],
            ttft_long_uncached_over_cached=off["long-prefix"]["ttft_long_ms"] / lp["ttft_long_ms"])
    return out


def format_table(result: dict) -> str:
    lines = [f"prefix-cache: {result['preset']} on {result['device']} ({result['backend']}, "
             f"{result['dtype']}, mode {result['mode']}, {result['clients']} clients, "
             f"batch invariant {result['batch_invariant']})"]
    if "chat" in result["on"]:
        start = ("all at once" if result["lockstep"] else
                 f"over {result['chat_offsets_s'][-1] * 1e3:.0f} ms")
        lines.append(f"chat: {result['conversations']} conversations, the clients started {start}")
    lines.append(f"{'shape':<12} {'cache':<5} {'TTFT p50/p90/p99 ms':>24} {'TPOT p50 ms':>12} "
                 f"{'tok/s':>9} {'hit rate':>9} {'evict':>6}")
    for shape in ("chat", "system", "no-hit"):
        if shape not in result["on"]:
            continue
        for key in ("on", "off"):
            c = result[key][shape]
            ttft = "/".join(f"{c[f'ttft_ms_p{p}']:.1f}" for p in (50, 90, 99))
            lines.append(f"{shape:<12} {key:<5} {ttft:>24} {c['tpot_ms_p50']:>12.2f} "
                         f"{c['output_tok_per_s']:>9.1f} {c['hit_rate']:>9.3f} {c['evictions']:>6}")
    if "long-prefix" in result["on"]:
        on, off = result["on"]["long-prefix"], result["off"]["long-prefix"]
        lines.append(f"long-prefix: TTFT of {result['long_prompt']} tokens with "
                     f"{result['long_cached']} cached {on['ttft_long_ms']:.1f} ms (uncached "
                     f"{off['ttft_long_ms']:.1f} ms), of {result['short_prompt']} uncached "
                     f"{on['ttft_short_ms']:.1f} ms")
    for shape, r in result["ratios"].items():
        lines.append(f"{shape}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    lines.append("requests whose tokens differ, on vs off: " +
                 ", ".join(f"{s} {n}" for s, n in result["tokens_differ"].items()))
    return "\n".join(lines)


# -- through HTTP ------------------------------------------------------------------------
def _server_flags(args, caching: bool) -> list[str]:
    rows, max_context = args.clients, _max_context(args)
    blocks = 2 * rows * (max_context // BLOCK) + 1   # as the in-process engines get
    return (["--model", args.http, "--backend", args.backend, "--mode", args.mode,
             "--max-concurrency", str(rows), "--max-context", str(max_context),
             "--block-size", str(BLOCK), "--kv-blocks", str(blocks),
             "--max-queued", str(max(256, args.requests)), "--shutdown-timeout", "10"]
            + ([] if caching else ["--no-prefix-cache"]))


def _http_chat(pool, conversations, offsets, output_len: int, timeout_s: float):
    """_chat through HTTP: each client on its own thread, starting offsets[c] s after the
    first, takes the next conversation and sends its turns, a turn's prompt the history
    (every earlier prompt and answer) and its new tokens; (completions by conversation then
    turn, the prompt tokens sent, wall)."""
    from vt.bench.serve_http import run_clients
    first = np.cumsum([0] + [len(c) for c in conversations])   # conversation k's turns start there
    done: list = [None] * int(first[-1])
    sent = [0] * len(conversations)
    waiting, lock = iter(range(len(conversations))), threading.Lock()

    def client(i):
        time.sleep(offsets[i])
        c = pool.get(i)
        while True:
            with lock:
                k = next(waiting, None)
            if k is None:
                return
            history = []
            for t, new in enumerate(conversations[k]):
                prompt = history + new.tolist()
                sent[k] += len(prompt)
                done[first[k] + t] = c.stream(prompt, output_len)
                history = prompt + done[first[k] + t].token_ids
    _, wall = run_clients(client, min(len(offsets), len(conversations)), done, "chat", timeout_s)
    return done, sum(sent), wall


def _http_measure(url: str, serve) -> tuple[dict, list]:
    """Run serve() -> (completions, prompt tokens sent, wall) against url: the cell's metrics
    (the in-process cell's keys) and its requests' tokens."""
    before = _cache_counters(url)
    done, prompt, wall = serve()
    after = _cache_counters(url)
    return _cell_metrics([c.token_ids for c in done], wall, prompt=prompt,
                         cached=after["cached"] - before["cached"],
                         evictions=after["evictions"] - before["evictions"],
                         sent_at=[c.sent_at for c in done],
                         token_times=[c.token_times for c in done])


def _cache_counters(url: str) -> dict:
    """Prompt tokens served from the cache and evictions, from vt serve's /metrics."""
    import httpx
    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    out = {}
    for line in text.splitlines():
        if line.startswith("vt_prefix_cache_cached_tokens_total "):
            out["cached"] = int(float(line.split()[1]))
        elif line.startswith("vt_prefix_cache_evictions_total "):
            out["evictions"] = int(float(line.split()[1]))
    if len(out) != 2:
        from vt.bench.errors import CommandFailed
        raise CommandFailed(f"vt bench: {url}/metrics lacks the prefix cache's counters "
                            f"(vt_prefix_cache_cached_tokens_total, vt_prefix_cache_evictions_total)")
    return out


def _http_shapes(pool, url: str, args, work, offsets, timeout_s: float) -> tuple[dict, dict]:
    """Every asked shape against one warm server, chat's clients starting at `offsets`:
    ({shape: metrics}, {shape: tokens})."""
    from vt.bench.serve_http import closed_loop
    cells, tokens = {}, {}
    n = args.output_len

    def closed(prompts):
        reqs = [(p.tolist(), n) for p in prompts]
        done, wall = closed_loop(pool, reqs, args.clients, timeout_s)
        return done, sum(len(p) for p in prompts), wall
    if "chat" in args.shapes:
        cells["chat"], tokens["chat"] = _http_measure(
            url, lambda: _http_chat(pool, work["chat"], offsets, n, timeout_s))
    if "system" in args.shapes:
        cells["system"], tokens["system"] = _http_measure(url, lambda: closed(work["system"]))
    if "no-hit" in args.shapes:
        cells["no-hit"], tokens["no-hit"] = _http_measure(url, lambda: closed(work["no_hit"]))
    if "long-prefix" in args.shapes:
        c, prefix = pool.get(0), work["long_prefix"].tolist()
        c.stream(prefix + work["tails"][0][:1].tolist(), 1)   # caches every block of the prefix
        before = _cache_counters(url)
        longs, shorts = [], []
        for tail, short in zip(work["tails"][1:], work["shorts"][1:]):
            r = c.stream(prefix + tail.tolist(), 1)
            longs.append(r.token_times[0] - r.sent_at)
            r = c.stream(short.tolist(), 1)
            shorts.append(r.token_times[0] - r.sent_at)
        after = _cache_counters(url)
        cells["long-prefix"] = dict(
            ttft_long_ms=statistics.median(longs) * 1e3, ttft_short_ms=statistics.median(shorts) * 1e3,
            cached_tokens_per_long=(after["cached"] - before["cached"]) / len(longs))
    return cells, tokens


def _http_warm(pool, args, vocab: int) -> float:
    """Every kind of step once, outside the timing (as _warm does in process), and a
    connection per client; returns the median time between two streamed tokens while every
    client decodes (as _warm does)."""
    from vt.bench.serve_http import closed_loop
    rng = np.random.default_rng(args.seed + 1)
    lengths = {args.short_prompt, args.long_prompt, args.no_hit_len, args.turn_tokens[1],
               args.long_prompt - args.long_cached}
    for n in sorted(lengths):
        pool.get(0).stream(rng.integers(0, vocab, n).tolist(), 2)
    prompts = [rng.integers(0, vocab, args.turn_tokens[0]).tolist() for _ in range(args.clients)]
    done, _ = closed_loop(pool, [(p, STEP_TIMING_TOKENS) for p in prompts], args.clients, 600.0)
    again = [(p + c.token_ids + p[:8], 2) for p, c in zip(prompts, done)]
    closed_loop(pool, again, args.clients, 600.0)
    return _step_s([c.token_times for c in done])


def run_http(args, timeout_s: float = 600.0, start_timeout_s: float = 600.0) -> dict:
    """run()'s result, every shape through HTTP against `vt serve --model args.http`, with
    caching on and off (two servers, one after the other)."""
    import platform
    from pathlib import Path

    from vt.bench.serve_http import (ClientPool, describe_server, spawn_vt_serve,
                                     stop_vt_serve)
    out = dict(preset=Path(args.http).name, backend=args.backend, dtype="auto",
               device=platform.node(), via="http", workload="prefix-cache", mode=args.mode,
               shapes=list(args.shapes), clients=args.clients,
               conversations=conversations(args), lockstep=args.lockstep, turns=list(args.turns),
               turn_tokens=list(args.turn_tokens), output_len=args.output_len,
               system_len=list(args.system_len), requests=args.requests,
               long_prompt=args.long_prompt, long_cached=args.long_cached,
               short_prompt=args.short_prompt, no_hit_len=args.no_hit_len, seed=args.seed,
               batch_invariant=None, max_context=_max_context(args))
    runs, tokens, work, offsets = {}, {}, None, None
    for caching in (True, False):
        key = "on" if caching else "off"
        t0 = time.perf_counter()
        proc, url = spawn_vt_serve(_server_flags(args, caching), start_timeout_s)
        try:
            info = describe_server(url)
            work = work or draw(args, info.vocab)
            pool = ClientPool(url, info.model, timeout_s)
            try:
                step_s = _http_warm(pool, args, info.vocab)
                setup_s = time.perf_counter() - t0
                if offsets is None:   # the first server's: both get the same
                    offsets = out["chat_offsets_s"] = chat_offsets(
                        args.clients, args.output_len, step_s, args.lockstep)
                runs[key], tokens[key] = _http_shapes(pool, url, args, work, offsets, timeout_s)
                runs[key]["setup_s"] = setup_s
            finally:
                pool.close()
        finally:
            stop_vt_serve(proc)
    out["on"], out["off"] = runs["on"], runs["off"]
    out["tokens_differ"] = {s: sum(a != b for a, b in zip(tokens["on"][s], tokens["off"][s]))
                            for s in tokens["on"]}
    out["ratios"] = ratios(runs["on"], runs["off"])
    return out
