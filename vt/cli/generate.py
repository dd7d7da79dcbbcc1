"""`vt generate --model DIR --prompt TEXT`: one completion of a Hugging Face checkpoint,
printed as text, through the same engine and text path as `vt serve` (a first try, no server)."""
from __future__ import annotations

import argparse
import sys

from vt.cli.common import UsageError


def add_parser(sub) -> None:
    from vt.cli.serve import add_model_arguments
    p = sub.add_parser("generate", help="one completion of a checkpoint, printed as text")
    add_model_arguments(p, preset=False)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--stop", action="append", default=[], help="a stop string, not empty (repeatable)")
    p.set_defaults(func=cmd_generate, max_concurrency=1)


def cmd_generate(args: argparse.Namespace) -> int:
    from vt.cli.serve import check_model_arguments, open_served
    from vt.step.contract import SamplingParams

    check_model_arguments(args, "vt generate")
    if args.max_tokens < 1 or not 0 <= args.temperature <= 2:
        raise UsageError("vt generate: --max-tokens must be positive and --temperature in [0, 2]")
    if "" in args.stop:
        # An empty stop string is found before the first character: the completion would be
        # empty whatever the model says (vt serve refuses it too).
        raise UsageError("vt generate: --stop takes a non-empty string, got ''")

    be, served, engine, _ = open_served(args, "vt generate")
    try:
        text = served.text
        ids = (text.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat
               else text.encode(args.prompt))
        room = served.geometry.max_context - len(ids) + 1
        if room < 1:
            raise UsageError(f"vt generate: the prompt has {len(ids)} tokens; the context holds "
                             f"{served.geometry.max_context} (--max-context)")
        handle = engine.submit(ids, max_new_tokens=min(args.max_tokens, room),
                               stop_token=list(served.eos_ids) or None,
                               sampling=SamplingParams(args.temperature, seed=args.seed))
        stream = text.stream(tuple(args.stop))
        for tok in handle.stream():
            sys.stdout.write(stream.push([tok]))
            sys.stdout.flush()
            if stream.stopped:
                handle.cancel()
                break
        sys.stdout.write(stream.finish() + "\n")
    finally:
        engine.close()
        served.close()
        be.close()
    return 0
