"""Checkpoints, geometry and torch forwards: every way a model could be served wrong without an
error is refused at construction or capture, or made to match transformers.

| defect class                                              | test                                                       |
|-----------------------------------------------------------|------------------------------------------------------------|
| module built for one KV geometry, served under another    | test_a_geometry_other_than_the_modules_is_refused_naming_both |
|   (or a vocab other than the module's)                    | test_a_vocab_other_than_the_modules_is_refused_at_construction |
| rope_scaling ignored when rope_parameters is also set     | test_rope_frequencies_equal_transformers (+ _greedy_tokens_) |
| a rope type or field vt does not implement                | test_an_unimplemented_rope_type_or_field_is_refused        |
| tie_word_embeddings with an lm_head.weight in the file    | test_tied_config_with_a_file_lm_head_serves_transformers_tokens |
| a forward that returns its logits / rebinds logits_out    | test_a_forward_that_does_not_write_logits_out_is_refused   |
| corrupt safetensors, missing tensor or bias, bad shape    | test_a_broken_checkpoint_is_one_line_naming_file_and_tensor |
| incomplete llama3 block, missing head counts, bad paths,  | test_a_broken_config_is_one_line_naming_file_and_field     |
|   a null or wrongly typed number or flag                  |                                                            |
| hf.load defaulting to cuda on a CPU machine               | test_load_defaults_to_the_backends_device                  |
| sim accepts forwards a CUDA capture refuses               | test_the_sim_capture_refuses_what_cuda_refuses             |
| a Python step counter advancing on the sim                | test_a_python_counter_is_frozen_at_capture_on_the_sim      |
"""
import json
import re

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
transformers = pytest.importorskip("transformers", reason="the comparisons need transformers")

from vt.backend import CaptureError, available_backends  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.torch import TorchCaptureError, TorchForwardModel, hf, torch_device  # noqa: E402

from vt.torch.llama import rope_table  # noqa: E402

from vt_torch._torch_util import GEO, generate, prompts, tiny_llama  # noqa: E402

pytestmark = pytest.mark.torch_allocator

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
             max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=0,
             hidden_act="silu")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _save(tmp_path, config_edit=None, **cfg):
    """A tiny random transformers Llama saved to tmp_path, config.json then edited."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**dict(SMALL, **cfg)), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    if config_edit is not None:
        path = tmp_path / "config.json"
        data = json.loads(path.read_text())
        config_edit(data)
        path.write_text(json.dumps(data))
    return tmp_path


def _hf_greedy(path, ps, new):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in ps:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def _vt_greedy(sim_backend, path, ps, new):
    module = hf.load(path, GEO, dtype=torch.float32, device="cpu")
    return generate(sim_backend, TorchForwardModel(sim_backend, module), "ring", ps, new)


# -- geometry and vocab -----------------------------------------------------------------------

def test_a_geometry_other_than_the_modules_is_refused_naming_both(sim_backend):
    """A module built for block size 4 served under block size 8: refused, both named; left
    out, the module's geometry is used."""
    module = tiny_llama(sim_backend)
    other = KVGeometry(max_seqs=8, num_kv_blocks=48, block_size=8, max_context=32)
    with pytest.raises(ValueError, match=r"block_size=8.*differs.*block_size=4"):
        TorchForwardModel(sim_backend, module, geometry=other)
    assert TorchForwardModel(sim_backend, module).geometry == module.geometry


def test_a_vocab_other_than_the_modules_is_refused_at_construction(sim_backend):
    module = tiny_llama(sim_backend)
    with pytest.raises(ValueError, match=r"vocab=64 differs from the module's vocab=96"):
        TorchForwardModel(sim_backend, module, vocab=64)
    with pytest.raises(TypeError, match="geometry is required"):
        TorchForwardModel(sim_backend, lambda inputs, out: None, vocab=8)


# -- RoPE as transformers reads it ------------------------------------------------------------

ROPE_CASES = {
    "both fields: rope_scaling wins": dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                           rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "linear, old 'type' key": dict(rope_theta=3e5, rope_scaling={"type": "linear", "factor": 2.0}),
    "top-level theta under params": dict(rope_theta=123.0,
                                         rope_parameters={"rope_type": "linear", "factor": 2.0}),
    "block theta wins": dict(rope_theta=123.0, rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 77.0}),
    "llama3, original max from max_position_embeddings": dict(rope_scaling=LLAMA3),
    "llama3, top-level original max wins": dict(
        original_max_position_embeddings=16,
        rope_scaling=dict(LLAMA3, original_max_position_embeddings=32)),
    "nothing: default theta": dict(),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_equal_transformers(case):
    """vt's cos/sin tables equal transformers' rotary embedding of the same config.json."""
    data = dict(SMALL, model_type="llama", **ROPE_CASES[case])
    ref_cfg = transformers.LlamaConfig.from_dict(json.loads(json.dumps(data)))
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(ref_cfg)
    positions = torch.arange(48)[None]
    cos_ref, sin_ref = rotary(torch.zeros(1, 48, 16), positions)
    cos, sin = rope_table(hf.config_from_hf(data), 48)
    assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0]), case


def test_greedy_tokens_follow_rope_scaling_when_both_fields_are_set(sim_backend, tmp_path):
    """config.json with rope_parameters (default) and rope_scaling (linear 4): vt's greedy
    tokens equal transformers', and differ from the default RoPE's (the case matters)."""
    def both(cfg):
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    path = _save(tmp_path, both)
    ps = prompts(4, seed=3, vocab=128, max_len=9)
    expect = _hf_greedy(path, ps, 8)
    assert _vt_greedy(sim_backend, path, ps, 8) == expect
    default = tmp_path / "default"
    _save(default)
    assert _hf_greedy(default, ps, 8) != expect


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
     r"rope_parameters.rope_type='yarn' is not supported"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_parameters.rope_type='dynamic'"),
    ({"rope_type": "linear", "factor": 2.0, "attention_factor": 1.5},
     r"rope_parameters.attention_factor is not supported for rope_type='linear'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"rope_type": "linear"}, r"rope_parameters.factor is missing"),
])
def test_an_unimplemented_rope_type_or_field_is_refused(rope, match):
    with pytest.raises(ValueError, match=r"config.json: " + match):
        hf.config_from_hf(dict(SMALL, model_type="llama", rope_parameters=rope))


# -- tied embeddings --------------------------------------------------------------------------

def test_tied_config_with_a_file_lm_head_serves_transformers_tokens(sim_backend, tmp_path):
    """tie_word_embeddings true, the file holding an lm_head that differs from the embeddings:
    transformers uses the file's head, so does vt (tokens equal), not the embeddings."""
    path = _save(tmp_path, lambda cfg: cfg.update(tie_word_embeddings=True))
    module = hf.load(path, GEO, dtype=torch.float32, device="cpu")
    assert module.lm_head is not None
    assert not torch.equal(module.lm_head.weight, module.embed.weight)
    ps = prompts(4, seed=5, vocab=128, max_len=7)
    assert _vt_greedy(sim_backend, path, ps, 6) == _hf_greedy(path, ps, 6)


# -- a forward that does not write logits_out -------------------------------------------------

def _returns(inputs, logits_out):
    return torch.zeros_like(logits_out)


def _rebinds(inputs, logits_out):
    logits_out = torch.zeros(logits_out.shape)   # noqa: F841 (the defect under test)


@pytest.mark.parametrize("forward,match", [
    (_returns, r"returned a Tensor of shape \[\d+, 16\].*write the logits into logits_out"),
    (_rebinds, r"left logits_out unwritten.*write the logits into logits_out"),
])
def test_a_forward_that_does_not_write_logits_out_is_refused(backend, forward, match):
    """Refused while the engine warms up, before any request is served."""
    geo = KVGeometry(max_seqs=4, num_kv_blocks=8, block_size=4, max_context=16)
    model = TorchForwardModel(backend, forward, vocab=16, geometry=geo)
    with pytest.raises(Exception) as info:
        Engine(backend, model, ExecutorConfig(mode="ring", serving_conc=2, capture_sizes=(2,)))
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__
    assert any(re.search(match, m) for m in chain), chain


# -- broken checkpoints -----------------------------------------------------------------------

def _drop(name):
    def edit(path):
        from safetensors.torch import load_file, save_file
        f = path / "model.safetensors"
        tensors = load_file(str(f))
        del tensors[name]
        save_file(tensors, str(f))
    return edit


def _reshape(name):
    def edit(path):
        from safetensors.torch import load_file, save_file
        f = path / "model.safetensors"
        tensors = load_file(str(f))
        tensors[name] = tensors[name][:-1].contiguous()
        save_file(tensors, str(f))
    return edit


def _corrupt(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])


@pytest.mark.parametrize("edit,cfg,match", [
    (_corrupt, {}, r"model.safetensors: not a readable safetensors file \(SafetensorError"),
    (_drop("model.layers.1.mlp.up_proj.weight"), {},
     r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    (_drop("model.layers.0.self_attn.k_proj.bias"), {"attention_bias": True},
     r"tensor 'model.layers.0.self_attn.k_proj.bias' is missing.*biases"),
    (_drop("lm_head.weight"), {}, r"'lm_head.weight' is missing.*tie_word_embeddings is false"),
    (_reshape("model.layers.0.self_attn.o_proj.weight"), {},
     r"model.safetensors: tensor 'model.layers.0.self_attn.o_proj.weight' has shape \[63, 64\]; "
     r"config.json implies \[64, 64\]"),
])
def test_a_broken_checkpoint_is_one_line_naming_file_and_tensor(tmp_path, edit, cfg, match):
    path = _save(tmp_path, **cfg)
    edit(path)
    with pytest.raises(ValueError, match=match) as info:
        hf.load(path, GEO, dtype=torch.float32, device="cpu")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                         "high_freq_factor": 4.0}),
     r"config.json: rope_parameters.low_freq_factor is missing"),
    (lambda c: c.pop("num_attention_heads"), r"config.json: num_attention_heads is missing"),
    (lambda c: c.update(num_key_value_heads="2"), r"config.json: num_key_value_heads must be an integer in \[1, 2147483647\], got '2'"),
    (lambda c: c.update(num_key_value_heads=3), r"config.json: LlamaConfig: heads=4 must be a "
                                                r"multiple of kv_heads=3"),
    (lambda c: c.update(rms_norm_eps=None), r"config.json: rms_norm_eps=None must be a positive"),
    (lambda c: c.update(rms_norm_eps="1e-6"), r"config.json: rms_norm_eps='1e-6' must be a positive"),
    (lambda c: (c.pop("rope_parameters"), c.update(rope_theta=None)),
     r"config.json: rope_theta=None must be a positive number"),
    (lambda c: c.update(tie_word_embeddings="false"),
     r"config.json: tie_word_embeddings='false' must be true or false"),
    (lambda c: c.update(attention_bias=1), r"config.json: attention_bias=1 must be true or false"),
    (lambda c: c.update(layer_types=3), r"config.json: layer_types=3 must be a list"),
    (lambda c: c.update(pretraining_tp=True), r"config.json: pretraining_tp=True is not supported"),
])
def test_a_broken_config_is_one_line_naming_file_and_field(tmp_path, edit, match):
    path = _save(tmp_path, edit)
    with pytest.raises(ValueError, match=match) as info:
        hf.load(path, GEO, dtype=torch.float32, device="cpu")
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_a_missing_path_or_hub_id_is_named_as_such(tmp_path):
    for where in (tmp_path / "nowhere", "meta-llama/Llama-3.2-1B"):
        with pytest.raises(ValueError, match=r"does not exist .*does not download hub ids"):
            hf.load(where, GEO)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        hf.read_config(tmp_path / "file")


def test_load_defaults_to_the_backends_device(tmp_path):
    """No device argument: the device of get_backend()'s backend (cpu without a GPU)."""
    module = hf.load(_save(tmp_path), GEO, dtype=torch.float32)
    expect = "cuda" if "cuda" in available_backends() else "cpu"
    assert module.embed.weight.device.type == expect


# -- the sim's capture of a torch forward -----------------------------------------------------

REFUSED = {
    "torch.Tensor.item": lambda i, out: out.fill_(i.seq_lens.max().item()),
    "torch.tensor": lambda i, out: out.copy_(torch.tensor([1.0]).expand_as(out)),
    "torch.Tensor.cpu": lambda i, out: out.copy_(i.positions.cpu()[:, None].float()),
    "torch.Tensor.nonzero": lambda i, out: out.fill_(i.positions.nonzero().shape[0]),
    "torch.randn": lambda i, out: out.copy_(torch.randn(out.shape)),
    "torch.Tensor.__getitem__": lambda i, out: out.copy_(
        i.positions[i.positions > 0].float().sum().expand_as(out)),
}


@pytest.mark.parametrize("call", list(REFUSED))
def test_the_sim_capture_refuses_what_cuda_refuses(sim_backend, call):
    """Each call runs eagerly, and fails the capture with CaptureError caused by a
    TorchCaptureError naming it, as on cuda; a new engine on the same backend then serves."""
    geo = KVGeometry(max_seqs=4, num_kv_blocks=8, block_size=4, max_context=16)
    model = TorchForwardModel(sim_backend, REFUSED[call], vocab=16, geometry=geo)
    with pytest.raises(CaptureError) as info:
        Engine(sim_backend, model, ExecutorConfig(mode="ring", serving_conc=2,
                                                           capture_sizes=(2,)))
    cause = info.value.__cause__
    assert isinstance(cause, TorchCaptureError), repr(cause)
    assert call in str(cause) and call in str(info.value)
    assert "\n" not in str(cause)
    module = tiny_llama(sim_backend)
    assert len(generate(sim_backend, TorchForwardModel(sim_backend, module), "ring",
                        prompts(2, seed=1), 3)[0]) == 3


def test_a_python_counter_is_frozen_at_capture_on_the_sim(sim_backend):
    """A forward whose logits follow a Python counter: graph steps all give the token of the
    counter's captured value (the Python does not run at replay), as a CUDA graph does."""
    vocab = 64
    state = {"calls": 0}
    dev = torch_device(sim_backend)
    eye = torch.eye(vocab, device=dev)

    def forward(inputs, logits_out):
        state["calls"] += 1
        logits_out.copy_(eye[state["calls"] % vocab].expand_as(logits_out))

    geo = KVGeometry(max_seqs=2, num_kv_blocks=16, block_size=4, max_context=32)
    model = TorchForwardModel(sim_backend, forward, vocab=vocab, geometry=geo)
    cfg = ExecutorConfig(mode="drain", serving_conc=1, capture_sizes=(1,))
    with Engine(sim_backend, model, cfg) as eng:
        built = state["calls"]
        res = eng.generate([[1]], max_new_tokens=12)[0]
        graph_steps = eng.stats()["graph_steps"]
    assert graph_steps >= 10
    tokens = list(map(int, res.tokens))
    frozen = tokens[-1]
    assert 0 < frozen <= built   # a value the counter had while the engine was built
    assert tokens[-graph_steps:] == [frozen] * graph_steps
    assert state["calls"] - built == len(tokens) - graph_steps   # the eager steps only
