"""Build a tiny Llama checkpoint directory with a real tokenizer, offline: what `vt serve` and
`vt generate` are tried and tested on without downloading anything.

The directory is what a Hugging Face export holds: config.json and model.safetensors (random
weights, seeded, fp32), generation_config.json (its eos_token_id), and a byte-level BPE
tokenizer trained here with the `tokenizers` library on a few sentences (ASCII and
multi-byte text, so tokens that split a UTF-8 character exist), saved by transformers'
PreTrainedTokenizerFast with a chat template. Every file is written by save_pretrained.

  python3 tools/tiny_checkpoint.py /tmp/tiny-llama     # then: vt serve --model /tmp/tiny-llama

`--shape llama3-8b` writes Llama-3-8B's shape instead (32 layers, hidden 4096, 32 heads, 8 KV
heads, MLP 14336, rope_theta 500000, 8192 positions), bf16 random weights, 16 GB: what the
serving benchmarks run on without downloading the model (tools/serve_http_ab.py). Its
config's vocab_size is the real model's 128256, padded past the trained tokenizer's few
hundred tokens as real checkpoints pad theirs: the weights and the logits have the 8B's
size, and an id the tokenizer does not know decodes to no text. Its weights are drawn
tensor by tensor on the GPU when there is one (else the CPU) and written in safetensors
shards with their index, the names and shapes those vt.torch.hf loads. `--shape smollm2-135m`
writes SmolLM2-135M's shape the same way (30 layers, hidden 576, 9 heads, 3 KV heads, MLP
1536, vocab 49152, tied embeddings, 8192 positions; 0.3 GB): what `vt serve` start-up on the
sim is measured with (docs/serve.md).

Needs torch, transformers and tokenizers (python3 -m pip install ".[serve]": transformers brings tokenizers).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

BOS, EOS = "<s>", "</s>"
ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A decode step runs as one captured CUDA graph while the host prepares the next one.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9, \u00fcber sch\u00f6n, se\u00f1or.",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u7684\u53e5\u5b50\u3002",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: + - * / = < > ( ) [ ] { }.",
    "Emoji travel in four bytes: \U0001f680 \U0001f30d \u2728.",
]
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
             rope_theta=10000.0, tie_word_embeddings=False)
# SmolLM2-135M's shape: a real model's layers and vocabulary at a size the sim serves (what
# `vt serve` start-up is measured on without a GPU, docs/serve.md).
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    initializer_range=0.02, rope_theta=100000.0, tie_word_embeddings=True,
                    vocab_size=49152)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 initializer_range=0.02, rope_theta=500000.0, tie_word_embeddings=False,
                 vocab_size=128256)
SHAPES = {"tiny": MODEL, "smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA3_8B}
SHARD_BYTES = 4 << 30   # a safetensors file per ~4 GiB, as Hugging Face exports shard


def train_tokenizer(vocab_size: int = 400):
    """A transformers PreTrainedTokenizerFast: byte-level BPE trained on CORPUS, BOS added to
    every encoded text, the chat template set, no clean-up of spaces on decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, *(f"<|{r}|>" for r in ROLES)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(path, *, seed: int = 0, shape: str = "tiny", log=None) -> Path:
    """Write the checkpoint directory at `path` (created if missing); returns it. shape:
    "tiny" (transformers' own model, fp32), "smollm2-135m" or "llama3-8b" (bf16 weights drawn
    directly, write_random_weights). log: called with progress lines (the 8B shape takes a
    while)."""
    import torch
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    bos = tokenizer.convert_tokens_to_ids(BOS)
    dims = dict(SHAPES[shape])
    vocab = dims.pop("vocab_size", len(tokenizer))
    cfg = transformers.LlamaConfig(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos,
                                   pad_token_id=eos, **dims)
    generation = transformers.GenerationConfig(bos_token_id=bos, eos_token_id=[eos],
                                               pad_token_id=eos)
    if shape == "tiny":
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
        model.generation_config = generation
        model.save_pretrained(path)
    else:
        cfg.torch_dtype = "bfloat16"
        cfg.save_pretrained(path)
        generation.save_pretrained(path)
        write_random_weights(path, seed=seed, std=cfg.initializer_range, log=log)
    tokenizer.save_pretrained(path)
    return path


def write_random_weights(path: Path, *, seed: int, std: float, log=None) -> None:
    """Every tensor the config.json at `path` implies (vt.torch.hf.hf_shapes: the names and
    shapes the loader checks), bf16: matrices normal(0, std), norms 1. Each is drawn on the
    GPU when there is one (a second of work for 8B parameters, against minutes on the CPU),
    copied to the host and written into ~SHARD_BYTES safetensors files with
    model.safetensors.index.json, one shard in host memory at a time."""
    import json
    import time

    import torch
    from safetensors.torch import save_file

    from vt.torch.hf import hf_shapes, read_config

    log = log or (lambda msg: None)
    shapes = hf_shapes(read_config(path))
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    t0, total = time.perf_counter(), 0
    for i, (names, file) in enumerate(zip(shards, files)):
        tensors = {}
        for name in names:
            if len(shapes[name]) == 1:   # a norm's weight
                t = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                t = torch.randn(shapes[name], generator=gen, device=device,
                                dtype=torch.bfloat16).mul_(std).cpu()
            tensors[name] = t
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        log(f"tiny_checkpoint: wrote {file} ({total / 2**30:.1f} GiB, "
            f"{time.perf_counter() - t0:.0f} s, weights drawn on {device.type})")
        del tensors
    index = {"metadata": {"total_size": total},
             "weight_map": {name: file for names, file in zip(shards, files) for name in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES),
                        help="tiny (default); smollm2-135m: SmolLM2-135M's shape, bf16, 0.3 GB; "
                             "llama3-8b: Llama-3-8B's shape, bf16, 16 GB")
    args = parser.parse_args(argv)
    out = build(args.path, seed=args.seed, shape=args.shape,
                log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"{args.shape} Llama checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
