"""Differential fuzz of the executor modes: every safe mode against the synchronous run.

A *case* is a random serving workload and an engine configuration: one or more rounds of
requests (one generate() each, on the same engine) with random prompts, budgets, per-request
sampling (greedy, or temperature + top_k + top_p + min_p + seed) and a stop token; capture sizes (possibly
none: every step eager), serving concurrency, KV geometry (tight caches make
requests wait for blocks), sim device delay or, on cuda, queued device work per step (the host
runs ahead of the device). Each case runs in mode "sync" (depth 1, the reference) and in every
safe mode of vt.config.SAFE_MODES, POISON on for the async ones (and drawn for drain), and
compares token for token, finish_reason and logits bytes: the schedule is the same at every
depth, so the runs must be byte-identical. The "positional" model (tools/positional_toy.py,
position-addressed KV) draws prompts that share prefixes and serves them with prefix caching
on, against a reference with it off: cached blocks must give the same bytes. The unsafe arm (mode unguarded + POISON) runs on
the same cases and must show mismatches, or the harness is blind.

Speculative cases (every third case by default, each with --speculative, none with
--spec-every 0) serve the positional toy through a speculative engine
(Engine(..., speculative=...), docs/speculative.md) in every safe mode, sync included, with
prefix caching on, against the same reference: sync, no speculation, caching off. The
proposer is drawn per case from ngram, draft (a second positional toy of the same geometry:
the target's twin, every draft accepted, or one with noisy logits that agrees sometimes) and
oracle (the reference's tokens, all or half of each step's drafts right), k from 1, 2, 4.
Greedy and seeded sampled tokens must equal the reference's exactly: docs/speculative.md
promises it wherever a verify step's logits are the one-token step's bit for bit, which the
numpy toys' are. Logits are not compared (a speculative engine does not record them). The
toy (recurrent state) and the bundled hybrids cannot verify by decode, so only the
positional toy speculates; its report rows are "positional+spec", with "reference" the
non-speculative sync run.

  python3 tools/fuzz.py --backend sim --steps-per-mode 2000                 # CPU, ~1 min
  python3 tools/fuzz.py --backend cuda --steps-per-mode 2000 --json fuzz.json   # H200, ~2 min
  python3 tools/fuzz.py --backend sim --seed 17 --cases 1 --models toy      # replay a case seed
  python3 tools/fuzz.py --backend sim --replay case.json                    # replay a printed case
  python3 tools/fuzz.py --faults          # step faults and NaN rows, online (tools/fuzz_faults.py)
  python3 tools/fuzz.py --speculative --time-budget-s 60   # every case speculative

Per model and mode it reports steps (all kinds), graph steps, requests, prompt tokens served
from the prefix cache (cached), mismatches vs sync
(request level: tokens, finish_reason, logits bytes; greedy ones with the top-2 logit gap at
the first divergence, so a float-rounding flip is told apart from a wrong input), and with
--alone-cases N, batch invariance: the sync run's requests served alone (serving_conc=1)
against the same requests in their batch. On the GPU different batch shapes may change the
bundled model's float rounding (cuBLAS picks kernels by shape), so those flips are counted and
reported, not hidden and not failed; between modes the shapes are the same and nothing may
differ. Exit code 1 when a safe mode mismatched or broke a request, or when the unsafe arm
showed no mismatch.

The case drawing is written once against a small drawer interface (NumpyDraw here, a
hypothesis-backed drawer in tests/executor/_fuzz.py), so the GPU runner and the tests share
one distribution.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
from vt.backend import get_backend  # noqa: E402
from vt.engine.engine import Engine  # noqa: E402
from vt.engine.scheduler import kv_blocks_needed  # noqa: E402
from vt.config import MODES, SAFE_MODES, ExecutorConfig  # noqa: E402
from vt.forward.speculative import SpeculativeConfig  # noqa: E402
from vt.step.contract import KVGeometry, SamplingParams  # noqa: E402
from vt.hooks import NULL_HOOKS, Poison, with_device_work  # noqa: E402

ASYNC_MODES = tuple(m for m in MODES if ExecutorConfig(mode=m).guarded)   # the ring modes
UNSAFE = "unguarded+poison"
CAPTURE_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
TOY_VOCAB = 64
BUNDLED = ("tiny-dense", "tiny-moe")
BUNDLED_MAX_SEQS, BUNDLED_KV_BLOCKS = 16, 96   # 96 blocks of 8: requests wait for blocks
ALONE_REQUESTS = 12
TOYS = ("toy", "positional")   # the toy forwards: their geometry is drawn
SPEC_MODELS = ("positional",)   # the models that verify by decode (docs/speculative.md)
SPEC_METHODS = ("ngram", "draft", "oracle")
SPEC_KS = (1, 2, 4)
DRAFT_NOISES = (0.0, 0.001, 0.01, 1.0)   # 0: the target's twin (every draft accepted)
REFERENCE = "reference"   # a speculative case's reference run (sync, no speculation)


# -- cases ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Req:
    prompt: tuple
    budget: int
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=self.seed)


@dataclass(frozen=True)
class Case:
    model: str                  # "toy", "positional" or a vt.bundled preset
    vocab: int
    max_seqs: int
    num_kv_blocks: int          # the scratch block included (KVGeometry)
    block_size: int
    max_context: int
    rounds: tuple               # tuple of tuple[Req]: one generate() each, same engine
    stops: tuple                # per round: stop token or None
    capture_sizes: tuple
    serving_conc: int
    drain_poison: bool
    sim_delay_s: float = 0.0    # sim: device delay per op
    device_work_s: float = 0.0  # cuda: queued device time per decode (the host runs ahead)
    record_logits: bool = True  # the modes under test (the sync reference always records)
    profile: bool = False       # timing events around each step
    wait_poll_us: float | None = None   # ExecutorConfig.wait_poll_us (None: the default)
    max_prefill_tokens: int | None = None   # Engine(max_prefill_tokens=...): prompts per step
    seed: int | None = None     # the NumpyDraw seed it came from (None: drawn by hypothesis)
    speculative: str | None = None   # the proposer of a speculative case (SPEC_METHODS)
    spec_k: int = 0             # its drafts per step
    draft_noise: float = 0.0    # method "draft": the draft's logits noise (0: the target's twin)
    oracle_accept: float = 1.0  # method "oracle": the fraction of each step's drafts kept right

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(max_seqs=self.max_seqs, num_kv_blocks=self.num_kv_blocks,
                          block_size=self.block_size, max_context=self.max_context)

    @property
    def requests(self) -> int:
        return sum(len(r) for r in self.rounds)

    @property
    def label(self) -> str:
        """The report's model column: the model, "+spec" for a speculative case."""
        return f"{self.model}+spec" if self.speculative else self.model

    @property
    def reference_key(self) -> str:
        """The run the others are compared with: "sync", or a speculative case's REFERENCE
        (its own "sync" run is speculative, and compared too)."""
        return REFERENCE if self.speculative else "sync"

    def spec_summary(self) -> str:
        """The speculation drawn, in words ("" for none)."""
        if not self.speculative:
            return ""
        extra = {"draft": f" noise {self.draft_noise}", "oracle": f" accept {self.oracle_accept}"}
        return f"{self.speculative} k={self.spec_k}{extra.get(self.speculative, '')}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        d = json.loads(text)
        d["rounds"] = tuple(tuple(Req(tuple(r["prompt"]), r["budget"], r["temperature"],
                                      r["top_k"], r["seed"], r.get("top_p", 1.0), r.get("min_p", 0.0))
                                  for r in rnd) for rnd in d["rounds"])
        d["stops"], d["capture_sizes"] = tuple(d["stops"]), tuple(d["capture_sizes"])
        return cls(**d)

    def replay_hint(self) -> str:
        """The command that runs exactly this case again (its JSON: exact whatever drew it)."""
        backend = "cuda" if self.model not in TOYS or self.device_work_s else "sim"
        return f"python3 tools/fuzz.py --backend {backend} --replay '{self.to_json()}'"


class NumpyDraw:
    """The drawer interface over a numpy Generator (hypothesis has its own, same methods)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:          # inclusive
        return int(self.rng.integers(lo, hi + 1))

    def bool(self) -> bool:
        return bool(self.rng.integers(0, 2))

    def choice(self, options):
        return options[int(self.rng.integers(0, len(options)))]


def draw_case(d, *, model: str = "toy", max_requests: int = 24, max_rounds: int = 2,
              sim_delays=(0.0,), device_works=(0.0,), max_prompt: int = 12,
              max_budget: int | None = None, max_round_steps: int = 150,
              seed: int | None = None, speculative: bool = False) -> Case:
    """One case from drawer `d`. A toy's geometry is drawn; a bundled preset's is the
    model's (tools' HybridModel of BUNDLED_MAX_SEQS rows and BUNDLED_KV_BLOCKS blocks). The
    positional toy's prompts start with one of a few shared prefixes (or are one whole), so
    later requests and rounds hit the prefix cache. A
    round's budgets add up to at most serving_conc * max_round_steps tokens (about that many
    steps): the cost of a case stays bounded whatever the concurrency drawn.
    speculative: a speculative case (a model of SPEC_MODELS): its proposer, k and the
    proposer's knob are drawn after everything else (so a seed draws the same workload with
    speculation or without), its KV pool grown by the k positions a request reserves more."""
    if speculative and model not in SPEC_MODELS:
        raise ValueError(f"draw_case: speculative=True needs a model that verifies by decode "
                         f"({', '.join(SPEC_MODELS)}), got model={model!r}")
    if model in TOYS:
        vocab, bs = TOY_VOCAB, d.choice((2, 4, 8))
        ctx, max_seqs = d.choice((16, 32, 48)), d.choice((4, 8, 16))
    else:
        from vt.bundled import PRESETS
        cfg = PRESETS[model]
        vocab, bs, ctx, max_seqs = cfg.vocab, cfg.kv_block_size, cfg.max_context, BUNDLED_MAX_SEQS
    max_budget = max_budget or ctx
    conc = d.int(1, max_seqs)
    longest = min(max_prompt, ctx)
    prefixes = tuple(tuple(d.int(0, vocab - 1) for _ in range(d.int(min(bs, longest), longest)))
                     for _ in range(d.int(1, 3))) if model == "positional" else ()   # a block or more
    rounds, stops, need = [], [], 1
    for _ in range(d.int(1, max_rounds)):
        reqs, tokens = [], 0
        for _ in range(d.int(1, max_requests)):
            if prefixes:
                prefix = d.choice(prefixes)
                prompt = prefix + tuple(d.int(0, vocab - 1)
                                        for _ in range(d.int(0, longest - len(prefix))))
                plen = len(prompt)
            else:
                plen = d.int(1, longest)
                prompt = tuple(d.int(0, vocab - 1) for _ in range(plen))
            budget = d.int(1, min(max_budget, ctx - plen + 1))
            tokens += budget
            if reqs and tokens > conc * max_round_steps:
                break
            kind = d.int(0, 2)                       # 0 greedy, 1-2 sampled (a third greedy)
            if kind == 0:
                reqs.append(Req(prompt, budget))
            else:
                seed_ = d.int(0, 2**63 - 1) if d.bool() else d.int(0, 7)   # small seeds collide
                top_k = d.choice((None, d.int(1, vocab)))
                top_p = d.choice((1.0, d.int(1, 10) / 10))
                min_p = d.choice((0.0, d.int(0, 9) / 20))
                reqs.append(Req(prompt, budget, d.int(1, 30) / 10, top_k, seed_, top_p, min_p))
            need = max(need, -(-(plen + budget - 1) // bs))
        rounds.append(tuple(reqs))
        stops.append(d.int(0, vocab - 1) if d.bool() else None)
    if model in TOYS:    # from one request's worth of blocks (+ scratch) to plenty
        num_kv_blocks = need + 1 + d.choice((0, d.int(0, need * max_seqs)))
    else:
        num_kv_blocks = BUNDLED_KV_BLOCKS + 1
    sizes = tuple(s for s in CAPTURE_CHOICES if s <= max_seqs and d.bool())
    case = Case(model=model, vocab=vocab, max_seqs=max_seqs, num_kv_blocks=num_kv_blocks,
                block_size=bs, max_context=ctx, rounds=tuple(rounds), stops=tuple(stops),
                capture_sizes=sizes, serving_conc=conc, drain_poison=d.bool(), sim_delay_s=d.choice(tuple(sim_delays)),
                device_work_s=d.choice(tuple(device_works)), record_logits=d.bool(),
                profile=d.bool(), wait_poll_us=d.choice((None, 0, 20, 200)),
                max_prefill_tokens=d.choice((None, 2 * ctx, 4 * ctx)), seed=seed)
    if not speculative:
        return case
    method, k = d.choice(SPEC_METHODS), d.choice(SPEC_KS)
    noise = d.choice(DRAFT_NOISES) if method == "draft" else 0.0
    accept = d.choice((1.0, 0.5)) if method == "oracle" else 1.0
    return with_speculation(case, method, k, draft_noise=noise, oracle_accept=accept)


def with_speculation(case: Case, method: str, k: int, *, draft_noise: float = 0.0,
                     oracle_accept: float = 1.0) -> Case:
    """`case` (not speculative, of a SPEC_MODELS model) served with speculation: its KV pool
    grown by the k positions a request reserves more (kv_blocks_needed), logits not recorded
    (a speculative engine refuses to), and with the target's twin as the draft every
    request greedy, so that every draft must be accepted (check_results)."""
    if case.model not in SPEC_MODELS or case.speculative:
        raise ValueError(f"with_speculation: needs a case of {', '.join(SPEC_MODELS)} without "
                         f"speculation, got model={case.model!r}, speculative={case.speculative!r}")
    if method not in SPEC_METHODS or k not in SPEC_KS:
        raise ValueError(f"with_speculation: method must be one of {SPEC_METHODS} and k one of "
                         f"{SPEC_KS}, got {method!r}, {k!r}")
    rounds = case.rounds
    if method == "draft" and draft_noise == 0.0:
        rounds = tuple(tuple(Req(r.prompt, r.budget) for r in rnd) for rnd in rounds)
    geo = case.geometry
    more = max(kv_blocks_needed(len(r.prompt), r.budget, geo, k) -
               kv_blocks_needed(len(r.prompt), r.budget, geo) for rnd in rounds for r in rnd)
    return dataclasses.replace(case, rounds=rounds, num_kv_blocks=case.num_kv_blocks + more,
                               record_logits=False, speculative=method, spec_k=k,
                               draft_noise=draft_noise if method == "draft" else 0.0,
                               oracle_accept=oracle_accept if method == "oracle" else 1.0)


def numpy_case(seed: int, **kw) -> Case:
    return draw_case(NumpyDraw(np.random.default_rng(seed)), seed=seed, **kw)


# -- running ----------------------------------------------------------------------------
@dataclass
class ModeRun:
    mode: str
    rounds: list                # per round: list[RequestResult]
    stats: dict


def mode_config(case: Case, mode: str):
    """The ExecutorConfig of `mode` for this case and its test hooks ("unguarded+poison": the
    unsafe arm)."""
    base = dict(serving_conc=case.serving_conc, capture_sizes=case.capture_sizes,
                wait_poll_us=case.wait_poll_us)
    if mode == UNSAFE:
        return ExecutorConfig(mode="unguarded", **base), Poison()
    poison = mode in ASYNC_MODES or (mode == "drain" and case.drain_poison)
    return ExecutorConfig(mode=mode, **base), (Poison() if poison else NULL_HOOKS)


class Models:
    """Step models per case: a fresh toy per engine; one HybridModel per (backend, preset),
    shared by every engine (a run on a model that served others == on a fresh one). Prefix
    caching is on (by default) for the positional toy only: the others keep recurrent state."""

    def __init__(self):
        self._bundled = {}

    def step_model(self, be, case: Case, device_work_s: float):
        if case.model == "toy":
            from vt.forward.toy import ToyForward
            return with_device_work(ToyForward(be, vocab=case.vocab, geometry=case.geometry)
                                    .step_model(), device_work_s)
        if case.model == "positional":
            from tools.positional_toy import PositionalToy
            return PositionalToy(be, case.geometry, max_k=case.spec_k).step_model(device_work_s)
        from vt.forward.hybrid import HybridStepModel
        key = (id(be), case.model)
        if key not in self._bundled:
            from vt.bundled import PRESETS, HybridModel, init_weights
            cfg = PRESETS[case.model]
            self._bundled[key] = HybridModel(be, cfg, init_weights(cfg, seed=0),
                                             max_seqs=BUNDLED_MAX_SEQS,
                                             num_kv_blocks=BUNDLED_KV_BLOCKS)
        return with_device_work(HybridStepModel(be, self._bundled[key]), device_work_s)

    def close(self):
        for m in self._bundled.values():
            m.close()
        self._bundled.clear()


def spec_config(be, case: Case, references: dict | None) -> SpeculativeConfig | None:
    """A speculative case's SpeculativeConfig (None for another case): the draft a fresh
    positional toy of the case's geometry on `be` (the target's twin at noise 0); the
    oracle's references, prompt tuple -> the reference run's tokens (of two requests with
    one prompt, the last: a wrong reference costs acceptance, not exactness)."""
    if not case.speculative:
        return None
    if case.speculative == "draft":
        from tools.positional_toy import PositionalToy
        draft = PositionalToy(be, case.geometry, max_k=case.spec_k, noise=case.draft_noise)
        return SpeculativeConfig("draft", k=case.spec_k, draft=draft.step_model())
    if case.speculative == "oracle":
        if references is None:
            raise ValueError("spec_config: the oracle proposer needs the reference run's tokens")
        return SpeculativeConfig("oracle", k=case.spec_k, accept=case.oracle_accept,
                                 references=references)
    return SpeculativeConfig(case.speculative, k=case.spec_k)


def references_of(case: Case, run: ModeRun) -> dict:
    """The oracle's references from a run of `case`: prompt tuple -> that run's tokens."""
    return {tuple(int(t) for t in req.prompt): list(res.tokens)
            for reqs, results in zip(case.rounds, run.rounds) for req, res in zip(reqs, results)}


def run_mode(be, models: Models, case: Case, mode: str, *, device_work_s: float = 0.0,
             reference: bool = False, references: dict | None = None) -> ModeRun:
    """Every round of the case through one engine of `mode` (the reference records logits,
    without timing events, prefix caching or speculation; the others as the case says, with
    prefix caching where the model allows it, the engine's default, and a speculative
    case's speculation: `references` are its oracle's, references_of the reference run)."""
    step = models.step_model(be, case, device_work_s)
    record, profile = (True, False) if reference else (case.record_logits, case.profile)
    config, hooks = mode_config(case, mode)
    with Engine(be, step, config, hooks=hooks, record_logits=record, profile=profile,
                max_prefill_tokens=case.max_prefill_tokens,
                prefix_caching=False if reference else None,
                speculative=None if reference else spec_config(be, case, references)) as eng:
        rounds = [eng.generate([np.asarray(r.prompt, np.int32) for r in reqs],
                               max_new_tokens=[r.budget for r in reqs], stop_token=stop,
                               sampling=[r.sampling for r in reqs])
                  for reqs, stop in zip(case.rounds, case.stops)]
        stats = eng.stats()
    return ModeRun(mode, rounds, stats)


def check_results(case: Case, run: ModeRun) -> list[str]:
    """What must hold of any run on its own: every request finished with its tokens."""
    problems = []
    for k, (reqs, stop, results) in enumerate(zip(case.rounds, case.stops, run.rounds)):
        if len(results) != len(reqs):
            problems.append(f"round {k}: {len(results)} results for {len(reqs)} requests")
        for req, res in zip(reqs, results):
            toks, where = res.tokens, f"{run.mode} round {k} request {res.index}"
            if any(not 0 <= t < case.vocab for t in toks):
                problems.append(f"{where}: token outside the vocab: {toks}")
            if res.finish_reason == "length":
                if len(toks) != req.budget or (stop is not None and stop in toks):
                    problems.append(f"{where}: 'length' with {len(toks)}/{req.budget} tokens "
                                    f"(stop {stop}): {toks}")
            elif res.finish_reason == "stop":
                if not toks or toks[-1] != stop or stop in toks[:-1] or len(toks) > req.budget:
                    problems.append(f"{where}: 'stop' (stop {stop}) with {toks}")
            else:
                problems.append(f"{where}: finish_reason {res.finish_reason!r}")
    spec = run.stats.get("speculative")
    if spec and case.speculative == "draft" and case.draft_noise == 0.0 and \
            spec["verify_rows"] and spec["acceptance_rate"] != 1.0:
        # The target's twin drafting greedy requests proposes the target's own tokens: a
        # rejected one means its KV missed an accepted token (docs/speculative.md, the draft).
        problems.append(f"{run.mode}: the target's twin as the draft had {spec['accepted']} of "
                        f"{spec['drafts']} drafts accepted, not all")
    return problems


def _top2_gap(logits, at: int):
    if logits is None or at >= len(logits):
        return None
    row = np.sort(np.asarray(logits[at], np.float64))
    return float(row[-1] - row[-2])


def compare(case: Case, ref: ModeRun, got: ModeRun) -> list[dict]:
    """Requests of `got` that differ from `ref`: tokens, finish_reason or logits bytes."""
    out = []
    for k, (reqs, a_round, b_round) in enumerate(zip(case.rounds, ref.rounds, got.rounds)):
        for req, a, b in zip(reqs, a_round, b_round):
            if a.tokens == b.tokens and a.finish_reason == b.finish_reason:
                if a.logits is not None and b.logits is not None and \
                        a.logits.tobytes() != b.logits.tobytes():
                    out.append(dict(round=k, request=a.index, kind="logits", greedy=req.temperature == 0))
                continue
            at = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
                      min(len(a.tokens), len(b.tokens)))
            out.append(dict(round=k, request=a.index,
                            kind="tokens" if a.tokens != b.tokens else "finish_reason",
                            at=at, ref=a.tokens[at:at + 4], got=b.tokens[at:at + 4],
                            ref_finish=a.finish_reason, got_finish=b.finish_reason,
                            greedy=req.temperature == 0, top2_gap=_top2_gap(a.logits, at)))
    return out


@dataclass
class CaseReport:
    case: Case
    runs: dict                  # mode -> ModeRun
    mismatches: dict            # mode -> list[dict] vs sync
    problems: list              # check_results of every run
    alone: list | None = None   # compare(batch sync, alone sync), when asked

    @property
    def steps(self) -> int:
        return sum(r.stats["steps"] for r in self.runs.values())

    def safe_failures(self) -> dict:
        return {m: mm for m, mm in self.mismatches.items() if mm and m != UNSAFE}

    def describe(self) -> str:
        lines = [f"case: {self.case.to_json()}", f"replay: {self.case.replay_hint()}"]
        if self.case.speculative:
            lines.append(f"speculative: {self.case.spec_summary()} (every run but {REFERENCE})")
        ref = self.case.reference_key
        for m, run in self.runs.items():
            st = run.stats
            lines.append(f"  {m:<17} steps {st['steps']:>5} (graph {st['graph_steps']}, eager "
                         f"{st['eager_steps']}, mixed {st['mixed_steps']}, prefill "
                         f"{st['prefill_steps']})  mismatches vs {ref}: {len(self.mismatches.get(m, []))}")
            for mm in self.mismatches.get(m, [])[:5]:
                lines.append(f"      {mm}")
        lines += [f"  problem: {p}" for p in self.problems[:10]]
        return "\n".join(lines)


def run_case(case: Case, *, backend: str = "sim", modes=SAFE_MODES, models: Models | None = None,
             be=None, unsafe: bool = False, alone: bool = False) -> CaseReport:
    """Run `case` in "sync" and each of `modes` (plus the unsafe arm if asked) and compare.

    On the sim each case gets fresh backends: the reference without delay, the others with the
    case's device delay. On cuda pass `be` (one backend for the whole run) and `models`.
    """
    own_models = models is None
    models = models or Models()
    sim = backend == "sim"
    ref_be = be or get_backend("sim")
    test_be = be or (get_backend("sim", device_delay_s=case.sim_delay_s) if case.sim_delay_s
                     else ref_be)
    work = 0.0 if sim else case.device_work_s
    ref = case.reference_key
    try:
        runs = {ref: dataclasses.replace(run_mode(ref_be, models, case, "sync", reference=True),
                                         mode=ref)}
        references = references_of(case, runs[ref]) if case.speculative else None
        tested = [m for m in modes if m != ref] + ([UNSAFE] if unsafe else [])
        for mode in tested:
            dw = max(work, 5e-4) if (mode == UNSAFE and not sim) else work
            runs[mode] = run_mode(test_be, models, case, mode, device_work_s=dw,
                                  references=references)
        problems = [p for m, r in runs.items() if m != UNSAFE for p in check_results(case, r)]
        mismatches = {m: compare(case, runs[ref], r) for m, r in runs.items() if m != ref}
        alone_mm = None
        if alone:   # the first round's first ALONE_REQUESTS requests, one at a time
            solo = dataclasses.replace(case, rounds=(case.rounds[0][:ALONE_REQUESTS],),
                                       stops=case.stops[:1], serving_conc=1)
            in_batch = ModeRun("sync", [runs[ref].rounds[0][:ALONE_REQUESTS]], {})
            alone_mm = compare(solo, in_batch, run_mode(ref_be, models, solo, "sync",
                                                        reference=True))
        return CaseReport(case, runs, mismatches, problems, alone_mm)
    finally:
        if own_models:
            models.close()
        if be is None:
            for b in {id(ref_be): ref_be, id(test_be): test_be}.values():
                b.close()


# -- the command line -------------------------------------------------------------------
def _tally_case(tally: dict, rep: CaseReport) -> None:
    t = tally.setdefault(rep.case.label, {})
    for mode, run in rep.runs.items():
        m = t.setdefault(mode, dict(steps=0, graph_steps=0, eager_steps=0, mixed_steps=0,
                                    prefill_steps=0, requests=0, cases=0, mismatches=0,
                                    token_mismatches=0, finish_mismatches=0,
                                    logits_only_mismatches=0, greedy_flips=0,
                                    greedy_flips_near_tie=0, sampled_mismatches=0,
                                    cached_tokens=0))
        for k in ("steps", "graph_steps", "eager_steps", "mixed_steps", "prefill_steps"):
            m[k] += run.stats[k]
        m["cached_tokens"] += run.stats["prefix_cache"]["cached_tokens"]
        m["requests"] += rep.case.requests
        m["cases"] += 1
        _count_mismatches(m, rep.mismatches.get(mode, []))
    if rep.case.speculative:
        _tally_speculation(tally.setdefault("_spec", {}), rep)
    if rep.alone is not None:
        a = tally.setdefault("_alone", {}).setdefault(rep.case.model, dict(
            requests=0, mismatches=0, token_mismatches=0, finish_mismatches=0,
            logits_only_mismatches=0, greedy_flips=0, greedy_flips_near_tie=0,
            sampled_mismatches=0))
        a["requests"] += min(len(rep.case.rounds[0]), ALONE_REQUESTS)
        _count_mismatches(a, rep.alone)


def _tally_speculation(s: dict, rep: CaseReport) -> None:
    """Speculative cases by proposer and k, and their runs' verify rows, drafts and accepted
    drafts (the unsafe arm's left out)."""
    c = rep.case
    s["cases"] = s.get("cases", 0) + 1
    for key in (c.speculative, f"k={c.spec_k}"):
        s[key] = s.get(key, 0) + 1
    for mode, run in rep.runs.items():
        spec = run.stats.get("speculative")
        if mode == UNSAFE or not spec:
            continue
        per = s.setdefault(f"{c.speculative} drafts", dict(verify_rows=0, drafts=0, accepted=0))
        for k in per:
            per[k] += spec[k]


def _count_mismatches(m: dict, mms: list[dict]) -> None:
    for mm in mms:
        m["mismatches"] += 1
        if mm["kind"] == "logits":
            m["logits_only_mismatches"] += 1
            continue
        m["token_mismatches" if mm["kind"] == "tokens" else "finish_mismatches"] += 1
        if mm["greedy"]:
            m["greedy_flips"] += 1
            gap = mm.get("top2_gap")
            m["greedy_flips_near_tie"] += gap is not None and gap < 1e-3
        else:
            m["sampled_mismatches"] += 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--faults" in argv:   # the fault fuzz has its own options (tools/fuzz_faults.py)
        from tools import fuzz_faults
        return fuzz_faults.main([a for a in argv if a != "--faults"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", action="store_true",
                    help="run the fault fuzz instead: random step faults and NaN rows, on the sim or "
                         "cuda (tools/fuzz_faults.py; its options: --faults --help)")
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    ap.add_argument("--models", default=None,
                    help="comma-separated: toy, positional (prefix caching on), tiny-dense, "
                         "tiny-moe (default: the two toys on sim, all four on cuda)")
    ap.add_argument("--steps-per-mode", type=int, default=2000,
                    help="stop a model once every safe mode ran this many steps on it")
    ap.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    ap.add_argument("--seed", type=int, default=0, help="case i uses seed + i (printed per case)")
    ap.add_argument("--time-budget-s", type=float, default=100.0,
                    help="stop drawing new cases after this long (the report says so)")
    ap.add_argument("--alone-cases", type=int, default=2,
                    help="per model, this many cases also run their requests alone (batch invariance)")
    ap.add_argument("--no-unsafe", action="store_true", help="skip the unguarded+poison arm")
    ap.add_argument("--speculative", action="store_true",
                    help="every case speculative (the positional toy through a speculative "
                         "engine; proposer and k drawn per case)")
    ap.add_argument("--spec-every", type=int, default=3,
                    help="every Nth case is speculative (0: none) when the positional toy is "
                         "among --models")
    ap.add_argument("--replay", default=None, help="a case's JSON (or a file holding it): run it only")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case in full")
    args = ap.parse_args(argv)

    sim = args.backend == "sim"
    models_arg = args.models or ("toy,positional" if sim else "toy,positional,tiny-dense,tiny-moe")
    names = [m.strip() for m in models_arg.split(",") if m.strip()]
    for n in names:
        if n not in TOYS + BUNDLED:
            ap.error(f"--models: unknown model {n!r}; choose from {', '.join(TOYS + BUNDLED)}")
    if args.spec_every < 0:
        ap.error(f"--spec-every must be >= 0, got {args.spec_every}")
    spec_models = [n for n in names if n in SPEC_MODELS]
    if args.speculative and not spec_models:
        ap.error(f"--speculative needs a model that verifies by decode among --models "
                 f"({', '.join(SPEC_MODELS)}); got {', '.join(names)}")
    be = None if sim else get_backend("cuda")
    models = None if sim else Models()
    draw_kw = (dict(sim_delays=(0.0, 0.0, 1e-4, 3e-4)) if sim else
               dict(device_works=(0.0, 0.0, 2e-4, 5e-4)))
    tally, reports, failures, t0 = {}, [], [], time.perf_counter()
    cases_by_model = {n: 0 for n in names}
    out_of_time = False

    def done(name):
        t = tally.get(f"{name}+spec" if args.speculative else name, {})
        return all(t.get(m, {}).get("steps", 0) >= args.steps_per_mode for m in SAFE_MODES)

    def speculative_slot(i: int) -> bool:
        return bool(spec_models) and (args.speculative or (
            args.spec_every > 0 and i % args.spec_every == args.spec_every - 1))

    try:
        if args.replay:
            text = args.replay if args.replay.lstrip().startswith("{") else \
                Path(args.replay).read_text()
            queue = [Case.from_json(text)]
        else:
            queue = None
        i = 0
        while True:
            if queue is not None:
                if not queue:
                    break
                case = queue.pop()
            else:
                live = [n for n in names if not done(n)]
                if not live or (args.cases is not None and i >= args.cases):
                    break
                if time.perf_counter() - t0 > args.time_budget_s:
                    out_of_time = True
                    break
                spec = speculative_slot(i)
                name = spec_models[i % len(spec_models)] if spec else live[i % len(live)]
                # Big cases on cuda: each mode's engine capture is paid once per case.
                kw = dict(draw_kw, max_requests=40 if sim else 96, max_rounds=2 if sim else 3,
                          max_round_steps=150 if sim else 600)
                if name not in TOYS:
                    kw.update(max_prompt=24, max_budget=64)
                case = numpy_case(args.seed + i, model=name, speculative=spec, **kw)
            i += 1
            alone = cases_by_model.get(case.model, 0) < args.alone_cases
            cases_by_model[case.model] = cases_by_model.get(case.model, 0) + 1
            tc = time.perf_counter()
            rep = run_case(case, backend=args.backend, be=be, models=models,
                           unsafe=not args.no_unsafe, alone=alone)
            _tally_case(tally, rep)
            bad = rep.safe_failures() or rep.problems
            if bad:
                failures.append(rep)
            unsafe_mm = len(rep.mismatches.get(UNSAFE, []))
            print(f"case seed={case.seed} model={case.label} requests={case.requests} "
                  f"conc={case.serving_conc} sizes={list(case.capture_sizes)} "
                  f"delay={case.sim_delay_s or case.device_work_s}"
                  f"{f' spec={case.spec_summary()}' if case.speculative else ''}: "
                  f"{rep.steps} steps in {time.perf_counter() - tc:.1f}s, "
                  f"{'MISMATCH' if bad else 'ok'}"
                  f"{f', unsafe arm {unsafe_mm} mismatched' if not args.no_unsafe else ''}",
                  flush=True)
            if bad or args.verbose:
                print(rep.describe(), flush=True)
                if queue is None:
                    print(f"  or: python3 tools/fuzz.py --backend {args.backend} --models "
                          f"{case.model} --seed {case.seed} --cases 1"
                          f"{' --speculative' if case.speculative else ''}", flush=True)
            reports.append(dict(seed=case.seed, model=case.label, steps=rep.steps,
                                safe_mismatches={m: mm for m, mm in rep.safe_failures().items()},
                                problems=rep.problems, unsafe_mismatches=unsafe_mm,
                                case=json.loads(case.to_json()) if bad else None))
    finally:
        if models is not None:
            models.close()
        if be is not None:
            be.close()

    elapsed = time.perf_counter() - t0
    alone_tally = tally.pop("_alone", {})
    spec_tally = tally.pop("_spec", {})
    print(f"\n{args.backend}: {len(reports)} cases in {elapsed:.1f}s"
          f"{' (time budget reached before every mode got its steps)' if out_of_time else ''}")
    hdr = (f"{'model':<15} {'mode':<17} {'steps':>7} {'graph':>7} {'reqs':>6} {'mismatch':>8} "
           f"{'tokens':>6} {'finish':>6} {'logits':>6} {'greedy':>6} {'~tie':>5} {'sampled':>7} "
           f"{'cached':>7}")
    print(hdr)
    refs = {name: REFERENCE for name in tally if name.endswith("+spec")}   # the others: sync
    for name, modes in tally.items():
        for mode, m in modes.items():
            print(f"{name:<15} {mode:<17} {m['steps']:>7} {m['graph_steps']:>7} {m['requests']:>6} "
                  f"{'-' if mode == refs.get(name, 'sync') else m['mismatches']:>8} "
                  f"{m['token_mismatches']:>6} {m['finish_mismatches']:>6} "
                  f"{m['logits_only_mismatches']:>6} {m['greedy_flips']:>6} "
                  f"{m['greedy_flips_near_tie']:>5} {m['sampled_mismatches']:>7} "
                  f"{m['cached_tokens']:>7}")
    for name, a in alone_tally.items():
        print(f"batch invariance {name}: {a['requests']} requests alone vs in their batch (sync): "
              f"{a['token_mismatches']} token mismatches ({a['greedy_flips']} greedy flips, "
              f"{a['greedy_flips_near_tie']} at a top-2 gap < 1e-3; {a['sampled_mismatches']} "
              f"sampled), {a['finish_mismatches']} finish, {a['logits_only_mismatches']} "
              f"logits-bytes only (reported, not failed)")
    if spec_tally:
        drafts = "; ".join(f"{k[:-7]}: {v['accepted']}/{v['drafts']} drafts accepted over "
                           f"{v['verify_rows']} verify rows" for k, v in spec_tally.items()
                           if k.endswith(" drafts"))
        print(f"speculative cases: {spec_tally['cases']} ("
              + ", ".join(f"{m} {spec_tally.get(m, 0)}" for m in SPEC_METHODS) + "; "
              + ", ".join(f"k={k} {spec_tally.get(f'k={k}', 0)}" for k in SPEC_KS)
              + f"){'; ' + drafts if drafts else ''}")
    safe_bad = sum(m["mismatches"] for modes in tally.values() for k, m in modes.items()
                   if k not in (REFERENCE, UNSAFE))
    unsafe_total = sum(modes.get(UNSAFE, {}).get("mismatches", 0) for modes in tally.values())
    blind = not args.no_unsafe and unsafe_total == 0
    watched = [f"{n}+spec" for n in spec_models] if args.speculative else names
    short = [f"{n}/{m}" for n in watched for m in SAFE_MODES
             if tally.get(n, {}).get(m, {}).get("steps", 0) < args.steps_per_mode]
    print(f"safe-mode mismatches: {safe_bad}; broken requests: "
          f"{sum(len(r.problems) for r in failures)}"
          + ("" if args.no_unsafe else f"; unsafe arm (unguarded+poison) mismatches: {unsafe_total}"
             f"{' -- HARNESS BLIND' if blind else ' (> 0 expected)'}"))
    if short and args.replay is None and args.cases is None:
        print(f"below --steps-per-mode {args.steps_per_mode}: {', '.join(short)}")
    for rep in failures:
        print("\nFAILED " + rep.describe())
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            backend=args.backend, elapsed_s=elapsed, steps_per_mode=args.steps_per_mode,
            seed=args.seed, out_of_time=out_of_time, below_target=short, totals=tally,
            batch_invariance=alone_tally, speculative=spec_tally, unsafe_mismatches=unsafe_total,
            safe_mismatches=safe_bad, cases=reports), indent=1, default=str))
        print(f"wrote {args.json}")
    return 1 if (failures or blind) else 0


if __name__ == "__main__":
    sys.exit(main())
