"""When something goes wrong first (a step fails, a row's logits turn NaN, a client leaves a
stream early, an argument is odd), no request may see another's tokens or another's error,
and every odd argument gets a one-line error naming it.

| defect | test |
|---|---|
| after a failed step, a new request's stream()/snapshot() yields an earlier request's tokens | test_after_a_failed_step_a_new_request_streams_only_its_own_tokens |
| NaN on a request's last token is blamed on the request admitted next into its row | test_nan_on_a_last_token_fails_that_request_and_serves_the_next_in_its_row |
| a kernel raising in a sim graph replay is not reported by the query that sees its step done (the engine then delivers that step's tokens) | test_sim_event_and_stream_query_report_a_kernel_that_raised_in_a_replay |
| breaking out of stream_async held in a variable does not cancel the request | test_breaking_out_of_a_stream_async_held_in_a_variable_cancels_it |
| aclose() of a stream_async stream does not cancel it | test_aclose_of_a_stream_async_stream_cancels_it |
| max_prefill_tokens past a full batch dies in numpy ("could not broadcast") | test_max_prefill_tokens_past_a_full_batch_means_a_full_batch |
| stream(timeout=nan) busy-spins; result(timeout=inf) raises OverflowError | test_a_nan_timeout_is_refused_and_an_infinite_one_waits |
| stop_token=np.array(3) fails with "iteration over a 0-d array" | test_a_0d_array_stop_token_is_its_id |
| submit(sampling=[SamplingParams()]) is accepted | test_submit_refuses_generates_per_prompt_lists |
| under random step faults and NaN rows, streamed tokens differ from results, errors go to the wrong request | test_the_fault_fuzz_finds_no_stream_mismatch_and_no_misattributed_error |
| under step faults and NaN rows with prefix caching on (shared prefixes, second turns), tokens differ from caching off | test_the_fault_fuzz_with_prefix_caching_gives_the_tokens_of_caching_off |
| with speculation, a request finished ahead of its scheduled last step has its answer's blocks named again at that step, when another request holds them: a next turn gets that request's KV | test_the_fault_fuzz_with_speculation_gives_the_tokens_of_decoding_without_it |
| after an error row, the n-gram proposer drafts -1, an input token outside the vocab, for the step in flight | test_the_fault_fuzz_sees_an_input_token_outside_the_vocab |
"""
import asyncio
import math
import threading
import time

import numpy as np
import pytest

from tools import fuzz, fuzz_faults as faults
from vt import Engine, ExecutorConfig, ForwardModel, KVGeometry, SamplingParams
from vt.forward.toy import ToyForward

from tests.speculative._broken import accept_first_drafts

GEO = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=64)
VOCAB = 64


def _config(mode, **kw):
    return ExecutorConfig(mode=mode, **{"serving_conc": 6, "capture_sizes": (1, 2, 4), **kw})


class _CountUp:
    """logits[r] = one-hot at (token + 1) % V; NaN when the input token is `nan_token`."""

    def run_numpy(self, table, rows, logits, *, nan_token):
        tok = table[rows]
        logits[...] = 0
        logits[np.arange(len(rows)), (tok + 1) % logits.shape[1]] = 1
        logits[tok == nan_token] = np.nan

    def run_cupy(self, stream_handle, table, rows, logits, *, nan_token):
        import cupy as cp
        tok = table[rows][:, None]
        out = cp.where(cp.arange(logits.shape[1])[None, :] == (tok + 1) % logits.shape[1],
                       cp.float32(1), cp.float32(0))
        logits[...] = cp.where(tok == nan_token, cp.float32(cp.nan), out)


def _count_up_engine(be, mode, *, nan_token=-2, **cfg):
    table = be.empty((GEO.max_seqs + 1,), np.int32)
    kernel = _CountUp()

    def forward(stream, inputs, logits_out):
        be.launch(stream, kernel, table, inputs.token_rows, logits_out, nan_token=nan_token)

    model = ForwardModel(be, forward, vocab=32, token_table=table, geometry=GEO)
    return Engine(be, model, _config(mode, **cfg))


# -- silent wrong tokens ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "drain", "ring", "staged"])
def test_after_a_failed_step_a_new_request_streams_only_its_own_tokens(sim_backend, mode):
    """A step fails; then B is submitted and its first step held on the host: until it runs,
    B has no token (not the failed requests' old ones), and its stream is its result."""
    fwd = faults.FaultyToy(sim_backend, vocab=VOCAB, geometry=GEO)
    rng = np.random.default_rng(1)
    with Engine(sim_backend, fwd.step_model(), _config(mode)) as eng:
        for trial in range(3):
            fwd.fault.arm(6)
            with pytest.raises(RuntimeError, match="step fault"):
                eng.generate([rng.integers(0, VOCAB, 3) for _ in range(4)], max_new_tokens=20)
            gate = threading.Event()
            held = fwd.hold_next_eager(gate)
            b = eng.submit([1, 2, 3], max_new_tokens=8)
            assert held.wait(30), "B's first step never reached the forward"
            early = [b.snapshot()[0].tolist()]
            gate.set()
            streamed = list(b.stream(timeout=30))
            assert early == [[]] and streamed == b.result().tokens, (trial, early, streamed)


@pytest.mark.parametrize("mode", ["drain", "ring", "staged"])
def test_nan_on_a_last_token_fails_that_request_and_serves_the_next_in_its_row(backend, mode):
    """R1's last token comes from NaN logits and R2 takes R1's row next (one row serves; at
    depth 2, before R1's last token is stored): R1 ends "error" with the tokens before it,
    R2 is served whole. Twelve such pairs (the depth-1 run: tests/engine/test_error_rows)."""
    with _count_up_engine(backend, mode, nan_token=4, serving_conc=1) as eng:
        res = eng.generate([[1], [10]] * 12, max_new_tokens=4)
    for k in range(0, len(res), 2):
        r1, r2 = res[k], res[k + 1]
        assert (r1.finish_reason, r1.tokens) == ("error", [2, 3, 4]) and "NaN" in r1.error, (k, r1)
        assert (r2.finish_reason, r2.tokens, r2.error) == ("length", [11, 12, 13, 14], None), (k, r2)


class _Raise:
    name = "raise"

    def run_numpy(self):
        raise faults.StepFault("raised in a replay")


def _poll(query, deadline_s=30.0):
    """query() until it says done (or raises)."""
    deadline = time.monotonic() + deadline_s
    while not query():
        assert time.monotonic() < deadline, "the op never completed"
        time.sleep(0.001)


@pytest.mark.parametrize("which", ["event", "stream"])
def test_sim_event_and_stream_query_report_a_kernel_that_raised_in_a_replay(sim_backend, which):
    """As cudaEventQuery / cudaStreamQuery return an earlier launch's error, the sim's query
    raises the failure of a kernel replayed before it (once), not only a later sync."""
    be = sim_backend
    s = be.stream(name="replays")
    with be.capture(s, name="raises") as cap:
        be.launch(s, _Raise())
    ev = be.event()
    cap.graph.launch(s)
    ev.record(s)
    with pytest.raises(RuntimeError, match=r"sim op 'launch\(raise\)' on stream 'replays' "
                                           r"failed: StepFault: raised in a replay"):
        _poll(ev.query if which == "event" else s.query)
    assert ev.query() and s.query()   # reported once


# -- stream_async ----------------------------------------------------------------------------
def _toy_engine(be):
    return Engine(be, ToyForward(be, geometry=GEO).step_model(), _config("ring"))


async def _until_idle(eng):
    deadline = time.monotonic() + 30
    while not eng.idle() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)


def test_breaking_out_of_a_stream_async_held_in_a_variable_cancels_it(delayed_sim):
    """`stream = eng.stream_async(...)`, then `async for tok in stream: ... break`: the request
    is cancelled at once, while the stream is still held (not when it is collected)."""
    async def main(eng):
        stream = eng.stream_async([1, 2], max_new_tokens=60)
        got = []
        async for tok in stream:
            got.append(tok)
            if len(got) == 2:
                break
        await _until_idle(eng)
        return got, stream

    with _toy_engine(delayed_sim) as eng:
        got, _ = asyncio.run(main(eng))
        st = eng.stats()
    assert len(got) == 2
    assert st["requests_finished"] == 1 and 2 <= st["tokens"] < 60, st["tokens"]


def test_aclose_of_a_stream_async_stream_cancels_it(delayed_sim):
    """`await stream.aclose()` cancels the request (submitted when stream_async was called)."""
    async def main(eng):
        stream = eng.stream_async([1, 2], max_new_tokens=60)
        await asyncio.sleep(0.02)
        await stream.aclose()
        await _until_idle(eng)
        return stream

    with _toy_engine(delayed_sim) as eng:
        asyncio.run(main(eng))
        st = eng.stats()
    assert st["requests_finished"] == 1 and st["tokens"] < 60, st


# -- arguments ------------------------------------------------------------------------------
def test_max_prefill_tokens_past_a_full_batch_means_a_full_batch(sim_backend):
    """No step holds more than max_seqs * max_context prompt tokens: a larger budget is that
    one, and the engine serves (instead of failing in the prefill warm-up)."""
    from vt.bundled import PRESETS, HybridModel, init_weights
    cfg = PRESETS["tiny-dense"]
    model = HybridModel(sim_backend, cfg, init_weights(cfg, seed=0), max_seqs=2, num_kv_blocks=32)
    try:
        with Engine(sim_backend, model, _config("ring", serving_conc=2, capture_sizes=(1, 2)),
                    max_prefill_tokens=10**6) as eng:
            assert eng.max_prefill_tokens == 2 * cfg.max_context
            (res,) = eng.generate([[1, 2, 3]], max_new_tokens=3)
            assert res.finish_reason == "length" and len(res.tokens) == 3
    finally:
        model.close()


def test_a_nan_timeout_is_refused_and_an_infinite_one_waits(delayed_sim):
    with _toy_engine(delayed_sim) as eng:
        h = eng.submit([1], max_new_tokens=12)
        with pytest.raises(ValueError, match="stream: timeout must be a number of seconds or None, got nan"):
            h.stream(timeout=math.nan)
        with pytest.raises(ValueError, match="result: timeout must be .* got nan"):
            h.result(timeout=math.nan)
        with pytest.raises(TypeError, match="result: timeout must be a number"):
            h.result(timeout="1")
        res = h.result(timeout=math.inf)
        assert len(res.tokens) == 12 and list(h.stream(timeout=math.inf)) == res.tokens


def test_a_0d_array_stop_token_is_its_id(sim_backend):
    with _count_up_engine(sim_backend, "ring") as eng:
        (res,) = eng.generate([[1]], max_new_tokens=8, stop_token=np.array(3))
        assert (res.finish_reason, res.tokens) == ("stop", [2, 3])
        assert eng.submit([1], max_new_tokens=8, stop_token=np.array(4)).result().tokens == [2, 3, 4]
        with pytest.raises(ValueError, match="stop_token must be a token id"):
            eng.submit([1], stop_token=np.array(2.0))


def test_submit_refuses_generates_per_prompt_lists(sim_backend):
    with _count_up_engine(sim_backend, "ring") as eng:
        with pytest.raises(TypeError, match=r"submit: sampling must be a vt.SamplingParams or "
                                            r"None \(one request; generate\(\) takes one per prompt\), got list"):
            eng.submit([1], sampling=[SamplingParams()])
        with pytest.raises(TypeError, match="submit: max_new_tokens must be an int"):
            eng.submit([1], max_new_tokens=[4])
        assert eng.idle()


# -- the fault fuzz, briefly ------------------------------------------------------------------
@pytest.mark.parametrize("seed", [4, 5])
def test_the_fault_fuzz_finds_no_stream_mismatch_and_no_misattributed_error(seed):
    """tools/fuzz.py --faults on two cases: random step faults and NaN rows, online, in drain,
    ring and staged: every request streams its result, every error is its own."""
    case = fuzz.numpy_case(seed, max_requests=32, max_rounds=1, sim_delays=(0.0, 1e-4, 3e-4))
    reports = faults.run_fault_case(case, seed=seed, fault_gap_s=0.04)
    for rep in reports:
        assert rep.faults > 0, f"{rep.mode}: no fault fired: the fuzz tested nothing"
        assert not any(rep.counts.values()), (rep.mode, rep.counts, rep.failures[:5])


@pytest.mark.parametrize("seed", [4, 5])
def test_the_fault_fuzz_with_prefix_caching_gives_the_tokens_of_caching_off(seed):
    """tools/fuzz.py --faults --forward positional on two cases: the positional toy with prefix
    caching on, prompts sharing prefixes and second turns (the prompt, the reference's answer,
    new tokens) sent after their first: under step faults and NaN rows every request's tokens
    are those of the clean run with caching off, and the cache served some in every mode.
    (Seed 5 catches a cache that takes a whole cached prompt without computing its last
    token.)"""
    case = faults.positional_case(seed, max_requests=32, sim_delays=(0.0, 1e-4, 3e-4))
    reports = faults.run_fault_case(case, seed=seed, fault_gap_s=0.04)
    assert reports[0].requests > len(case.rounds[0]), "no second turn: the history was not sent"
    for rep in reports:
        assert rep.faults > 0, f"{rep.mode}: no fault fired: the fuzz tested nothing"
        assert rep.cached_tokens > 0, f"{rep.mode}: no prompt token came from the cache"
        assert not any(rep.counts.values()), (rep.mode, rep.counts, rep.failures[:5])


def test_the_fault_fuzz_on_one_backend_of_each_kind(backend):
    """The fault fuzz's case with one backend for the reference and every mode, as on cuda.
    There a graph replay calls no Python: step faults hit the eager forwards only, and the NaN
    rows come from a kernel captured into every step's graph."""
    seed = 6
    case = fuzz.numpy_case(seed, max_requests=24, max_rounds=1, sim_delays=(0.0,))
    reports = faults.run_fault_case(case, seed=seed, fault_gap_s=0.04, be=backend)
    for rep in reports:
        assert rep.faults > 0, f"{rep.mode}: no fault fired: the fuzz tested nothing"
        assert rep.outcomes.get("error", 0) > 0, f"{rep.mode}: no NaN row ended a request"
        assert not any(rep.counts.values()), (rep.mode, rep.counts, rep.failures[:5])


@pytest.mark.parametrize("method,k,seed", [("ngram", 4, 4), ("draft", 2, 5), ("oracle", 1, 4)])
def test_the_fault_fuzz_with_speculation_gives_the_tokens_of_decoding_without_it(method, k, seed):
    """tools/fuzz.py --faults --speculative: the positional toy through a speculative engine
    (prefix caching on, second turns) under step faults (in the draft's passes too) and NaN
    rows, in drain, ring and staged: every request's tokens and outcome are those decoding
    without speculation gives, cut at its NaN token. The draft is the target's twin with
    noisy logits; the oracle proposes the reference's tokens, NaN token included (accepted:
    the request ends there)."""
    case = fuzz.with_speculation(
        faults.positional_case(seed, max_requests=24, sim_delays=(0.0, 1e-4)), method, k,
        draft_noise=0.01)
    reports = faults.run_fault_case(case, seed=seed, fault_gap_s=0.04)
    assert reports[0].requests > len(case.rounds[0]), "no second turn: the history was not sent"
    for rep in reports:
        assert rep.faults > 0, f"{rep.mode}: no fault fired: the fuzz tested nothing"
        assert rep.speculative["verify_rows"] > 0, f"{rep.mode}: no verify step"
        assert not any(rep.counts.values()), (rep.mode, rep.counts, rep.failures[:5])
    assert sum(rep.outcomes.get("error", 0) for rep in reports) > 0, "no NaN row ended a request"


def test_the_fault_fuzz_sees_a_speculative_engine_that_accepts_a_wrong_draft(monkeypatch):
    """The fault fuzz can fail under speculation: acceptance broken to keep each row's first
    draft whatever the target drew gives requests wrong tokens (or NaN errors where the
    reference has none), and the fuzz counts them."""
    accept_first_drafts(monkeypatch)
    case = fuzz.with_speculation(faults.positional_case(4, max_requests=24), "ngram", 2)
    reports = faults.run_fault_case(case, modes=("ring",), seed=4, fault_gap_s=1.0)
    counts = reports[0].counts
    assert counts["wrong_tokens"] + counts["misattributed"] > 0, counts


def test_the_fault_fuzz_sees_an_input_token_outside_the_vocab(monkeypatch):
    """Acceptance as it was: an error token written into the row's history as -1, which the
    n-gram proposer of the step in flight drafts, the target's input token. The fault fuzz's
    forward checks every input token on the sim, so the step fails: a problem."""
    from vt.forward import spec_kernels
    original = spec_kernels.Accept.run_numpy

    def keeps_minus_1(self, targets, v_logits, drafts, token_rows, pos, hist, token_table,
                      records, logits_out, *, k, pad_row):
        original(self, targets, v_logits, drafts, token_rows, pos, hist, token_table, records,
                 logits_out, k=k, pad_row=pad_row)
        for r, row in enumerate(token_rows):
            last = records[r, spec_kernels.TOKENS + records[r, spec_kernels.COUNT] - 1]
            if row != pad_row and last < 0:
                hist[row, min(int(pos[row]), hist.shape[1] - 1)] = last

    monkeypatch.setattr(spec_kernels.Accept, "run_numpy", keeps_minus_1)
    case = fuzz.with_speculation(faults.positional_case(204, max_requests=32), "ngram", 2)
    reports = faults.run_fault_case(case, modes=("ring",), seed=204, fault_gap_s=1.0)
    rep = reports[0]
    assert rep.counts["problem"] > 0, (rep.counts, rep.outcomes)
    assert any("outside the vocab" in " ".join(why) for _, why in rep.failures), rep.failures[:3]
