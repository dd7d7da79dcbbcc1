"""A trigram toy target for sampled speculation on the sim: the logits of a row are a fixed
random table's entry for the row's previous token and its own, read through a paged KV cache
(each row writes its token to its KV slot, then reads its previous position's), so a verify
step is a decode over its rows (verifies_by_decode). Its next-token distribution depends on a
prefix's last two tokens only: prompts that differ earlier share it, so thousands of rows,
each with its own prompt, seed and oracle reference, draw from one distribution, which
`exact_*` give in closed form for a chi-square."""
import numpy as np

from vt.backend.zeros import zeros
from vt.forward.speculative import verify_table_rows
from vt.forward.user import ForwardModel, KVGeometry
from vt.sampling import reference

VOCAB = 12
TAIL = (3, 7)              # every prompt's last two tokens
PROMPT_LEN = 6


def table(seed: int = 5) -> np.ndarray:
    """logits [VOCAB (previous token), VOCAB (token), VOCAB] f32."""
    return (np.random.default_rng(seed).standard_normal((VOCAB, VOCAB, VOCAB)) * 1.5).astype(np.float32)


class TrigramToy:
    verifies_by_decode = True

    def __init__(self, be, rows: int, k: int, *, max_context: int = 16, seed: int = 5):
        """seed: the logits table's (another seed, another model: a draft)."""
        self.be, self.vocab, self.table = be, VOCAB, table(seed)
        bs = 4
        blocks = rows * -(-max_context // bs) + 1
        self.geometry = KVGeometry(max_seqs=rows, num_kv_blocks=blocks, block_size=bs,
                                   max_context=max_context)
        self.token_table = zeros(be, (verify_table_rows(rows, rows, k),), np.int32)
        self.kv = zeros(be, (blocks * bs,), np.int32)
        if be.name == "cuda":   # the forward's kernels read it on the device
            import cupy as cp
            self.device_table = cp.asarray(self.table)
        else:
            self.device_table = self.table

    def __call__(self, stream, inputs, logits_out) -> None:
        self.be.launch(stream, _TRIGRAM, self.token_table, inputs.token_rows, inputs.positions,
                       inputs.slot_mapping, inputs.block_tables, self.kv, logits_out,
                       trigram=self.device_table, block_size=self.geometry.block_size)

    def step_model(self) -> ForwardModel:
        return ForwardModel(self.be, self, vocab=self.vocab, token_table=self.token_table,
                            geometry=self.geometry)


class _Trigram:
    name = "trigram_toy"

    def run_numpy(self, token_table, rows, pos, slots, bt, kv, logits, *, trigram, block_size):
        _forward(np, token_table, rows, pos, slots, bt, kv, logits, trigram, block_size)

    def run_cupy(self, stream_handle, token_table, rows, pos, slots, bt, kv, logits, *, trigram,
                 block_size):
        import cupy as cp
        _forward(cp, token_table, rows, pos, slots, bt, kv, logits, trigram, block_size)


def _forward(xp, token_table, rows, pos, slots, bt, kv, logits, trigram, block_size):
    tok = token_table[rows]
    kv[slots] = tok                       # every row's KV before any row reads
    prev_pos = xp.maximum(pos - 1, 0)
    prev_slot = bt[xp.arange(len(rows)), prev_pos // block_size] * block_size + prev_pos % block_size
    prev = xp.where(pos > 0, kv[prev_slot], 0)
    logits[:len(rows)] = trigram[xp.clip(prev, 0, VOCAB - 1), xp.clip(tok, 0, VOCAB - 1)]


_TRIGRAM = _Trigram()


def prompts(n: int, seed: int = 0) -> list[np.ndarray]:
    """n distinct prompts of PROMPT_LEN tokens, all ending in TAIL."""
    rng = np.random.default_rng(seed)
    heads = rng.choice(VOCAB ** (PROMPT_LEN - 2), size=n, replace=False)
    digits = (heads[:, None] // VOCAB ** np.arange(PROMPT_LEN - 2)) % VOCAB
    return [np.array([*d, *TAIL], np.int32) for d in digits]


def sample_without_speculation(prompts, seeds, n: int, temperature, top_k=0, top_p=1.0) -> np.ndarray:
    """[rows, n] the tokens vt's sampler (its numpy twin) draws decoding the prompts one token a
    step: each keyed on its seed and the position of its input token."""
    t = table()
    seqs = np.array([list(p) for p in prompts], np.int32)
    S = len(seqs)
    knobs = [np.full(S, temperature, np.float32), np.full(S, top_k, np.int32),
             np.full(S, top_p, np.float32), np.zeros(S, np.float32), np.asarray(seeds, np.uint64)]
    for _ in range(n):
        logits = t[seqs[:, -2], seqs[:, -1]]
        nxt = reference.sample_tokens(logits, np.full(S, seqs.shape[1] - 1), *knobs)
        seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
    return seqs[:, PROMPT_LEN:]


def _next(prev: int, tok: int, knobs) -> np.ndarray:
    return reference.distribution(table()[prev, tok], *knobs)


def exact_second_and_third(knobs) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact distributions of a request's second token [V] and of its second
    and third together [V, V] (the first two tokens speculation emits; the first is the
    prefill's), with knobs (temperature, top_k, top_p)."""
    first = _next(*TAIL, knobs)
    joint = np.zeros((VOCAB, VOCAB))
    for a in range(VOCAB):
        second = _next(TAIL[1], a, knobs)
        for b in range(VOCAB):
            joint[b] += first[a] * second[b] * _next(a, b, knobs)
    return joint.sum(axis=1), joint
