"""HybridModel: the reference hybrid decoder on a vt backend (sim: numpy, cuda: CuPy + cuBLAS).

Set-up order: check weights, upload them (fused where one GEMM can serve several HF tensors),
allocate the paged KV cache, the GDN states and the token table (each with one scratch
entry for padded rows), then the cuBLAS workspaces. `decode` only launches kernels and takes
its temporaries from the pool, so it is capturable; those temporaries become the capture's
scratch.

batch_invariant=True (or VT_BATCH_INVARIANT=1 when the argument is None): a row's logits do
not depend on the batch it runs in, its padded size, or prefill's token count. Every GEMM
then runs in blocks of INVARIANT_ROWS rows (buffers padded to a multiple; kernels/gemm.py),
MoE always takes the all-experts path (the routed one reads a different GEMM), and attention
uses a fixed split count. Off by default on cuda: it costs device time (measured in
docs/data/invariance-h200.json). The sim's numpy kernels are row-invariant either way.
"""
from __future__ import annotations

import numpy as np

from . import kernels as K
from .config import ModelConfig
from .inputs import DecodeInputs, PrefillInputs
from .kernels.attention import invariant_splits
from .kernels.gemm import WORKSPACE_BYTES
from .weights import check_weights
from vt.validate import integer
from vt import env
from vt.sampling import Sampler

_EMBED, _GATHER, _NORM, _ROPE, _KVW = K.EmbedTokens(), K.GatherRows(), K.RMSNorm(), K.RoPE(), K.KVWrite()
_ATTN, _GDN, _ACT, _ROUTER, _COMBINE = K.PagedAttention(), K.GDN(), K.SiluMul(), K.Router(), K.Combine()
_COMBINE_ROUTED = K.CombineRouted()
_FILL = K.Fill()
_STAGING_BYTES = 64 << 20
INVARIANT_ROWS = 64   # GEMM row block of a batch-invariant model (>= the default max_batch)


class HybridModel:
    def __init__(self, backend, cfg: ModelConfig, weights: dict[str, np.ndarray],
                 max_seqs: int | None = None, num_kv_blocks: int | None = None, *,
                 max_batch: int = 64, gemm_streams: int = 4, batch_invariant: bool | None = None):
        # None means "the default"; anything else must be a real size. Checked first: 0 used to
        # become the default silently and a negative count failed deep inside the pool.
        for name, v in (("max_seqs", max_seqs), ("num_kv_blocks", num_kv_blocks)):
            if v is not None:
                integer(f"HybridModel: {name} (None: the default)", v, 1)
        self.batch_invariant = env.switch_argument("HybridModel: batch_invariant",
                                                   batch_invariant, "VT_BATCH_INVARIANT")
        check_weights(cfg, weights)
        self.be, self.cfg = backend, cfg
        self.max_seqs = cfg.max_seqs if max_seqs is None else max_seqs
        self.num_kv_blocks = (self.max_seqs * cfg.max_blocks_per_seq if num_kv_blocks is None
                              else num_kv_blocks)
        self.max_batch = max(max_batch, self.max_seqs)
        # Scratch entries for padded rows: one past the real ones.
        self.scratch_row = self.scratch_state = self.max_seqs
        self.scratch_block = self.num_kv_blocks
        self.stream = backend.stream(name="model-init")
        self._staging = backend.pinned_empty((_STAGING_BYTES,), np.uint8)
        self._upload_weights(weights)
        st, bs = cfg.storage_dtype, cfg.kv_block_size
        kv_shape = (self.num_kv_blocks + 1, bs, cfg.kv_heads, cfg.head_dim)
        self.k_cache = {i: backend.empty(kv_shape, st) for i in cfg.attn_layers}
        self.v_cache = {i: backend.empty(kv_shape, st) for i in cfg.attn_layers}
        st_shape = (self.max_seqs + 1, cfg.gdn_heads, cfg.gdn_dk, cfg.gdn_dv)
        self.states = {i: backend.empty(st_shape, np.float32) for i in cfg.gdn_layers}
        self.token_table = backend.empty((self.max_seqs + 1,), np.int32)   # [max_seqs + 1]
        self._iota = self._const(np.arange(self.max_batch + 1, dtype=np.int32))
        self._sample = Sampler()   # its own: a Sampler's calls must run in order (sampler.py)
        self._sample.bind(backend, self.max_seqs + 1, cfg.vocab)
        self.token_masks = self._sample.masks
        # Everything a step can read is defined: padded rows read the scratch block and state,
        # and sanitizer runs (initcheck) flag reads of memory nobody wrote.
        for a in [*self.states.values(), *self.k_cache.values(), *self.v_cache.values(), self.token_table]:
            backend.launch(self.stream, _FILL, a, value=0)
        ws = [backend.empty((WORKSPACE_BYTES,), np.uint8) for _ in range(gemm_streams)] \
            if backend.name == "cuda" else []
        self.gemm = K.Gemm(ws, rows_block=INVARIANT_ROWS if self.batch_invariant else None)
        self._attn_splits = (invariant_splits(cfg.kv_heads) if backend.name == "cuda" else 1) \
            if self.batch_invariant else None
        self.routed_gemm = K.RoutedGemm(self.gemm)   # shares the GEMM's cuBLAS handles
        self.stream.synchronize()

    # ------------------------------------------------------------------ set-up
    def _const(self, host: np.ndarray):
        """A device copy of `host` through the pinned staging buffer (eager, synchronous)."""
        d = self.be.empty(host.shape, host.dtype)
        src, dst = np.ascontiguousarray(host).reshape(-1).view(np.uint8), d.reshape(-1).view(np.uint8)
        for a in range(0, src.size, _STAGING_BYTES):
            n = min(_STAGING_BYTES, src.size - a)
            self._staging[:n] = src[a: a + n]
            self.be.copy_h2d(dst[a: a + n], self._staging[:n], self.stream)
            self.stream.synchronize()  # the staging buffer is reused by the next chunk
        return d

    def _upload_weights(self, w):
        c, up = self.cfg, self._const
        self.emb, self.lm_head = up(w["model.embed_tokens.weight"]), up(w["lm_head.weight"])
        self.final_norm = up(w["model.norm.weight"])
        self.layers = []
        for i, kind in enumerate(c.kinds):
            p = f"model.layers.{i}."
            L = {"ln1": up(w[p + "input_layernorm.weight"]), "ln2": up(w[p + "post_attention_layernorm.weight"])}
            if kind == "A":
                a = p + "self_attn."
                L["qkv"] = up(np.concatenate([w[a + n + "_proj.weight"] for n in "qkv"]))  # [(Hq+2Hk)D, H]
                L["o"] = up(w[a + "o_proj.weight"])
            else:
                g = p + "linear_attn."
                L["in"] = up(np.concatenate([w[g + "in_proj_qkvz.weight"], w[g + "in_proj_ba.weight"]]))
                L["out"] = up(w[g + "out_proj.weight"])
                for n in ("A_log", "dt_bias"):
                    L[n] = up(w[g + n])
                L["norm"] = up(w[g + "norm.weight"])
            m = p + "mlp."
            if c.moe:
                E = range(c.experts)
                L["router"] = up(w[m + "gate.weight"])
                L["egu"] = up(np.stack([np.concatenate([w[f"{m}experts.{e}.gate_proj.weight"],
                                                        w[f"{m}experts.{e}.up_proj.weight"]]) for e in E]))
                L["edown"] = up(np.stack([w[f"{m}experts.{e}.down_proj.weight"] for e in E]))
                m += "shared_expert."
            if not c.moe or c.shared_ffn:
                L["gu"] = up(np.concatenate([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))  # [2F, H]
                L["down"] = up(w[m + "down_proj.weight"])
            self.layers.append(L)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all the weights a step may read (every expert; the embedding table, only
        gathered, excluded)."""
        arrs = [self.emb[:0], self.lm_head, self.final_norm] + [a for L in self.layers for a in L.values()]
        return int(sum(a.nbytes for a in arrs))

    def routed(self, rows: int) -> bool:
        """Whether a forward over `rows` rows computes only each row's top-k experts: when that
        reads fewer expert matrices (rows * top_k) than all of them (kernels/moe.py)."""
        return self.cfg.moe and not self.batch_invariant and rows * self.cfg.top_k < self.cfg.experts

    def weight_bytes_read(self, rows: int) -> int:
        """Weight bytes one decode step of `rows` rows reads: weight_bytes, less the experts a
        routed step does not touch (a matrix picked by two rows counts twice: it is fetched
        by two products)."""
        if not self.routed(rows):
            return self.weight_bytes
        expert = sum(L[k].nbytes // self.cfg.experts for L in self.layers for k in ("egu", "edown"))
        return self.weight_bytes - expert * (self.cfg.experts - rows * self.cfg.top_k)

    # ------------------------------------------------------------------ forward
    def decode(self, s, inp: DecodeInputs, logits_out) -> None:
        """One decode step for inp.batch rows; logits_out [S, vocab] fp32. Launches only."""
        S = inp.batch
        if S > self.max_batch:
            raise ValueError(f"decode: batch {S} > max_batch {self.max_batch} of this model")
        h = self.be.empty((self._padded(S), self.cfg.hidden), np.float32)   # [P, H] residual stream
        self.be.launch(s, _EMBED, self.emb, self.token_table, inp.token_rows, h[:S])
        self._layers(s, h, S, inp.positions, inp.slot_mapping, inp.block_tables, inp.seq_lens,
                     self._iota[:S], inp.state_idx, self._iota[: S + 1], fresh=False)
        self._logits(s, h, S, logits_out)

    def prefill(self, s, pinp: PrefillInputs, logits_out) -> None:
        """Eager prefill of B segments (whole prompts or chunks: a segment starting past
        position 0 reads the earlier positions' K/V from the cache and goes on from its GDN
        state); writes the KV cache and the GDN states; logits_out [B, vocab] fp32 gets each
        segment's last-token logits."""
        T = pinp.tokens
        h = self.be.empty((self._padded(T), self.cfg.hidden), np.float32)   # [P >= T, H]
        self.be.launch(s, _GATHER, self.emb, pinp.token_ids, h[:T])
        self._layers(s, h, T, pinp.positions, pinp.slot_mapping, pinp.block_tables, pinp.ctx_lens,
                     pinp.token_seq, pinp.state_idx, pinp.cu_seqlens, fresh=True)
        B = pinp.batch
        last = self.be.empty((self._padded(B), self.cfg.hidden), np.float32)   # [P >= B, H]
        self.be.launch(s, _GATHER, h[:T], pinp.last_idx, last[:B])
        self._logits(s, last, B, logits_out)

    def sample(self, s, logits, inp, out_tokens) -> None:
        """out_tokens[S] int32 (or records [S, RECORD_WORDS]) <- sampled tokens (each row's
        sampling knobs from `inp`; -1 for an error row: vt/sampling/sampler.py); also
        token_table[inp.token_rows]."""
        self.be.launch(s, self._sample, logits, inp.token_rows, inp.sample_positions, inp.temperature,
                       inp.top_k, inp.top_p, inp.min_p, inp.seed, out_tokens, self.token_table,
                       *self._sample.extra_args(inp))

    def begin_requests(self, s, seqs) -> None:
        """The sampler's penalty state of the rows of `seqs` (vt/sampling/penalties.py)."""
        self._sample.begin_rows(s, seqs)

    def _padded(self, n: int) -> int:
        """Rows of a GEMM operand for n rows: n, or the next multiple of the invariant block
        (the GEMMs read and write the padding rows, the other kernels only the first n)."""
        return -(-n // INVARIANT_ROWS) * INVARIANT_ROWS if self.batch_invariant else n

    def _zero_padding(self, s, n, *arrays) -> None:
        """Zero the padding rows of GEMM inputs (and of h, which GEMMs accumulate into): no
        kernel writes them, so they would carry stale pool bytes (NaN, inf) through the
        GEMMs; zeros keep every value defined (sanitizer initcheck, numpy warnings)."""
        for a in arrays:
            if a is not None and a.shape[0] > n:
                self.be.launch(s, _FILL, a[n:], value=0)

    def _layers(self, s, h, n, positions, slots, block_tables, lens, rows, state_idx, cu, fresh):
        """h [P, H] (P = _padded(n)), n real rows. fresh: a segment whose first token is at
        position 0 starts from a zero GDN state (prefill); off, every state goes on (decode)."""
        c, be, L0 = self.cfg, self.be, self.layers
        P, st = h.shape[0], c.storage_dtype
        x = be.empty((P, c.hidden), st)                                   # [P, H] normed
        hq, hk, D = c.heads, c.kv_heads, c.head_dim
        g, dk, dv = c.gdn_heads, c.gdn_dk, c.gdn_dv
        qkv = be.empty((P, (hq + 2 * hk) * D), st) if c.attn_layers else None
        att = be.empty((P, hq * D), st) if c.attn_layers else None
        proj = be.empty((P, 2 * g * (dk + dv) + 2 * g), st) if c.gdn_layers else None
        go = be.empty((P, g * dv), st) if c.gdn_layers else None
        self._zero_padding(s, n, h, x, att, go)
        for i, kind in enumerate(c.kinds):
            L = L0[i]
            be.launch(s, _NORM, h[:n], L["ln1"], x[:n], eps=c.rms_eps)
            if kind == "A":
                be.launch(s, self.gemm, x, L["qkv"], qkv)
                be.launch(s, _ROPE, qkv[:n], positions, n_heads=hq + hk, head_dim=D, theta=c.rope_theta)
                be.launch(s, _KVW, qkv[:n], slots, self.k_cache[i], self.v_cache[i], q_heads=hq,
                          kv_heads=hk, head_dim=D)
                be.launch(s, _ATTN, qkv[:n], self.k_cache[i], self.v_cache[i], block_tables, lens, rows,
                          att[:n], q_heads=hq, kv_heads=hk, head_dim=D, fixed_splits=self._attn_splits)
                be.launch(s, self.gemm, att, L["o"], h, accumulate=True)
            else:
                be.launch(s, self.gemm, x, L["in"], proj)
                be.launch(s, _GDN, proj[:n], L["A_log"], L["dt_bias"], L["norm"], self.states[i],
                          state_idx, cu, positions, go[:n], heads=g, dk=dk, dv=dv, fresh=fresh,
                          eps=c.rms_eps)
                be.launch(s, self.gemm, go, L["out"], h, accumulate=True)
            be.launch(s, _NORM, h[:n], L["ln2"], x[:n], eps=c.rms_eps)
            self._mlp(s, L, x, h, n)

    def _mlp(self, s, L, x, h, n):
        c, be, P, st = self.cfg, self.be, x.shape[0], self.cfg.storage_dtype
        if c.moe:
            E, F = c.experts, c.expert_ffn
            rl = be.empty((P, E), np.float32)                              # [P, E] router logits
            wd = be.empty((n, E), np.float32)
            topk = be.empty((n, c.top_k), np.int32)
            be.launch(s, self.gemm, x, L["router"], rl)
            be.launch(s, _ROUTER, rl[:n], wd, topk, k=c.top_k)
            if self.routed(n):        # only the selected experts (kernels/moe.py)
                slots = n * c.top_k
                gu = be.empty((slots, 2 * F), st)                          # [N * k, 2F]
                act = be.empty((slots, F), st)
                y = be.empty((slots, c.hidden), st)                        # [N * k, H]
                be.launch(s, self.routed_gemm, x[:n], L["egu"], topk, gu)
                be.launch(s, _ACT, gu, act)
                be.launch(s, self.routed_gemm, act, L["edown"], topk, y)
                be.launch(s, _COMBINE_ROUTED, wd, topk, y, h[:n])
            else:                     # every expert for every row, in blocks of B rows
                B = INVARIANT_ROWS if self.batch_invariant else P
                C = P // B
                gu = be.empty((C, E, B, 2 * F), st)                        # [C, E, B, 2F]
                act = be.empty((C, E, B, F), st)
                y = be.empty((C, E, B, c.hidden), st)                      # [C, E, B, H]
                be.launch(s, self.gemm, x, L["egu"], gu)
                be.launch(s, _ACT, gu, act)
                be.launch(s, self.gemm, act, L["edown"], y)
                be.launch(s, _COMBINE, wd, topk, y, h[:n])
        if "gu" in L:
            F = L["down"].shape[1]
            gu = be.empty((P, 2 * F), st)
            act = be.empty((P, F), st)
            be.launch(s, self.gemm, x, L["gu"], gu)
            be.launch(s, _ACT, gu, act)
            be.launch(s, self.gemm, act, L["down"], h, accumulate=True)

    def _logits(self, s, h, n, logits_out):
        """h [P, H] (n real rows) -> logits_out [n, vocab]."""
        P = h.shape[0]
        x = self.be.empty((P, self.cfg.hidden), self.cfg.storage_dtype)
        self._zero_padding(s, n, x)
        self.be.launch(s, _NORM, h[:n], self.final_norm, x[:n], eps=self.cfg.rms_eps)
        if P == n:
            self.be.launch(s, self.gemm, x, self.lm_head, logits_out)            # [S, vocab]
            return
        full = self.be.empty((P, self.cfg.vocab), np.float32)                   # [P, vocab]
        self.be.launch(s, self.gemm, x, self.lm_head, full)
        self.be.copy_d2d(logits_out, full[:n], s)

    def release_stream(self, stream) -> None:
        """`stream` will not run this model again (its graphs are gone): free what the model
        holds for it (the GEMM's cuBLAS handle and workspace), so another stream can use them."""
        self.gemm.release_stream(stream.handle)

    def close(self) -> None:
        self.gemm.close()
