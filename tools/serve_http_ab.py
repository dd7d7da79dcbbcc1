"""`vt serve` through HTTP against the in-process serve workload: one model, the same requests,
one run, one table.

  python3 tools/serve_http_ab.py --shape llama3-8b --json ab.json      # on a GPU: the 8B shape

1. The checkpoint: --model DIR, or one built by tools/tiny_checkpoint.py (--shape; into
   --checkpoint-dir, else a temporary directory removed at the end).
2. In process: the checkpoint loaded by vt.serve.model_source.load_checkpoint (the module,
   geometry and prefill vt serve loads) under an Engine with vt serve's config
   (vt.cli.serve.serving_config: its mode, rows and graphs; unprofiled, as vt serve runs),
   warmed, then every (arrival, load) cell of vt bench's serve workload
   (vt/bench/serve.py). The engine and the model are then closed and their memory
   freed before the server loads its own copy.
3. Through HTTP: `python3 -m vt serve --model DIR` with the same mode, rows, context and KV
   block size, on a free port; once it listens (a deadline), the same requests (drawn from
   the same seed) as streamed /v1/completions (vt/bench/serve_http.py), warmed first the
   same way; then SIGINT, and the server must exit 0 within a deadline.
4. One table with both (`via` engine / http), then per load: output tokens/s through HTTP
   over in process, and TTFT p50 through HTTP against 1.1x in process + 2 ms (what an HTTP
   front end may add: "meets" or "misses"). --json writes it all.

The defaults are the acceptance's traffic: closed loop, 16 and 32 clients, 96 requests per
cell, prompts of 256 to 2048 tokens, 128 output tokens, ring mode. Bad flags are one line
and exit 2; a failed step (the server not listening in time, a cell past its deadline) is one
line and exit 1.
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TTFT_FACTOR, TTFT_SLACK_MS = 1.1, 2.0   # through HTTP, TTFT p50 may be this much above
START_TIMEOUT_S = 600.0                 # the server's load, capture and warm-up (16 GB on cuda)
STOP_TIMEOUT_S = 60.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line, as vt's commands print it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def parse(argv):
    from tools.tiny_checkpoint import SHAPES
    from vt.config import SAFE_MODES
    p = _OneLineParser(prog="serve_http_ab.py", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a checkpoint directory to serve (default: build --shape)")
    src.add_argument("--shape", choices=list(SHAPES), default=None,
                     help="build this shape with tools/tiny_checkpoint.py (default: llama3-8b "
                          "on cuda, tiny on the sim)")
    p.add_argument("--checkpoint-dir", help="where a built checkpoint goes, and stays (default: "
                   "a temporary directory, removed at the end)")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--mode", default="ring", choices=list(SAFE_MODES))
    p.add_argument("--arrival", nargs="+", default=["closed"], choices=["closed", "poisson"])
    p.add_argument("--clients", type=int, nargs="+", default=[16, 32])
    p.add_argument("--rate", type=float, nargs="+", default=[40.0],
                   help="poisson arrivals per second (with --arrival poisson)")
    p.add_argument("--requests", type=int, default=96, help="requests per cell")
    p.add_argument("--prompt-range", type=int, nargs="+", default=[256, 2048], metavar="N")
    p.add_argument("--output-len", type=int, nargs="+", default=[128], metavar="N")
    p.add_argument("--block-size", type=int, default=16, help="KV block size, both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                   help="seconds the server gets to listen (default: %(default)g)")
    args = p.parse_args(argv)
    args.png, args.repeats, args.modes, args.preset = None, 1, None, None   # for the checks

    def error(msg):
        p.error(msg)
    from vt.bench.serve_run import resolve_serve
    from vt.bench.setup import backend_name
    args.backend = backend_name(args.backend)
    resolve_serve(args, args.backend, error)   # the serve bench's own checks of the traffic
    if not 1 <= args.block_size <= 256:
        error(f"--block-size must be in [1, 256], got {args.block_size}")
    if not 0 < args.start_timeout <= 3600:
        error(f"--start-timeout must be in (0, 3600], got {args.start_timeout:g}")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        error(f"--model {args.model!r} is not a checkpoint directory (no config.json)")
    if args.shape is None and args.model is None:
        args.shape = "llama3-8b" if args.backend == "cuda" else "tiny"
    if args.json is not None:
        from vt.atomic_file import output_path_problem
        if why := output_path_problem(args.json):
            error(f"--json {args.json!r} {why}")
    # Every request's prompt and output, as the server counts them (max_tokens may reach
    # max_context - prompt + 1).
    args.max_context = args.prompt_range[1] + args.output_len[1] - 1
    return args


def main(argv=None) -> int:
    from vt.bench.errors import CommandFailed
    args = parse(argv)
    try:
        return run(args)
    except CommandFailed as e:
        print(str(e), file=sys.stderr)
        return 1


def run(args) -> int:
    from vt.bench.serve import serve_loads
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vt-serve-ab-") as scratch:
        path = Path(args.model) if args.model else build_checkpoint(args, Path(scratch))
        conc = max(args.clients)
        engine_cells, vocab, work, warm = in_process(args, path, serve_loads(args), conc)
        http = through_http(args, path, work, warm, conc, vocab)
    res = result(args, path, engine_cells + http, time.perf_counter() - t0)
    from vt.bench import serve_report
    print("\n" + serve_report.table(res) + "\n" + verdict_lines(res["ab"]), flush=True)
    if args.json:
        serve_report.write_json(res, args.json)
        print(f"serve_http_ab: wrote {args.json}")
    return 0


def build_checkpoint(args, scratch: Path) -> Path:
    from tools import tiny_checkpoint
    path = Path(args.checkpoint_dir) if args.checkpoint_dir else scratch / args.shape
    log(f"serve_http_ab: writing the {args.shape} checkpoint to {path} ...")
    t = time.perf_counter()
    tiny_checkpoint.build(path, seed=args.seed, shape=args.shape, log=log)
    log(f"serve_http_ab: checkpoint written in {time.perf_counter() - t:.0f} s")
    return path


def in_process(args, path: Path, loads, conc: int) -> tuple[list[dict], int, dict, list]:
    """The serve workload's cells on an engine in this process; (cells, the model's vocab,
    the requests per load and the warm-up ones it served: the HTTP side sends the same).
    Everything it loaded is closed and freed before it returns."""
    from vt.bench.progress import ProgressBar
    from vt.bench.serve import draw_work, serve_cell
    from vt.bench.serve_run import median_run
    from vt.bench.setup import pick_backend
    from vt.cli.serve import serving_config
    from vt.engine.engine import Engine
    from vt.serve.model_source import load_checkpoint
    be = pick_backend(args.backend, who="serve_http_ab")
    served = engine = None
    cells = []
    try:
        log(f"serve_http_ab: loading {path} in process on {be.name} ...")
        served = load_checkpoint(be, path, max_seqs=conc, max_context=args.max_context,
                                 block_size=args.block_size)
        vocab, name = served.vocab, path.name
        work, warm = draw_work(args.seed, loads, args.requests, vocab, args.prompt_range,
                               args.output_len, conc)
        with ProgressBar(1 + len(loads), desc="serve_http_ab", bar=False) as progress:
            engine = Engine(be, served.step_model, serving_config(args.mode, conc))
            serve_cell(engine, warm, "closed", conc, args.seed)
            progress.step(f"{args.mode} in process: captured and warmed")
            for arrival, load in loads:
                row, tokens = serve_cell(engine, work[arrival, load], arrival, load, args.seed)
                row.update(preset=name, mode=args.mode, arrival=arrival, load=load,
                           via="engine", token_ids=tokens)
                cells.append(median_run([row]))   # one run; the keys of vt bench's cells
                progress.step(f"{args.mode} {arrival} {load:g} in process: "
                              f"{row['output_tok_per_s']:8.1f} tok/s, TTFT p50 "
                              f"{row['ttft_ms_p50']:.1f} ms")
    finally:
        if engine is not None:
            engine.close()
        if served is not None:
            served.close()
        be.close()
        # The server loads its own copy next: no reference here may keep this one's memory.
        engine = served = None
        gc.collect()
        _empty_torch_cache()
    return cells, vocab, work, warm


def _empty_torch_cache() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def through_http(args, path: Path, work: dict, warm: list, conc: int, vocab: int) -> list[dict]:
    """The same requests through a `vt serve` subprocess; stopped with SIGINT after."""
    from vt.bench.progress import ProgressBar
    from vt.bench.serve_http import ClientPool, describe_server, http_cells
    from vt.bench.errors import CommandFailed
    proc, url = start_server(args, path, conc)
    try:
        info = describe_server(url)
        if (info.vocab, info.mode, info.max_context) != (vocab, args.mode, args.max_context):
            raise CommandFailed(f"serve_http_ab: the server serves vocab {info.vocab}, mode "
                                f"{info.mode}, context {info.max_context}; in process it was "
                                f"{vocab}, {args.mode}, {args.max_context}")
        pool = ClientPool(url, info.model)
        try:
            with ProgressBar(1 + len(work), desc="serve_http_ab", bar=False) as progress:
                cells = http_cells(pool, url, info, work, warm, conc, 1, args.seed, progress)
        finally:
            pool.close()
        for c in cells:
            c["preset"] = path.name   # the in-process cells' label
    finally:
        rc = stop_server(proc)
    if rc != 0:
        raise CommandFailed(f"serve_http_ab: vt serve exited {rc} after SIGINT, not 0")
    return cells


def start_server(args, path: Path, conc: int) -> tuple[subprocess.Popen, str]:
    """`python3 -m vt serve` on 127.0.0.1, a free port; (process, URL) once it prints that it
    listens. Its stderr (loading, capturing) passes through."""
    from vt.bench.serve_http import spawn_vt_serve
    flags = ["--model", str(path), "--backend", args.backend, "--mode", args.mode,
             "--max-concurrency", str(conc), "--max-context", str(args.max_context),
             "--block-size", str(args.block_size),
             # Poisson arrivals may all be in the server at once: none may get a 429.
             "--max-queued", str(max(256, args.requests)), "--shutdown-timeout", "10"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    log(f"serve_http_ab: starting -m vt serve {' '.join(flags)}")
    return spawn_vt_serve(flags, args.start_timeout, env=env, cwd=ROOT)


def stop_server(proc: subprocess.Popen) -> int:
    """SIGINT, then its exit code; killed (and -9) past STOP_TIMEOUT_S."""
    from vt.bench.serve_http import stop_vt_serve
    return stop_vt_serve(proc, STOP_TIMEOUT_S)


def ab_rows(cells: list[dict]) -> list[dict]:
    """Per (arrival, load): tok/s through HTTP over in process, and TTFT p50 through HTTP
    against TTFT_FACTOR x in process + TTFT_SLACK_MS."""
    out = []
    for e in (c for c in cells if c["via"] == "engine"):
        h = next(c for c in cells if c["via"] == "http" and
                 (c["arrival"], c["load"]) == (e["arrival"], e["load"]))
        limit = TTFT_FACTOR * e["ttft_ms_p50"] + TTFT_SLACK_MS
        out.append(dict(arrival=e["arrival"], load=e["load"],
                        tok_per_s_http_to_engine=h["output_tok_per_s"] / e["output_tok_per_s"],
                        ttft_p50_engine_ms=e["ttft_ms_p50"], ttft_p50_http_ms=h["ttft_ms_p50"],
                        ttft_p50_limit_ms=limit, ttft_p50_meets=h["ttft_ms_p50"] <= limit))
    return out


def verdict_lines(ab: list[dict]) -> str:
    lines = [f"through HTTP / in process (TTFT p50 limit: {TTFT_FACTOR:g}x in process + "
             f"{TTFT_SLACK_MS:g} ms):"]
    lines += [f"  {r['arrival']} {r['load']:g}: tok/s {r['tok_per_s_http_to_engine']:.3f}x, "
              f"TTFT p50 {r['ttft_p50_http_ms']:.1f} ms vs {r['ttft_p50_engine_ms']:.1f} ms in "
              f"process (limit {r['ttft_p50_limit_ms']:.1f}: "
              f"{'meets' if r['ttft_p50_meets'] else 'misses'})" for r in ab]
    return "\n".join(lines)


def result(args, path: Path, cells: list[dict], wall_s: float) -> dict:
    import platform

    from vt.bench.run import vt_commit
    from vt.bench.serve_run import compare_to_drain
    compare_to_drain(cells, compare_tokens=False)
    return dict(format="vt-bench-serve/1", workload="serve", tool="serve_http_ab",
                backend=args.backend, vt_commit=vt_commit(), device=_device(args.backend),
                host=platform.node(), python=platform.python_version(), wall_s=wall_s,
                model=str(path), shape=args.shape, presets=[path.name], modes=[args.mode],
                arrivals=list(args.arrival), clients=list(args.clients), rates=list(args.rate),
                requests=args.requests, output_len=list(args.output_len),
                prompt_len=list(args.prompt_range), max_context=args.max_context,
                block_size=args.block_size, seed=args.seed, serving_conc=max(args.clients),
                profiled=False, tokens_compared=False, cells=cells, ab=ab_rows(cells))


def _device(backend: str) -> str:
    import torch
    return torch.cuda.get_device_name() if backend == "cuda" and torch.cuda.is_available() else ""


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))   # `python3 tools/serve_http_ab.py` from anywhere
    sys.exit(main())
