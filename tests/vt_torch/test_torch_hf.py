"""Hugging Face checkpoints through vt.torch.hf: tiny random-initialised transformers models
(fp32), saved with save_pretrained, loaded by vt, served by an Engine: greedy tokens equal
transformers' own generate(do_sample=False), prompt by prompt; and the loader's refusals."""
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")
transformers = pytest.importorskip("transformers", reason="the comparison needs transformers")

import numpy as np  # noqa: E402

from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.torch import TorchForwardModel, hf, torch_device  # noqa: E402

from _torch_util import GEO, generate, prompts, step_model  # noqa: E402

pytestmark = pytest.mark.torch_allocator

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
             max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=0)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0),
    "llama-bias-tied": lambda: transformers.LlamaConfig(**SMALL, attention_bias=True,
                                                        tie_word_embeddings=True),
    "qwen2-tied": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
}


def _save(tmp_path, make_config, device):
    torch.manual_seed(0)
    cfg = make_config()
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    return model.to(device)


def _hf_greedy(model, prompt, new, device):
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_equal_transformers_generate(backend, tmp_path, family):
    """A batch of prompts of different lengths served by vt (ring) == transformers' greedy."""
    device = torch_device(backend)
    reference = _save(tmp_path, CONFIGS[family], device)
    module = hf.load(tmp_path, GEO, dtype=torch.float32, device=device)
    ps = prompts(5, seed=7, vocab=SMALL["vocab_size"], max_len=9)
    new = 8
    expect = [_hf_greedy(reference, p, new, device) for p in ps]
    assert len({tuple(e) for e in expect}) > 1   # the prompts lead to different continuations
    got = generate(backend, step_model(backend, module), "ring", ps, new)
    assert got == expect


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "mistral", "model_type='mistral'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     "rope_parameters.rope_type='yarn'"),
    ("layer_types", ["sliding_attention", "full_attention"], "layer_types"),
])
def test_loader_refuses_an_unsupported_config_naming_the_field(field, value, match):
    """Each unsupported setting is a ValueError that names its config.json field."""
    cfg = transformers.Qwen2Config(**SMALL).to_dict()
    cfg[field] = value
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("(", r"\(")):
        hf.config_from_hf(cfg)


def test_loader_refuses_a_directory_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        hf.read_config(tmp_path)


LONG_GEO = KVGeometry(max_seqs=4, num_kv_blocks=4 * 20 + 1, block_size=16, max_context=320)
LONG = dict(SMALL, max_position_embeddings=512)
LONG_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**LONG, rope_theta=500000.0),
    "qwen2-tied": lambda: transformers.Qwen2Config(**LONG, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**LONG, head_dim=32),
}


@pytest.mark.parametrize("family", list(LONG_CONFIGS))
def test_flat_prefill_equals_transformers_generate_for_prompts_of_1_to_300_tokens(
        backend, tmp_path, family):
    """prefill="flat": prompts of 1 to 300 tokens, whole and in chunks of 48 that split them
    (mixed steps as later prompts join), greedy tokens == transformers' generate."""
    device = torch_device(backend)
    reference = _save(tmp_path, LONG_CONFIGS[family], device)
    module = hf.load(tmp_path, LONG_GEO, dtype=torch.float32, device=device)
    rng = np.random.default_rng(5)
    ps = [rng.integers(0, SMALL["vocab_size"], size=n).tolist() for n in (1, 300, 45, 170, 9, 2)]
    new = 6
    expect = [_hf_greedy(reference, p, new, device) for p in ps]
    model = TorchForwardModel(backend, module, vocab=module.cfg.vocab, geometry=LONG_GEO,
                              prefill="flat")
    for mpt in (None, 48):
        cfg = ExecutorConfig(mode="ring", serving_conc=3, capture_sizes=(1, 2, 4))
        with Engine(backend, model, cfg, max_prefill_tokens=mpt) as eng:
            got = [list(map(int, r.tokens)) for r in eng.generate(ps, max_new_tokens=new)]
            assert eng.stats()["mixed_steps"] > 0
        assert got == expect, f"max_prefill_tokens={mpt}"


def test_the_loader_holds_one_parameter_of_the_checkpoint_at_a_time(tmp_path, monkeypatch):
    """The files are read a parameter at a time into the module: while it loads, the host holds
    at most the three tensors of one fused parameter (q, k and v of one layer), never the
    checkpoint (which the ranks of a tensor-parallel engine could not each hold)."""
    import weakref

    reference = _save(tmp_path, CONFIGS["llama-bias-tied"], "cpu")
    alive, peak, reads = [], [0], [0]
    read = hf._Tensor.read

    def counted(self):
        t = read(self)
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(t)]
        peak[0], reads[0] = max(peak[0], len(alive)), reads[0] + 1
        return t
    monkeypatch.setattr(hf._Tensor, "read", counted)
    module = hf.load(tmp_path, GEO, dtype=torch.float32, device="cpu")
    assert reads[0] > 20 and peak[0] <= 3, (reads[0], peak[0])
    q = reference.model.layers[1].self_attn.q_proj.weight   # what went where
    assert torch.equal(module.layers[1].attn.qkv.weight[:q.shape[0]], q)
