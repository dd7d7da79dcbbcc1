"""A causal toy target for speculative decoding on the sim: a paged KV cache and nothing else
(no recurrent state), every row's KV written before any row reads, so a verify step is a
decode over its rows (vt/forward/speculative.py's verifies_by_decode)."""
import numpy as np

from vt.backend.zeros import zeros
from vt.engine.engine import Engine
from vt.forward.speculative import SpeculativeConfig, SpeculativeModel, verify_table_rows
from vt.forward.user import ForwardModel, KVGeometry, kv_slot
from vt.config import ExecutorConfig

VOCAB = 32
MAX_K = 4
GEOMETRY = KVGeometry(max_seqs=8, num_kv_blocks=160, block_size=4, max_context=64)
MODES = ("sync", "drain", "ring", "staged")
SIZES = (1, 2, 4, 8)


class CausalToy:
    """forward(stream, inputs, logits_out): embeds (token, position), writes it to its KV slot,
    then each row sums its context's KV (positions < seq_len): logits depend on every token
    before and at the row's position, as attention's do."""

    verifies_by_decode = True

    def __init__(self, be, *, geometry=GEOMETRY, vocab=VOCAB, max_k=MAX_K, salt=0.0):
        """salt: shifts every logit's phase, another model of the same shape (a draft that
        disagrees with the target)."""
        self.be, self.vocab, self.geometry, self.salt = be, vocab, geometry, salt
        g = geometry
        self.token_table = zeros(be, (verify_table_rows(g.max_seqs, g.max_seqs, max_k),), np.int32)
        self.kv = zeros(be, (g.num_kv_blocks * g.block_size,), np.float32)

    def __call__(self, stream, inputs, logits_out) -> None:
        self.be.launch(stream, _CAUSAL, self.token_table, inputs.token_rows, inputs.positions,
                       inputs.seq_lens, inputs.slot_mapping, inputs.block_tables, self.kv,
                       logits_out, block_size=self.geometry.block_size, salt=self.salt)

    def step_model(self, *, prefix_cacheable: bool = False) -> ForwardModel:
        """prefix_cacheable: a position's KV is its token's and position's alone, so cached
        prefixes may be shared (the engine's prefix caching)."""
        return ForwardModel(self.be, self, vocab=self.vocab, token_table=self.token_table,
                            geometry=self.geometry, prefix_cacheable=prefix_cacheable)


class _Causal:
    name = "causal_toy"

    def run_numpy(self, table, rows, pos, lens, slots, bt, kv, logits, *, block_size, salt):
        x = np.sin(table[rows].astype(np.float32) * np.float32(12.9898) +
                   pos.astype(np.float32) * np.float32(78.233)) * np.float32(43758.547)
        kv[slots] = x - np.floor(x)
        j = np.arange(logits.shape[1], dtype=np.float32)
        for r in range(len(rows)):
            acc = kv[kv_slot(bt[r], np.arange(lens[r]), block_size)].sum(dtype=np.float32)
            logits[r] = np.sin(acc * (j + 1) * np.float32(0.37) + j + np.float32(salt))


_CAUSAL = _Causal()


def workload(n, seed=0, max_len=9, max_new=(5, 20)):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, max_len + 1))) for _ in range(n)]
    budgets = [int(b) for b in rng.integers(max_new[0], max_new[1] + 1, size=n)]
    return prompts, budgets


def reference(be, prompts, budgets, stop_token=None):
    """Greedy tokens of the target without speculation (the engine, mode drain)."""
    with Engine(be, CausalToy(be).step_model(), ExecutorConfig(mode="drain")) as eng:
        return [r.tokens for r in eng.generate(prompts, max_new_tokens=budgets,
                                               stop_token=stop_token)]


def config(method, k, prompts=None, refs=None, accept=1.0, draft=None):
    """A SpeculativeConfig; the oracle's references are `refs`, the tokens of `prompts`;
    draft: method "draft"'s step model."""
    refs = None if refs is None else {tuple(int(t) for t in p): list(r) for p, r in zip(prompts, refs)}
    return SpeculativeConfig(method, k=k, accept=accept, references=refs, draft=draft)


def speculative(be, method, k, prompts=None, refs=None, accept=1.0, draft_salt=0.0):
    """A SpeculativeModel over a fresh causal toy. method "draft": the draft is another causal
    toy with its own KV cache, the target's own function for draft_salt 0 (every draft
    accepted), another for any other salt."""
    refs = None if refs is None else {tuple(int(t) for t in p): r for p, r in zip(prompts, refs)}
    draft = CausalToy(be, salt=draft_salt).step_model() if method == "draft" else None
    cfg = SpeculativeConfig(method, k=k, accept=accept, references=refs, draft=draft)
    return SpeculativeModel(be, CausalToy(be).step_model(), cfg)


def record_steps(monkeypatch, module) -> list:
    """Replace `module`'s Runner (for the test) with one that appends ("launch", index) and
    ("collect", index) to the returned list as it launches and collects each step."""
    events = []

    class Recording(module.Runner):
        def launch(self, plan):
            h = super().launch(plan)
            events.append(("launch", h.index))
            return h

        def collect(self, handle):
            events.append(("collect", handle.index))
            return super().collect(handle)

    monkeypatch.setattr(module, "Runner", Recording)
    return events


def check_tokens(got, want):
    """Each request's tokens equal its reference's; the first differing request named."""
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if list(a) != list(b)]
    assert not bad, f"requests {bad} differ: {list(got[bad[0]])} vs {list(want[bad[0]])}"
