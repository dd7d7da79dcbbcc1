"""vt bench's torch-decode and torch-ttft with --quantization fp8: the FP8 decoder runs, the
floor counts FP8 codes and scales, and the dense (bf16) floor is reported beside it."""
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from _torch_util import tiny_bench  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.torch.llama import LlamaConfig, LlamaDecoder  # noqa: E402

pytestmark = pytest.mark.torch_allocator


def test_weight_bytes_count_codes_and_scales_and_the_dense_equivalent():
    """An FP8 decoder: one byte a projection weight plus four a scale; dense: the dtype's."""
    from vt.bench.torch_decode import weight_bytes
    cfg = LlamaConfig(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1,
                      head_dim=16)
    geo = KVGeometry(max_seqs=1, num_kv_blocks=4, block_size=4, max_context=8)
    m = LlamaDecoder(cfg, geo, dtype=torch.float32, device="cpu", quantization="fp8")
    proj = (32 * 64) + (32 * 32) + (2 * 64 * 32) + (32 * 64)   # qkv, o, gate_up, down weights
    rows = 64 + 32 + 128 + 32                                   # their output channels: scales
    rest = 4 * (2 * 2 * 32 + 32 + 64 * 32)                      # norms, final norm, head (f32)
    assert weight_bytes(m) == 2 * (proj + 4 * rows) + rest
    assert weight_bytes(m, dense=True) == 2 * 4 * proj + rest
    dense = LlamaDecoder(cfg, geo, dtype=torch.float32, device="cpu")
    assert weight_bytes(dense) == weight_bytes(m, dense=True)


def test_the_decode_bench_runs_an_fp8_decoder_on_the_sim(capsys, tmp_path):
    """--quantization fp8 on the tiny preset: the table says so, the JSON holds both weight
    sizes (FP8 smaller)."""
    printed, result = tiny_bench(capsys, tmp_path, "torch-decode", "--rows", "1", "2", "--live",
                                 "8", "--max-context", "32", "--steps", "4", "--repeats", "1",
                                 "--hf-rows", "--quantization", "fp8")
    assert "fp8: codes and scales" in printed
    assert result["quantization"] == "fp8"
    assert result["weight_bytes"] < result["dense_weight_bytes"]
    assert all(c["tpot_s"] > 0 for c in result["cells"])


def test_the_dense_floor_of_an_fp8_run_is_its_weights_in_the_dtype():
    """floor_s(dense=True) counts dense_weight_bytes: numbers worked by hand."""
    from vt.bench.torch_decode import floor_s
    r = dict(floor_Bps=2e12, weight_bytes=8.1e9, dense_weight_bytes=16e9,
             kv_bytes_per_token=131072, embed_row_bytes=8192)
    assert floor_s(r, 1, 256) == pytest.approx((8.1e9 + 8192 + 256 * 131072) / 2e12)
    assert floor_s(r, 1, 256, dense=True) == pytest.approx((16e9 + 8192 + 256 * 131072) / 2e12)


def test_the_ttft_bench_runs_an_fp8_decoder_on_the_sim(capsys, tmp_path):
    """torch-ttft --quantization fp8 --no-peer on the tiny preset: its table names FP8."""
    printed, result = tiny_bench(capsys, tmp_path, "torch-ttft", "--conc", "2", "--prompt-len",
                                 "6", "--context", "10", "--repeats", "1", "--no-peer",
                                 "--quantization", "fp8")
    assert "fp8 weights (prompt linear scaled_mm)" in printed
    assert result["vt"]["tpot_s"] > 0
