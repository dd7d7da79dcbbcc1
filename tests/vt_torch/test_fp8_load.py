"""FP8 weights in vt.torch (vt.torch.fp8): checkpoints written here in each format vt reads
(compressed-tensors float8 per channel and per tensor, `fp8` with 128 x 128 blocks) and a
dense one quantized at load give, on the CPU reference path, the logits of the same decoder
with the dequantized weights in float32 (within 1e-5 of the largest logit: float32 summation
order); every quantization_config vt does not implement is refused in one line naming the
field. (How far FP8 logits are from the unquantized model's is measured, not asserted:
tools/fp8_quality.py.)"""
import json

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")
pytest.importorskip("safetensors", reason="the checkpoints are safetensors files")

from safetensors.torch import save_file  # noqa: E402

from tools.fp8_quality import position_logits  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.torch import fp8, hf  # noqa: E402
from vt.torch.llama import LlamaDecoder, quantize_weights_  # noqa: E402

GEO = KVGeometry(max_seqs=2, num_kv_blocks=8, block_size=4, max_context=16)
# q, k, v, gate and up rows multiples of 128: the block format's fused projections need it.
CONFIG = dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
              rms_norm_eps=1e-6, max_position_embeddings=16, tie_word_embeddings=False)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = [3, 17, 99, 42, 7, 64, 120, 5]

CT_GROUP = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "channel", "group_size": None, "block_structure": None}}


def compressed_tensors(strategy="channel", **changes):
    group = json.loads(json.dumps(CT_GROUP))
    group["weights"]["strategy"] = strategy
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None}
    qc.update(changes)
    return qc


BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}


def _dense_weights(family="llama"):
    """Random weights of CONFIG's shape; qwen3 adds its q/k norms, qwen2 its q/k/v biases
    (the tensors those families' FP8 checkpoints keep unquantized beside the codes)."""
    g = torch.Generator().manual_seed(0)
    h, inter, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
              "model.norm.weight": (h,)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (h, h)
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
        if family == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (CONFIG["head_dim"],)
            shapes[p + "self_attn.k_norm.weight"] = (CONFIG["head_dim"],)
        if family == "qwen2":
            for name in ("q_proj", "k_proj", "v_proj"):
                shapes[p + f"self_attn.{name}.bias"] = (h,)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = (1 if "norm" in name else 0) + 0.1 * torch.randn(shape, generator=g)
        else:   # rows of different magnitudes: a scale per channel matters
            rows = torch.rand(shape[0], 1, generator=g) * 4 + 0.25
            out[name] = torch.randn(shape, generator=g) * rows / shape[1] ** 0.5
    return out


def _write(path, tensors, qc=None, family="llama"):
    path.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG, model_type=family)
    if qc is not None:
        config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def _quantized(dense, scheme):
    """(the checkpoint's tensors in `scheme`, the same weights dequantized to float32)."""
    files, dequantized = {}, {}
    for name, w in dense.items():
        base = name.removesuffix(".weight")
        if not name.endswith(".weight") or base.rpartition(".")[2] not in PROJ:
            files[name] = dequantized[name] = w
            continue
        if scheme == "block":
            q = fp8.quantize_block(w)
            files[base + ".weight_scale_inv"] = q.scale
        elif scheme == "channel":
            q = fp8.quantize_per_channel(w)
            files[base + ".weight_scale"] = q.scale[:, None]
        else:   # one scale for the tensor
            q = fp8.quantize_per_tensor(w)
            files[base + ".weight_scale"] = q.scale[:1].clone()
        files[name] = q.data
        dequantized[name] = fp8.dequantize(q)
    return files, dequantized


def _cpu_logits(path):
    """The logits of the checkpoint at `path`, loaded in float32 on the CPU, over TOKENS."""
    return position_logits(hf.load(path, GEO, dtype=torch.float32, device="cpu"), TOKENS)


def _max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
def test_an_fp8_checkpoint_gives_the_dequantized_models_logits(tmp_path, scheme):
    """Each FP8 format vt reads: the reference path's logits within 1e-5 (of the largest) of
    the dense decoder holding the dequantized weights."""
    dense = _dense_weights()
    files, dequantized = _quantized(dense, scheme)
    qc = BLOCK_FP8 if scheme == "block" else compressed_tensors(scheme)
    _write(tmp_path / "fp8", files, qc)
    _write(tmp_path / "deq", dequantized)
    model = hf.load(tmp_path / "fp8", GEO, dtype=torch.float32, device="cpu")
    assert model.quantization == "fp8"
    proj = model.layers[0].attn.qkv
    assert proj.qweight.dtype == fp8.FP8 and proj.weight.per_block == (scheme == "block")
    got = position_logits(model, TOKENS)
    want = _cpu_logits(tmp_path / "deq")
    assert _max_rel(got, want) < 1e-5


@pytest.mark.parametrize("family, scheme", [("qwen3", "block"), ("qwen2", "channel")])
def test_qwen_fp8_checkpoints_keep_their_norms_and_biases_dense(tmp_path, family, scheme):
    """The published Qwen FP8 layouts: Qwen3's (128 x 128 blocks, q/k norms beside the codes)
    and Qwen2's (per channel, q/k/v biases beside them) give the logits of the dense decoder
    holding the dequantized weights, the norms and biases as they were."""
    dense = _dense_weights(family)
    files, dequantized = _quantized(dense, scheme)
    assert files["model.layers.0.self_attn.q_proj.weight"].dtype == fp8.FP8
    qc = BLOCK_FP8 if scheme == "block" else compressed_tensors(scheme)
    _write(tmp_path / "fp8", files, qc, family)
    _write(tmp_path / "deq", dequantized, family=family)
    model = hf.load(tmp_path / "fp8", GEO, dtype=torch.float32, device="cpu")
    assert model.quantization == "fp8" and model.cfg.qk_norm == (family == "qwen3")
    assert model.cfg.qkv_bias == (family == "qwen2")
    got = position_logits(model, TOKENS)
    want = _cpu_logits(tmp_path / "deq")
    assert _max_rel(got, want) < 1e-5
    # the norms and biases matter here: without them the logits move far beyond that
    plain = {k: v for k, v in dequantized.items() if "q_norm" not in k and "k_norm" not in k
             and not k.endswith(".bias")}
    _write(tmp_path / "plain", plain)
    other = _cpu_logits(tmp_path / "plain")
    assert _max_rel(other, want) > 1e-2


def test_a_dense_checkpoint_quantized_at_load_is_quantized_per_channel(tmp_path):
    """hf.load(quantization="fp8"): the projections FP8 with per-channel scales (the head,
    embedding and norms float32), logits those of the per-channel dequantized weights."""
    dense = _dense_weights()
    _write(tmp_path / "dense", dense)
    _, dequantized = _quantized(dense, "channel")
    _write(tmp_path / "deq", dequantized)
    model = hf.load(tmp_path / "dense", GEO, dtype=torch.float32, device="cpu",
                    quantization="fp8")
    assert model.layers[1].mlp.down.weight_scale.shape == (CONFIG["hidden_size"],)
    assert model.lm_head.weight.dtype == model.embed.weight.dtype == torch.float32
    assert model.layers[0].attn_norm.weight.dtype == torch.float32
    got = position_logits(model, TOKENS)
    want = _cpu_logits(tmp_path / "deq")
    assert _max_rel(got, want) < 1e-5


def test_the_codes_and_scales_do_not_depend_on_the_activation_dtype(tmp_path):
    """Quantized at load from the checkpoint's float32: a bf16 decoder holds the same FP8
    codes and float32 scales as a float32 one (only the activations' dtype differs)."""
    _write(tmp_path / "dense", _dense_weights())
    f32 = hf.load(tmp_path / "dense", GEO, dtype=torch.float32, device="cpu", quantization="fp8")
    bf16 = hf.load(tmp_path / "dense", GEO, dtype=torch.bfloat16, device="cpu",
                   quantization="fp8")
    a, b = f32.layers[1].mlp.gate_up, bf16.layers[1].mlp.gate_up
    assert b.weight_scale.dtype == torch.float32 and torch.equal(a.weight_scale, b.weight_scale)
    assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
    assert position_logits(bf16, TOKENS[:2]).isfinite().all()


def test_the_reference_linear_rounds_once_to_the_activation_dtype():
    """fp8.linear on the CPU: float32 product of the dequantized weight, one rounding to bf16."""
    g = torch.Generator().manual_seed(1)
    w = fp8.quantize_per_channel(torch.randn(48, 64, generator=g))
    x = torch.randn(3, 64, generator=g).bfloat16()
    want = (x.float() @ fp8.dequantize(w).T).bfloat16()
    assert torch.equal(fp8.linear(x, w), want)
    blocks = fp8.quantize_block(torch.randn(200, 300, generator=g))
    xb = torch.randn(2, 300, generator=g)
    dense = fp8.dequantize(blocks)
    assert dense.shape == (200, 300)
    assert torch.allclose(fp8.linear(xb, blocks), xb @ dense.T, rtol=0, atol=1e-5)


def test_dense_weights_pass_through_to_the_dense_linear():
    """The head stays in its dtype: a plain tensor weight goes to the dense linear."""
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(fp8.linear(x, w, dense=lambda *a: torch.zeros(1)), torch.zeros(1))


REFUSED = [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "awq"}, "quant_method='awq'"),
    (dict(BLOCK_FP8, weight_block_size=[64, 64]), "weight_block_size=[64, 64]"),
    (dict(BLOCK_FP8, weight_block_size=None), "weight_block_size=None"),
    (dict(BLOCK_FP8, activation_scheme="static"), "activation_scheme='static'"),
    (dict(BLOCK_FP8, fmt="e5m2"), "fmt='e5m2'"),
    (dict(BLOCK_FP8, ignored_layers=["model.layers.0.mlp.down_proj"]), "ignored_layers="),
    (compressed_tensors(format="pack-quantized"), "format='pack-quantized'"),
    (compressed_tensors(format="int-quantized"), "format='int-quantized'"),
    (compressed_tensors(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme="),
    (compressed_tensors(ignore=["re:.*down_proj"]), "ignore="),
    (compressed_tensors(sparsity_config={"format": "sparse-24-bitmask",
                                         "sparsity_structure": "2:4"}), "sparsity_config="),
    (compressed_tensors(transform_config={"config_groups": {}}), "transform_config="),
    (compressed_tensors("group"), "strategy='group'"),
    (compressed_tensors("block"), "strategy='block'"),
    (compressed_tensors("tensor_group"), "strategy='tensor_group'"),
    ({**compressed_tensors(), "config_groups": {"group_0": dict(
        CT_GROUP, weights=dict(CT_GROUP["weights"], type="int"))}}, "weights.type='int'"),
    ({**compressed_tensors(), "config_groups": {"group_0": dict(
        CT_GROUP, weights=dict(CT_GROUP["weights"], num_bits=4))}}, "weights.num_bits=4"),
    ({**compressed_tensors(), "config_groups": {"group_0": dict(
        CT_GROUP, input_activations={"num_bits": 8, "type": "int"})}}, "input_activations="),
    ({**compressed_tensors(), "config_groups": {"a": CT_GROUP, "b": CT_GROUP}}, "config_groups="),
    ("fp8", "quantization_config='fp8'"),
]


@pytest.mark.parametrize("qc, named", REFUSED, ids=[r[1] for r in REFUSED])
def test_unsupported_quantization_configs_are_refused_in_one_line(tmp_path, qc, named):
    """Refused by name before any weight is read, never loaded as bf16 garbage."""
    _write(tmp_path, {"unread": torch.zeros(1)}, qc)
    with pytest.raises(ValueError, match="is not supported") as err:
        hf.load(tmp_path, GEO, dtype=torch.float32, device="cpu")
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_dense_format_sparsity_config_loads_as_plain_fp8(tmp_path):
    """2:4-sparse checkpoints stored in the dense format hold ordinary codes and scales."""
    files, dequantized = _quantized(_dense_weights(), "channel")
    qc = compressed_tensors(sparsity_config={"format": "dense", "sparsity_structure": "2:4"})
    _write(tmp_path / "fp8", files, qc)
    _write(tmp_path / "deq", dequantized)
    got = _cpu_logits(tmp_path / "fp8")
    want = _cpu_logits(tmp_path / "deq")
    assert _max_rel(got, want) < 1e-5


def test_fp8_codes_without_a_quantization_config_are_refused(tmp_path):
    """A projection stored as F8_E4M3 in a checkpoint that announces no quantization."""
    files, _ = _quantized(_dense_weights(), "channel")
    files = {k: v for k, v in files.items() if not k.endswith("weight_scale")}
    _write(tmp_path, files)
    with pytest.raises(ValueError, match=r"q_proj.weight' is F8_E4M3; expected F32 or F16"):
        hf.load(tmp_path, GEO, dtype=torch.float32, device="cpu")


def test_a_missing_or_misshapen_scale_is_refused(tmp_path):
    """The scales are checked like the weights: by name and shape, before anything is read."""
    files, _ = _quantized(_dense_weights(), "channel")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    _write(tmp_path / "missing", {k: v for k, v in files.items() if k != name},
           compressed_tensors())
    with pytest.raises(ValueError, match="down_proj.weight_scale' is missing"):
        hf.load(tmp_path / "missing", GEO, dtype=torch.float32, device="cpu")
    _write(tmp_path / "shape", dict(files, **{name: files[name][:5]}), compressed_tensors())
    with pytest.raises(ValueError, match=r"down_proj.weight_scale' has shape \[5, 1\]"):
        hf.load(tmp_path / "shape", GEO, dtype=torch.float32, device="cpu")


def test_block_scales_need_fused_rows_in_whole_blocks(tmp_path):
    """The `fp8` format with q rows not a multiple of 128: refused naming the count."""
    _write(tmp_path, {"unread": torch.zeros(1)}, BLOCK_FP8)
    cfg = dict(CONFIG, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, quantization_config=BLOCK_FP8)))
    with pytest.raises(ValueError, match="kv_heads \\* head_dim=64 is not a multiple of 128"):
        hf.load(tmp_path, GEO, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kwargs, named", [
    (dict(quantization="fp8"), "quantization='fp8'"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    (dict(quantization="fp8", kv_cache_dtype="fp8"), "quantization='fp8' and kv_cache_dtype"),
], ids=["weights", "kv-cache", "both"])
def test_fp8_on_a_gpu_older_than_ada_is_refused_before_anything_is_allocated(monkeypatch, kwargs,
                                                                             named):
    """An A100 (8.0) has no e4m3 conversions or FP8 tensor cores: one line naming the GPU and
    the minimum, raised before the decoder touches the device (so it runs on a CPU machine)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    cfg = hf.config_from_hf(CONFIG)
    with pytest.raises(ValueError) as err:
        LlamaDecoder(cfg, GEO, dtype=torch.bfloat16, device="cuda", **kwargs)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).endswith("compute capability 8.9 or newer (e4m3 conversions and FP8 "
                                   "tensor cores); NVIDIA A100 is 8.0")


def test_the_fp8_device_check_passes_ada_hopper_and_the_cpu(monkeypatch):
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        fp8.check_device("x", "cuda")
    fp8.check_device("x", "cpu")


def test_quantization_arguments_are_checked():
    """LlamaDecoder and hf.load name a quantization they do not implement."""
    from vt.torch.hfconfig import config_from_hf
    cfg = config_from_hf(CONFIG)
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="batch_invariant=True is not implemented"):
        LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu", quantization="fp8",
                     batch_invariant=True)
    with pytest.raises(ValueError, match="fp8_prompt_linear='cublas'"):
        LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu", quantization="fp8",
                     fp8_prompt_linear="cublas")


@pytest.mark.parametrize("w8a8_from", [1, "never"], ids=["w8a8", "weight-only"])
def test_an_fp8_decoder_serves_captured_steps_with_its_eager_tokens(sim_backend, monkeypatch,
                                                                     w8a8_from):
    """On the sim, vt's captured decode steps of an FP8 decoder (ring mode, batches of 1 to 4)
    give the greedy tokens of the same module called eagerly, position by position, with the
    activations quantized on every step (W8A8) or on none. (By default a step's row count
    picks, fp8.W8A8_MIN_ROWS, so an eager prompt of a few tokens and the engine's prompt step
    of several prompts at once may differ; each row's numbers depend on that row alone either
    way.)"""
    from _torch_util import TINY, eager_greedy, generate, prompts, step_model, tiny_llama
    from vt.torch import fp8
    monkeypatch.setattr(fp8, "W8A8_MIN_ROWS",
                        w8a8_from if w8a8_from != "never" else fp8.GEMV_MAX_ROWS + 1)
    dense = tiny_llama(sim_backend)
    prompt_linear = "dequantize" if w8a8_from == "never" else "scaled_mm"
    model = LlamaDecoder(TINY, dense.geometry, dtype=torch.float32, device="cpu",
                         quantization="fp8", fp8_prompt_linear=prompt_linear)
    quantize_weights_(model, dense.state_dict())
    ps = prompts(4, seed=3)
    expect = [eager_greedy(model, p, 6) for p in ps]
    assert generate(sim_backend, step_model(sim_backend, model), "ring", ps, 6) == expect
