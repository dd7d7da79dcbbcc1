"""`vt serve`: an OpenAI-compatible HTTP server on vt's engine (vt/serve), for a Hugging Face
checkpoint directory (--model) or a bundled preset (--preset, token ids only).

Every flag is checked before the model is loaded; a bad one is a one-line UsageError (exit
2). The server prints the address it listens on once the engine is captured and warmed, and
exits 0 after SIGINT or SIGTERM (vt/serve/server.py says how in-flight requests end), or 1
once its engine has stopped for good (a tensor-parallel rank died)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from vt.cli.common import UsageError, backend_name, pick_backend

SIM_DEFAULT_CONC, CUDA_DEFAULT_CONC = 8, 32
# What a checkpoint needs beyond vt's own dependencies (the serve extra brings them).
CHECKPOINT_MODULES = ("torch", "transformers")
SERVER_MODULES = ("fastapi", "uvicorn")


def add_model_arguments(p: argparse.ArgumentParser, *, preset: bool) -> None:
    """The flags of the served model (vt serve and vt generate)."""
    if preset:
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument("--model", help="a Hugging Face checkpoint directory (Llama, Qwen2, Qwen3)")
        src.add_argument("--preset", help="a bundled model with random weights (token ids only)")
    else:
        p.add_argument("--model", required=True,
                       help="a Hugging Face checkpoint directory (Llama, Qwen2, Qwen3)")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    from vt.config import SAFE_MODES
    p.add_argument("--mode", default="ring", choices=list(SAFE_MODES),
                   help="executor mode (default: ring)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help=f"requests decoded together, the rows of the batch (default: "
                        f"{CUDA_DEFAULT_CONC} on cuda, {SIM_DEFAULT_CONC} on sim)")
    p.add_argument("--max-context", "--max-model-len", dest="max_context", type=int, default=None,
                   help="tokens per sequence, prompt and output, at most the checkpoint's "
                        "max_position_embeddings (default: that, capped at 4096)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV cache blocks, one of them scratch (default: from "
                        "--gpu-memory-utilization on cuda, 512 MiB on sim, at most a whole "
                        "context for every row)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="cuda, --model: the fraction of the GPU memory free at start-up that "
                        "the weights, activations and KV cache may take (default 0.9)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache (auto: bfloat16 on cuda, float32 on sim)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="--model: FP8 (e4m3) projection weights, quantized per channel at "
                        "load from a bf16/fp32 checkpoint (an FP8 checkpoint is FP8 without "
                        "it; docs/torch.md)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="--model: the KV cache's element type (auto: --dtype's; fp8: e4m3 codes "
                        "with a scale of 1.0 per layer's K and V, one byte an element; "
                        "docs/torch.md)")
    p.add_argument("--seed", type=int, default=0, help="--preset: seed of the random weights")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="--model: shard it over N processes, one GPU each on cuda "
                        "(docs/parallel.md; default 1)")


def check_model_arguments(args, who: str) -> None:
    for flag in ("max_concurrency", "max_context", "kv_blocks", "block_size"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise UsageError(f"{who}: --{flag.replace('_', '-')} must be a positive integer, got {v}")
    if args.tensor_parallel < 1:
        raise UsageError(f"{who}: --tensor-parallel must be a positive integer, got "
                         f"{args.tensor_parallel}")
    if args.tensor_parallel > 1 and getattr(args, "preset", None):
        raise UsageError(f"{who}: --tensor-parallel needs --model: a bundled preset runs in one "
                         f"process")
    if getattr(args, "quantization", None) and getattr(args, "preset", None):
        raise UsageError(f"{who}: --quantization needs --model: a bundled preset has no FP8 "
                         f"form")
    if getattr(args, "kv_cache_dtype", "auto") != "auto" and getattr(args, "preset", None):
        raise UsageError(f"{who}: --kv-cache-dtype needs --model: a bundled preset's KV cache "
                         f"is its own")
    if args.max_concurrency is not None and args.max_concurrency > 1024:
        raise UsageError(f"{who}: --max-concurrency must be at most 1024, got {args.max_concurrency}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"{who}: --gpu-memory-utilization must be in (0, 1], got "
                         f"{args.gpu_memory_utilization}")


def require_serve_extra(who: str, modules) -> None:
    """UsageError naming the first of `modules` that does not import and the extra to install
    (the distribution is vt-graphs: `vt` on PyPI is another project)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UsageError(f"{who} needs the serve extra ({e.name or module} is missing): "
                             f"pip install 'vt-graphs[serve]' (from a checkout: "
                             f"pip install '.[serve]')") from None


def serving_config(mode: str, conc: int):
    """The engine config of vt serve (and of the in-process side of tools/serve_http_ab.py, so
    that both serve with the same graphs): `conc` rows, a graph per default size below it and
    one of `conc` itself."""
    from vt.config import DEFAULT_CAPTURE_SIZES, ExecutorConfig
    sizes = tuple(s for s in DEFAULT_CAPTURE_SIZES if s < conc) + (conc,)
    return ExecutorConfig(mode=mode, serving_conc=conc, capture_sizes=sizes)


def open_served(args, who: str, out=None):
    """(backend, ServedModel, Engine) for the parsed flags; the caller closes them in reverse.
    What the start-up does and chooses goes to `out` (stderr) as it happens
    (vt/cli/start_up.py)."""
    from vt.cli.start_up import StartUpLog

    if not getattr(args, "preset", None):
        require_serve_extra(who, CHECKPOINT_MODULES)
    from vt.engine.engine import Engine
    from vt.forward.speculative import verify_table_rows
    from vt.serve.model_source import load_checkpoint, load_preset

    log = StartUpLog(who, out)
    name = backend_name(args.backend)
    conc = args.max_concurrency or (CUDA_DEFAULT_CONC if name == "cuda" else SIM_DEFAULT_CONC)
    be = pick_backend(args.backend, who=who)
    k = getattr(args, "num_spec", None) if getattr(args, "speculative", None) else None
    try:
        if getattr(args, "preset", None):
            log.line(f"{who}: preset {args.preset} (random weights, token ids only) on {be.name}")
            served = load_preset(be, args.preset, max_seqs=conc, max_context=args.max_context,
                                 seed=args.seed)
        else:
            log.line(f"{who}: loading {args.model} on {be.name} ...")
            served = load_checkpoint(be, args.model, max_seqs=conc, max_context=args.max_context,
                                     block_size=args.block_size, kv_blocks=args.kv_blocks,
                                     dtype=args.dtype,
                                     name=getattr(args, "served_model_name", None) or args.model,
                                     tensor_parallel=args.tensor_parallel,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     quantization=getattr(args, "quantization", None),
                                     kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                                     progress=log, token_table_rows=verify_table_rows(
                                         conc, conc, k) if k else None,
                                     draft=getattr(args, "draft_model", None))
    except ValueError as e:
        be.close()
        raise UsageError(f"{who}: {e}") from None
    except BaseException:
        be.close()
        raise
    for note in served.notes:
        log.line(f"{who}: {note}")
    spec = speculative_config(args, served.draft)
    config = serving_config(args.mode, conc)
    try:
        log.line(f"{who}: {args.mode} mode, decode graphs for batch sizes "
                 f"{', '.join(map(str, config.capture_sizes))}")
        engine = Engine(be, served.step_model, config, tensor_parallel=args.tensor_parallel,
                        start_up_progress=log,
                        prefix_caching=False if getattr(args, "no_prefix_cache", False) else None,
                        speculative=spec)
        log.line(f"{who}: {engine.prefix_caching_note}")
        if spec:
            log.line(f"{who}: speculative decoding: {spec.method}, {spec.k} drafts a step "
                     f"(no logprobs or penalties)")
    except BaseException:
        served.close()
        be.close()
        raise
    return be, served, engine, conc


def speculative_config(args, draft=None):
    """The SpeculativeConfig of --speculative/--num-spec (None without them); draft: the
    step model of --draft-model (ServedModel.draft) for --speculative draft."""
    method = getattr(args, "speculative", None)
    if method is None:
        return None
    from vt.forward.speculative import SpeculativeConfig
    return SpeculativeConfig(method, k=args.num_spec, draft=draft)


def check_speculative_arguments(args, who: str) -> None:
    """--speculative needs --model on one process; --num-spec needs --speculative; a draft
    model and --speculative draft come together."""
    from vt.forward.speculative import MAX_K
    method = getattr(args, "speculative", None)
    draft_model = getattr(args, "draft_model", None)
    if draft_model is not None and method != "draft":
        raise UsageError(f"{who}: --draft-model needs --speculative draft")
    if method is None:
        if getattr(args, "num_spec", None) is not None:
            raise UsageError(f"{who}: --num-spec needs --speculative")
        return
    if method == "draft" and draft_model is None:
        raise UsageError(f"{who}: --speculative draft needs --draft-model DIR, the draft "
                         f"model's checkpoint directory")
    if getattr(args, "preset", None):
        raise UsageError(f"{who}: --speculative needs --model: a bundled preset keeps a "
                         f"recurrent state, which a verify step cannot roll back")
    if args.tensor_parallel > 1:
        raise UsageError(f"{who}: --speculative runs in one process, not with --tensor-parallel "
                         f"{args.tensor_parallel}")
    if args.num_spec is None:
        args.num_spec = 4
    if not 1 <= args.num_spec <= MAX_K:
        raise UsageError(f"{who}: --num-spec must be in [1, {MAX_K}], got {args.num_spec}")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a checkpoint or preset")
    add_model_arguments(p, preset=True)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model as given, or the preset)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; default 8000)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting for a row beyond --max-concurrency; more are answered "
                        "429 with Retry-After (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight responses get to finish after SIGINT/SIGTERM before "
                        "they are aborted (finish_reason abort; default 30)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt whole: no KV blocks shared between requests "
                        "(default: shared when the model's KV is position-addressed)")
    p.add_argument("--api-key", default=None,
                   help="every endpoint but /health asks for 'Authorization: Bearer KEY' "
                        "(default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to serve with instead of the tokenizer's")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding (docs/speculative.md): ngram proposes the "
                        "tokens that followed the latest earlier match of the row's last "
                        "tokens in its prompt and output; draft, the greedy tokens of "
                        "--draft-model; greedy or sampled requests, without logprobs, "
                        "penalties, grammars or min_tokens")
    p.add_argument("--num-spec", type=int, default=None, metavar="K",
                   help="--speculative: drafts verified per row per step (default 4)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="--speculative draft: the draft model's Hugging Face checkpoint "
                        "directory, a smaller model of --model's tokenizer (same vocabulary), "
                        "loaded with its backend and --dtype")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    check_model_arguments(args, "vt serve")
    check_speculative_arguments(args, "vt serve")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"vt serve: --port must be in [0, 65535], got {args.port}")
    if args.max_queued < 0 or not 0 <= args.shutdown_timeout <= 3600:
        raise UsageError("vt serve: --max-queued must be >= 0 and --shutdown-timeout in [0, 3600]")
    api_key = args.api_key
    if api_key is not None and not api_key.strip():
        raise UsageError("vt serve: --api-key is empty")
    template = None
    if args.chat_template is not None:
        if getattr(args, "preset", None):
            raise UsageError("vt serve: --chat-template needs --model (a preset has no tokenizer)")
        try:
            template = Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"vt serve: --chat-template {args.chat_template!r} cannot be read: {e}") from None
    require_serve_extra("vt serve", SERVER_MODULES)
    from vt.serve.server import address, bind, make_server
    from vt.serve.generation import GenerationService
    from vt.serve.metrics import ServeMetrics

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        sock = bind(args.host, args.port)
    except ValueError as e:
        raise UsageError(f"vt serve: {e}") from None
    with sock:
        be, served, engine, conc = open_served(args, "vt serve")
        if args.served_model_name and getattr(args, "preset", None):
            served.name = args.served_model_name
        if template is not None:
            served.text.use_chat_template(template)
        try:
            service = GenerationService(engine, served, ServeMetrics(served.name),
                                        serving_conc=conc, max_queued=args.max_queued)
            listening = f"vt serve: {served.name!r} listening on {address(sock)}"
            server = make_server(service, shutdown_timeout_s=args.shutdown_timeout,
                                 log_level=args.log_level,
                                 on_listening=lambda: print(listening, flush=True),
                                 api_key=api_key)
            server.run(sockets=[sock])
        finally:
            engine.close()
            served.close()
            be.close()
    if server.engine_failure is not None:
        log(f"vt serve: exiting, the engine stopped: {server.engine_failure}")
        return 1
    log("vt serve: stopped")
    return 0
