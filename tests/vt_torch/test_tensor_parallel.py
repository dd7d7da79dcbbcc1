"""Tensor parallelism inside vt.torch.llama.LlamaDecoder (vt.torch.tensor_parallel): two ranks
over gloo on the CPU, each a process of tests/vt_torch/_tp_worker.py, against the full model.

Tolerance: fp32, relative Frobenius error of the logits below 1e-5. Sharding changes only
the order of the sums (o's and down's products summed per rank, then over the ranks), so
the TP logits differ from the full model's by float32 rounding carried through two layers
(below 1e-6 here); a wrong shard (a head, a bias counted twice, a misplaced vocab row) is
an error of order 1. The ranks' logits are compared bit for bit: every rank gets the same
all-reduced sums and the gather adds no arithmetic."""
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

from vt.torch.llama import LlamaDecoder, shard_state_dict  # noqa: E402
from vt.torch.tensor_parallel import TensorParallel  # noqa: E402

from _torch_util import GEO, TINY  # noqa: E402

WORKER = Path(__file__).with_name("_tp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out_dir: Path, job: str, *args: str) -> list:
    """JOB on 2 ranks (processes of _tp_worker.py); each rank's result. A rank that fails, or
    ranks still running after TIMEOUT_S (then killed), fail the test with their output."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    logs = [out_dir / f"rank{r}.log" for r in range(2)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), job, str(r), str(port), str(out_dir), *args],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=WORKER.parent))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in hung:
            procs[r].kill()
            procs[r].wait()
    output = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{logs[r].read_text()[-4000:]}"
                       for r, p in enumerate(procs))
    if hung:
        pytest.fail(f"{job}: ranks {hung} still running after {TIMEOUT_S} s (killed)\n{output}")
    if any(p.returncode for p in procs):
        pytest.fail(f"{job}: a rank failed\n{output}")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check_logits(ranks: list, name: str) -> None:
    """Rank 0's and rank 1's TP logits equal bit for bit, within TOLERANCE of the full
    model's, with its greedy tokens; logits that say something (well spread)."""
    r0, r1 = ranks[0][name], ranks[1][name]
    assert len(r0["tp"]) == len(r0["full"]) == 2 + 4   # prefill, mixed, 4 decode steps
    for step, (a, b, full) in enumerate(zip(r0["tp"], r1["tp"], r0["full"])):
        assert torch.equal(a, b), f"{name} step {step}: rank 0's and rank 1's logits differ"
        assert a.shape == full.shape == (full.shape[0], r0["vocab"])
        assert torch.isfinite(a).all()
        err = rel_err(a, full)
        assert err < TOLERANCE, f"{name} step {step}: relative error {err:.2e}"
        assert torch.equal(a.argmax(-1), full.argmax(-1)), f"{name} step {step}: greedy differs"
        assert (full.amax(-1) - full.amin(-1)).min() > 1.0
    assert torch.equal(r0["full"][-1], r1["full"][-1])   # the same full model in both


@pytest.fixture(scope="module")
def forward_results(tmp_path_factory):
    """Every case of _tp_worker.CASES run once on 2 ranks: their logits, and the shapes of
    rank 0's and rank 1's shards."""
    start = time.monotonic()
    ranks = run_ranks(tmp_path_factory.mktemp("tp_forward"), "forward")
    print(f"forward job: {time.monotonic() - start:.1f} s")
    return ranks


CASE_NAMES = ["llama-torch", "llama-vt", "qwen2-biases-vt", "qwen3-qk-norm",
              "qwen3-qk-norm-vt", "tied-vocab-97", "untied-vocab-97-vt"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_two_rank_logits_equal_the_full_model_and_each_other(forward_results, case):
    """A flat prefill step, a mixed step (a chunk over its cached prefix), 4 decode steps."""
    assert sorted(forward_results[0]) == sorted(CASE_NAMES)
    check_logits(forward_results, case)


def test_each_rank_holds_its_share(forward_results):
    """TINY's 4 heads, 2 KV heads of 16, intermediate 128, hidden 64 on 2 ranks: 2 q heads
    and 1 KV head per rank (qkv (2 + 2 * 1) * 16 rows), o 32 columns, 64 + 64 gate_up rows,
    down 64 columns, the KV cache 1 head; the head vocab / 2 rows (97: 49 on each)."""
    for rank in forward_results:
        got = rank["llama-torch"]["shapes"]
        assert got == {"qkv": (64, 64), "o": (64, 32), "gate_up": (128, 64), "down": (64, 64),
                       "head": (48, 64), "k_cache": (TINY.layers, GEO.num_kv_blocks *
                                                      GEO.block_size, 1, TINY.head_dim)}
        assert rank["tied-vocab-97"]["shapes"]["head"] == (49, 64)
        assert rank["untied-vocab-97-vt"]["shapes"]["head"] == (49, 64)


HF_SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def test_hf_load_with_tp_equals_the_unsharded_load(tmp_path):
    """Tiny transformers checkpoints (Qwen2 with its qkv biases and tied embeddings, and
    Qwen3 with q/k norms, both with an odd vocab) loaded with tp=(rank, 2) in each of 2
    processes: the sharded forward equals the unsharded one."""
    transformers = pytest.importorskip("transformers", reason="the checkpoints need transformers")
    configs = {"qwen2-tied": transformers.Qwen2Config(**HF_SMALL, tie_word_embeddings=True),
               "qwen3": transformers.Qwen3Config(**HF_SMALL, head_dim=32)}
    paths = []
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(tmp_path / name)
        paths.append(str(tmp_path / name))
    ranks = run_ranks(tmp_path, "hf", *paths)
    for name in configs:
        check_logits(ranks, name)
    assert ranks[0]["qwen3"]["shapes"]["qkv"] == ((2 + 2 * 1) * 32, 64)


def test_engine_generate_under_sim_capture_gives_the_full_models_tokens(tmp_path):
    """Each rank serves its TP model through TorchForwardModel(prefill="flat") on the sim
    (decode steps captured: the collectives recorded and replayed) and generates for the
    same prompts: both ranks' greedy tokens equal each other and the full model's, in sync
    and ring mode. Each captured step holds its collectives (an all-reduce after o and after
    down per layer, the logits' all-gather: each a collective op and its wait). Sampled (temperature 1, one seed), the ranks draw the same tokens: vt's
    sampler is keyed on (seed, position) and their logits are the same bit for bit."""
    modes = ["sync", "ring"]
    ranks = run_ranks(tmp_path, "engine", *modes)
    for mode in modes:
        full = ranks[0][(mode, "full")]
        assert full["graph_steps"] > 0 and full["mixed_steps"] > 0
        assert len({tuple(t) for t in full["tokens"]}) > 1
        for r, rank in enumerate(ranks):
            got = rank[(mode, "tp")]
            assert got["tokens"] == full["tokens"], f"{mode}: rank {r}"
            assert got["graph_steps"] == full["graph_steps"]
            # 1 recording per captured size (sync), 2 per size (ring: 2 slots); 3 sizes
            assert got["collectives"] == [2 * (2 * TINY.layers + 1)] * (3 if mode == "sync" else 6)
            assert full["collectives"] == [0] * len(got["collectives"])
    sampled = [rank[("ring", "tp-sampled")]["tokens"] for rank in ranks]
    assert sampled[0] == sampled[1]
    assert sampled[0] != ranks[0][("ring", "full")]["tokens"]   # sampling, not greedy


# Single-process checks.

def test_tensor_parallel_is_validated():
    with pytest.raises(ValueError, match=r"TensorParallel.size must be an integer in \[1, "):
        TensorParallel(0, 0)
    with pytest.raises(ValueError, match=r"TensorParallel.rank must be an integer in \[0, 1\], "
                                         r"got 2"):
        TensorParallel(2, 2)
    with pytest.raises(ValueError, match=r"TensorParallel.rank must be .* got -1"):
        TensorParallel(-1, 2)
    with pytest.raises(TypeError, match="TensorParallel.size"):
        TensorParallel(0, 2.0)


def test_shard_is_the_ranks_contiguous_share_and_refuses_a_remainder():
    assert [TensorParallel(r, 4).shard(12, "rows") for r in range(4)] == [
        slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert TensorParallel(0, 1).shard(7, "rows") == slice(0, 7)
    with pytest.raises(ValueError, match="^heads=6 is not divisible by the tensor-parallel "
                                         "size 4$"):
        TensorParallel(1, 4).shard(6, "heads")


def test_collectives_are_the_identity_at_size_1():
    tp = TensorParallel(0, 1)
    x = torch.randn(3, 5)
    assert tp.all_reduce(x) is x and tp.all_gather(x, dim=-1) is x


def test_collectives_need_an_initialised_group():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("this process already has a default process group")
    with pytest.raises(RuntimeError, match=r"TensorParallel\(rank=0, size=2\): torch.distributed "
                                           r"is not initialised"):
        TensorParallel(0, 2).all_reduce(torch.ones(2))


@pytest.mark.parametrize("changes,size,match", [
    (dict(heads=6), 4, "LlamaConfig.heads=6 is not divisible by the tensor-parallel size 4"),
    ({}, 4, "LlamaConfig.kv_heads=2 is not divisible by the tensor-parallel size 4"),
    (dict(intermediate=129), 2,
     "LlamaConfig.intermediate=129 is not divisible by the tensor-parallel size 2"),
], ids=["heads", "kv_heads", "intermediate"])
def test_the_decoder_refuses_counts_the_group_does_not_divide(changes, size, match):
    """TINY has 4 heads, 2 KV heads: each count the size does not divide is named."""
    cfg = dataclasses.replace(TINY, **changes)
    tp = TensorParallel(0, size)
    with pytest.raises(ValueError, match=f"^LlamaDecoder: {match}$"):
        LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu", tp=tp)
    with pytest.raises(ValueError, match=f"^LlamaDecoder: {match}$"):
        shard_state_dict({}, cfg, tp)


@pytest.mark.parametrize("cfg", [TINY, dataclasses.replace(TINY, qk_norm=False, qkv_bias=True,
                                                           o_bias=True, mlp_bias=True,
                                                           tie_embeddings=True, vocab=97)],
                         ids=["qwen3", "biases-tied"])
def test_size_1_is_the_unsharded_decoder(cfg):
    """tp=(0, 1): the same parameters (names and shapes) as tp=None, shard_state_dict the
    identity, and the same logits bit for bit."""
    from _tp_worker import script, seeded
    plain = seeded(cfg, "torch")
    one = seeded(cfg, "torch", tp=TensorParallel(0, 1))
    assert {k: v.shape for k, v in one.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()}
    state = shard_state_dict(plain.state_dict(), cfg, TensorParallel(0, 1))
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    a, b = script([plain, one])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_shard_state_dict_slices_each_layer_as_the_docs_say():
    """Rank 1 of 2 with TINY (4 heads, 2 KV heads of 16): qkv rows are [q heads 2, 3 | k head
    1 | v head 1], o's columns heads 2, 3, gate_up [gate[64:] | up[64:]], down's columns
    64:, the head rows 48:96; norms and biases of row-parallel layers whole."""
    cfg = dataclasses.replace(TINY, qkv_bias=True, o_bias=True, mlp_bias=True)
    full = LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu")
    state = {k: torch.randn(v.shape) for k, v in full.state_dict().items()}
    got = shard_state_dict(state, cfg, TensorParallel(1, 2))
    qkv = state["layers.0.attn.qkv.weight"]   # rows: q 0:64, k 64:96, v 96:128
    assert torch.equal(got["layers.0.attn.qkv.weight"],
                       torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]]))
    bias = state["layers.1.attn.qkv.bias"]
    assert torch.equal(got["layers.1.attn.qkv.bias"],
                       torch.cat([bias[32:64], bias[80:96], bias[112:128]]))
    assert torch.equal(got["layers.0.attn.o.weight"], state["layers.0.attn.o.weight"][:, 32:64])
    gu = state["layers.0.mlp.gate_up.weight"]
    assert torch.equal(got["layers.0.mlp.gate_up.weight"], torch.cat([gu[64:128], gu[192:256]]))
    assert torch.equal(got["layers.0.mlp.down.weight"], state["layers.0.mlp.down.weight"][:, 64:])
    assert torch.equal(got["lm_head.weight"], state["lm_head.weight"][48:96])
    for name in ("embed.weight", "norm.weight", "layers.0.attn.o.bias", "layers.0.mlp.down.bias",
                 "layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight",
                 "layers.0.attn_norm.weight", "layers.0.mlp_norm.weight"):
        assert got[name] is state[name], name
    assert got.keys() == state.keys()


def test_shard_state_dict_pads_an_uneven_vocab_with_zero_rows():
    """vocab 97 on 2 ranks: 49 head rows each; rank 1's last row is zero. Tied, the embedding
    is padded to 98 rows, the padding zero."""
    cfg = dataclasses.replace(TINY, vocab=97)
    state = {k: torch.randn(v.shape) for k, v in
             LlamaDecoder(cfg, GEO, dtype=torch.float32, device="cpu").state_dict().items()}
    head = state["lm_head.weight"]
    assert torch.equal(shard_state_dict(state, cfg, TensorParallel(0, 2))["lm_head.weight"],
                       head[:49])
    last = shard_state_dict(state, cfg, TensorParallel(1, 2))["lm_head.weight"]
    assert torch.equal(last[:48], head[49:]) and not last[48].any()
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    del state["lm_head.weight"]
    embed = shard_state_dict(state, tied, TensorParallel(1, 2))["embed.weight"]
    assert embed.shape == (98, 64) and torch.equal(embed[:97], state["embed.weight"])
    assert not embed[97].any()


def test_shard_state_dict_refuses_an_unknown_parameter():
    with pytest.raises(ValueError, match="^shard_state_dict: 'layers.0.attn.rotary' is not a "
                                         "LlamaDecoder parameter$"):
        shard_state_dict({"layers.0.attn.rotary": torch.zeros(2)}, TINY, TensorParallel(0, 2))
