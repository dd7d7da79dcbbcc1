"""FP8's quality, measured: a model with FP8 projections (vt.torch.fp8, quantized per channel
at load), an FP8 KV cache or both, against the same model in its own dtype, over one text,
teacher-forced (both read the same tokens; each position's logits compared):

- logits relative error: ||fp8 - ref|| / ||ref|| over every position's logits (and the
  largest per-position value);
- top-1 agreement: the share of positions where the two models' greedy (argmax) tokens agree;
- perplexity of the text's next tokens under each model (and their ratio).

  python3 tools/fp8_quality.py --model DIR [--text FILE] [--tokens 1000] [--rows 16]
                               [--weights fp8|dense] [--kv-cache-dtype auto|fp8]
  python3 tools/fp8_quality.py --preset torch-llama3-8b --tokens 1000    # random weights, cuda

--model: a dense (bf16/fp32) Hugging Face checkpoint directory with its tokenizer (loaded
twice: as it is and as measured); --text (default: a built-in English passage,
repeated to --tokens) is tokenized by the checkpoint's tokenizer. --preset: one of vt bench's
torch presets with random weights and seeded random tokens (perplexity then says nothing about
language, only that both models agree). The text runs as decode steps (the captured path's ops)
on cuda when a GPU is usable, else the CPU (the reference path: the same arithmetic as the
GPU's kernels but for the summation order). --rows R (default 1): each step decodes R
consecutive positions as R rows of the one sequence, as a speculative verify step does (every
row's K and V are written before any row reads the cache), so the FP8 linears see R rows: from
16 rows (fp8.W8A8_MIN_ROWS) they quantize the activations too, per token, the path of larger
batches and prompts; below, weights only. The last step starts R positions before the text's
end, so that every step has R rows, and keeps only the positions not measured yet. --dtype: the
models' activation and dense-weight dtype (default: bfloat16 on cuda, float32 on the CPU, where
bfloat16 runs too, slower). --kv-cache-dtype fp8: the measured model holds its KV cache as e4m3
codes too (vt.torch.kv_fp8); with --weights dense (its projections as the reference's) that
measures the FP8 cache alone. --json F also writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

WEIGHTS = ("fp8", "dense")
PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when movable metal "
    "type made it possible to reproduce books quickly and cheaply. Before that, texts were "
    "copied by hand, a slow process that kept books rare and expensive. Within a few decades "
    "presses spread across Europe, and the number of books in circulation grew from thousands "
    "to millions. Scholars could compare editions, merchants could print price lists, and "
    "governments could publish laws that everyone could read. The new technology also changed "
    "how people learned: grammar books, maps and scientific treatises reached students far "
    "from the great universities. ")


def position_logits(module, tokens, rows: int = 1) -> "torch.Tensor":
    """[len(tokens), vocab] float32 on the CPU: each position's logits, from decode steps of
    `rows` consecutive positions each (module docstring; the module's geometry holds `rows`
    sequences and the text's blocks)."""
    import torch

    from vt.torch import TorchInputs
    geo, dev = module.geometry, module.k_cache.device
    if not 1 <= rows <= min(geo.max_seqs, len(tokens)):
        raise ValueError(f"rows {rows}: between 1 and the positions ({len(tokens)}) and "
                         f"the geometry's sequences ({geo.max_seqs})")
    table = torch.zeros(geo.max_seqs + 1, dtype=torch.int32, device=dev)
    blocks = torch.arange(1, geo.max_blocks + 1, dtype=torch.int32, device=dev)
    blocks = blocks[None].expand(rows, -1).contiguous()
    logits = torch.empty(rows, module.cfg.vocab, device=dev)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)   # noqa: E731
    measured, out = 0, []
    while measured < len(tokens):
        first = min(measured, len(tokens) - rows)
        pos = list(range(first, first + rows))
        table[:rows] = i32([tokens[p] for p in pos])
        slots = [(p // geo.block_size + 1) * geo.block_size + p % geo.block_size for p in pos]
        module(TorchInputs.decode(table, i32(list(range(rows))), i32(pos),
                                  i32([p + 1 for p in pos]), i32(slots), blocks,
                                  i32([0] * rows)), logits)
        out.append(logits[measured - first:].cpu().clone())
        measured = first + rows
    return torch.cat(out)


def what_runs(rows: int, weights: str = "fp8", kv_cache_dtype: str = "auto") -> str:
    """What the measured model computes in FP8 at `rows` rows a step: its linears (a
    per-channel FP8 linear's choice, vt.torch.fp8's module docstring) and its KV cache."""
    from vt.torch import fp8
    if weights == "dense":
        linears = "weights in the dtype"
    elif fp8.activations_quantized(rows, None):
        linears = "W8A8: weights and activations in FP8"
    else:
        linears = "FP8 weights, activations in the dtype"
    return linears + ("; an FP8 KV cache" if kv_cache_dtype == "fp8" else "")


def _quantized(weights: str, kv_cache_dtype: str) -> dict:
    """The decoder arguments of the measured model (module docstring: --weights and
    --kv-cache-dtype)."""
    if weights not in WEIGHTS or kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"weights {weights!r} must be one of {WEIGHTS}, kv_cache_dtype "
                         f"{kv_cache_dtype!r} 'auto' or 'fp8'")
    if weights == "dense" and kv_cache_dtype == "auto":
        raise ValueError("--weights dense with --kv-cache-dtype auto quantizes nothing: "
                         "measure FP8 weights, an FP8 KV cache (--kv-cache-dtype fp8), or both")
    return dict(quantization="fp8" if weights == "fp8" else None, kv_cache_dtype=kv_cache_dtype)


def compare(fp8_logits, ref_logits, tokens) -> dict:
    """The numbers of the module docstring, from two [L, vocab] float32 logits tensors over
    `tokens` (position p predicts tokens[p + 1])."""
    import torch
    diff = fp8_logits - ref_logits
    per_pos = diff.norm(dim=1) / ref_logits.norm(dim=1)
    agree = (fp8_logits.argmax(1) == ref_logits.argmax(1)).float().mean().item()
    nxt = torch.tensor(tokens[1:])

    def ppl(logits):
        nll = torch.nn.functional.cross_entropy(logits[:-1].double(), nxt)
        return math.exp(nll.item())
    p8, pr = ppl(fp8_logits), ppl(ref_logits)
    return dict(positions=len(tokens), logits_rel_err=(diff.norm() / ref_logits.norm()).item(),
                logits_rel_err_max_position=per_pos.max().item(), top1_agreement=agree,
                perplexity_fp8=p8, perplexity_ref=pr, perplexity_ratio=p8 / pr)


def _geometry(n: int, rows: int = 1):
    from vt.step import KVGeometry
    bs = 16
    blocks = -(-n // bs)
    return KVGeometry(max_seqs=rows, num_kv_blocks=blocks + 1, block_size=bs,
                      max_context=blocks * bs)


def text_tokens(tokenizer, text: str | None, n: int, tool: str = "fp8_quality") -> list[int]:
    """The first n tokens of `text` (None: PASSAGE, repeated to n tokens); fewer, said on
    stderr by `tool`, where the text holds fewer."""
    body = text if text is not None else PASSAGE * (1 + 8 * n // len(PASSAGE))
    tokens = tokenizer(body)["input_ids"][:n]
    if len(tokens) < n:
        print(f"{tool}: the text holds {len(tokens)} tokens; measuring those",
              file=sys.stderr)
    return tokens


def run_checkpoint(path: str, text: str | None, n: int, device, dtype, rows: int = 1,
                   weights: str = "fp8", kv_cache_dtype: str = "auto") -> dict:
    from transformers import AutoTokenizer

    from vt.torch import hf
    quantized = _quantized(weights, kv_cache_dtype)
    tokens = text_tokens(AutoTokenizer.from_pretrained(path), text, n)
    geo = _geometry(len(tokens), rows)
    ref = position_logits(hf.load(path, geo, dtype=dtype, device=device), tokens, rows)
    fp8 = position_logits(hf.load(path, geo, dtype=dtype, device=device, **quantized),
                          tokens, rows)
    return dict(compare(fp8, ref, tokens), model=path, dtype=str(dtype).split(".")[-1],
                rows=rows, weights=weights, kv_cache_dtype=kv_cache_dtype,
                what_runs=what_runs(rows, weights, kv_cache_dtype))


def run_preset(preset: str, n: int, device, dtype, rows: int = 1, weights: str = "fp8",
               kv_cache_dtype: str = "auto") -> dict:
    import torch

    from vt.bench.torch_workload import model_config
    from vt.torch.llama import LlamaDecoder, quantize_weights_
    quantized = _quantized(weights, kv_cache_dtype)
    cfg = model_config("torch-tiny" if preset == "tiny" else preset)
    geo = _geometry(n, rows)
    torch.manual_seed(0)
    dense = LlamaDecoder(cfg, geo, dtype=dtype, device=device)
    tokens = torch.randint(0, cfg.vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = position_logits(dense, tokens, rows)
    dense_weights = dense.state_dict()
    model = LlamaDecoder(cfg, geo, dtype=dtype, device=device, **quantized)
    if quantized["quantization"] == "fp8":
        quantize_weights_(model, dense_weights)
    else:
        model.load_state_dict(dense_weights)
    del dense, dense_weights
    fp8 = position_logits(model, tokens, rows)
    return dict(compare(fp8, ref, tokens), model=f"{preset} (random weights)",
                dtype=str(dtype).split(".")[-1], rows=rows, weights=weights,
                kv_cache_dtype=kv_cache_dtype,
                what_runs=what_runs(rows, weights, kv_cache_dtype))


def format_report(r: dict) -> str:
    return (f"{r['model']}, {r['dtype']}, {r['positions']} positions, {r['rows']} "
            f"row{'s' if r['rows'] > 1 else ''} a step ({r['what_runs']}): logits relative error "
            f"{r['logits_rel_err']:.4f} (largest position {r['logits_rel_err_max_position']:.4f}); "
            f"greedy top-1 agreement {100 * r['top1_agreement']:.1f} %; perplexity fp8 "
            f"{r['perplexity_fp8']:.3f} against {r['perplexity_ref']:.3f} "
            f"(x{r['perplexity_ratio']:.4f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a dense Hugging Face checkpoint directory")
    src.add_argument("--preset", help="a vt bench torch preset, random weights (e.g. "
                                      "torch-llama3-8b, tiny)")
    p.add_argument("--text", default=None, help="a UTF-8 text file (--model only)")
    p.add_argument("--tokens", type=int, default=1000, help="positions measured (default 1000)")
    p.add_argument("--rows", type=int, default=1,
                   help="consecutive positions decoded per step (default 1; from 16 the FP8 "
                        "linears quantize the activations too)")
    p.add_argument("--weights", choices=WEIGHTS, default="fp8",
                   help="the measured model's projections: FP8 (default) or as the reference's")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="the measured model's KV cache (default auto: the dtype, as the "
                        "reference's)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="the models' dtype (auto: bfloat16 on cuda, float32 on the CPU)")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error(f"--tokens {args.tokens}: at least 2 (perplexity needs a next token)")
    if args.rows < 1 or args.rows > args.tokens:
        p.error(f"--rows {args.rows}: between 1 and --tokens ({args.tokens})")
    if args.weights == "dense" and args.kv_cache_dtype == "auto":
        p.error("--weights dense with --kv-cache-dtype auto quantizes nothing")
    if args.text is not None and args.model is None:
        p.error("--text needs --model (a preset has no tokenizer)")
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = (getattr(torch, args.dtype) if args.dtype != "auto"
             else torch.bfloat16 if device.type == "cuda" else torch.float32)
    text = None if args.text is None else open(args.text, encoding="utf-8").read()
    try:
        what = dict(rows=args.rows, weights=args.weights, kv_cache_dtype=args.kv_cache_dtype)
        r = (run_checkpoint(args.model, text, args.tokens, device, dtype, **what)
             if args.model else run_preset(args.preset, args.tokens, device, dtype, **what))
    except ValueError as exc:
        print(f"fp8_quality: {exc}", file=sys.stderr)
        return 2
    print(format_report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
