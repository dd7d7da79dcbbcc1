"""Helpers the engine, executor, sampling and reliability tests share: a seeded workload, one
engine run on the toy forward, an engine over a numpy kernel, the bundled presets' weights, and
how many results differ."""
import numpy as np

from vt.backend import get_backend
from vt.engine.engine import Engine
from vt.config import ExecutorConfig
from vt.forward.toy import ToyForward
from vt.forward.user import ForwardModel, KVGeometry
from vt.bundled import PRESETS, init_weights
from vt.hooks import NULL_HOOKS, with_device_work

VOCAB = 64
_WEIGHTS = {}


def preset_weights(preset: str) -> dict:
    """The bundled preset's seed-0 weights, made once per test session (they are read-only)."""
    if preset not in _WEIGHTS:
        _WEIGHTS[preset] = init_weights(PRESETS[preset], seed=0)
    return _WEIGHTS[preset]


def workload(n, seed=0, max_len=7, max_new=(6, 14)):
    """n fresh random prompts and per-prompt budgets (varied, so steps mix prefill and decode)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, max_len + 1))) for _ in range(n)]
    budgets = [int(b) for b in rng.integers(max_new[0], max_new[1] + 1, size=n)]
    return prompts, budgets


def run_toy(be, prompts, budgets, *, device_work_s=0.0, record_logits=True, stop_token=None,
            hooks=NULL_HOOKS, **cfg):
    """Results and stats of one generate() on a fresh toy forward (state starts at zero);
    `hooks`: vt.hooks's test arms, e.g. Poison()."""
    config = ExecutorConfig(**cfg)
    step = with_device_work(ToyForward(be, vocab=VOCAB).step_model(), device_work_s)
    with Engine(be, step, config, hooks=hooks, record_logits=record_logits) as eng:
        results = eng.generate(prompts, max_new_tokens=budgets, stop_token=stop_token)
        stats = eng.stats()
    return results, stats


_UNDELAYED = {}


def undelayed_reference(prompts, budgets, **cfg):
    """run_toy's results and stats on a sim without device delay, made once per workload and
    config in a session: what a run on a delayed sim is compared with. The OFF path's tokens
    and logits do not depend on how fast the device is (tools/fuzz.py's reference runs
    undelayed too); on the delayed sim it would only take ~20x longer."""
    key = (tuple(tuple(int(t) for t in p) for p in prompts), tuple(budgets),
           tuple(sorted(cfg.items())))
    if key not in _UNDELAYED:
        be = get_backend("sim")
        try:
            _UNDELAYED[key] = run_toy(be, prompts, budgets, **cfg)
        finally:
            be.close()
    return _UNDELAYED[key]


def mismatches(ref, got):
    """How many requests differ from the reference in tokens (or in logits bytes)."""
    bad = 0
    for a, b in zip(ref, got):
        same = a.tokens == b.tokens and a.finish_reason == b.finish_reason
        if same and a.logits is not None and b.logits is not None:
            same = a.logits.tobytes() == b.logits.tobytes()
        bad += not same
    return bad


def kernel_engine(be, kernel, vocab: int, mode: str, model_class=ForwardModel, **engine_kwargs):
    """An Engine (mode, 4 rows, graphs of 1, 2 and 4 rows) over a model_class whose forward
    launches kernel.run_numpy(token table, token_rows, positions, logits_out): 8 rows, 64 KV
    blocks of 4 tokens, 64 of context. The prompt's last token is the first sampled one's
    input: the forward reads it from the token table, which the model's prefill fills
    (ForwardModel's flat prefill gathers it)."""
    geo = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=64)
    table = be.empty((geo.max_seqs + 1,), np.int32)

    def forward(stream, inputs, logits_out):
        be.launch(stream, kernel, table, inputs.token_rows, inputs.positions, logits_out)

    model = model_class(be, forward, vocab=vocab, token_table=table, geometry=geo)
    return Engine(be, model, ExecutorConfig(mode=mode, serving_conc=4, capture_sizes=(1, 2, 4)),
                  **engine_kwargs)
