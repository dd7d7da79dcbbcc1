"""How far each round-to-nearest FP8 (e4m3) weight scheme moves a checkpoint's next-token
choices, so that vt's own scheme can be judged against the others: every projection weight
quantized and dequantized in place ("fake quantization"), the model run by transformers in
float32 over one text in a single forward, each scheme's logits compared with the unquantized
model's (tools/fp8_quality.compare: logits relative error, greedy top-1 agreement, perplexity).

  python3 tools/fp8_schemes.py --model DIR [--text FILE] [--tokens 1000] [--json F]

The schemes, one scale for each:
  bf16         the weights rounded to bfloat16 (no FP8): the size of a dtype's own noise;
  channel      each output channel, amax / 448 (what vt does at load: vt.torch.fp8);
  tensor       the whole matrix, amax / 448 (vLLM's --quantization fp8, compressed-tensors'
               per-tensor scheme);
  block        each 128 x 128 block (the `fp8` checkpoint format: vt.torch.fp8.quantize_block);
  channel-mse  each output channel, the scale among amax / 448 x (1 + i / 16), i = 0..15, with
               the smallest squared error over the row (a searched scale; vt does not do this).
Only the weights are quantized (vt's path below 16 rows); `tools/fp8_quality.py --rows 16`
measures vt's own model with its activations quantized too. The "channel" row equals
`tools/fp8_quality.py --dtype float32` on the same text but for float32 summation order.
Needs torch and transformers (the `serve` extra); a model of 135M parameters and 1,000 tokens
takes about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

SEARCH_STEPS = 16


def _channel_searched(w):
    """The per-channel scale with the smallest squared error among SEARCH_STEPS candidates
    spanning one binade above amax / 448 (e4m3's grid repeats every factor of 2)."""
    import torch

    from vt.torch import fp8
    amax = w.abs().amax(dim=1, keepdim=True)
    base = torch.where(amax > 0, amax / fp8.FP8_MAX, torch.ones_like(amax))
    best, best_err = None, None
    for i in range(SEARCH_STEPS):
        scale = base * (1 + i / SEARCH_STEPS)
        q = fp8.to_fp8(w / scale).float() * scale
        err = (q - w).square().sum(dim=1, keepdim=True)
        if best is None:
            best, best_err = q, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, q, best), torch.where(better, err, best_err)
    return best


def schemes() -> dict:
    """name -> function from a float32 weight [N, K] to its fake-quantized float32 copy."""
    import torch

    from vt.torch import fp8
    return {
        "bf16": lambda w: w.to(torch.bfloat16).float(),
        "channel": lambda w: fp8.dequantize(fp8.quantize_per_channel(w)),
        "tensor": lambda w: fp8.dequantize(fp8.quantize_per_tensor(w)),
        "block": lambda w: fp8.dequantize(fp8.quantize_block(w)),
        "channel-mse": _channel_searched,
    }


def is_projection(name: str, param) -> bool:
    """The weights vt quantizes: the decoder layers' linear projections (not the embedding,
    the norms or the LM head)."""
    return name.endswith("_proj.weight") and param.dim() == 2


def run(model_dir: str, text: str | None, n: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.fp8_quality import compare, text_tokens
    tokens = text_tokens(AutoTokenizer.from_pretrained(model_dir), text, n, "fp8_schemes")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = {name: p.detach().clone() for name, p in model.named_parameters()
                if is_projection(name, p)}
    if not original:
        raise ValueError(f"{model_dir}: no *_proj.weight matrices to quantize")

    @torch.no_grad()
    def logits(fake_quantize):
        for name, p in model.named_parameters():
            if name in original:
                w = original[name]
                p.copy_(w if fake_quantize is None else fake_quantize(w))
        return model(torch.tensor([tokens])).logits[0].float()

    ref = logits(None)
    return [dict(compare(logits(fn), ref, tokens), scheme=name)
            for name, fn in schemes().items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a dense Hugging Face checkpoint directory")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: a built-in passage)")
    p.add_argument("--tokens", type=int, default=1000, help="positions measured (default 1000)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error(f"--tokens {args.tokens}: at least 2 (perplexity needs a next token)")
    text = None if args.text is None else open(args.text, encoding="utf-8").read()
    try:
        rows = run(args.model, text, args.tokens)
    except ValueError as exc:
        print(f"fp8_schemes: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model}, float32, {rows[0]['positions']} positions, weights only:")
    for r in rows:
        print(f"  {r['scheme']:<12} logits relative error {r['logits_rel_err']:.4f}, greedy "
              f"top-1 agreement {100 * r['top1_agreement']:.1f} %, perplexity "
              f"{r['perplexity_fp8']:.3f} against {r['perplexity_ref']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
