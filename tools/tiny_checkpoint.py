"""Build a tiny Llama checkpoint directory with a real tokenizer, offline: what `vt serve` and
`vt generate` are tried and tested on without downloading anything.

The directory is what a Hugging Face export holds: config.json and model.safetensors (random
weights, seeded, fp32), generation_config.json (its eos_token_id), and a byte-level BPE
tokenizer trained here with the `tokenizers` library on a few sentences (ASCII and
multi-byte text, so tokens that split a UTF-8 character exist), saved by transformers'
PreTrainedTokenizerFast with a chat template. Every file is written by save_pretrained.

  python3 tools/tiny_checkpoint.py /tmp/tiny-llama     # then: vt serve --model /tmp/tiny-llama

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


def build(path, *, seed: int = 0) -> Path:
    """Write the checkpoint directory at `path` (created if missing); returns it."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    bos = tokenizer.convert_tokens_to_ids(BOS)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos,
                                   pad_token_id=eos, **MODEL)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = transformers.GenerationConfig(bos_token_id=bos, eos_token_id=[eos],
                                                            pad_token_id=eos)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    out = build(args.path, seed=args.seed)
    print(f"tiny Llama checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
