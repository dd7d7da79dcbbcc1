"""Decode tokens/s of vt.torch's Llama decoder served by vt on the sim backend against
transformers' `generate` on the same CPU, the same weights, in one process; prints the ratio.

    python3 tools/sim_decode_vs_transformers.py [--max-context 4096] [--prompt 32] [--new 32]
                                                [--requests 1] [--repeats 3] [--shape 135m|tiny]
                                                [--batch-invariant]

The model (--shape 135m, the default): hidden 576, 30 layers, GQA 9/3 (head_dim 64),
intermediate 1536, vocab 49152, tied embeddings, float32: the shape of published ~135M
Llama-family models, with seeded random weights. transformers' LlamaForCausalLM is made
first, saved to a temporary checkpoint and loaded into vt's decoder through vt.torch.hf.load,
as `vt serve --model` loads one: both run the same weights, so their greedy tokens should
agree (printed; float32 sums in another order may flip a near tie).

vt: `vt serve`'s sim defaults (float32, 8 rows, block size 16, mode ring, prefill="flat"),
max_context --max-context (vt serve's default: the config's max_position_embeddings, at most
4096), --requests requests (at most 8) of one --prompt-token prompt submitted together, each
generating --new tokens; --batch-invariant: the decoder with batch_invariant=True.
transformers: `generate` (greedy, its dynamic cache, eager) of the same prompt, a batch of
--requests, the same count. Each side's decode step time is the median of the intervals
between consecutive generated tokens (vt: the first request's token_times; transformers: a
logits processor stamping each step), the first token (the prefill) left out; the medians
over --repeats runs, vt's and transformers' interleaved so that both see the same load.
tokens/s = requests / that time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

SHAPES = {
    "135m": dict(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                 head_dim=64),
    "tiny": dict(vocab=256, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                 head_dim=16),
}
SIM_ROWS, BLOCK_SIZE = 8, 16   # vt serve's sim defaults


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="generated tokens per run")
    p.add_argument("--requests", type=int, default=1, help=f"decoded together, 1..{SIM_ROWS}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-invariant", action="store_true",
                   help="vt's decoder with batch_invariant=True")
    args = p.parse_args(argv)
    if args.prompt < 1 or args.new < 3 or args.repeats < 1:
        p.error("--prompt and --repeats must be positive, --new at least 3")
    if not 1 <= args.requests <= SIM_ROWS:
        p.error(f"--requests {args.requests} must be in 1..{SIM_ROWS}")
    if args.prompt + args.new > args.max_context:
        p.error(f"--prompt {args.prompt} + --new {args.new} exceeds --max-context "
                f"{args.max_context}")
    r = run(args)
    print(f"{args.shape} shape, float32, torch {r['torch']} with {r['threads']} threads, "
          f"transformers {r['transformers']}; {args.requests} request(s); vt: sim, ring, "
          f"max_context {args.max_context}, kernels {r['kernels']}, batch_invariant "
          f"{r['batch_invariant']}")
    print(f"vt           {r['vt_tok_s']:7.2f} tokens/s  (decode step ms, per run: "
          f"{_ms(r['vt_runs'])})")
    print(f"transformers {r['hf_tok_s']:7.2f} tokens/s  (decode step ms, per run: "
          f"{_ms(r['hf_runs'])})")
    print(f"vt / transformers: {r['vt_tok_s'] / r['hf_tok_s']:.2f}x; greedy tokens "
          f"{'agree' if r['tokens_agree'] else 'differ'}")
    return 0


def run(args) -> dict:
    import torch
    import transformers

    from vt.backend import get_backend
    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.serve.model_source import geometry_for
    from vt.torch import TorchForwardModel, hf
    from vt.torch.llama import LlamaDecoder

    shape = SHAPES[args.shape]
    hf_cfg = transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=args.max_context,
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    peer = transformers.LlamaForCausalLM(hf_cfg).eval()
    be = get_backend("sim")
    geo = geometry_for(SIM_ROWS, args.max_context, BLOCK_SIZE)
    with tempfile.TemporaryDirectory() as ckpt:
        peer.save_pretrained(ckpt)
        module = hf.load(ckpt, geo, dtype=torch.float32, device="cpu")
    if args.batch_invariant:
        invariant = LlamaDecoder(module.cfg, geo, dtype=torch.float32, device="cpu",
                                 batch_invariant=True)
        invariant.load_state_dict(module.state_dict())
        module = invariant
    model = TorchForwardModel(be, module, prefill="flat")
    prompt = torch.randint(1, shape["vocab"], (args.prompt,), generator=torch.Generator()
                           .manual_seed(1)).tolist()
    config = ExecutorConfig(mode="ring", serving_conc=SIM_ROWS,
                                     capture_sizes=(1, 2, 4, SIM_ROWS))
    vt_runs, hf_runs = [], []
    with Engine(be, model, config) as eng:
        eng.generate([prompt] * args.requests, max_new_tokens=3)   # capture and warm up
        _hf_generate(peer, prompt, args.requests, 3)
        for _ in range(args.repeats):
            res = eng.generate([prompt] * args.requests, max_new_tokens=args.new)[0]
            vt_runs.append(_per_token(res.token_times))
            hf_tokens, stamps = _hf_generate(peer, prompt, args.requests, args.new)
            hf_runs.append(_per_token(stamps))
        vt_tokens = list(map(int, res.tokens))
    be.close()
    n = args.requests
    return dict(torch=torch.__version__, transformers=transformers.__version__,
                threads=torch.get_num_threads(), kernels=module.kernels,
                batch_invariant=module.batch_invariant, vt_runs=vt_runs, hf_runs=hf_runs,
                vt_tok_s=n / statistics.median(vt_runs), hf_tok_s=n / statistics.median(hf_runs),
                tokens_agree=vt_tokens == hf_tokens)


def _hf_generate(model, prompt: list[int], rows: int, new: int):
    """transformers' greedy generate of exactly `new` tokens for `rows` copies of the prompt:
    (the first row's tokens, the time each step's logits reached the logits processors)."""
    import torch
    import transformers

    stamps = []

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([prompt] * rows)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                             logits_processor=transformers.LogitsProcessorList([Stamp()]))
    return out[0, len(prompt):].tolist(), stamps


def _per_token(times) -> float:
    """The median interval between consecutive tokens, the first (the prefill's) left out."""
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def _ms(runs) -> str:
    return ", ".join(f"{1e3 * t:.1f}" for t in runs)


if __name__ == "__main__":
    sys.exit(main())
