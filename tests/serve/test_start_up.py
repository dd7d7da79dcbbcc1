"""`vt serve` / `vt generate` start-up: it says what it does and what it chose (the context, the
KV cache), refuses a context past the checkpoint's, names the extra to install when a
dependency is missing, and stops at once on Ctrl-C."""
import os
import signal
import subprocess
import sys
import time

import pytest

from vt.cli.main import main
from vt.serve import kv_cache
from vt.serve.model_source import DEFAULT_MAX_CONTEXT, checkpoint_context, checkpoint_kv_cache
from vt.torch.llama import LlamaConfig

from ._live import ROOT

FLAGS = ["--backend", "sim", "--block-size", "4"]
CFG = LlamaConfig(vocab=400, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                  head_dim=16)


def test_generate_says_each_phase_and_what_it_chose(checkpoint, capsys):
    """Not a terminal: one line per phase with its counts and time, the context and where it
    came from, the KV cache in blocks, tokens and bytes."""
    assert main(["generate", "--model", str(checkpoint), "--prompt", "Hello", "--max-tokens",
                 "2", *FLAGS]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert any(line.startswith("vt generate: loading weights 15/15 (") and " in " in line
               for line in lines), err
    assert ("vt generate: max context 256 tokens (config.json's max_position_embeddings 256)"
            in lines), err
    # one row of 256 tokens in blocks of 4, + the scratch block; fp32 K and V of 2 layers
    per_block = 2 * 2 * 2 * 16 * 4 * 4
    assert (f"vt generate: KV cache 65 blocks of 4 tokens (256 tokens for requests, one block "
            f"is scratch; {65 * per_block / 2**20:.1f} MiB): a whole context for every row "
            f"(1 x 256 tokens; the sim's budget of 512 MiB holds more)") in lines, err
    captured = [line for line in lines if "capturing decode graphs" in line]
    assert len(captured) == 1 and captured[0].startswith(
        "vt generate: capturing decode graphs 2/2 (size 1, slot 1) in "), err
    assert any(line.startswith("vt generate: warming up eager steps 2/2 (the prompt path) in ")
               for line in lines), err


def test_a_context_past_the_checkpoint_is_refused(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt", "x", "--max-context",
                 "100000", *FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("vt generate: max context 100,000 exceeds the checkpoint's 256 "
                       "(config.json's max_position_embeddings 256): positions past it were "
                       "never trained; give at most 256 (--max-context)"), err


@pytest.mark.parametrize("max_pos,linear,asked,expect", [
    (8192, 1.0, None, (DEFAULT_MAX_CONTEXT, "max context 4,096 tokens, the default cap "
                       "(config.json's max_position_embeddings 8,192; --max-context to change)")),
    (2048, 1.0, None, (2048, "max context 2,048 tokens (config.json's max_position_embeddings "
                       "2,048)")),
    (None, 1.0, None, (4096, "max context 4,096 tokens, the default cap (config.json names no "
                       "max_position_embeddings; --max-context to change)")),
    (2048, 2.0, 4096, (4096, "max context 4,096 tokens (as given; config.json's "
                       "max_position_embeddings 2,048 x its linear RoPE factor 2 = 4,096)")),
    (8192, 1.0, 8192, (8192, "max context 8,192 tokens (as given; config.json's "
                       "max_position_embeddings 8,192)")),
])
def test_the_context_and_the_line_that_says_where_it_came_from(max_pos, linear, asked, expect):
    cfg = LlamaConfig(**{**CFG.__dict__, "rope_linear_factor": linear})
    assert checkpoint_context(cfg, max_pos, asked) == expect


def test_a_linear_rope_factor_extends_the_limit_as_vllm_derives_it():
    cfg = LlamaConfig(**{**CFG.__dict__, "rope_linear_factor": 2.0})
    with pytest.raises(ValueError, match="max context 4,097 exceeds the checkpoint's 4,096"):
        checkpoint_context(cfg, 2048, 4097)


def test_the_kv_cache_of_a_checkpoint_on_each_backend(backend):
    """The sim: its fixed budget; cuda: from the free GPU memory, within one context and a
    whole context for every row (the bounds hold on any GPU with memory for this tiny model)."""
    import torch
    size = checkpoint_kv_cache(backend, CFG, torch.float32, max_seqs=4, max_context=64,
                               block_size=4, kv_blocks=None, tensor_parallel=1, utilization=0.5)
    assert size.num_kv_blocks == 4 * 16 + 1   # the budget holds every row's whole context
    if backend.name == "cuda":
        assert "0.5 of the " in size.why and "GiB of GPU memory free at start-up" in size.why
    else:
        assert "the sim's budget of 512 MiB holds more" in size.why


def test_a_budget_below_every_row_gives_whole_contexts_and_says_so():
    size = kv_cache.size_kv_cache(bytes_per_token=1024, block_size=16, max_seqs=8,
                                  max_context=4096, budget_bytes=10 << 20, budget_why="a test")
    assert (size.num_kv_blocks, size.tokens, size.nbytes) == (640, 639 * 16, 640 * 16 * 1024)
    assert size.why == "a test, 2 whole contexts of 4,096 tokens; --kv-blocks to change"


def test_a_budget_below_one_context_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"the KV cache budget \(a test: 1.0 MiB\) holds 64 "
                       r"blocks of 16 tokens \(0.0 MiB each\); one sequence of max_context 4096 "
                       r"needs 256: lower --max-context, or set --kv-blocks"):
        kv_cache.size_kv_cache(bytes_per_token=1024, block_size=16, max_seqs=8,
                               max_context=4096, budget_bytes=1 << 20, budget_why="a test")


def test_kv_blocks_sets_the_count_whatever_the_budget():
    size = kv_cache.size_kv_cache(bytes_per_token=1024, block_size=16, max_seqs=8,
                                  max_context=4096, budget_bytes=0, budget_why="none",
                                  kv_blocks=10)
    assert (size.num_kv_blocks, size.why) == (10, "set by --kv-blocks")


def test_the_gpu_budget_is_the_fraction_of_free_memory_less_weights_and_activations():
    """cuda's arithmetic (its inputs are the GPU's free memory and the model's sizes)."""
    got = kv_cache.kv_budget_bytes(free_bytes=80 << 30, utilization=0.9, weight_bytes=16 << 30,
                                   activation_bytes=1 << 30)
    assert got == int((80 << 30) * 0.9) - (17 << 30) - kv_cache.GPU_RESERVE_BYTES


@pytest.mark.parametrize("command,missing", [("generate", "torch"), ("serve", "transformers")])
def test_a_missing_dependency_names_the_extra_to_install(checkpoint, monkeypatch, capsys,
                                                         command, missing):
    monkeypatch.setitem(sys.modules, missing, None)   # import -> ImportError
    extra = ["--prompt", "x"] if command == "generate" else ["--port", "0"]
    assert main([command, "--model", str(checkpoint), *extra, *FLAGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"vt {command} needs the serve extra ({missing} is missing): pip install "
                       f"'vt-graphs[serve]' (from a checkout: pip install '.[serve]')"), err


@pytest.mark.parametrize("after, inherited", [
    ("vt serve: loading ", signal.SIG_DFL),
    # started as a background job of a script is (SIGINT ignored), while it captures
    ("vt serve: ring mode, decode graphs", signal.SIG_IGN)])
def test_ctrl_c_during_the_start_up_exits_at_once(checkpoint, after, inherited):
    """SIGINT while `vt serve` loads, and while it captures its graphs: exit 130 within a
    few seconds, never listening, whatever SIGINT disposition the process inherited."""
    proc = subprocess.Popen([sys.executable, "-m", "vt", "serve", "--model", str(checkpoint),
                             *FLAGS, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    try:
        line = proc.stderr.readline()
        while line and not line.startswith(after):
            line = proc.stderr.readline()
        assert line, f"no line starting {after!r}"
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            # where it is stuck: faulthandler prints every thread's stack on SIGABRT
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            pytest.fail(f"no exit 30 s after SIGINT:\n{proc.stderr.read()[-6000:]}")
        assert time.monotonic() - t0 < 5
        assert rc == 130, proc.stderr.read()
        assert "interrupted" in proc.stderr.read() and "listening" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
