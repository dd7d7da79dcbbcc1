"""The prefix-caching tests' workloads and runs, on tools/positional_toy.py's forward (the KV
of a position depends only on the tokens up to it, so prefix caching may be on for it, and a
step that reads a poisoned slot ends its request in an error row)."""
from __future__ import annotations

import numpy as np

from tools.positional_toy import VOCAB, PositionalToy
from vt.engine.engine import Engine
from vt.forward.user import KVGeometry
from vt.config import ExecutorConfig

__all__ = ["VOCAB", "PositionalToy", "shared_prefix_workload", "run", "tokens", "run_turns"]


def shared_prefix_workload(n, seed=0, *, prefix_len=9, tail=(1, 6), max_new=(3, 8), groups=3):
    """n prompts: each starts with one of `groups` shared prefixes (so later ones hit the
    cache), then a random tail; per-prompt budgets."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, size=prefix_len) for _ in range(groups)]
    prompts, budgets = [], []
    for i in range(n):
        t = rng.integers(0, VOCAB, size=int(rng.integers(tail[0], tail[1] + 1)))
        prompts.append(np.concatenate([prefixes[i % groups], t]).astype(np.int32))
        budgets.append(int(rng.integers(max_new[0], max_new[1] + 1)))
    return prompts, budgets


def run(be, prompts, budgets, *, mode="sync", prefix_caching=True, geometry=None, sampling=None,
        device_work_s=0.0, hooks=None, conc=4, poison=False, poison_fence=True):
    """(results, stats, hooks) of one generate() on a fresh PositionalToy."""
    from vt.hooks import KVPoison
    geo = geometry or KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=32)
    toy = PositionalToy(be, geo)
    if poison:
        hooks = KVPoison(toy.poison_writer(), fence=poison_fence)
    cfg = ExecutorConfig(mode=mode, serving_conc=conc,
                                  capture_sizes=tuple(s for s in (1, 2, 4, 8) if s <= conc))
    with Engine(be, toy.step_model(device_work_s), cfg, hooks=hooks,
                prefix_caching=prefix_caching) as eng:
        res = eng.generate(prompts, max_new_tokens=budgets, sampling=sampling)
        stats = eng.stats()
    return res, stats, hooks


def tokens(results):
    return [(list(map(int, r.tokens)), r.finish_reason) for r in results]


def run_turns(be, prompts, budgets, *, mode="sync", prefix_caching=True, geometry=None,
              seed=None, conc=4, tail=(1, 5)):
    """Two turns of a conversation per prompt on one engine: the second turn's prompt is the
    first's, its answer and a new random tail (the whole history again, as a chat client
    sends it). seed: None for greedy, else each turn's requests sample with seeds from it.
    Returns (first results, second results, the second prompts, prefix_cache stats after
    the first turn, after the second)."""
    geo = geometry or KVGeometry(max_seqs=8, num_kv_blocks=128, block_size=4, max_context=40)
    toy = PositionalToy(be, geo)
    cfg = ExecutorConfig(mode=mode, serving_conc=conc,
                         capture_sizes=tuple(s for s in (1, 2, 4, 8) if s <= conc))
    rng = np.random.default_rng(7)

    def sampling(turn):
        if seed is None:
            return None
        from vt.sampling import SamplingParams
        return [SamplingParams(temperature=0.9, top_k=20, seed=seed + 100 * turn + i)
                for i in range(len(prompts))]

    with Engine(be, toy.step_model(), cfg, prefix_caching=prefix_caching) as eng:
        first = eng.generate(prompts, max_new_tokens=budgets, sampling=sampling(0))
        after_first = dict(eng.stats()["prefix_cache"])
        second_prompts = [np.concatenate([p, np.asarray(r.tokens, np.int32),
                                          rng.integers(0, VOCAB, int(rng.integers(tail[0], tail[1] + 1)))
                                          ]).astype(np.int32)
                          for p, r in zip(prompts, first)]
        second = eng.generate(second_prompts, max_new_tokens=budgets, sampling=sampling(1))
        after_second = dict(eng.stats()["prefix_cache"])
    return first, second, second_prompts, after_first, after_second
