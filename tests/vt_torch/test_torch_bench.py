"""`vt bench --workload torch`: refused without a GPU; on one, the hand-written CUDA-graph
peer around the same module samples the tokens vt's engines sample."""
import io

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from vt.backend import get_backend  # noqa: E402
from vt.bench import torch_workload  # noqa: E402
from vt.cli.main import main as vt_main  # noqa: E402
from vt.torch.llama import LlamaConfig  # noqa: E402

from _torch_util import generate  # noqa: E402

pytestmark = pytest.mark.torch_allocator


def main(argv) -> int:
    """`vt bench ARGV`, its exit code."""
    return vt_main(["bench", *argv])


def test_the_torch_workload_is_refused_on_the_sim(capsys):
    """A usage error (exit 2) naming the flag, before any model is built."""
    assert main(["--workload", "torch", "--backend", "sim"]) == 2
    assert "--workload torch needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["torch_sync", "torch_async"])
def test_the_graph_loop_peer_samples_vts_tokens(variant):
    """A small bf16 decoder: the peer's greedy tokens == vt ring's, prompt for prompt."""
    be = get_backend("cuda")
    try:
        cfg = LlamaConfig(vocab=256, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                          head_dim=32)
        module, model = torch_workload.build(be, 4, 48, seed=0, cfg=cfg)
        prompts = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(1)).tolist()
        peer = torch_workload.TorchLlamaPeer(module, 4)
        got = peer.run(variant, prompts, 20)["tokens"]
        peer.close()
        want = generate(be, model, "ring", prompts, 21, sizes=(4,))
        assert got == want
    finally:
        torch.cuda.synchronize()
        be.close()


def test_the_torch_workload_refuses_an_unknown_preset_listing_each(capsys):
    """Each preset is listed with what it is, in one line."""
    assert main(["--workload", "torch", "--preset", "torch-nope"]) == 2
    err = capsys.readouterr().err
    assert "torch-nope" in err and "torch-llama3-8b: Llama-3-8B's shape" in err
    assert torch_workload.model_config("torch-llama3-8b").vocab == 128256


@pytest.mark.parametrize("choice", ["auto", "torch"])
def test_the_torch_workload_records_the_prompt_kernels_the_decoder_ran(sim_backend, choice):
    """The JSON's prompt_kernels per preset: what each built decoder's steps with prompt
    tokens ran ("auto" resolved: vt's kernels, which the CPU runs too; a choice as given).
    run_torch on the sim, the peer left out (the CLI refuses the workload there)."""
    from vt.cli.bench import add_arguments_to_parser
    from vt.bench.progress import ProgressBar
    args = add_arguments_to_parser("vt bench").parse_args(
        ["--workload", "torch", "--preset", "torch-tiny", "--conc", "2", "--modes", "ring",
         "--steps", "3", "--prompt-len", "4", "--repeats", "1", "--profile", "off",
         "--ceiling-replays", "2", "--prompt-kernels", choice])
    got = {}
    with ProgressBar(8, bar=False, out=io.StringIO()) as progress:
        rows = torch_workload.run_torch(sim_backend, args, progress, "no peer on the sim", got)
    assert got == {"torch-tiny": "vt" if choice == "auto" else choice}
    assert [r["status"] for r in rows if r["impl"] == "vt"] == ["ok"]


def test_the_ttft_tool_prints_its_table_on_the_sim(capsys, tmp_path):
    """The tiny preset, vt against transformers on the CPU: every row of the table (a 1-request
    TTFT per --single length, one longer than --context), and the JSON's times positive."""
    import json

    pytest.importorskip("transformers", reason="the peer is transformers")
    out = tmp_path / "ttft.json"
    assert main(["--workload", "torch-ttft", "--preset", "tiny", "--backend", "sim", "--conc", "3", "--prompt-len",
                            "6", "--single", "6", "20", "--context", "16", "--repeats", "1",
                            "--json", str(out)]) == 0
    table = capsys.readouterr().out
    for row in ("TTFT, 1 request of 6 tokens", "TTFT, 1 request of 20 tokens",
                "TTFT, 3 requests of 6 tokens (last)", "TPOT, 3 requests, context 16",
                "vt prefill of 1 x 20 tokens", "transformers"):
        assert row in table
    result = json.loads(out.read_text())
    assert all(result[side][k] > 0 for side in ("vt", "peer") for k in ("ttft_n_last_s", "tpot_s"))
    assert all(result[side]["ttft_single_s"][n] > 0 for side in ("vt", "peer", "peer_static")
               for n in ("6", "20"))
    assert "static cache" in result["peer_static"]["impl"] and "static: transformers" in table
    assert result["vt"]["steps"]["prefill"] >= 3
    # every timed prompt is computed, none served by the prefix cache (on by default)
    assert result["vt"]["prefix_hit_rate"] == 0.0


def test_the_decode_floor_tool_prints_its_table_on_the_sim(capsys, tmp_path):
    """The tiny preset on the sim (no floor, no graph loop there): a row per (rows, live) with
    vt's TPOT and its graph's ceiling, transformers at the rows asked, the JSON and the PNG."""
    import json

    pytest.importorskip("transformers", reason="the peer is transformers")
    out, png = tmp_path / "decode.json", tmp_path / "decode.png"
    argv = ["--workload", "torch-decode", "--preset", "tiny", "--backend", "sim", "--rows", "1", "3", "--live", "8", "20",
            "--max-context", "48", "--steps", "6", "--repeats", "1", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        argv += ["--png", str(png)]
    except ImportError:
        png = None
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "no floor on this backend" in table and "transformers" in table
    result = json.loads(out.read_text())
    cells = {(c["rows"], c["live"]): c for c in result["cells"]}
    assert set(cells) == {(1, 8), (3, 8), (1, 20), (3, 20)}
    assert all(c["tpot_s"] > 0 and c["ceiling_s"] > 0 for c in cells.values())
    assert {(c["rows"], c["live"], c["cache"]) for c in result["hf"]["cells"]} == {
        (1, 8, "dynamic"), (1, 20, "dynamic"), (1, 8, "static"), (1, 20, "static")}
    assert png is None or png.stat().st_size > 0


def test_the_decode_floor_counts_weights_live_kv_and_the_rows_embeddings():
    """floor = (weights but the embedding + S x (an embedding row + live x KV per token)) /
    the floor rate: numbers worked by hand."""
    from vt.bench.torch_decode import floor_s
    r = dict(floor_Bps=2e12, weight_bytes=16e9, kv_bytes_per_token=131072, embed_row_bytes=8192)
    assert floor_s(r, 1, 256) == pytest.approx((16e9 + 8192 + 256 * 131072) / 2e12)
    assert floor_s(r, 32, 2048) == pytest.approx((16e9 + 32 * (8192 + 2048 * 131072)) / 2e12)
    assert floor_s(dict(r, floor_Bps=None), 1, 256) is None


def test_staggered_budgets_end_every_request_on_one_step():
    """Request i's first token comes at step ((i + 1) * P - 1) // chunk; first step + budget is
    the same for all, and the last admitted gets steps + 1."""
    from vt.bench.torch_decode import staggered_budgets
    for n, P, chunk in ((64, 2016, 16384), (5, 7, 10), (3, 4, 100)):
        budgets = staggered_budgets(n, P, chunk, 8)
        ends = {((i + 1) * P - 1) // chunk + b for i, b in enumerate(budgets)}
        assert len(ends) == 1 and budgets[-1] == 9
    assert staggered_budgets(3, 4, 100, 8) == [9, 9, 9]


@pytest.mark.parametrize("mode", ["drain", "ring"])
def test_staggered_run_ends_every_request_on_one_full_step(sim_backend, mode):
    """torch_decode's workload on the sim: 8 prompts of 12 tokens prefilled in chunks of 8
    while the first ones decode. Every request's last token comes from one step, and the
    ring of 8 rows holds that step with all 8 (the step Engine.device_ceiling_us replays)."""
    import dataclasses
    from vt.bench.torch_decode import staggered_run
    from vt.bench.torch_ttft import seeded_prompts
    from vt.engine import Engine
    from vt.config import ExecutorConfig
    from vt.step import KVGeometry
    from vt.torch import TorchForwardModel
    from _torch_util import TINY, tiny_llama
    geo = KVGeometry(max_seqs=8, num_kv_blocks=8 * 8 + 1, block_size=4, max_context=32)
    cfg = dataclasses.replace(TINY, qk_norm=False)
    model = TorchForwardModel(sim_backend, tiny_llama(sim_backend, cfg=cfg, geometry=geo),
                              vocab=cfg.vocab, geometry=geo, prefill="flat")
    config = ExecutorConfig(mode=mode, serving_conc=8, capture_sizes=(1, 8))
    with Engine(sim_backend, model, config, max_prefill_tokens=8) as eng:
        times = staggered_run(eng, seeded_prompts(cfg.vocab, 8, 12, 7), 6, 8)
        assert len({t[-1] for t in times}) == 1
        assert eng.runner.driver.ceiling_slot(8).last_rows == 8


def test_the_decode_floor_tool_refuses_a_live_context_past_max_context(capsys):
    """A usage error (exit 2, one line) naming the value, before any model is built."""
    assert main(["--workload", "torch-decode", "--preset", "tiny", "--live", "4090",
                 "--max-context", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vt bench --workload torch-decode: --live 4090") and err.count("\n") == 1
