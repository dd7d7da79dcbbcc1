"""A position-addressed toy forward for the prefix-caching tests, and its poison writer.

Per row it embeds the input token (a hash of token and position), writes it to its paged KV
slot and reads back every slot of the sequence, weighted by position (a stand-in for
attention with no recurrent state): the KV of a position depends only on the tokens up to
it, so a sequence may start from another's cached blocks (prefix_cacheable), and a step
that reads a poisoned (NaN) slot produces NaN logits: an error row."""
from __future__ import annotations

import numpy as np

from vt.backend.zeros import zeros
from vt.forward.user import ForwardModel, KVGeometry, kv_slot
from vt.knobs import ExecutorConfig
from vt.engine.engine import Engine
from vt.testing import with_device_work

VOCAB = 64


class PositionalToy:
    """forward(stream, inputs, logits_out) of the module docstring, on any backend."""

    prefix_cacheable = True

    def __init__(self, be, geometry: KVGeometry):
        self.be, self.vocab, self.geometry = be, VOCAB, geometry
        g = geometry
        self.token_table = zeros(be, (g.max_seqs + 1,), np.int32)
        self.kv = zeros(be, (g.num_kv_blocks * g.block_size,), np.float32)

    def __call__(self, stream, inputs, logits_out) -> None:
        tmp = self.be.empty((len(inputs.token_rows), 2), np.float32)
        self.be.launch(stream, _ATTEND, self.token_table, inputs.token_rows, inputs.positions,
                       inputs.seq_lens, inputs.slot_mapping, inputs.block_tables, self.kv, tmp,
                       block_size=self.geometry.block_size)
        self.be.launch(stream, _LOGITS, tmp, logits_out)

    def step_model(self, device_work_s: float = 0.0):
        return with_device_work(ForwardModel(self.be, self, vocab=VOCAB, token_table=self.token_table,
                                             geometry=self.geometry), device_work_s)

    def poison_writer(self):
        """write(blocks): NaN into those KV blocks now, on a stream of its own, not ordered
        after the decode stream (what vt.testing.KVPoison calls)."""
        side = self.be.stream(name="kv-poison")
        bs = self.geometry.block_size

        def write(blocks) -> None:
            slots = (np.repeat(np.asarray(blocks, np.int32) * bs, bs) +
                     np.tile(np.arange(bs, dtype=np.int32), len(blocks))).astype(np.int32)
            self.be.launch(side, _POISON, self.kv, slots)
            side.synchronize()
        return write


def _embed(tok, pos):
    x = np.sin(np.float32(tok) * np.float32(12.9898) + np.float32(pos) * np.float32(78.233)) * np.float32(43758.547)
    return np.float32(x - np.floor(x))


class _Attend:
    name = "positional_toy_attend"

    def run_numpy(self, table, rows, pos, lens, slots, bt, kv, tmp, *, block_size):
        for r in range(len(rows)):
            v = _embed(table[rows[r]], pos[r])
            kv[slots[r]] = v
            q = np.arange(lens[r])
            w = np.sin(q.astype(np.float32) + np.float32(1)).astype(np.float32)
            tmp[r, 0] = (kv[kv_slot(bt[r], q, block_size)] * w).sum(dtype=np.float32)
            tmp[r, 1] = v

    def run_cupy(self, stream_handle, table, rows, pos, lens, slots, bt, kv, tmp, *, block_size):
        _cupy()["attend"](table, rows, pos, lens, slots, bt, np.int32(bt.shape[1]),
                          np.int32(block_size), kv, tmp, size=len(rows))


class _Logits:
    name = "positional_toy_logits"

    def run_numpy(self, tmp, logits):
        j = np.arange(logits.shape[1], dtype=np.float32)
        logits[...] = np.sin(tmp[:, :1] * (j + 1) * np.float32(0.37) + tmp[:, 1:] * np.float32(1.3) + j)

    def run_cupy(self, stream_handle, tmp, logits):
        _cupy()["logits"](tmp, np.int32(logits.shape[1]), logits)


class _Poison:
    name = "kv_poison"

    def run_numpy(self, kv, slots):
        kv[slots] = np.float32("nan")

    def run_cupy(self, stream_handle, kv, slots):
        import cupy as cp
        _cupy()["poison"](cp.asarray(slots), kv, size=len(slots))


_KERNELS = {}


def _cupy():
    if not _KERNELS:
        import cupy as cp
        _KERNELS["attend"] = cp.ElementwiseKernel(
            "raw int32 table, raw int32 rows, raw int32 pos, raw int32 lens, raw int32 slots, "
            "raw int32 bt, int32 max_blocks, int32 bs", "raw float32 kv, raw float32 tmp",
            """
            float x = sinf((float)table[rows[i]] * 12.9898f + (float)pos[i] * 78.233f) * 43758.547f;
            float v = x - floorf(x);
            kv[slots[i]] = v;
            float acc = 0.f;
            for (int q = 0; q < lens[i]; ++q)
                acc += kv[bt[i * max_blocks + q / bs] * bs + q % bs] * sinf((float)q + 1.f);
            tmp[2 * i] = acc;
            tmp[2 * i + 1] = v;
            """, "vt_positional_toy_attend")
        _KERNELS["logits"] = cp.ElementwiseKernel(
            "raw float32 tmp, int32 V", "float32 logits",
            "int r = i / V, j = i % V;"
            "logits = sinf(tmp[2 * r] * (j + 1) * 0.37f + tmp[2 * r + 1] * 1.3f + j);",
            "vt_positional_toy_logits")
        _KERNELS["poison"] = cp.ElementwiseKernel(
            "raw int32 slots", "raw float32 kv", "kv[slots[i]] = __int_as_float(0x7fc00000);",
            "vt_kv_poison")
    return _KERNELS


_ATTEND, _LOGITS, _POISON = _Attend(), _Logits(), _Poison()


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
    from vt.testing import KVPoison
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
