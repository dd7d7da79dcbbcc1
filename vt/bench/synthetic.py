"""The synthetic workload: a user forward written only against vt's public API.

Its device time per step is D µs (a one-thread spin kernel on the GPU's nanosecond clock) plus
one logits kernel whose one-hot row r sits at next_token(table[token_rows[r]], positions[r]):
the logits depend on the step's host vectors, so a stale or poisoned read changes the tokens.
D is read from a device scalar, so one captured graph serves every D of a sweep.

The same two kernels (same source) are the user forward of the PyTorch peer (torch_peer.py):
both sides run the same device work per step; each adds its own sampling and token feedback.
"""
from __future__ import annotations

import time

import numpy as np

SYNTH_VOCAB = 32000   # the default: a real LLM's vocabulary (vt bench --vocab)
_BLOCK = 256

CUDA_SOURCE = r"""
extern "C" __global__ void vt_bench_spin(const long long* ns) {
    unsigned long long start, now, wait = (unsigned long long)ns[0];
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < wait);
}
extern "C" __global__ void vt_bench_logits(const int* table, int n_table, const int* rows,
                                           const int* pos, float* logits, int V) {
    int r = blockIdx.x;
    int row = rows[r];
    row = row < 0 ? 0 : (row >= n_table ? n_table - 1 : row);
    long long tok = ((long long)table[row] % V + V) % V;
    long long p = pos[r] < 0 ? 0 : pos[r];
    int target = (int)((tok * 7 + p * 13 + 1) % V);
    float* out = logits + (long long)r * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) out[j] = j == target ? 1.0f : 0.0f;
}
"""


def next_token(tok, pos, vocab: int = SYNTH_VOCAB):
    """The token the synthetic forward's argmax picks after `tok` at position `pos` (numpy)."""
    tok = np.mod(np.asarray(tok, np.int64), vocab)
    return ((tok * 7 + np.maximum(np.asarray(pos, np.int64), 0) * 13 + 1) % vocab).astype(np.int32)


def expected_tokens(prompt, n: int, vocab: int = SYNTH_VOCAB) -> list[int]:
    """The n greedy tokens of one request: what every mode and the torch peer must produce."""
    tok, pos, out = int(prompt[-1]), len(prompt) - 1, []
    for _ in range(n):
        tok = int(next_token(tok, pos, vocab))
        out.append(tok)
        pos += 1
    return out


class _CudaKernels:
    """The compiled module, loaded once per process (compiling inside a capture is not allowed)."""
    _fns = None

    @classmethod
    def get(cls):
        if cls._fns is None:
            import cupy
            mod = cupy.RawModule(code=CUDA_SOURCE)
            cls._fns = (mod.get_function("vt_bench_spin"), mod.get_function("vt_bench_logits"))
        return cls._fns


def launch_spin_cupy(ns) -> None:
    """ns: a device int64 [1] (CuPy array); spins that many ns on CuPy's current stream."""
    _CudaKernels.get()[0]((1,), (1,), (ns,))


def launch_logits_cupy(table, rows, pos, logits) -> None:
    """logits [S, V] f32 one-hot at next_token(table[rows], pos), on CuPy's current stream."""
    S, V = logits.shape
    _CudaKernels.get()[1]((S,), (_BLOCK,), (table, np.int32(len(table)), rows, pos, logits,
                                            np.int32(V)))


class Spin:
    """A vt kernel object: spins for the ns held in a device int64 [1]."""
    name = "bench_spin"

    def run_numpy(self, ns):
        if ns[0] > 0:
            time.sleep(float(ns[0]) * 1e-9)

    def run_cupy(self, stream_handle, ns):
        launch_spin_cupy(ns)


class Logits:
    """A vt kernel object: the one-hot logits of next_token(table[rows], positions)."""
    name = "bench_logits"

    def run_numpy(self, table, rows, pos, logits):
        S, V = logits.shape
        r = np.clip(rows.astype(np.int64), 0, len(table) - 1)
        logits[...] = 0
        logits[np.arange(S), next_token(table[r], pos, V)] = 1

    def run_cupy(self, stream_handle, table, rows, pos, logits):
        launch_logits_cupy(table, rows, pos, logits)


class SyntheticModel:
    """A vt.ForwardModel over the synthetic forward, for up to `max_seqs` rows of
    `max_context` tokens; set_device_us(D) changes the spin of every later step."""

    def __init__(self, be, *, max_seqs: int, max_context: int, vocab: int = SYNTH_VOCAB,
                 block_size: int = 16):
        from vt.forward.user import ForwardModel, KVGeometry
        self.be, self.vocab = be, vocab
        per_seq = -(-max_context // block_size)
        geo = KVGeometry(max_seqs=max_seqs, num_kv_blocks=max_seqs * per_seq + 1,
                         block_size=block_size, max_context=max_context)
        self.table = be.empty((max_seqs + 1,), np.int32)   # last token per row (+ scratch row)
        self._ns = be.empty((1,), np.int64)
        self._ns_host = be.pinned_empty((1,), np.int64)
        self._stream = be.stream(name="bench-synthetic")
        self.device_us = None
        self.set_device_us(0.0)
        spin, logits, table, ns = Spin(), Logits(), self.table, self._ns

        def forward(stream, inputs, logits_out):   # launches only: it gets captured
            be.launch(stream, spin, ns)
            be.launch(stream, logits, table, inputs.token_rows, inputs.positions, logits_out)
        self.model = ForwardModel(be, forward, vocab=vocab, token_table=self.table, geometry=geo)

    def set_device_us(self, us: float) -> None:
        """Set D; call it only while no step is in flight (between generate() calls)."""
        if not us >= 0:
            raise ValueError(f"device_us must be >= 0, got {us!r}")
        self._ns_host[0] = round(us * 1e3)
        self.be.copy_h2d(self._ns, self._ns_host, self._stream)
        self._stream.synchronize()
        self.device_us = float(us)

    def close(self) -> None:
        self._stream.close()
