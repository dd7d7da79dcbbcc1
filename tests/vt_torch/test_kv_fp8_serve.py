"""The FP8 KV cache through vt serve and vt bench: load_checkpoint(kv_cache_dtype="fp8") and
hf.load serve a decoder with an e4m3 cache, the KV cache is sized at one byte an element, the
weights of an FP8 model counted at their FP8 bytes where the cache is sized from GPU memory,
the bench flags run on the sim and count the FP8 cache's bytes in the floor, and the
refusals name the value in one line."""
import json

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")
pytest.importorskip("transformers", reason="the tiny checkpoint's tokenizer needs transformers")

from _torch_util import tiny_bench  # noqa: E402
from tools import tiny_checkpoint  # noqa: E402
from vt.cli.main import main as vt_main  # noqa: E402
from vt.serve import kv_cache  # noqa: E402
from vt.serve.model_source import (checkpoint_kv_cache, checkpoint_weight_bytes,  # noqa: E402
                                   load_checkpoint)
from vt.torch.llama import LlamaConfig  # noqa: E402

pytestmark = pytest.mark.torch_allocator


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint.build(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_load_checkpoint_serves_an_fp8_kv_cache(sim_backend, checkpoint, quantization):
    loaded = []
    served = load_checkpoint(sim_backend, checkpoint, max_seqs=2, max_context=64,
                             kv_cache_dtype="fp8", quantization=quantization,
                             wrap_forward=lambda m: loaded.append(m) or m)
    module, = loaded
    assert module.quantization == quantization
    assert module.kv_cache_dtype == "fp8" and module.k_cache.dtype == torch.float8_e4m3fn
    assert module.layers[0].attn.v_scale.item() == 1.0
    assert served.geometry.num_kv_blocks == module.k_cache.shape[1] // 16


def test_the_kv_cache_is_sized_at_one_byte_an_element(sim_backend):
    """The sim's budget over a byte a K or V element holds twice a float16 cache's blocks
    (max_seqs large enough that the budget, not the rows, bounds the count)."""
    cfg = LlamaConfig(vocab=64, hidden=512, intermediate=64, layers=8, heads=8, kv_heads=8,
                      head_dim=64)
    args = dict(max_seqs=4096, max_context=4096, block_size=16, kv_blocks=None,
                tensor_parallel=1, utilization=0.9)
    fp16 = checkpoint_kv_cache(sim_backend, cfg, torch.float16, **args)
    fp8 = checkpoint_kv_cache(sim_backend, cfg, torch.float16, kv_cache_dtype="fp8", **args)
    assert fp8.bytes_per_block == 2 * 8 * 8 * 64 * 16 == fp16.bytes_per_block // 2
    assert fp8.num_kv_blocks == 2 * fp16.num_kv_blocks
    assert kv_cache.kv_element_bytes(2, "auto") == 2 and kv_cache.kv_element_bytes(4, "fp8") == 1


def test_fp8_weights_are_counted_at_their_bytes():
    """By hand: the projections one byte a weight and four a scale per output row; the
    embedding, head and norms at the dtype's bytes; a tensor-parallel rank's share."""
    cfg = LlamaConfig(vocab=100, hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1,
                      head_dim=16)
    proj = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 2 * 64 * 32 + 32 * 64   # q k v o gate up down
    rows = 32 + 16 + 16 + 32 + 64 + 64 + 32
    norms = 2 * 2 * 32 + 32
    embed = head = 100 * 32
    assert checkpoint_weight_bytes(cfg, 2) == 2 * (embed + head + norms + 2 * proj)
    assert checkpoint_weight_bytes(cfg, 2, quantization="fp8") == (
        2 * embed + 2 * head + 2 * norms + 2 * (proj + 4 * rows))
    assert checkpoint_weight_bytes(cfg, 2, 2) == 2 * embed + 2 * (head + norms + 2 * proj) // 2


def test_the_refusals_name_the_value_in_one_line(sim_backend, checkpoint, tmp_path, capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' runs in one process"):
        load_checkpoint(sim_backend, checkpoint, max_seqs=2, tensor_parallel=2,
                        kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' must be one of"):
        load_checkpoint(sim_backend, checkpoint, max_seqs=2, kv_cache_dtype="int8")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    scheme = tmp_path / "kv-scheme"
    scheme.mkdir()
    for f in checkpoint.iterdir():
        (scheme / f.name).symlink_to(f)
    (scheme / "config.json").unlink()
    (scheme / "config.json").write_text(json.dumps(config))
    from vt.step import KVGeometry
    from vt.torch import hf
    geo = KVGeometry(max_seqs=1, num_kv_blocks=5, block_size=16, max_context=64)
    with pytest.raises(ValueError, match="has a kv_cache_scheme") as e:
        hf.load(scheme, geo, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8")
    assert "\n" not in str(e.value)
    assert vt_main(["serve", "--preset", "tiny", "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype needs --model" in capsys.readouterr().err


def test_the_decode_bench_counts_the_fp8_cache_in_its_floor(capsys, tmp_path):
    """torch-decode --kv-cache-dtype fp8 on the sim: the table says so; the JSON's KV bytes a
    token are a byte an element, the dense floor's the dtype's."""
    printed, r = tiny_bench(capsys, tmp_path, "torch-decode", "--rows", "2", "--live", "8",
                            "--max-context", "32", "--steps", "2", "--repeats", "1", "--hf-rows",
                            "--kv-cache-dtype", "fp8")
    assert "(fp8 cache)" in printed
    assert r["kv_cache_dtype"] == "fp8"
    assert r["dense_kv_bytes_per_token"] == 4 * r["kv_bytes_per_token"]   # float32 on the sim
    assert all(c["tpot_s"] > 0 for c in r["cells"])
    from vt.bench.torch_decode import floor_s
    r = dict(floor_Bps=2e12, weight_bytes=8e9, dense_weight_bytes=16e9, kv_bytes_per_token=65536,
             dense_kv_bytes_per_token=131072, embed_row_bytes=8192)
    assert floor_s(r, 32, 2048) == pytest.approx((8e9 + 32 * (8192 + 2048 * 65536)) / 2e12)
    assert floor_s(r, 32, 2048, dense=True) == pytest.approx(
        (16e9 + 32 * (8192 + 2048 * 131072)) / 2e12)


def test_the_ttft_bench_runs_an_fp8_cache_on_the_sim(capsys, tmp_path):
    printed, result = tiny_bench(capsys, tmp_path, "torch-ttft", "--conc", "2", "--prompt-len",
                                 "6", "--context", "10", "--repeats", "1", "--no-peer",
                                 "--kv-cache-dtype", "fp8")
    assert "fp8 KV cache" in printed
    assert result["vt"]["tpot_s"] > 0
