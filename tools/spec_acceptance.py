"""Speculative decoding's acceptance on real weights: a checkpoint served by vt's Engine with
each proposer (the n-gram one, and a draft model per --draft-model) on a prompt-heavy task,
greedy: each request asks the model to repeat a passage it is given, word for word.

  python3 tools/real_checkpoint.py /tmp/smol                       # SmolLM2-135M-Instruct
  python3 tools/real_checkpoint.py /tmp/smol-8 --layers 8          # its first 8 layers
  python3 tools/spec_acceptance.py --model /tmp/smol --draft-model /tmp/smol-8 --num-spec 4

Per proposer, one engine over the same loaded model (each draft loaded with its geometry)
serves --passages requests together: each a chat prompt (the tokenizer's template when it
has one) holding --passage-tokens tokens of --text (default: the checkpoint's LICENSE, else
tools/fp8_quality.py's passage), --new tokens at most, ending at EOS. Reported per proposer:
acceptance rate (drafts accepted / verified), mean accepted length (tokens a verify step
emits per row, 1 .. k + 1), tokens per second (on the sim, CPU float32: the cost of
speculation there, not a GPU's), and how many requests' tokens equal the engine's without
speculation (with the decoder's default kernels a verify step's logits may differ from a
one-token step's in their last bits: docs/speculative.md says when tokens are equal). A
layer-skip draft (tools/real_checkpoint.py --layers N) shares the model's embedding, final
norm and head. --json F also writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

INSTRUCTION = "Repeat the following text word for word, and nothing else:\n\n"


def passages(tok, text: str, n: int, tokens: int) -> list[str]:
    """n consecutive pieces of `text`, each `tokens` tokens long as `tok` splits it."""
    ids = tok(text, add_special_tokens=False).input_ids
    if len(ids) < n * tokens:
        ids = ids * -(-n * tokens // max(len(ids), 1))
    return [tok.decode(ids[i * tokens:(i + 1) * tokens]) for i in range(n)]


def prompt_ids(tok, passage: str) -> list[int]:
    messages = [{"role": "user", "content": INSTRUCTION + passage}]
    if tok.chat_template:
        chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(chat, add_special_tokens=False).input_ids
    return tok(INSTRUCTION + passage).input_ids


def run(args) -> dict:
    import transformers

    from tools.fp8_quality import PASSAGE
    from vt.backend import get_backend
    from vt.config import ExecutorConfig
    from vt.engine import Engine
    from vt.forward.speculative import SpeculativeConfig, verify_table_rows
    from vt.serve.model_source import load_checkpoint
    from vt.serve.text import eos_token_ids

    model = Path(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    text = Path(args.text).read_text() if args.text else (
        (model / "LICENSE").read_text() if (model / "LICENSE").is_file() else PASSAGE)
    prompts = [prompt_ids(tok, p) for p in passages(tok, text, args.passages, args.passage_tokens)]
    context = max(len(p) for p in prompts) + args.new + args.num_spec + 1
    eos = list(eos_token_ids(model))
    be = get_backend(args.backend)
    rows, k = args.passages, args.num_spec
    load = dict(max_seqs=rows, max_context=context, block_size=16,
                token_table_rows=verify_table_rows(rows, rows, k))
    config = ExecutorConfig(mode="ring", serving_conc=rows, capture_sizes=(rows,))
    out = dict(model=str(model), backend=be.name, k=k, passages=rows,
               prompt_tokens=[len(p) for p in prompts], new=args.new, runs=[])
    try:
        served = load_checkpoint(be, model, **load)
        load["kv_blocks"] = served.geometry.num_kv_blocks   # a draft's geometry is the target's

        def serve(spec) -> dict:
            with Engine(be, served.step_model, config, speculative=spec,
                        prefix_caching=False) as eng:
                t0 = time.perf_counter()
                res = eng.generate(prompts, max_new_tokens=args.new, stop_token=eos)
                wall = time.perf_counter() - t0
                st = eng.stats()["speculative"] or {}
            tokens = [list(map(int, r.tokens)) for r in res]
            return dict(tokens=tokens, wall_s=wall,
                        tokens_per_s=sum(len(t) for t in tokens) / wall,
                        acceptance_rate=st.get("acceptance_rate"),
                        mean_accepted_length=st.get("mean_accepted_length"))

        base = serve(None)
        out["runs"].append(dict(base, proposer="none"))
        _say(out["runs"][-1], base)
        proposers = [("ngram", None)] + [(f"draft {d}", d) for d in args.draft_model]
        for name, draft_dir in proposers:
            draft = None if draft_dir is None else load_checkpoint(be, draft_dir, **load)
            spec = SpeculativeConfig("ngram" if draft is None else "draft", k=k,
                                     draft=None if draft is None else draft.step_model)
            r = serve(spec)
            r["same"] = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
            out["runs"].append(dict(r, proposer=name))
            _say(out["runs"][-1], base)
    finally:
        be.close()
    return out


def _say(r: dict, base: dict) -> None:
    if r["proposer"] == "none":
        print(f"{'none':>28}: {sum(map(len, r['tokens'])):5d} tokens, {r['tokens_per_s']:7.1f} "
              f"tok/s", flush=True)
        return
    print(f"{r['proposer']:>28}: acceptance {r['acceptance_rate']:.3f}, mean accepted length "
          f"{r['mean_accepted_length']:.2f}, {r['tokens_per_s']:7.1f} tok/s "
          f"(x{r['tokens_per_s'] / base['tokens_per_s']:.2f}), tokens equal the baseline's in "
          f"{r['same']} of {len(r['tokens'])} requests", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target's Hugging Face checkpoint directory")
    p.add_argument("--draft-model", action="append", default=[], metavar="DIR",
                   help="a draft model's checkpoint directory (repeat for several)")
    p.add_argument("--num-spec", type=int, default=4, metavar="K", help="drafts a step (default 4)")
    p.add_argument("--text", default=None, help="the passages' source text (default: the "
                                                "checkpoint's LICENSE)")
    p.add_argument("--passages", type=int, default=4, help="requests served together (default 4)")
    p.add_argument("--passage-tokens", type=int, default=200,
                   help="tokens of text in each prompt (default 200)")
    p.add_argument("--new", type=int, default=160, help="new tokens at most (default 160)")
    p.add_argument("--backend", default="sim", choices=["sim", "cuda"])
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if min(args.num_spec, args.passages, args.passage_tokens, args.new) < 1:
        p.error("--num-spec, --passages, --passage-tokens and --new must be positive")
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
