"""Config validation, presets, and safetensors save/load with shape checks."""
import numpy as np
import pytest

from vt.bundled import PRESETS, ModelConfig, check_weights, init_weights, load_weights, save_weights


def test_presets_are_valid_and_their_patterns_repeat():
    """Every preset builds; layer kinds repeat the pattern."""
    for name, cfg in PRESETS.items():
        assert cfg.kinds == (cfg.layer_pattern * cfg.layers)[: cfg.layers], name
    assert PRESETS["bench-dense"].hidden >= 4096 and not PRESETS["bench-dense"].moe
    assert PRESETS["bench-moe"].moe and PRESETS["tiny-moe"].moe


@pytest.mark.parametrize("change,match", [
    (dict(layer_pattern="GXA"), "layer_pattern"),
    (dict(heads=6, kv_heads=4), "multiple of"),
    (dict(head_dim=48), "head_dim=48"),
    (dict(dtype="float8"), "dtype"),
    (dict(hidden=0), "hidden"),
    (dict(top_k=2), "dense model"),
    (dict(experts=4, top_k=5, expert_ffn=8, ffn=0), "top_k"),
])
def test_bad_config_raises_naming_the_field(change, match):
    """A bad field raises ValueError that names it."""
    with pytest.raises(ValueError, match=match):
        PRESETS["tiny-dense"].replace(**change)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_save_load_roundtrip_is_exact(tmp_path, dtype):
    """Weights saved with HF names load back bit-identical, for fp16 and bf16 storage."""
    cfg = PRESETS["tiny-moe"].replace(dtype=dtype)
    w = init_weights(cfg, seed=3)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in w
    assert "model.layers.3.self_attn.q_proj.weight" in w and "model.layers.1.mlp.experts.7.down_proj.weight" in w
    save_weights(w, str(tmp_path / "w.safetensors"))
    w2 = load_weights(str(tmp_path / "w.safetensors"), cfg)
    assert w.keys() == w2.keys()
    for k in w:
        assert w[k].dtype == w2[k].dtype and w[k].tobytes() == w2[k].tobytes(), k


def test_init_is_seeded():
    a, b, c = (init_weights(PRESETS["tiny-dense"], seed=s) for s in (1, 1, 2))
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert any(a[k].tobytes() != c[k].tobytes() for k in a)


def test_mismatched_checkpoint_names_every_problem(tmp_path):
    """Load refuses a checkpoint of other shapes, naming the tensors and the shapes."""
    cfg = PRESETS["tiny-dense"]
    w = init_weights(cfg)
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:10]
    del w["lm_head.weight"]
    w["extra.weight"] = np.zeros(3, np.float16)
    save_weights(w, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj.weight: shape \(10, 128\), expected \(256, 128\)") as e:
        load_weights(str(tmp_path / "bad.safetensors"), cfg)
    assert "missing lm_head.weight" in str(e.value) and "unexpected extra.weight" in str(e.value)
    with pytest.raises(ValueError, match="dtype float32"):
        check_weights(cfg, {**init_weights(cfg), "model.norm.weight": np.ones(128, np.float32)})


def test_activations_stay_order_one_through_the_bench_depth():
    """Random init keeps the residual stream O(1) over many layers (float64 model)."""
    from vt.bundled.reference import ReferenceModel
    cfg = PRESETS["tiny-moe"].replace(layers=16)
    ref = ReferenceModel(cfg, init_weights(cfg))
    _, logits = ref.prefill([1, 2, 3, 4])
    assert 0.1 < np.abs(logits).std() < 10
