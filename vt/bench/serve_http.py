"""`vt bench --workload serve --url URL`: the serve bench's traffic through OpenAI's API,
against a running `vt serve`.

The requests are the in-process bench's (vt/bench/serve.py: drawn by draw_work from the
same flags and seed, prompts as token-id lists), each a streamed POST /v1/completions with
`max_tokens` its drawn output length, greedy, `ignore_eos` set (so every request makes exactly
its output length: checked, with the usage the server reports) and the server's `token_ids`
per chunk. Closed loop: `clients` clients, each sending its next request when its stream
ended; Poisson: requests sent at seeded exponential gaps whatever the server's progress.

Per request the client stamps when it sent the request and when each streamed token arrived
(time.perf_counter, on this process's clock), and the cell's TTFT (send -> the first chunk
with a token), TPOT and ITL percentiles come from those by the in-process cells' formula
(latency_metrics); output tokens/s is over the cell's wall, first send to last token. What
the HTTP side cannot see of the engine (its phases, device time, drain causes) is None; its
steps and drains come from the server's /metrics, read before and after the cell.

Clients are threads, each with its own blocking httpx.Client (one keep-alive connection,
opened by the warm-up): a thread blocks in the kernel's recv with the GIL released, and wakes
when its bytes arrive, so a token is stamped when it reaches this process, without an event
loop's queue in between; httpx's blocking path is also lighter per chunk than its asyncio
one (no anyio layer). Every wait has the cell's deadline (CELL_TIMEOUT_S): past it the bench
fails with a one-line CommandFailed, as the in-process cells do.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from vt.bench.serve import (CELL_TIMEOUT_S, ENGINE_COUNTS, draw_work, latency_metrics,
                                 serve_loads)

# Poisson arrivals: at most this many requests in flight from the client (one thread and one
# connection each); an arrival beyond them waits for one, and its TTFT counts from its
# arrival, so a short pool would show as latency, never hide it.
MAX_OPEN_LOOP_THREADS = 512
CONNECT_TIMEOUT_S = 10.0


def _failed(message: str):
    from vt.bench.errors import CommandFailed
    return CommandFailed(f"vt bench: {message}")


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself: the model name requests must send, its vocabulary
    (the prompts' ids are drawn below it), its context and its executor mode."""
    model: str
    vocab: int
    max_context: int
    mode: str


def describe_server(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> ServerInfo:
    """GET /v1/models and /metrics of `url`; CommandFailed in one line when it does not answer
    as `vt serve` does."""
    import httpx
    try:
        models = httpx.get(f"{url}/v1/models", timeout=timeout_s)
        models.raise_for_status()
        entry = models.json()["data"][0]
        counters = server_counters(url, timeout_s)
        return ServerInfo(entry["id"], int(entry["vocab_size"]), int(entry["max_model_len"]),
                          counters["mode"])
    except httpx.HTTPError as e:
        raise _failed(f"--url {url}: {type(e).__name__}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise _failed(f"--url {url} does not answer as vt serve does (/v1/models with "
                      f"vocab_size, /metrics with vt_engine_info): {type(e).__name__}: {e}") from None


def server_counters(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> dict:
    """The engine's steps and drains and its mode, from vt serve's /metrics."""
    import httpx
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).raise_for_status().text
    out = {}
    for line in text.splitlines():
        if line.startswith("vt_engine_steps_total "):
            out["steps"] = int(float(line.split()[1]))
        elif line.startswith("vt_drained_steps_total "):
            out["drains"] = int(float(line.split()[1]))
        elif line.startswith('vt_engine_info{mode="'):
            out["mode"] = line.split('"')[1]
    if len(out) != 3:
        raise KeyError(f"/metrics lacks {sorted({'steps', 'drains', 'mode'} - set(out))}")
    return out


@dataclass
class StreamedCompletion:
    """One request as the client saw it: when it was sent (or arrived, open loop), when each
    token came, the ids, and how the server said it ended."""
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None


class CompletionClient:
    """One client: a blocking httpx.Client (one keep-alive connection) streaming completions."""

    def __init__(self, url: str, model: str, timeout_s: float):
        import httpx
        self.model = model
        self._http = httpx.Client(base_url=url, timeout=httpx.Timeout(
            timeout_s, connect=CONNECT_TIMEOUT_S))

    def stream(self, prompt: list[int], max_tokens: int, sent_at: float | None = None,
               fields: dict | None = None) -> StreamedCompletion:
        """Stream one completion (`fields`: more of the body, e.g. {"logprobs": 5}); CommandFailed
        if the server refuses it, the stream breaks, or it does not make exactly `max_tokens`
        tokens."""
        import httpx
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, **(fields or {})}
        out = StreamedCompletion(time.perf_counter() if sent_at is None else sent_at)
        try:
            with self._http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise _failed(f"POST /v1/completions answered {r.status_code}: "
                                  f"{_error_message(r.read())}")
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    _read_chunk(json.loads(line[6:]), out, time.perf_counter())
        except httpx.HTTPError as e:
            raise _failed(f"POST /v1/completions: {type(e).__name__}: {e}") from None
        n = len(out.token_ids)
        if (n, out.completion_tokens, out.finish_reason) != (max_tokens, max_tokens, "length"):
            raise _failed(f"a request for {max_tokens} tokens streamed {n} (usage says "
                          f"{out.completion_tokens}, finish_reason {out.finish_reason!r}); "
                          f"the bench needs ignore_eos honoured and every token streamed")
        return out

    def close(self) -> None:
        self._http.close()


def _read_chunk(obj: dict, out: StreamedCompletion, now: float) -> None:
    if "error" in obj:
        raise _failed(f"the stream ended in an error: {obj['error'].get('message')}")
    if obj.get("usage"):
        out.completion_tokens = obj["usage"]["completion_tokens"]
    for choice in obj.get("choices") or ():
        ids = choice.get("token_ids") or ()
        out.token_ids.extend(ids)
        out.token_times.extend([now] * len(ids))   # ids that came together share their time
        out.finish_reason = choice.get("finish_reason") or out.finish_reason


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


class ClientPool:
    """CompletionClients by index, made on first use and kept across cells (their connections
    too); close() closes them all."""

    def __init__(self, url: str, model: str, timeout_s: float = CELL_TIMEOUT_S,
                 fields: dict | None = None, share: float = 1.0):
        self._args = (url, model, timeout_s)
        self._clients: list[CompletionClient] = []
        self._lock = threading.Lock()
        self.fields, self.share = fields or {}, share

    def fields_for(self, i: int) -> dict | None:
        """The extra body fields of request i: on a `share` of the requests, spread evenly
        (share 0.5: every other one), none on the rest."""
        return self.fields if self.fields and int((i + 1) * self.share) > int(i * self.share) else None

    def get(self, i: int) -> CompletionClient:
        with self._lock:
            while len(self._clients) <= i:
                self._clients.append(CompletionClient(*self._args))
            return self._clients[i]

    def close(self) -> None:
        for c in self._clients:
            c.close()


def closed_loop(pool: ClientPool, requests, clients: int, timeout_s: float):
    """`clients` threads, each sending the next request when its last one ended;
    (completions in request order, wall)."""
    out: list[StreamedCompletion | None] = [None] * len(requests)
    nxt = iter(range(len(requests)))
    lock = threading.Lock()

    def client(k):
        c = pool.get(k)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            out[i] = c.stream(*requests[i], fields=pool.fields_for(i))
    return run_clients(client, min(clients, len(requests)), out, f"closed loop of {clients} clients",
                timeout_s)


def open_loop(pool: ClientPool, requests, rate: float, rng, timeout_s: float):
    """Requests sent at Poisson arrivals of `rate` per second (the in-process bench's gaps,
    from the same seed); (completions, wall)."""
    gaps = rng.exponential(1.0 / rate, len(requests))
    out: list[StreamedCompletion | None] = [None] * len(requests)
    arrivals: queue.Queue = queue.Queue()
    threads = min(len(requests), MAX_OPEN_LOOP_THREADS)

    def client(k):
        c = pool.get(k)
        while (item := arrivals.get()) is not None:
            i, at = item
            out[i] = c.stream(*requests[i], sent_at=at, fields=pool.fields_for(i))

    def dispatch(t0):
        at = t0
        for i, gap in enumerate(gaps):
            at += gap
            delay = at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            arrivals.put((i, at))
        for _ in range(threads):
            arrivals.put(None)
    return run_clients(client, threads, out, f"open loop at {rate:g}/s", timeout_s, dispatch)


def run_clients(client, threads: int, out: list, what: str, timeout_s: float, dispatch=None):
    """Run `client(k)` on `threads` daemon threads (and `dispatch(t0)` on this one) until all
    end, within timeout_s; the first error any of them raised is raised here. `out`: the
    completions the clients fill in; (out, wall), wall from the start to the last token."""
    errors: queue.Queue = queue.Queue()

    def guarded(k):
        try:
            client(k)
        except BaseException as e:   # noqa: BLE001 (handed to the driver, which raises it)
            errors.put(e)
    workers = [threading.Thread(target=guarded, args=(k,), daemon=True,
                                name=f"vt-bench-http-client-{k}") for k in range(threads)]
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    for w in workers:
        w.start()
    if dispatch is not None:
        dispatch(t0)
    while alive := [w for w in workers if w.is_alive()]:
        if not errors.empty():
            break
        left = deadline - time.perf_counter()
        if left <= 0:
            done = sum(c is not None for c in out)
            raise _failed(f"serve cell ({what}, through HTTP) not served within its "
                          f"{timeout_s:g} s deadline: {done} of {len(out)} requests finished")
        alive[0].join(min(left, 0.05))   # short: an error of another thread is seen soon
    if not errors.empty():
        raise errors.get()
    wall = max(c.token_times[-1] for c in out) - t0
    return out, wall


def http_cell(pool: ClientPool, url: str, requests, arrival: str, load: float, seed: int,
              timeout_s: float = CELL_TIMEOUT_S) -> tuple[dict, list]:
    """One cell through HTTP: the in-process cell's keys (vt/bench/serve.py:
    cell_metrics), None for what only the engine knows; and every request's tokens."""
    before = server_counters(url)
    if arrival == "closed":
        done, wall = closed_loop(pool, requests, int(load), timeout_s)
    else:
        done, wall = open_loop(pool, requests, load, np.random.default_rng(seed), timeout_s)
    after = server_counters(url)
    tokens = sum(len(c.token_ids) for c in done)
    counts = dict.fromkeys(ENGINE_COUNTS)
    counts.update(steps=after["steps"] - before["steps"], drains=after["drains"] - before["drains"])
    row = dict(requests=len(done), tokens=tokens, wall_s=wall,
               requests_per_s=len(done) / wall, output_tok_per_s=tokens / wall, gpu_busy=None,
               drained_fraction=counts["drains"] / counts["steps"] if counts["steps"] else 0.0,
               drains_after={}, phases={}, **counts)
    row.update(latency_metrics([c.sent_at for c in done], [c.token_times for c in done]))
    if pool.fields and pool.share < 1:   # the latencies of each half apart
        for name, carries in (("with_fields", True), ("without_fields", False)):
            part = [c for i, c in enumerate(done) if (pool.fields_for(i) is not None) == carries]
            row[name] = latency_metrics([c.sent_at for c in part], [c.token_times for c in part])
    return row, [c.token_ids for c in done]


def http_cells(pool: ClientPool, url: str, info: ServerInfo, work: dict, warm: list, conc: int,
               repeats: int, seed: int, progress) -> list[dict]:
    """Warm the server and `conc` connections, then every (arrival, load) of `work`, `repeats`
    times; a cell per load (median_run over its repeats), labelled by the server's model and
    mode, `via` "http"."""
    from vt.bench.serve_run import median_run
    http_cell(pool, url, warm, "closed", conc, seed)
    progress.step(f"{info.model} {info.mode} through HTTP: warmed ({conc} connections)")
    runs: dict = {}
    for _ in range(repeats):
        for (arrival, load), requests in work.items():
            row, tokens = http_cell(pool, url, requests, arrival, load, seed)
            row.update(preset=info.model, mode=info.mode, arrival=arrival, load=load, via="http",
                       token_ids=tokens)
            runs.setdefault((arrival, load), []).append(row)
            progress.step(f"{info.model} {info.mode} {arrival} {load:g} through HTTP: "
                          f"{row['output_tok_per_s']:8.1f} tok/s, TTFT p50 "
                          f"{row['ttft_ms_p50']:.1f} ms")
    return [median_run(rows) for rows in runs.values()]


def resolve_http(args, error) -> None:
    """--url's checks and defaults (the traffic's defaults are the cuda ones: a served model)."""
    from vt.bench import limits as lim
    from vt.bench.serve_run import resolve_serve
    if not args.url.startswith(("http://", "https://")):
        error(f"--url must be an http:// or https:// address, got {args.url!r}")
    args.url = args.url.rstrip("/")
    try:
        args.request_fields = json.loads(args.request_fields) if args.request_fields else {}
    except ValueError as e:
        error(f"--request-fields must be a JSON object, got {args.request_fields!r}: {e}")
    if not isinstance(args.request_fields, dict):
        error(f"--request-fields must be a JSON object, got {args.request_fields!r}")
    if not 0 < args.request_fields_share <= 1:
        error(f"--request-fields-share must be in (0, 1], got {args.request_fields_share}")
    for flag, value in (("--preset", args.preset), ("--modes", args.modes)):
        if value is not None:
            error(f"{flag} does not apply with --url: the server's model and mode are measured")
    args.repeats = 1 if args.repeats is None else args.repeats
    why = (lim.int_problem("--repeats", args.repeats, 1, lim.MAX_REPEATS)
           or lim.int_problem("--seed", args.seed, 0, lim.MAX_SEED))
    if why:
        error(why)
    resolve_serve(args, "cuda", error)


def run_serve_http(args, progress_factory) -> dict:
    """The serve bench through HTTP against args.url: a vt-bench-serve/1 result whose cells
    carry via="http"."""
    import platform

    from vt.bench.serve_run import compare_to_drain
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    info = describe_server(args.url)
    longest = args.prompt_range[1] + args.output_len[1] - 1
    if longest > info.max_context:
        raise _failed(f"--prompt-range up to {args.prompt_range[1]} and --output-len up to "
                      f"{args.output_len[1]} need a context of {longest}; the server's is "
                      f"{info.max_context}")
    loads = serve_loads(args)
    conc = max(args.clients)
    work, warm = draw_work(args.seed, loads, args.requests, info.vocab, args.prompt_range,
                           args.output_len, conc)
    pool = ClientPool(args.url, info.model, fields=args.request_fields,
                      share=args.request_fields_share)
    try:
        with progress_factory(1 + len(loads) * args.repeats) as progress:
            cells = http_cells(pool, args.url, info, work, warm, conc, args.repeats, args.seed,
                               progress)
    finally:
        pool.close()
    compare_to_drain(cells, compare_tokens=False)
    from vt.bench.run import vt_commit
    return dict(format="vt-bench-serve/1", workload="serve", backend="http", url=args.url,
                vt_commit=vt_commit(), device="", host=platform.node(),
                python=platform.python_version(), started=started,
                wall_s=time.perf_counter() - t0, presets=[info.model], modes=[info.mode],
                arrivals=list(args.arrival), clients=list(args.clients), rates=list(args.rate),
                requests=args.requests, output_len=list(args.output_len),
                prompt_len=list(args.prompt_range), seed=args.seed, serving_conc=conc,
                request_fields=args.request_fields, request_fields_share=args.request_fields_share,
                tokens_compared=False, cells=cells)


def spawn_vt_serve(flags: list[str], start_timeout_s: float, *, env: dict | None = None,
                   cwd=None, capture_stderr: bool = False):
    """`python -m vt serve FLAGS --host 127.0.0.1 --port 0` in `cwd` with `env` (None: this
    process's); (process, base URL) once it prints that it listens; CommandFailed in one line
    when it exits first or does not listen within start_timeout_s. Its stderr passes through,
    or with capture_stderr is a pipe (proc.stderr) for the caller to read, quoted when it exits
    before it listens."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "vt", "serve", *flags, "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            stderr=subprocess.PIPE if capture_stderr else None)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                said = (f"its stderr: {' | '.join(proc.stderr.read().strip().splitlines()[-3:])}"
                        if capture_stderr else "its stderr is above")
                raise _failed(f"vt serve {' '.join(flags)} exited {proc.returncode} before it "
                              f"listened ({said})") from None
            continue
        if "listening on " in line:
            return proc, line.rsplit("listening on ", 1)[1].strip()
    stop_vt_serve(proc)
    raise _failed(f"vt serve {' '.join(flags)} did not listen within {start_timeout_s:g} s")


def stop_vt_serve(proc, timeout_s: float = 30.0, sig=None) -> int:
    """`sig` (None: SIGINT), then its exit code; killed (-9) past timeout_s."""
    import signal
    import subprocess
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGINT if sig is None else sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
        return -9
