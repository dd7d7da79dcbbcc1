"""The sampler's launch object: the same protocol as the model's kernels (run_numpy on the sim,
run_cupy on the current CuPy stream; capturable: no host sync, one kernel node, its
workspace comes from CuPy's allocator (its histograms zeroed by the kernel itself), every
scalar is baked into the launch). The first call of each build (V % 4 == 0 with 16-byte aligned
logits, or not) compiles it, and the first call of an instance allocates its counters, so both
must be eager.

The kernel's per-row counters must be zero at launch, and the kernel leaves them zero: each
instance keeps one zeroed counter buffer for up to COUNTER_ROWS rows and needs no zeroing node
(a node in a graph costs every replay device time). So an instance's calls must run in order,
on one stream at a time, as one model's steps do; a call with more rows takes per-call counters
zeroed by a kernel first.

The kernel's blocks of one row wait for each other at barriers; the grid is sized to fit on the
GPU at once (split), so they never wait for a block that cannot start, unless another stream
keeps SMs busy for good.

Arguments (S rows, vocabulary V):
  logits [S, V] f32, token_rows [S] i32, positions [S] i32, temperature [S] f32,
  top_k [S] i32 (0 = all), top_p [S] f32, min_p [S] f32, seed [S] u64,
  out_tokens [S] i32, or records [S, RECORD_WORDS] i32 (vt/sampling/logprobs.py),
  token_table [*] i32, logprobs [S] i32 (with records: -1, or how many top tokens a row asks),
  then, for penalties, logit bias and min_tokens (vt/sampling/penalties.py), penalized [S] i32,
  presence [S], frequency [S], repetition [S] f32 and the instance's PenaltyState tables
  (bind() makes them; extra_args() gives all of these for a step's inputs), then the
  TokenMaskState's on [R] and bits [R, ceil(V / 32)] (vt/sampling/token_mask.py)
Writes out_tokens[r] (records: the record of row r, its token first, then the logprobs the row
asks for) and token_table[token_rows[r]] (the next step's input token).

Error rows: a row with a NaN or +inf logit, or only -inf logits, gets out_tokens[r] = -1 (the
engine finishes that request with an error) and token_table[token_rows[r]] = 0, so the next
embedding stays in range. -inf logits are otherwise legal: masked tokens, never drawn. A row
whose finite largest logit / temperature overflows float32 (a tiny temperature) gets the argmax,
the limit as temperature -> 0.
"""
from __future__ import annotations

import numpy as np

from . import reference
from .device_code import counter_bytes, workspace_bytes
from .kernels import BLOCKS_PER_SM, CODE
from .logprobs import RECORD_WORDS, launch_records, write_records
from .penalties import PenaltyState, count, launch_count, launch_penalize, penalize
from .token_mask import TokenMaskState, apply_mask, launch_mask

_MIN_CHUNK = 1024      # elements per block: below this a block is mostly launch overhead
COUNTER_ROWS = 4096    # rows whose counters an instance keeps zeroed between calls


def split(S: int, V: int, sms: int) -> tuple[int, int]:
    """(blocks per row B, elements per block C): as many blocks as fit on the GPU at once (a
    row's blocks wait for each other at its barriers, so when B > 1 all S * B must be resident),
    chunks a multiple of 4 (float4 loads) and none empty."""
    B = max(1, min(BLOCKS_PER_SM * sms // S, -(-V // _MIN_CHUNK)))
    C = (-(-V // B) + 3) // 4 * 4
    return -(-V // C), C


class Sampler:
    """logits [S, V] f32 -> out_tokens [S] i32 and token_table[token_rows] (see the module doc)."""

    name = "sample"

    def __init__(self):
        self._counters = {}    # CUDA device id -> this instance's zeroed counter buffer
        self.penalties: PenaltyState | None = None
        self.masks: TokenMaskState | None = None

    def bind(self, be, rows: int, vocab: int) -> None:
        """Keep penalty state (counts, prompts, logit bias, min_tokens) and grammar masks for
        `rows` token-table rows on `be`: the model that owns this sampler calls it once, before
        any step."""
        self.penalties = PenaltyState(be, rows, vocab)
        self.masks = TokenMaskState(be, rows, vocab)

    def extra_args(self, inputs) -> tuple:
        """The launch arguments after token_table for a step's `inputs` (DecodeInputs)."""
        if self.penalties is None:
            return (inputs.logprobs,)
        return (inputs.logprobs, inputs.penalized, inputs.presence_penalty, inputs.frequency_penalty,
                inputs.repetition_penalty, *self.penalties.args(), *self.masks.args())

    def begin_rows(self, stream, seqs) -> None:
        """The penalty state and first grammar mask of the rows of newly prefilled requests
        (PenaltyState.begin_rows, TokenMaskState.begin_rows)."""
        if self.penalties is not None:
            self.penalties.begin_rows(stream, seqs)
            self.masks.begin_rows(stream, seqs)

    def run_numpy(self, logits, token_rows, positions, temperature, top_k, top_p, min_p, seed,
                  out_tokens, token_table, logprobs=None, *extra):
        records = _records(out_tokens, logprobs)
        penalty, mask = _split(extra)
        if penalty:
            penalize(logits, token_rows, *penalty)
        if mask:
            apply_mask(logits, token_rows, *mask)
        tokens = reference.sample_tokens(logits, positions, temperature, top_k, top_p, min_p, seed)
        if penalty:
            count(tokens, token_rows, penalty[0], penalty[4], penalty[8])
        if records is None:
            out_tokens[...] = tokens
        else:
            write_records(records, logits, tokens, temperature, logprobs)
        token_table[token_rows] = np.maximum(tokens, 0)

    def run_cupy(self, stream_handle, logits, token_rows, positions, temperature, top_k, top_p,
                 min_p, seed, out_tokens, token_table, logprobs=None, *extra):
        import cupy as cp

        from vt.backend.nvrtc import cuda_function, sm_count

        S, V = logits.shape
        if not S:
            return
        records = _records(out_tokens, logprobs)
        if logits.dtype != np.float32 or not logits.flags.c_contiguous or V >= 2**23:
            raise ValueError(f"Sampler: logits must be C-contiguous float32 [S, V] with V < 2**23, "
                             f"got {logits.dtype} {logits.shape}")
        vec = int(V % 4 == 0 and logits.data.ptr % 16 == 0)
        B, C = split(S, V, sm_count())
        ws = cp.empty(workspace_for(S, V, sm_count()), cp.uint8)
        cnt = self._zeroed_counters(cp, S, ws)
        if records is not None:   # the tokens go to the workspace's head, then into the records
            tokens, ws = ws[:4 * S].view(cp.int32), ws[_token_head(S):]
        else:
            tokens = out_tokens
        penalty, mask = _split(extra)
        if penalty:
            launch_penalize(logits, token_rows, *penalty)
        if mask:
            launch_mask(logits, token_rows, *mask)
        cuda_function(CODE, "sample", VEC4=vec)(
            (S * B,), (256,), (logits, token_rows, positions, temperature, top_k, top_p, min_p, seed,
                               tokens, token_table, cnt, ws, np.int32(S), np.int32(V), np.int32(B),
                               np.int32(C)))
        if penalty:
            launch_count(tokens, token_rows, penalty[0], penalty[4], penalty[8])
        if records is not None:
            launch_records(logits, tokens, temperature, logprobs, records)

    def _zeroed_counters(self, cp, S: int, ws):
        """Counters for S rows that are zero now: the instance's own buffer (the kernel leaves
        it zero), or for more than COUNTER_ROWS rows the tail of this call's workspace zeroed
        by a kernel (not cudaMemsetAsync: inside a graph a memset node adds ~2 µs to every
        cudaGraphLaunch on the host, a kernel node next to nothing)."""
        if S > COUNTER_ROWS:
            n = counter_bytes(S)
            cnt = ws[(ws.size - n) // 8 * 8:][:n]      # 8-byte aligned; workspace_for counts it
            _zero_kernel(cp)(cnt.view(cp.uint32))
            return cnt
        dev = cp.cuda.Device().id
        if dev not in self._counters:
            cnt = cp.empty(counter_bytes(COUNTER_ROWS), cp.uint8)
            _zero_kernel(cp)(cnt.view(cp.uint32))
            self._counters[dev] = cnt
        return self._counters[dev]


_PENALTY_ARGS = 10   # penalized, presence, frequency, repetition, and PenaltyState.args()
_MASK_ARGS = 2       # TokenMaskState.args()


def _split(extra) -> tuple[tuple, tuple]:
    """The arguments after logprobs: (penalty's, the mask's), either empty when absent."""
    if len(extra) not in (0, _PENALTY_ARGS, _PENALTY_ARGS + _MASK_ARGS):
        raise ValueError(f"Sampler: {len(extra)} arguments after logprobs; expected 0, "
                         f"{_PENALTY_ARGS} (penalties) or {_PENALTY_ARGS + _MASK_ARGS} (and the mask)")
    return tuple(extra[:_PENALTY_ARGS]), tuple(extra[_PENALTY_ARGS:])


def _records(out, logprobs):
    """out as a records array [S, RECORD_WORDS] (None: out is tokens [S]); records need the
    rows' logprobs counts."""
    if out.ndim == 1:
        return None
    if out.shape[1:] != (RECORD_WORDS,) or logprobs is None:
        raise ValueError(f"Sampler: out must be tokens [S] or records [S, {RECORD_WORDS}] with the "
                         f"rows' logprobs counts, got {tuple(out.shape)} with logprobs "
                         f"{'absent' if logprobs is None else 'given'}")
    return out


def _token_head(S: int) -> int:
    """Bytes at the workspace's head that hold a records call's tokens [S] i32 (the kernel's
    own workspace follows, 256-byte aligned as the allocator's)."""
    return (4 * S + 255) // 256 * 256


_ZERO: list = []


def _zero_kernel(cp):
    """x = 0 over a uint32 array, as a plain kernel (CuPy's fill(0) would be a memset)."""
    if not _ZERO:
        _ZERO.append(cp.ElementwiseKernel("", "uint32 x", "x = 0", "vt_sampler_zero"))
    return _ZERO[0]


def workspace_for(S: int, V: int, sms: int) -> int:
    """Bytes the sampler allocates per call for S rows of V: an upper bound that depends only
    on S's power-of-two class (the S * B block terms are at most max(S, BLOCKS_PER_SM * sms),
    16 bytes each), so that the few sizes of workspace_sizes() cover every S and a pool warmed
    with them serves every later call without growing (prefill steps sample any row count)."""
    rows = 1 << max(0, S - 1).bit_length()
    return (workspace_bytes(rows, 1) + 16 * max(rows, BLOCKS_PER_SM * sms) + 64
            + _token_head(rows) + (counter_bytes(rows) if rows > COUNTER_ROWS else 0))


def workspace_sizes(max_rows: int, V: int, sms: int) -> list[int]:
    """Every size workspace_for gives for 1..max_rows rows (one per power of two), and the
    size of an instance's counter buffer (its first call may come inside a capture)."""
    return sorted({workspace_for(1 << k, V, sms) for k in range(max(1, max_rows - 1).bit_length() + 1)}
                  | {counter_bytes(COUNTER_ROWS)})
