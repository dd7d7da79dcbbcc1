"""`vt bench --workload prefix-cache` on the sim: every traffic shape (multi-turn chat, a
shared system prompt, a long cached prefix, prompts that never hit) runs with caching on and
off in one command, writes its JSON and prints its table; the hit rates say what was reused.
The chat shape's clients (a fake engine): each holds one conversation at a time and takes the
next when it ends, and they start one after another, not in step."""
import argparse
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from vt.bench import prefix_cache
from vt.cli.main import main

TINY = ["--preset", "tiny", "--backend", "sim", "--clients", "2", "--conversations", "3",
        "--turns", "2", "3",
        "--turn-tokens", "8", "12", "--output-len", "6", "--system-len", "32", "32",
        "--requests", "3", "--long-prompt", "48", "--long-cached", "32", "--short-prompt", "8",
        "--no-hit-len", "8", "--repeats", "1", "--max-prefill-tokens", "64"]


def test_every_shape_runs_on_the_sim_with_caching_on_and_off(capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "prefix.json"
    assert main(["bench", "--workload", "prefix-cache", *TINY, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    for shape in ("chat", "system", "no-hit"):
        for key in ("on", "off"):
            cell = r[key][shape]
            assert cell["output_tokens"] == cell["requests"] * 6 and cell["output_tok_per_s"] > 0
            assert cell["ttft_ms_p50"] > 0 and cell["tpot_ms_p50"] > 0
            assert f"{shape:<12} {key:<5}" in table
        assert r["off"][shape]["hit_rate"] == 0.0
        assert set(r["ratios"][shape]) == {"ttft_p50_off_over_on", "tok_per_s_on_over_off"}
    # chat: 3 conversations of 2 or 3 turns; every turn after the first finds its history
    # cached, the previous answers' full blocks included (an answer of 6 tokens after 8-12 new)
    assert 6 <= r["on"]["chat"]["requests"] <= 9 and r["on"]["chat"]["hit_rate"] > 0.3
    assert r["conversations"] == 3 and r["lockstep"] is False
    offsets = r["chat_offsets_s"]   # 2 clients: the second starts half an answer later
    assert len(offsets) == 2 and offsets[0] == 0.0 and offsets[1] > 0
    assert "chat: 3 conversations, the clients started over" in table
    # every system-prompt request but the first finds the 32-token prefix cached
    assert r["on"]["system"]["cached_tokens"] == 32 * (r["on"]["system"]["requests"] - 1)
    assert r["on"]["no-hit"]["cached_tokens"] == 0
    lp = r["on"]["long-prefix"]
    assert lp["cached_tokens_per_long"] == 32 and lp["ttft_long_ms"] > 0 and lp["ttft_short_ms"] > 0
    assert r["ratios"]["long-prefix"]["ttft_long_cached_over_short"] > 0
    assert r["tokens_differ"] == {"chat": 0, "system": 0, "no-hit": 0}
    assert "long-prefix: TTFT of 48 tokens with 32 cached" in table


def test_a_cached_prefix_that_is_not_whole_blocks_is_refused(capsys):
    assert main(["bench", "--workload", "prefix-cache", *TINY[:-4], "--long-cached", "30"]) == 2
    err = capsys.readouterr().err
    assert "--long-cached 30: a positive multiple of 16 below --long-prompt 48" in err
    assert err.count("\n") == 1


@pytest.mark.slow   # a checkpoint and two vt serve start-ups: about 35 s on 2 cores
def test_every_shape_runs_through_http_against_vt_serve_with_caching_on_and_off(
        capsys, tmp_path):
    """--http DIR: two `vt serve --model DIR` on the sim, caching on then off; the same table
    and keys, the hit rates from the servers' /metrics, the same tokens from both."""
    for mod in ("torch", "transformers", "fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod)
    from tools import tiny_checkpoint
    ckpt = tiny_checkpoint.build(tmp_path / "tiny-llama", seed=0)
    out = tmp_path / "prefix-http.json"
    flags = [f for f in TINY if f not in ("--preset", "tiny")]
    assert main(["bench", "--workload", "prefix-cache", *flags, "--http", str(ckpt),
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["via"] == "http"
    for shape in ("chat", "system", "no-hit"):
        for key in ("on", "off"):
            cell = r[key][shape]
            assert cell["output_tokens"] == cell["requests"] * 6 and cell["ttft_ms_p50"] > 0
            assert f"{shape:<12} {key:<5}" in table
        assert r["off"][shape]["cached_tokens"] == 0
    assert r["on"]["chat"]["hit_rate"] > 0.3
    assert r["on"]["system"]["cached_tokens"] == 32 * (r["on"]["system"]["requests"] - 1)
    assert r["conversations"] == 3 and len(r["chat_offsets_s"]) == 2
    assert r["on"]["no-hit"]["cached_tokens"] == 0
    assert r["on"]["long-prefix"]["cached_tokens_per_long"] == 32
    assert r["tokens_differ"] == {"chat": 0, "system": 0, "no-hit": 0}


# -- the chat clients, on a fake engine ------------------------------------------------------
class _FakeHandle:
    """A request the fake engine answers: `n` tokens, all at once, after its delay."""

    def __init__(self, prompt, n):
        self.submitted_at, self.prompt, self.n = time.perf_counter(), prompt, n
        self._lock, self._callbacks, self._result = threading.Lock(), [], None

    def add_done_callback(self, fn):
        with self._lock:
            if self._result is None:
                self._callbacks.append(fn)
                return
        fn(self)

    def finish(self):
        tokens = (len(self.prompt) + np.arange(self.n)) % 97
        now = time.perf_counter()
        with self._lock:
            self._result = SimpleNamespace(tokens=tokens, token_times=[now] * self.n)
            callbacks = self._callbacks
        for fn in callbacks:
            fn(self)

    def result(self, timeout=None):
        return self._result


class _FakeEngine:
    """Answers every request `delay` s after it is submitted (a timer thread each); records
    each submission (time, prompt, requests in flight after it)."""

    def __init__(self, delay: float):
        self.delay, self._lock = delay, threading.Lock()
        self.in_flight, self.submits = 0, []

    def submit(self, prompt, max_new_tokens):
        h = _FakeHandle(np.array(prompt), max_new_tokens)
        with self._lock:
            self.in_flight += 1
            self.submits.append((h.submitted_at, h.prompt, self.in_flight))
        threading.Timer(self.delay, self._finish, (h,)).start()
        return h

    def _finish(self, h):
        with self._lock:
            self.in_flight -= 1
        h.finish()


def _conversations(turns, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 97, int(rng.integers(2, 6))).astype(np.int32) for _ in range(n)]
            for n in turns]


def test_chat_clients_hold_one_conversation_each_and_take_the_next_when_it_ends():
    convs = _conversations([2, 3, 1, 2, 3, 2])
    eng = _FakeEngine(delay=0.01)
    handles, wall = prefix_cache._chat(eng, convs, [0.0, 0.0], output_len=4, timeout_s=30)
    # never more requests at once than clients (one conversation each), every turn served
    assert max(n for _, _, n in eng.submits) == 2
    assert len(handles) == sum(map(len, convs)) and wall > 0
    # by conversation then turn: each turn's prompt is the history (every earlier prompt and
    # answer) and its new tokens
    i = 0
    for conv in convs:
        history = np.zeros(0, np.int32)
        for new in conv:
            h = handles[i]
            np.testing.assert_array_equal(h.prompt, np.concatenate([history, new]))
            history = np.concatenate([h.prompt, h.result().tokens])
            i += 1


def test_chat_clients_start_one_after_another_over_one_answers_time():
    assert prefix_cache.chat_offsets(4, 128, 0.01, lockstep=False) == pytest.approx(
        [0.0, 0.32, 0.64, 0.96])
    assert prefix_cache.chat_offsets(4, 128, 0.01, lockstep=True) == [0.0] * 4
    eng = _FakeEngine(delay=0.3)   # each client's one-turn conversation lasts past the starts
    offsets = [0.0, 0.06, 0.12]
    prefix_cache._chat(eng, _conversations([1, 1, 1]), offsets, output_len=2, timeout_s=30)
    first = eng.submits[0][0]
    started = [t - first for t, _, _ in eng.submits]
    assert [s >= o for s, o in zip(started, offsets)] == [True] * 3, started


def test_chat_serves_four_conversations_per_client_unless_told():
    p = argparse.ArgumentParser()
    prefix_cache.add_arguments(p)
    args = p.parse_args(["--clients", "16"])
    assert prefix_cache.conversations(args) == 64
    assert len(prefix_cache.draw(args, 100)["chat"]) == 64
    args = p.parse_args(["--clients", "16", "--conversations", "5"])
    assert len(prefix_cache.draw(args, 100)["chat"]) == 5


def test_the_step_time_is_the_median_gap_past_each_requests_first_two_tokens():
    times = [[0.0, 0.5, 0.6, 0.7, 0.8], [0.0, 0.05, 0.3, 0.4, 0.6]]
    assert prefix_cache._step_s(times) == pytest.approx(0.1)
