"""The `vt` command line: `vt info` (what a user runs first), `vt run` (the demo decode loop),
`vt bench`, `vt serve` (an OpenAI-compatible server) and `vt generate` (one completion)."""
from __future__ import annotations

import argparse
import importlib.metadata
import platform

from vt import __version__
from vt.cli.common import OneLineParser, run_command
from vt.config import MODES

DISTRIBUTION = "vt-graphs"   # pyproject.toml's name; the import name is vt


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args: argparse.Namespace) -> int:
    """Print the backend vt would pick, the device, versions, and a capture/replay self-check."""
    from vt.backend import available_backends
    from vt.backend.selfcheck import run_selfcheck
    from vt.cli.common import pick_backend

    print(f"vt {_package_version(DISTRIBUTION) if _installed() else 'source tree'}"
          f"  python {platform.python_version()}")
    print(f"backends available: {', '.join(available_backends())}")
    for pkg in ("numpy", "cuda-bindings", "cupy-cuda13x", "nvmath-python", "safetensors"):
        print(f"  {pkg:<14} {_package_version(pkg)}")
    be = pick_backend(args.backend, who="vt info")
    try:
        print(f"backend picked ({args.backend}): {be.name}")
        for key, value in be.info().items():
            print(f"  {key:<18} {value}")
        ok, message = run_selfcheck(be)
    finally:
        be.close()
    print(f"self-check (capture + replay x3 with new host input): {'PASS' if ok else 'FAIL'} — {message}")
    print("prefix caching: on for step models whose KV is position-addressed (vt.torch's "
          "LlamaDecoder, StepModel.prefix_cacheable); the bundled hybrid (recurrent GDN state) "
          "runs without it")
    return 0 if ok else 1


def _installed() -> bool:
    try:
        importlib.metadata.version(DISTRIBUTION)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def cmd_run(args: argparse.Namespace) -> int:
    from vt.cli.run import run_demo
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="vt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="backend, device, versions and a capture/replay self-check")
    info.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    info.set_defaults(func=cmd_info)

    from vt.bench import limits as lim
    run = sub.add_parser("run", help="run a batch of requests through the decode loop")
    run.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    run.add_argument("--preset", default=None,
                     help="model preset (default: bench-dense on cuda, tiny-dense on sim)")
    run.add_argument("--requests", type=int, default=None,
                     help=f"number of requests, at most {lim.MAX_REQUESTS} (default: 2 x concurrency)")
    run.add_argument("--concurrency", type=int, default=None,
                     help=f"max requests decoded together, at most {lim.MAX_SERVING_CONC} "
                          f"(default: VT_ASYNC_SERVING_CONC or 8)")
    run.add_argument("--mode", default=None, choices=list(MODES),
                     help="executor mode (default: from VT_ASYNC_EXECUTOR and "
                          "VT_ASYNC_EXECUTOR_NO_DBUF, i.e. drain; a mode given here replaces "
                          "them); unguarded is the unsafe test arm and needs --unsafe-unguarded")
    run.add_argument("--unsafe-unguarded", action="store_true",
                     help="allow the unguarded mode (--mode unguarded or "
                          "VT_ASYNC_EXECUTOR_NO_DBUF=1), which produces wrong tokens on purpose")
    run.add_argument("--steps", type=int, default=32,
                     help="new tokens per request (prompt + new tokens - 1 must fit the preset's "
                          "max_context, as in Engine.generate)")
    run.add_argument("--prompt-len", type=int, default=16, help="tokens per random prompt")
    run.add_argument("--trace", default=None,
                     help="write a Chrome trace JSON (Perfetto) to this path (checked before the "
                          "run, written whole or not at all)")
    run.add_argument("--seed", type=int, default=0,
                     help="seed of the weights and prompts (0 to 2**63 - 1)")
    run.add_argument("--sim-delay-ms", type=float, default=0.0,
                     help=f"sim backend: device delay per op, 0 to {lim.MAX_SIM_DELAY_MS:g} ms")
    run.add_argument("--force", action="store_true",
                     help="run a bench-* preset on the sim backend anyway (GBs of memory, minutes)")
    run.set_defaults(func=cmd_run)

    from vt.cli.bench import add_parser as add_bench_parser
    add_bench_parser(sub)
    from vt.cli.serve import add_parser as add_serve_parser
    from vt.cli.generate import add_parser as add_generate_parser
    add_serve_parser(sub)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 1 a failed self-check, wrong tokens in vt bench, an output that
    could not be written after the work, or a wait past its deadline; 2 a usage error (bad
    flag, VT_* variable, preset or output path, missing GPU); 130 interrupted (Ctrl-C); 141
    stdout closed by its reader (`vt info | head -1`); 143 terminated (SIGTERM)."""
    import sys

    from vt.cli.bench import standalone_parser, standalone_workload
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["bench"] and (name := standalone_workload(args[1:])):
        return run_command(standalone_parser(name), args[1:])   # its own flags
    return run_command(build_parser(), argv)
