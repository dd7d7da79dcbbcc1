"""Fault fuzz (`tools/fuzz.py --faults`): random step faults and NaN rows, in drain, ring and
staged, on the sim or cuda; every request's streamed tokens and outcome checked against what it
must be.

A case is tools/fuzz.py's random workload (prompts, budgets, sampling, a stop token, KV geometry,
capture sizes, concurrency, ring depth, sim device delay) served ONLINE: client threads submit
its requests at random moments and read each through stream() as it runs (and snapshot() right
after submit()). The forward is a toy forward with two fault hooks (FaultyToy):
- step faults: a kernel in every forward (graph replays and eager steps alike) raises on its
  k-th call, armed at random moments by a fault thread: on the sim that is a device-side error,
  reported at the next query or sync of the stream, and the step fails with the requests that
  hold a row;
- NaN rows: the logits of every row whose input token is the case's NaN token are NaN, so that
  request ends "error" with the tokens before that one.

Prefix caching: every other case (or each, `--forward positional`) serves the positional toy
(tools/positional_toy.py: position-addressed KV) with prefix caching on. Its prompts share
prefixes, and after each first turn its client sends a second turn: that prompt, the tokens
the reference gave it and a few new ones (the whole history again, as a chat client sends it),
which hits the blocks of the first turn's answer when that turn finished in the faulty run.

Speculation: every third case (each with --speculative, none with --spec-every 0) serves the
positional toy with prefix caching on through a speculative engine (docs/speculative.md),
its proposer drawn from ngram, draft and oracle and k from 1, 2, 4 (tools/fuzz.py's
draw_case). A draft is a second FaultyToy of the same geometry without NaN rows (the
target's twin, or one with noisy logits) whose forward launches the same fault kernel: a
step fault may hit the draft's passes inside a verify step as well as the target's verify.
The rules below are the same, because a verify step changes none of them:
- a step fault fails the requests that hold a row, with a prefix of their tokens;
- NaN rows: a verify step computes logits at every draft position too, from the draft as
  that row's input token. A draft equal to the NaN token that is rejected ends nothing (its
  logits are past the row's first mismatch, never sampled from); one that is accepted is the
  request's own token, and the request ends "error" with the tokens before the NaN token's
  logits, exactly as without speculation. The error message names the same token index.
Speculative cases count in their own rows ("ring+spec", ...).

What each request must give comes from the same requests served by a clean engine (mode sync,
plain toy forward, prefix caching off, no speculation): its tokens cut before the first one
sampled from the NaN token (a request's tokens depend only on its prompt, sampling and the
model). Counted, per mode:
- stream mismatches: requests whose streamed tokens (or the snapshot after submit) differ from
  their final tokens;
- misattributed errors: a NaN-row error on a request or at a token whose logits were not NaN
  (its tokens, or the token index its message names), or a request whose logits were NaN
  that did not end there with that error;
- wrong tokens: a finished request's tokens not its expected ones, or a failed one's not a
  prefix of them; problems: a hang, an unexpected error or finish reason, an engine not idle.
Exit 1 when any count is nonzero.

  python3 tools/fuzz.py --faults                                   # sim, ~1-2 min
  python3 tools/fuzz.py --faults --backend cuda --time-budget-s 60 # a GPU
  python3 tools/fuzz.py --faults --cases 4 --seed 7 --modes ring   # a few cases, one mode
  python3 tools/fuzz.py --faults --forward positional              # prefix caching in each
  python3 tools/fuzz.py --faults --speculative                     # speculation in each

On cuda a graph replays without calling Python, so a step fault there can only hit an eager
forward (a prefill, an eager or a mixed step): the fault kernel raises at its launch, and is not
captured. NaN rows reach every step, captured ones included (an in-place CuPy kernel). The
reference then runs on the same cuda backend, since CuPy's float32 sin need not round as
NumPy's does. The sim remains the full test: its replays call the fault kernel too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from tools import fuzz as base  # noqa: E402
from tools.positional_toy import PositionalToy  # noqa: E402
from vt.backend import get_backend  # noqa: E402
from vt.engine.engine import Engine  # noqa: E402
from vt.engine.scheduler import kv_blocks_needed  # noqa: E402
from vt.forward.speculative import SpeculativeConfig  # noqa: E402
from vt.forward.toy import ToyForward  # noqa: E402
from vt.forward.user import ForwardModel  # noqa: E402

FAULT_MODES = ("drain", "ring", "staged")
FORWARDS = ("toy", "positional", "both")   # --forward: which toy the cases serve
WAIT_S = 60.0   # the longest a client waits for one request: past it, a hang


# -- the faulty forward -------------------------------------------------------------------
class StepFault(Exception):
    """What the fault kernel raises (numbered: fault #n)."""


class FaultKernel:
    """A kernel that raises StepFault on its k-th call after arm(k), once. Thread-safe: armed
    from the fault thread while the stream's worker calls it."""

    name = "step_fault"

    def __init__(self):
        self._lock = threading.Lock()
        self._left: int | None = None
        self.fired = 0

    def arm(self, k: int | None) -> None:
        """Raise on the k-th call from now (None: disarm)."""
        with self._lock:
            self._left = k

    def _tick(self) -> None:
        with self._lock:
            if self._left is None:
                return
            self._left -= 1
            if self._left > 0:
                return
            self._left = None
            self.fired += 1
            n = self.fired
        raise StepFault(f"step fault #{n}")

    def run_numpy(self) -> None:
        self._tick()

    def run_cupy(self, stream_handle) -> None:   # on cuda: at launch, eager steps only
        self._tick()


class _NaNRows:
    """logits[r] = NaN for every row r whose input token is `token`."""

    name = "nan_rows"

    def __init__(self):
        self._cupy_kernel = None

    def run_numpy(self, table, rows, logits, *, token):
        logits[table[rows] == token] = np.nan

    def run_cupy(self, stream_handle, table, rows, logits, *, token):
        # In place and allocation-free: it is captured into the step's graph.
        if self._cupy_kernel is None:
            import cupy as cp
            self._cupy_kernel = cp.ElementwiseKernel(
                "raw int32 table, raw int32 rows, int32 token, int32 V", "float32 logits",
                "if (table[rows[i / V]] == token) logits = __int_as_float(0x7fc00000);",
                "vt_fuzz_nan_rows")
        self._cupy_kernel(table, rows, np.int32(token), np.int32(logits.shape[1]), logits)


_NAN_ROWS = _NaNRows()


class _InputsInRange:
    """Raises (a device-side error on the sim) when a row's input token is outside the
    vocab: a step model must feed its forward tokens it can embed, after an error row too
    (the sampler puts 0 in place of an error token)."""

    name = "inputs_in_range"

    def run_numpy(self, table, rows, *, vocab):
        tok = table[rows]
        bad = np.flatnonzero((tok < 0) | (tok >= vocab))
        if bad.size:
            raise ValueError(f"input token {int(tok[bad[0]])} of row {int(bad[0])} is outside "
                             f"the vocab [0, {vocab})")


_IN_RANGE = _InputsInRange()


class FaultyToy:
    """A toy forward plus the fault kernel (launched first in every forward: on the sim
    captured or eager, on cuda eager only), on the sim a check that every input token is in
    the vocab (else the step fails with a ValueError: a problem), and, when nan_token is
    set, NaN logits for the rows
    whose input token it is. The toy: vt.forward.toy's (recurrent state), or with positional
    tools/positional_toy.py's, whose KV is position-addressed: then prefix_cacheable, and the
    engine's prefix caching is on by default, and verifies_by_decode (speculation: max_k, the
    drafts a step verifies; noise, a draft's, tools/positional_toy.py). fault: a FaultKernel
    to share (a draft's: the target's), else its own. hold_next_eager(gate): the next eager
    forward (a prefill substep, an eager or mixed step) waits on the host for the
    threading.Event `gate` first."""

    def __init__(self, be, *, vocab: int, geometry, nan_token: int | None = None,
                 positional: bool = False, max_k: int = 0, noise: float = 0.0,
                 fault: FaultKernel | None = None):
        self.be, self.nan_token = be, nan_token
        if positional and vocab != PositionalToy.vocab:
            raise ValueError(f"FaultyToy: the positional toy's vocab is {PositionalToy.vocab}, "
                             f"got vocab={vocab}")
        if not positional and (max_k or noise):
            raise ValueError(f"FaultyToy: max_k={max_k} and noise={noise} are the positional "
                             f"toy's (speculation); the toy keeps a recurrent state")
        self.toy = (PositionalToy(be, geometry, max_k=max_k, noise=noise) if positional
                    else ToyForward(be, vocab=vocab, geometry=geometry))
        self.prefix_cacheable = self.verifies_by_decode = positional
        self.fault = fault or FaultKernel()
        self._hold: tuple[threading.Event, threading.Event] | None = None

    def hold_next_eager(self, gate: threading.Event) -> threading.Event:
        """Hold the next eager forward until `gate` is set; returns an event set once it waits."""
        held = threading.Event()
        self._hold = (gate, held)
        return held

    def __call__(self, stream, inputs, logits_out) -> None:
        capturing = self.be.is_capturing(stream)
        if self._hold is not None and not capturing:
            (gate, held), self._hold = self._hold, None
            held.set()
            gate.wait(WAIT_S)
        if not (capturing and self.be.name == "cuda"):   # a cuda replay cannot call it
            self.be.launch(stream, self.fault)
        if self.be.name == "sim":
            self.be.launch(stream, _IN_RANGE, self.toy.token_table, inputs.token_rows,
                           vocab=self.toy.vocab)
        self.toy(stream, inputs, logits_out)
        if self.nan_token is not None:
            self.be.launch(stream, _NAN_ROWS, self.toy.token_table, inputs.token_rows,
                           logits_out, token=self.nan_token)

    def step_model(self) -> ForwardModel:
        return ForwardModel(self.be, self, vocab=self.toy.vocab, token_table=self.toy.token_table,
                            geometry=self.toy.geometry)


# -- what a request must give ---------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    tokens: tuple            # the reference's tokens, cut before the NaN one
    nan_at: int | None       # index of the first token sampled from NaN logits, if any

    @classmethod
    def of(cls, prompt, ref_tokens, nan_token):
        inputs = [prompt[-1]] + list(ref_tokens[:-1])   # token i is sampled after input i
        at = next((i for i, tok in enumerate(inputs) if tok == nan_token), None)
        return cls(tuple(ref_tokens[:at] if at is not None else ref_tokens), at)


def pick_nan_token(prompts, ref_tokens, vocab: int, rng: random.Random) -> int:
    """The token whose logits go NaN: the one that ends the most requests on their LAST
    token (the case where a row's next request is admitted before the error row is
    stored), a random one when none does."""
    at_last = np.zeros(vocab, np.int64)
    for prompt, toks in zip(prompts, ref_tokens):
        inputs = [prompt[-1]] + list(toks[:-1])
        if toks and inputs[-1] not in inputs[:-1]:
            at_last[inputs[-1]] += 1
    if not at_last.any():
        return rng.randrange(vocab)
    best = np.flatnonzero(at_last == at_last.max())
    return int(best[rng.randrange(len(best))])


@dataclass
class Outcome:
    """One request as its client saw it."""
    index: int
    early: list = field(default_factory=list)     # snapshot() right after submit()
    streamed: list = field(default_factory=list)
    final: list = field(default_factory=list)
    finish: str | None = None   # None: result() raised (the step failed)
    message: str | None = None  # RequestResult.error (an error row)
    error: BaseException | None = None
    hung: bool = False


def judge(exp: Expected, out: Outcome) -> dict:
    """The counts this request adds (each 0 or 1) and a line saying what went wrong."""
    got, want = tuple(out.final), exp.tokens
    c = dict(stream_mismatch=0, misattributed=0, wrong_tokens=0, problem=0)
    why = []
    if out.hung:
        c["problem"], why = 1, ["hung"]
        return dict(c, why=why)
    if out.streamed != out.final or out.early != out.final[:len(out.early)]:
        c["stream_mismatch"] = 1
        why.append(f"streamed {out.streamed} (early {out.early}) but final {out.final}")
    if out.finish is None:                           # a step failed while it held a row
        if not _is_step_fault(out.error):
            c["problem"] = 1
            why.append(f"failed with {type(out.error).__name__}: {out.error}")
        if got != want[:len(got)]:
            c["wrong_tokens"] = 1
            why.append(f"failed with {list(got)}, not a prefix of {list(want)}")
    elif out.finish == "error":                      # an error row: must be its NaN one
        if exp.nan_at is None or got != want or f"token {exp.nan_at} " not in (out.message or ""):
            c["misattributed"] = 1
            why.append(f"error row {out.message!r} with {list(got)}; expected "
                       f"{list(want)} (NaN at {exp.nan_at})")
    elif out.finish in ("length", "stop"):
        if exp.nan_at is not None:
            c["misattributed"] = 1
            why.append(f"{out.finish} with {list(got)}; its logits were NaN at {exp.nan_at}")
        elif got != want:
            c["wrong_tokens"] = 1
            why.append(f"{out.finish} with {list(got)}; expected {list(want)}")
    else:
        c["problem"] = 1
        why.append(f"finish_reason {out.finish!r}")
    return dict(c, why=why)


def _is_step_fault(exc) -> bool:
    while exc is not None:
        if isinstance(exc, StepFault):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# -- serving a case online -----------------------------------------------------------------
def _client(eng, items, stop, seed: int, max_gap_s: float, outcomes: dict) -> None:
    rng = random.Random(seed)
    for index, req in items:
        time.sleep(rng.uniform(0, max_gap_s))
        out = outcomes[index] = Outcome(index)
        h = eng.submit(np.asarray(req.prompt, np.int32), max_new_tokens=req.budget,
                       stop_token=stop, sampling=req.sampling)
        out.early = h.snapshot()[0].tolist()
        try:
            for tok in h.stream(timeout=WAIT_S):
                out.streamed.append(tok)
        except TimeoutError:
            out.hung = True
            continue
        except Exception as exc:  # noqa: BLE001 (judged: a step fault is expected)
            out.error = exc
        out.final = h.snapshot()[0].tolist()
        try:
            res = h.result(timeout=WAIT_S)
            out.finish, out.message = res.finish_reason, res.error
        except TimeoutError:
            out.hung = True
        except Exception as exc:  # noqa: BLE001
            out.error = out.error or exc


def _fault_thread(kernel: FaultKernel, done: threading.Event, seed: int, gap_s: float) -> None:
    """Arms the fault kernel at random moments. The first step of the case fails (armed for
    the next call, and not re-armed until it fired), so that every case sees a fault however
    fast its requests are served; later faults come at random."""
    rng = random.Random(seed)
    kernel.arm(1)
    while kernel.fired == 0 and not done.wait(0.001):
        pass
    while not done.wait(rng.uniform(0, 2 * gap_s)):
        kernel.arm(rng.randint(1, 24))
    kernel.arm(None)


@dataclass
class ModeReport:
    mode: str
    requests: int
    counts: dict
    faults: int
    failed_steps: int
    outcomes: dict              # finish kind -> requests
    failures: list              # (request index, why)
    cached_tokens: int = 0      # prompt tokens served from the prefix cache
    speculative: dict | None = None   # the engine's stats()["speculative"] (None: none)


def serve_faulty(case, mode: str, reqs, stop, nan_token: int, *, seed: int,
                 fault_gap_s: float, max_gap_s: float, be=None,
                 follows: dict | None = None,
                 references: dict | None = None) -> tuple[dict, FaultKernel, dict]:
    """The case's requests served online in `mode` on a FaultyToy under random step faults
    (the positional toy with prefix caching on when the case's model is "positional"; with a
    speculative case's speculation, `references` its oracle's): each request's Outcome, the
    fault kernel, the engine's stats. follows: {j: i}, request j is request i's next turn:
    the client that sends i sends j once i's result is in. `be`: a backend to serve on (kept
    open); None: a new sim backend with the case's device delay."""
    own_be = be is None
    be = get_backend("sim", device_delay_s=case.sim_delay_s) if own_be else be
    positional = case.model == "positional"
    fwd = FaultyToy(be, vocab=case.vocab, geometry=case.geometry, nan_token=nan_token,
                    positional=positional, max_k=case.spec_k)
    outcomes, done = {}, threading.Event()
    try:
        config, hooks = base.mode_config(case, mode)
        with Engine(be, fwd.step_model(), config, hooks=hooks,
                    max_prefill_tokens=case.max_prefill_tokens, prefix_caching=positional,
                    speculative=_spec_config(be, case, fwd, references)) as eng:
            conversations = _conversations(len(reqs), follows or {})
            n_clients = max(1, min(len(conversations), case.serving_conc + 1, 8))
            shares = [[(i, reqs[i]) for k, turns in enumerate(conversations)
                       if k % n_clients == c for i in turns]
                      for c in range(n_clients)]
            clients = [threading.Thread(target=_client, args=(eng, share, stop, seed * 31 + c,
                                                              max_gap_s, outcomes))
                       for c, share in enumerate(shares)]
            faults = threading.Thread(target=_fault_thread, args=(fwd.fault, done, seed, fault_gap_s))
            faults.start()
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            done.set()
            faults.join()
            deadline = time.monotonic() + WAIT_S
            while not eng.idle() and time.monotonic() < deadline:
                time.sleep(0.001)
            stats = dict(eng.stats(), idle=eng.idle())
    finally:
        done.set()
        if own_be:
            be.close()
    return outcomes, fwd.fault, stats


def _spec_config(be, case, target: FaultyToy, references: dict | None):
    """A speculative case's SpeculativeConfig (tools/fuzz.py's spec_config), its draft a
    FaultyToy sharing the target's fault kernel, without NaN rows; None for another case."""
    if case.speculative != "draft":
        return base.spec_config(be, case, references)
    draft = FaultyToy(be, vocab=case.vocab, geometry=case.geometry, positional=True,
                      max_k=case.spec_k, noise=case.draft_noise, fault=target.fault)
    return SpeculativeConfig("draft", k=case.spec_k, draft=draft.step_model())


def _conversations(n: int, follows: dict) -> list[list[int]]:
    """Requests 0..n-1 as conversations, each in turn order ({j: i}: j is i's next turn)."""
    nxt = {i: j for j, i in follows.items()}
    out = []
    for i in range(n):
        if i in follows:
            continue
        turns = [i]
        while turns[-1] in nxt:
            turns.append(nxt[turns[-1]])
        out.append(turns)
    return out


def second_turns(case, reqs, ref_results, rng: random.Random) -> list:
    """For each first turn whose history fits: its next turn, the prompt, the reference's
    tokens and 1-3 new ones, with a budget of up to 8 and a new seed; those that do not fit
    the case's context or KV pool (a request's blocks, k more positions' with speculation,
    and the scratch one) are None."""
    out, bs = [], case.block_size
    for r, res in zip(reqs, ref_results):
        prompt = tuple(r.prompt) + tuple(int(t) for t in res.tokens) + tuple(
            rng.randrange(case.vocab) for _ in range(rng.randint(1, 3)))
        room = case.max_context - len(prompt) + 1
        if room < 1:
            out.append(None)
            continue
        budget = rng.randint(1, min(8, room))
        if kv_blocks_needed(len(prompt), budget, case.geometry, case.spec_k) + 1 > case.num_kv_blocks:
            out.append(None)
            continue
        out.append(dataclasses.replace(r, prompt=prompt, budget=budget,
                                       seed=(r.seed + 1) % 2**63))
    return out


def positional_case(seed: int, *, max_requests: int, sim_delays=(0.0,), speculative: bool = False):
    """tools/fuzz.py's drawer on its positional model: prompts sharing prefixes, budgets of
    at most 8 (room for a second turn); speculative: with speculation drawn."""
    return base.numpy_case(seed, model="positional", max_requests=max_requests, max_rounds=1,
                           max_budget=8, sim_delays=sim_delays, speculative=speculative)


def run_fault_case(case, *, modes=FAULT_MODES, seed: int = 0, fault_gap_s: float = 0.15,
                   max_gap_s: float = 0.003, be=None) -> list[ModeReport]:
    """The reference (sync, clean toy, prefix caching off, no speculation), then each mode
    under faults (a speculative case's with its speculation, the oracle's references the
    reference's tokens); judged per request. A positional case gets second turns
    (second_turns, built from the reference's tokens, referenced too) served after their
    first by the same client, with prefix caching on. `be`: one backend for all of them
    (cuda); None: fresh sim backends."""
    reqs, stop = case.rounds[0], case.stops[0]
    ref_be = be or get_backend("sim")
    models = base.Models()
    follows = {}
    try:
        ref = base.run_mode(ref_be, models, case, "sync", reference=True).rounds[0]
        if case.model == "positional":
            nxt = second_turns(case, reqs, ref, random.Random(seed))
            firsts = [i for i, r in enumerate(nxt) if r is not None]
            if firsts:
                more = tuple(nxt[i] for i in firsts)
                ref2 = base.run_mode(ref_be, models, dataclasses.replace(
                    case, rounds=(more,), stops=(stop,)), "sync", reference=True).rounds[0]
                follows = {len(reqs) + k: i for k, i in enumerate(firsts)}
                reqs, ref = tuple(reqs) + more, list(ref) + list(ref2)
    finally:
        models.close()
        if be is None:
            ref_be.close()
    nan_token = pick_nan_token([r.prompt for r in reqs], [res.tokens for res in ref],
                               case.vocab, random.Random(seed))
    expected = [Expected.of(r.prompt, res.tokens, nan_token) for r, res in zip(reqs, ref)]
    references = {tuple(int(t) for t in r.prompt): list(res.tokens) for r, res in zip(reqs, ref)}
    reports = []
    for mode in modes:
        outcomes, kernel, stats = serve_faulty(case, mode, reqs, stop, nan_token, seed=seed,
                                               fault_gap_s=fault_gap_s, max_gap_s=max_gap_s,
                                               be=be, follows=follows, references=references)
        counts = dict(stream_mismatch=0, misattributed=0, wrong_tokens=0, problem=0)
        kinds, failures = {}, []
        for i, exp in enumerate(expected):
            out = outcomes.get(i)
            if out is None:
                counts["problem"] += 1
                failures.append((i, ["never submitted (a client thread died)"]))
                continue
            verdict = judge(exp, out)
            for k in counts:
                counts[k] += verdict[k]
            if verdict["why"]:
                failures.append((i, verdict["why"]))
            kind = "fault" if out.finish is None else out.finish
            kinds[kind] = kinds.get(kind, 0) + 1
        if not stats["idle"]:
            counts["problem"] += 1
            failures.append((-1, ["the engine was not idle after every request finished"]))
        reports.append(ModeReport(mode, len(reqs), counts, kernel.fired, stats["failed_steps"],
                                  kinds, failures, stats["prefix_cache"]["cached_tokens"],
                                  stats.get("speculative")))
    return reports


# -- the command line -------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/fuzz.py --faults",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=12, help="random cases (each in every mode)")
    ap.add_argument("--seed", type=int, default=0, help="case i uses seed + i")
    ap.add_argument("--modes", nargs="+", default=list(FAULT_MODES), choices=FAULT_MODES)
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim",
                    help="cuda: step faults hit eager forwards only (see above)")
    ap.add_argument("--max-requests", type=int, default=32, help="requests per case, at most")
    ap.add_argument("--forward", choices=FORWARDS, default="both",
                    help="the cases' toy: the toy (recurrent state), the positional toy (prefix "
                         "caching on, shared prefixes, second turns) or both, case by case")
    ap.add_argument("--speculative", action="store_true",
                    help="every case speculative (the positional toy through a speculative "
                         "engine; proposer and k drawn per case)")
    ap.add_argument("--spec-every", type=int, default=3,
                    help="every Nth case is speculative (0: none), unless --forward toy")
    ap.add_argument("--fault-gap-ms", type=float, default=150.0,
                    help="mean time between two armings of the fault kernel")
    ap.add_argument("--time-budget-s", type=float, default=300.0,
                    help="stop drawing new cases after this long (the report says so)")
    ap.add_argument("--json", default=None, help="write the totals here")
    args = ap.parse_args(argv)
    if args.cases < 1 or args.max_requests < 1 or not args.fault_gap_ms > 0:
        ap.error("--cases and --max-requests must be positive, --fault-gap-ms > 0")
    if args.spec_every < 0:
        ap.error(f"--spec-every must be >= 0, got {args.spec_every}")
    if args.speculative and args.forward == "toy":
        ap.error("--speculative needs the positional toy (--forward positional or both): the "
                 "toy keeps a recurrent state, so it cannot verify by decode")

    try:
        be = get_backend("cuda") if args.backend == "cuda" else None
    except RuntimeError as exc:
        ap.error(str(exc))
    try:
        return _fuzz(args, be)
    finally:
        if be is not None:
            be.close()


def _fuzz(args, be) -> int:
    """The cases of main's arguments; the table and the exit code (be: cuda's, or None)."""
    totals = {}
    spec = dict(cases=0, verify_rows=0, drafts=0, accepted=0, **{m: 0 for m in base.SPEC_METHODS},
                **{f"k={k}": 0 for k in base.SPEC_KS})
    t0, ran, out_of_time = time.perf_counter(), 0, False
    for i in range(args.cases):
        if time.perf_counter() - t0 > args.time_budget_s:
            out_of_time = True
            break
        seed = args.seed + i
        delays = (0.0, 1e-4, 3e-4) if be is None else (0.0,)
        speculative = args.forward != "toy" and (args.speculative or (
            args.spec_every > 0 and i % args.spec_every == args.spec_every - 1))
        if speculative or args.forward == "positional" or (args.forward == "both" and i % 2):
            case = positional_case(seed, max_requests=args.max_requests, sim_delays=delays,
                                   speculative=speculative)
        else:
            case = base.numpy_case(seed, max_requests=args.max_requests, max_rounds=1,
                                   sim_delays=delays)
        tc = time.perf_counter()
        reports = run_fault_case(case, modes=args.modes, seed=seed,
                                 fault_gap_s=args.fault_gap_ms / 1e3, be=be)
        ran += 1
        bad = [r for r in reports if any(r.counts.values())]
        print(f"case seed={seed} {case.label} requests={reports[0].requests} conc={case.serving_conc} "
              f"sizes={list(case.capture_sizes)} delay={case.sim_delay_s}"
              f"{f' spec={case.spec_summary()}' if case.speculative else ''}: "
              + ", ".join(f"{r.mode} {r.faults} faults/{sum(v for k, v in r.outcomes.items() if k != 'fault')}"
                          f" served" for r in reports)
              + f" in {time.perf_counter() - tc:.1f}s{'  FAILED' if bad else ''}", flush=True)
        if case.speculative:
            spec["cases"] += 1
            spec[case.speculative] += 1
            spec[f"k={case.spec_k}"] += 1
        for r in reports:
            t = totals.setdefault(r.mode + ("+spec" if case.speculative else ""), dict(
                requests=0, faults=0, failed_steps=0, cached_tokens=0, stream_mismatch=0,
                misattributed=0, wrong_tokens=0, problem=0, kinds={}))
            for k in ("verify_rows", "drafts", "accepted"):
                spec[k] += (r.speculative or {}).get(k, 0)
            t["requests"] += r.requests
            t["faults"] += r.faults
            t["failed_steps"] += r.failed_steps
            t["cached_tokens"] += r.cached_tokens
            for k, v in r.counts.items():
                t[k] += v
            for k, v in r.outcomes.items():
                t["kinds"][k] = t["kinds"].get(k, 0) + v
            for index, why in r.failures[:5]:
                print(f"  {r.mode} request {index}: {'; '.join(why)}", flush=True)
        if bad:
            print(f"  replay: python3 tools/fuzz.py --faults --backend {args.backend} --seed {seed} "
                  f"--cases 1 --forward {case.model}"
                  f"{' --speculative' if case.speculative else ' --spec-every 0'}", flush=True)

    print(f"\nfault fuzz on {args.backend}: {ran} cases in {time.perf_counter() - t0:.1f}s"
          f"{' (time budget reached)' if out_of_time else ''}")
    print(f"{'mode':<12} {'requests':>8} {'faults':>6} {'failed':>6} {'cached':>6} {'length':>6} {'stop':>5} "
          f"{'nan':>4} {'fault':>5} {'stream-mismatch':>15} {'misattributed':>13} "
          f"{'wrong-tokens':>12} {'problems':>8}")
    for mode, t in totals.items():
        k = t["kinds"]
        print(f"{mode:<12} {t['requests']:>8} {t['faults']:>6} {t['failed_steps']:>6} {t['cached_tokens']:>6} "
              f"{k.get('length', 0):>6} {k.get('stop', 0):>5} {k.get('error', 0):>4} "
              f"{k.get('fault', 0):>5} {t['stream_mismatch']:>15} {t['misattributed']:>13} "
              f"{t['wrong_tokens']:>12} {t['problem']:>8}")
    if spec["cases"]:
        print(f"speculative cases: {spec['cases']} ("
              + ", ".join(f"{m} {spec[m]}" for m in base.SPEC_METHODS) + "; "
              + ", ".join(f"k={k} {spec[f'k={k}']}" for k in base.SPEC_KS)
              + f"); {spec['accepted']}/{spec['drafts']} drafts accepted over "
              f"{spec['verify_rows']} verify rows")
    sums = {k: sum(t[k] for t in totals.values())
            for k in ("stream_mismatch", "misattributed", "wrong_tokens", "problem")}
    print(f"requests whose streamed tokens differ from their result: {sums['stream_mismatch']}; "
          f"errors attributed to the wrong request: {sums['misattributed']}; wrong tokens: "
          f"{sums['wrong_tokens']}; problems: {sums['problem']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cases=ran, seed=args.seed, backend=args.backend,
                                                   totals=totals, speculative=spec,
                                                   **sums), indent=1))
        print(f"wrote {args.json}")
    return 1 if any(sums.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
