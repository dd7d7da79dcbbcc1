"""A Llama-family decoder in PyTorch on vt's step contract: the template to copy for your model.

One call runs every token of a step, as a flattened batch (vt.torch.TorchInputs: T tokens of
B sequences; a decode step is one token per sequence):

    x, delta = embed(input_ids), None                                   # [T, hidden]
    ctx = build_context(inputs)        # once per step: RoPE rows, the KV slots, the masks
    per layer (Layer.forward):
                x = x + delta;  h = rms_norm(x)   # delta: the previous layer's MLP output
                q, k, v = qkv(h)                  (+ bias: Qwen2; q/k RMSNorm: Qwen3)
                q, k = rope(q, k, positions)
                k_cache[slot_mapping], v_cache[slot_mapping] = k, v     # the paged KV write
                x = x + o(attend(q, ...))         (vt/torch/attention.py: causal per sequence)
                h = rms_norm(x);  delta = down(silu(gate(h)) * up(h))
    logits_out = lm_head(rms_norm((x + delta)[logits_indices]))         # [B, vocab] f32

Every layer's forward is that one path. What computes each of its parts (a LayerOps: the
linears, the residual add with the norm after it, the SiLU product, and RoPE with the KV
write and attention) is chosen when the decoder is built, by the settings below, once per
kind of step: decode steps (decode_ops, and one_row_ops for a step of one row) and steps
with prompt tokens (prompt_ops). The decoder's forward picks the step's LayerOps and passes
it down.

A decode step's shapes are fixed by B and the geometry, so it has no host sync and vt captures
it as it is. `kernels` picks its attention and layer ops: "torch" reads max_context slots per
row and masks those at or beyond seq_lens (plain torch); "vt" runs
vt.torch.paged_attention.paged_decode_attention (each row's live tokens only) and the fused
ops of vt.torch.fused (rms_norm, add_rms_norm for each residual add and the norm after it,
the next layer's or the final one, silu_mul, and rope_and_cache unless qk_norm, whose norm
sits between the projection and RoPE; in a one-row step with head_dim >= 32, RoPE, the KV
write and attention are one call, paged_attention.rope_cache_decode_attention); "auto" (the
default) is "vt" on the CPU, and on CUDA with a power-of-two head_dim (the Triton kernels'
shape), else "torch". On the CPU "vt" is plain torch, its paged attention custom ops
(vt.torch.cpu_ops) that the sim's capture records as one op each: a captured step on the sim
attends over the live tokens, as on CUDA.

`linear` picks what computes a decode step's projections on vt's kernels: "torch"
(nn.Linear, cuBLAS on CUDA), "triton" (vt.torch.fused.linear: at most 16 rows in bf16/fp16
on CUDA run vt.torch.triton_gemv's kernels, and at one row the gate_up projection takes
silu_mul into its epilogue; more rows, or the CPU, compute the same with the torch ops), or
"auto" (the default): "triton" where `kernels` resolves to "vt", else "torch". Measured on an
H100 with the 8B shape (docs/torch.md), the Triton linears make the step 3.6-5.3 % faster
at 1, 8 and 16 rows.

Steps with prompt tokens run eagerly: serve the decoder with TorchForwardModel(...,
prefill="flat") so that a prompt chunk, or a whole mixed step, is one call. `prompt_kernels`
picks their ops: "vt" (with kernels="vt") is the same fused ops as a decode step, and the
attention of every token of the step (prompt chunks and a mixed step's decode rows) in one
vt.torch.paged_attention.paged_varlen_attention call: about 10 launches a layer instead of
about 70, which a short prompt pays in host time, and one call however many prompts the step
holds; cuBLAS computes the projections. "torch" is plain torch ops with SDPA per prompt chunk.
"auto" (the default) follows `kernels`: "vt" where decode steps run vt's kernels, measured
faster (docs/benchmarks.md, section 2: TTFT 0.75-0.88x transformers eager's against
0.93-1.14x with "torch"). vt.torch.hf loads Hugging Face checkpoints into it.

batch_invariant=True (None, the default: VT_BATCH_INVARIANT): a token's logits bits depend on
its sequence alone, not on the other rows of its step, their number, or how its prompt was cut
into chunks (which follows the other requests), so a greedy token never flips with the batch.
Every step then runs vt's kernels in their row-invariant forms: the projections and the head
through vt.torch.fused.invariant_linear (vt.torch.triton_invariant's fixed-shape matmul on
CUDA, one product per row on the CPU), the norms and the SiLU product one row at a time, and
attention with invariant=True, which computes a prompt token as it computes a decode row. It
costs time (docs/torch.md, "Batch invariance").

quantization="fp8": the four projections of every layer hold FP8 (e4m3) weights with float32
scales (vt.torch.fp8.Fp8Linear: per output channel, or per 128 x 128 block with
fp8_scales="block", as the `fp8` checkpoint format stores them); the embedding, the norms and
the head keep `dtype`. Each LayerOps' linears then take FP8 weights (fp8_ops) through
vt.torch.fp8.linear: weight-only below fp8.W8A8_MIN_ROWS rows, the activations quantized per
row too (W8A8) from there with per-channel scales, fp8_prompt_linear ("scaled_mm", the
default, or "dequantize") past fp8.GEMV_MAX_ROWS; the CPU reference follows the same choices.
quantize_weights_ fills them from dense weights; vt.torch.hf.load reads FP8 checkpoints or
quantizes at load. One rank, not batch_invariant.

kv_cache_dtype="fp8" ("auto", the default: the model's dtype): the KV cache holds K and V as
e4m3 codes, one byte an element, with a static float32 scale per layer for K and one for V
(1.0: vt.torch.kv_fp8 says how the codes are written and read, and why that scale). The KV
write quantizes (fused.rope_and_cache, rope_cache_decode_attention, the q/k-norm path's torch
write), and paged decode and varlen attention dequantize as they load, so it needs every step
on vt's kernels and is refused with batch_invariant.

With `tp` (a vt.torch.tensor_parallel.TensorParallel of more than one rank) each rank holds
its share of the heads, the KV cache, the MLP and the head; `o` and `down` end in an
all-reduce and the logits in an all-gather (LlamaDecoder's docstring; docs/torch.md).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vt import env
from vt.step import KVGeometry
from vt.torch import fp8, fused, kv_fp8
from vt.torch.attention import AttentionContext, attend, build_context
from vt.torch.paged_attention import rope_cache_decode_attention
from vt.torch.tensor_parallel import TensorParallel
from vt.torch.views import TorchInputs
from vt.validate import integer


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture. Llama: no biases; Qwen2: qkv_bias; Qwen3: qk_norm (and head_dim)."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_linear_factor: float = 1.0    # linear RoPE scaling: frequencies divided by it
    rope_llama3: tuple | None = None   # (factor, low_freq_factor, high_freq_factor, original_max)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim"):
            integer(f"LlamaConfig.{name}", getattr(self, name), 1)
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: heads={self.heads} must be a multiple of "
                             f"kv_heads={self.kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even (RoPE)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # In float32, as Hugging Face's Llama does, then back to the weights' dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # This rank's heads: qkv is column-parallel (its heads' rows), o row-parallel.
        self.heads, self.kv_heads = tp.local(cfg.heads, "heads"), tp.local(cfg.kv_heads, "kv_heads")
        q, kv = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, q + 2 * kv, bias=cfg.qkv_bias)   # fused q, k, v
        self.o = nn.Linear(q, cfg.hidden, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        # An FP8 KV cache's static scales of this layer's K and V (fp8_kv_scales); None for a
        # cache in the model's dtype. Not in the state dict: no checkpoint holds them.
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)

    def forward(self, h, ctx: AttentionContext, ops: LayerOps, k_cache, v_cache):
        qkv = ops.attn_linear(h, self.qkv.weight, self.qkv.bias)
        out = ops.attention(self, qkv, ctx, k_cache, v_cache)   # RoPE, the KV write, attention
        return self.tp.row_parallel(self.o, out, ops.attn_linear)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        # This rank's share of the intermediate: gate_up column-parallel, down row-parallel.
        inter = tp.local(cfg.intermediate, "intermediate")
        self.gate_up = nn.Linear(cfg.hidden, 2 * inter, bias=cfg.mlp_bias)   # fused [gate | up]
        self.down = nn.Linear(inter, cfg.hidden, bias=cfg.mlp_bias)

    def forward(self, h, ops: LayerOps):
        act = ops.gate_up_silu(h, self.gate_up.weight, self.gate_up.bias)   # silu(gate) * up
        return self.tp.row_parallel(self.down, act, ops.linear)


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.attn = Attention(cfg, tp)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, delta, ctx: AttentionContext, ops: LayerOps, k_cache, v_cache):
        """The layer over the residual stream x + delta (delta: the previous layer's MLP
        output, not added yet, so that the add and the norm after it can be one kernel;
        None before the first layer). Returns the same pair for the next layer."""
        x, h = ops.projection_norm(x, delta, self.attn_norm)
        x, h = ops.projection_norm(x, self.attn(h, ctx, ops, k_cache, v_cache), self.mlp_norm)
        return x, self.mlp(h, ops)


class LlamaDecoder(nn.Module):
    """The decoder and its paged KV cache ([num_kv_blocks * block_size, kv_heads, head_dim] per
    layer, K and V) for a vt geometry. Call it as vt's forward(inputs, logits_out).

    tp: rank tp.rank of a tensor-parallel group (vt.torch.tensor_parallel; None: one rank,
    no collective). Each rank holds heads / size query heads and kv_heads / size KV heads
    (their qkv rows and o columns, their KV cache), intermediate / size of the MLP, and
    vocab / size rows of the head (vocab padded up to a multiple of size with zero rows);
    the norms, the row-parallel layers' biases and the embedding are replicated (the
    embedding: the simplest; a vocab-parallel one would save (size - 1) / size of its
    vocab * hidden per rank at the cost of a masked lookup and an all-reduce per step).
    o and down are summed over the ranks (TensorParallel.row_parallel), the logits
    gathered (TensorParallel.all_gather): every rank's logits_out is the same, bit for bit.
    shard_state_dict makes a rank's weights."""

    # One call runs every token of a step (module docstring): TorchForwardModel takes this
    # as its prefill mode, so a prompt chunk costs one forward call, not one per position.
    prefill = "flat"
    # Its KV of a position depends only on the tokens up to it (no recurrent state): the
    # engine shares cached prompt blocks between sequences (StepModel.prefix_cacheable).
    prefix_cacheable = True
    # Each layer writes every row's K and V before any row's attention reads the cache, and a
    # row attends over its seq_len slots only: rows of one sequence at consecutive positions
    # are that sequence's causal run, so a speculative verify step is a decode over them
    # (vt/forward/speculative.py). Such a step has at least two rows: never the one-row kernel.
    verifies_by_decode = True

    def __init__(self, cfg: LlamaConfig, geometry: KVGeometry, *, dtype=torch.bfloat16,
                 device="cuda", kernels: str = "auto", linear: str = "auto",
                 prompt_kernels: str = "auto", tp: TensorParallel | None = None,
                 batch_invariant: bool | None = None, quantization: str | None = None,
                 fp8_scales: str = "channel", fp8_prompt_linear: str = fp8.PROMPT_LINEAR,
                 kv_cache_dtype: str | None = "auto"):
        super().__init__()
        self.tp = TensorParallel(0, 1) if tp is None else tp
        check_tensor_parallel(cfg, self.tp)
        self.cfg, self.geometry = cfg, geometry
        batch_invariant = env.switch_argument("LlamaDecoder: batch_invariant", batch_invariant,
                                              "VT_BATCH_INVARIANT")
        self.batch_invariant = batch_invariant
        self.kernels, self.prompt_kernels = resolve_kernels(
            kernels, prompt_kernels, torch.device(device), cfg.head_dim, batch_invariant)
        self.linear = resolve_linear(linear, self.kernels, batch_invariant)
        # Each kind of step's implementations, chosen here once: a decode step's projections
        # take the `linear` choice (its rows are the captured batch: the Triton GEMV's
        # regime), a step with prompt tokens' cuBLAS's (many rows) unless batch_invariant.
        prompt_linear = "invariant" if batch_invariant else "torch"
        self.decode_ops = layer_ops(cfg, self.kernels, self.linear, batch_invariant)
        self.one_row_ops = layer_ops(cfg, self.kernels, self.linear, batch_invariant,
                                     one_row=True)
        self.prompt_ops = layer_ops(cfg, self.prompt_kernels, prompt_linear, batch_invariant)
        self.quantization = check_quantization(quantization, fp8_scales, fp8_prompt_linear,
                                               self.tp, batch_invariant)
        if self.quantization == "fp8":
            self.decode_ops, self.one_row_ops, self.prompt_ops = (
                fp8_ops(ops, fp8_prompt_linear, per_block=fp8_scales == "block")
                for ops in (self.decode_ops, self.one_row_ops, self.prompt_ops))
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, self.kernels,
                                                   self.prompt_kernels, cfg, batch_invariant)
        fp8_parts = [f"{name}='fp8'" for name, value in (("quantization", self.quantization),
                                                         ("kv_cache_dtype", self.kv_cache_dtype))
                     if value == "fp8"]
        if fp8_parts:
            fp8.check_device(f"LlamaDecoder: {' and '.join(fp8_parts)}", device)
        factory = dict(dtype=dtype, device=device)
        self.vocab_shard = vocab_shard(cfg, self.tp)   # rows of the head on this rank
        # Tied, the head is the embedding's rows of this rank's shard: the padding is there.
        rows = self.vocab_shard * self.tp.size if cfg.tie_embeddings else cfg.vocab
        self.embed = nn.Embedding(rows, cfg.hidden, **factory)
        with torch.device(device):
            self.layers = nn.ModuleList(Layer(cfg, self.tp)
                                        for _ in range(cfg.layers)).to(dtype)
            if self.quantization == "fp8":   # after .to(dtype), which would cast FP8 codes
                for layer in self.layers:
                    quantized_linears(layer, dtype, per_block=fp8_scales == "block")
            if self.kv_cache_dtype == "fp8":   # after .to(dtype), which would cast scales
                for layer in self.layers:
                    fp8_kv_scales(layer.attn, device)
            self.norm = RMSNorm(cfg.hidden, cfg.rms_eps).to(dtype)
            self.lm_head = None if cfg.tie_embeddings else nn.Linear(
                cfg.hidden, self.vocab_shard, bias=False, **factory)
        slots = geometry.num_kv_blocks * geometry.block_size
        kv = (cfg.layers, slots, self.tp.local(cfg.kv_heads, "kv_heads"), cfg.head_dim)
        cache = dict(factory, dtype=kv_fp8.FP8) if self.kv_cache_dtype == "fp8" else factory
        self.register_buffer("k_cache", torch.zeros(kv, **cache), persistent=False)
        self.register_buffer("v_cache", torch.zeros(kv, **cache), persistent=False)
        cos, sin = rope_table(cfg, geometry.max_context)
        self.register_buffer("cos", cos.to(device), persistent=False)   # [max_context, hd] f32
        self.register_buffer("sin", sin.to(device), persistent=False)
        T = geometry.max_blocks * geometry.block_size
        self.register_buffer("context", torch.arange(T, device=device), persistent=False)   # [T]
        # The decode attention kernels' span counts (FusedStep.span_counters), one zeroed
        # buffer for every step and layer: the kernels leave it zero. It covers max_seqs rows;
        # a verify step's k + 1 rows per sequence merge in a second kernel (merges_in_split).
        self.register_buffer("span_counters", torch.zeros(
            geometry.max_seqs * kv[2], dtype=torch.int32, device=device), persistent=False)

    @property
    def vocab(self) -> int:
        """The logits' width (TorchForwardModel takes it, and `geometry`, from the module)."""
        return self.cfg.vocab

    @torch.inference_mode()
    def forward(self, inputs: TorchInputs, logits_out: torch.Tensor) -> None:
        """Every token of the step through the layers; logits_out [B, vocab] of each
        sequence's logits_indices token (a decode step's are all of its tokens)."""
        ops = self.step_ops(inputs)
        ctx = build_context(inputs, self.cos, self.sin, self.geometry.block_size, self.context,
                            fused=ops.fused, invariant=self.batch_invariant,
                            span_counters=self.span_counters)
        x, delta = self.embed(inputs.input_ids.long()), None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, ctx, ops, self.k_cache[i], self.v_cache[i])
        if not inputs.is_decode:   # a decode step's tokens are its sequences
            wanted = inputs.logits_indices.long()
            x, delta = x[wanted], delta[wanted]
        h = ops.add_norm(x, delta, self.norm)[1]   # the last layer's add in the final norm
        logits = ops.linear(h, self.head_weight())   # [B, vocab_shard]: this rank's shard
        # The vocab-parallel head: the ranks' shards side by side, the padding dropped.
        logits_out.copy_(self.tp.all_gather(logits, dim=-1)[:, :self.cfg.vocab])

    def step_ops(self, inputs: TorchInputs) -> LayerOps:
        """The implementations this kind of step runs (built in __init__): a decode step's
        (one_row_ops for one row: a decode step's shapes are fixed by its row count), or a
        step with prompt tokens'."""
        if not inputs.is_decode:
            return self.prompt_ops
        return self.one_row_ops if inputs.batch == 1 else self.decode_ops

    def head_weight(self) -> torch.Tensor:
        """[vocab_shard, hidden]: lm_head's, or (tied) the embedding's rows of this shard."""
        if self.lm_head is not None:
            return self.lm_head.weight
        return self.embed.weight[self.tp.shard(self.embed.weight.shape[0], "vocab")]


@dataclass(frozen=True)
class LayerOps:
    """What one kind of step computes each part of a layer with, chosen when the decoder is
    built (layer_ops), so that a layer's forward is one path whatever the settings."""
    fused: bool   # vt's kernels (build_context's `fused`: paged attention, no dense slots)
    linear: Callable        # F.linear's signature (x, weight, bias): the MLP's and the head
    attn_linear: Callable   # the same, for qkv and o
    # (x, delta, norm) -> (x + delta, norm(x + delta)); delta None: (x, norm(x))
    add_norm: Callable
    # add_norm before a layer's projections, whose normed rows only they read: FP8 weights
    # may take them quantized (vt.torch.fp8.Fp8Rows)
    projection_norm: Callable
    # (x, weight, bias) -> silu(gate) * up of the [gate | up] projection
    gate_up_silu: Callable
    # (attn, qkv, ctx, k_cache, v_cache) -> [T, heads * head_dim]: RoPE, the KV write, attention
    attention: Callable


# rope_cache_decode_attention's Triton kernel rotates head_dim's halves as power-of-two tiles
# of at least 16. It runs one-row decode steps only: on an H100 it made the 8B-shaped step
# faster at one row and slower at 32 rows (docs/torch.md).
ONE_KERNEL_MIN_HEAD_DIM = 32


def layer_ops(cfg: LlamaConfig, kernels: str, linear: str, invariant: bool,
              one_row: bool = False) -> LayerOps:
    """The LayerOps of a kind of step: kernels "torch" (plain torch ops) or "vt" (vt.torch.fused
    and paged attention), whose projections `linear` computes ("torch": F.linear, "triton":
    fused.linear, "invariant": fused.invariant_linear) and, with invariant (batch_invariant),
    whose norms and SiLU product run in their row-invariant forms. one_row: a one-row decode
    step, whose RoPE, KV write and attention are one kernel where head_dim allows."""
    if kernels == "torch":
        head_norm = module_head_norm if cfg.qk_norm else no_head_norm
        return LayerOps(False, F.linear, F.linear, torch_add_norm, torch_add_norm,
                        torch_gate_up_silu, partial(torch_rope_attention, head_norm=head_norm))
    add_norm = partial(fused_add_norm, invariant=invariant)
    matmul = dict(torch=F.linear, triton=fused.linear, invariant=fused.invariant_linear)[linear]
    if linear == "triton":   # the Triton GEMV: at one row, silu_mul in gate_up's epilogue
        gate_up_silu = fused.linear_silu_mul
    else:
        gate_up_silu = partial(linear_then_silu_mul, linear=matmul, invariant=invariant)
    if cfg.qk_norm:
        # Qwen3's q/k norms sit between the projection and RoPE, so RoPE is torch's; qkv and o
        # are F.linear's (the Triton GEMV serves the MLP and the head only) unless invariant.
        head_norm = invariant_head_norm if invariant else module_head_norm
        return LayerOps(True, matmul, matmul if invariant else F.linear, add_norm, add_norm,
                        gate_up_silu, partial(torch_rope_attention, head_norm=head_norm))
    if one_row and cfg.head_dim >= ONE_KERNEL_MIN_HEAD_DIM:
        attention = one_kernel_attention
    else:
        attention = fused_rope_attention
    return LayerOps(True, matmul, matmul, add_norm, add_norm, gate_up_silu, attention)


def fp8_ops(ops: LayerOps, prompt_linear: str | None = None, *,
            per_block: bool = False) -> LayerOps:
    """ops whose projections take FP8 weights (vt.torch.fp8.linear: the reference on the CPU,
    the FP8 GEMV or the prompt choice on CUDA); a plain tensor weight (the head) still goes
    to ops' own linear. Per-channel weights take the norm's rows quantized where their linear
    quantizes activations (fp8.add_norm_quantized); block-scaled ones never quantize them."""
    if not per_block:
        ops = replace(ops, projection_norm=partial(
            fp8.add_norm_quantized, add_norm=ops.add_norm, vt_kernels=ops.fused,
            prompt_linear=prompt_linear))
    return replace(ops, linear=partial(fp8.linear, dense=ops.linear, prompt_linear=prompt_linear),
                   attn_linear=partial(fp8.linear, dense=ops.attn_linear,
                                       prompt_linear=prompt_linear),
                   gate_up_silu=partial(fp8.linear_silu_mul, dense_silu=ops.gate_up_silu,
                                        prompt_linear=prompt_linear))


def quantized_linears(layer: Layer, dtype: torch.dtype, *, per_block: bool) -> None:
    """The layer's four projections as vt.torch.fp8.Fp8Linear, each holding its nn.Linear's
    initial weights quantized per channel (a loader or quantize_weights_ replaces them; with
    per_block, unit block scales over zero codes until then); its norms stay in `dtype`."""
    for parent, name in ((layer.attn, "qkv"), (layer.attn, "o"), (layer.mlp, "gate_up"),
                         (layer.mlp, "down")):
        old = getattr(parent, name)
        new = fp8.Fp8Linear(old.in_features, old.out_features, bias=old.bias is not None,
                            per_block=per_block, dtype=dtype, device=old.weight.device)
        with torch.no_grad():
            if not per_block:
                w = fp8.quantize_per_channel(old.weight)
                new.qweight.copy_(w.data)
                new.weight_scale.copy_(w.scale)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, name, new)


def fp8_kv_scales(attn: Attention, device) -> None:
    """An FP8 KV cache's scales of one layer: K's and V's, float32 scalars of
    vt.torch.kv_fp8.DEFAULT_SCALE (that module says why that value), on `device`."""
    attn.k_scale = torch.tensor(kv_fp8.DEFAULT_SCALE, dtype=torch.float32, device=device)
    attn.v_scale = torch.tensor(kv_fp8.DEFAULT_SCALE, dtype=torch.float32, device=device)


def check_kv_cache_dtype(kv_cache_dtype, kernels: str, prompt_kernels: str, cfg: LlamaConfig,
                         invariant: bool) -> str:
    """"auto" or "fp8"; ValueError, naming the value, for anything else or an FP8 cache where
    the decoder cannot read one: steps on the torch ops (their dense and SDPA attention reads
    the cache as it is), or batch_invariant (its kernels read a cache in the model's dtype)."""
    kv_cache_dtype = kv_fp8.check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "fp8":
        return kv_cache_dtype
    if "torch" in (kernels, prompt_kernels):
        raise ValueError(f"LlamaDecoder: kv_cache_dtype='fp8' runs on vt's kernels (paged "
                         f"attention reads the FP8 cache); kernels resolved to {kernels!r}, "
                         f"prompt_kernels to {prompt_kernels!r} (head_dim={cfg.head_dim})")
    if invariant:
        raise ValueError("LlamaDecoder: kv_cache_dtype='fp8' with batch_invariant=True is not "
                         "implemented (the batch-invariant attention reads a cache in the "
                         "model's dtype)")
    return kv_cache_dtype


def check_quantization(quantization, fp8_scales: str, fp8_prompt_linear: str,
                       tp: TensorParallel, invariant: bool) -> str | None:
    """None or "fp8"; ValueError, naming the value, for anything LlamaDecoder does not run."""
    quantization = fp8.check_quantization(quantization)
    if fp8_scales not in ("channel", "block"):
        raise ValueError(f"LlamaDecoder: fp8_scales={fp8_scales!r} must be 'channel' or 'block'")
    if fp8_prompt_linear not in fp8.PROMPT_LINEARS:
        raise ValueError(f"LlamaDecoder: fp8_prompt_linear={fp8_prompt_linear!r} must be one "
                         f"of {fp8.PROMPT_LINEARS}")
    if quantization is not None and tp.size > 1:
        raise ValueError(f"LlamaDecoder: quantization={quantization!r} runs on one rank; "
                         f"tensor parallelism (tp size {tp.size}) is not implemented for it")
    if quantization is not None and invariant:
        raise ValueError(f"LlamaDecoder: quantization={quantization!r} with "
                         f"batch_invariant=True is not implemented (its linears are bf16's)")
    return quantization


def quantize_weights_(model: LlamaDecoder, dense: dict[str, torch.Tensor]) -> None:
    """Fill an FP8 decoder's projections from dense weights (a dense LlamaDecoder's state
    dict names: "layers.{i}.attn.qkv.weight", ...), each quantized per output channel
    (vt.torch.fp8.quantize_per_channel); every other tensor copied as it is."""
    params = model.state_dict()
    with torch.no_grad():
        for name, t in dense.items():
            if name.endswith(".weight") and name.removesuffix(".weight") + ".qweight" in params:
                w = fp8.quantize_per_channel(t)
                base = name.removesuffix(".weight")
                params[base + ".qweight"].copy_(w.data)
                params[base + ".weight_scale"].copy_(w.scale)
            else:
                params[name].copy_(t)


def torch_add_norm(x, delta, norm: RMSNorm):
    if delta is not None:
        x = x + delta
    return x, norm(x)


def fused_add_norm(x, delta, norm: RMSNorm, *, invariant: bool):
    if delta is None:
        return x, fused.rms_norm(x, norm.weight, norm.eps, invariant=invariant)
    return fused.add_rms_norm(x, delta, norm.weight, norm.eps, invariant=invariant)


def torch_gate_up_silu(x, weight, bias):
    gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_then_silu_mul(x, weight, bias, *, linear, invariant: bool):
    return fused.silu_mul(linear(x, weight, bias), invariant=invariant)


def torch_rope_attention(attn: Attention, qkv, ctx: AttentionContext, k_cache, v_cache, *,
                         head_norm):
    """q, k and v apart, the q/k norms (head_norm), RoPE and the paged KV write in torch ops,
    then attend (dense, or on vt's kernels paged: the context says)."""
    hd, heads, kv_heads = attn.cfg.head_dim, attn.heads, attn.kv_heads
    T = qkv.shape[0]
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = head_norm(attn.q_norm, q.view(T, heads, hd))
    k = head_norm(attn.k_norm, k.view(T, kv_heads, hd))
    v = v.view(T, kv_heads, hd)
    q, k = rope(q, ctx.cos, ctx.sin), rope(k, ctx.cos, ctx.sin)
    # The paged KV write: each token's key and value go to its slot (a pad row's: the
    # scratch block), before attention, which reads the cache.
    kv_fp8.write(k_cache, ctx.slot_mapping, k, attn.k_scale)
    kv_fp8.write(v_cache, ctx.slot_mapping, v, attn.v_scale)
    return attend(q, k, v, k_cache, v_cache, ctx, attn.k_scale,
                  attn.v_scale).reshape(T, heads * hd)


def fused_rope_attention(attn: Attention, qkv, ctx: AttentionContext, k_cache, v_cache):
    """RoPE and the paged KV write in one pass over the projection (fused.rope_and_cache),
    then attend, which reads this step's K and V back from the cache."""
    p = ctx.fused
    q = fused.rope_and_cache(qkv, p.positions, p.cos_table, p.sin_table, k_cache, v_cache,
                             ctx.slot_mapping, heads=attn.heads, kv_heads=attn.kv_heads,
                             head_dim=attn.cfg.head_dim, k_scale=attn.k_scale,
                             v_scale=attn.v_scale)
    return attend(q, None, None, k_cache, v_cache, ctx, attn.k_scale,
                  attn.v_scale).reshape(qkv.shape[0], -1)


def one_kernel_attention(attn: Attention, qkv, ctx: AttentionContext, k_cache, v_cache):
    """A one-row decode step's RoPE, KV write and attention in one call."""
    p = ctx.fused
    return rope_cache_decode_attention(
        qkv, p.positions, p.cos_table, p.sin_table, k_cache, v_cache, ctx.slot_mapping,
        p.block_tables, p.seq_lens, block_size=p.block_size, invariant=p.invariant,
        heads=attn.heads, kv_heads=attn.kv_heads, head_dim=attn.cfg.head_dim,
        k_scale=attn.k_scale, v_scale=attn.v_scale, span_counters=p.span_counters
    ).reshape(1, -1)


def no_head_norm(norm, x):
    return x


def module_head_norm(norm: RMSNorm, x):
    return norm(x)


def invariant_head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of x [T, heads, head_dim], each head's row on its own."""
    rows = x.reshape(-1, x.shape[-1])
    return fused.rms_norm(rows, norm.weight, norm.eps, invariant=True).view(x.shape)


def check_tensor_parallel(cfg: LlamaConfig, tp: TensorParallel) -> None:
    """ValueError, naming the count, if tp.size does not divide the heads, the KV heads or
    the intermediate size (each rank holds an equal share of each)."""
    for name in ("heads", "kv_heads", "intermediate"):
        try:
            tp.local(getattr(cfg, name), f"LlamaConfig.{name}")
        except ValueError as exc:
            raise ValueError(f"LlamaDecoder: {exc}") from None


def vocab_shard(cfg: LlamaConfig, tp: TensorParallel) -> int:
    """Rows of the head per rank: vocab / size, rounded up (the last ranks' tail is padding)."""
    return -(-cfg.vocab // tp.size)


# A layer's parameters that every rank holds whole: the norms (Qwen3's q_norm and k_norm
# too) and the row-parallel layers' biases, added once after the reduce.
_REPLICATED = frozenset({"attn_norm.weight", "mlp_norm.weight", "attn.q_norm.weight",
                         "attn.k_norm.weight", "attn.o.bias", "mlp.down.bias"})


def shard_state_dict(state_dict: dict, cfg: LlamaConfig, tp: TensorParallel) -> dict:
    """A full (one-rank) LlamaDecoder state dict to rank tp.rank's: qkv's rows of its heads
    ([its q heads | its k heads | its v heads], bias likewise), o's columns of its heads,
    gate_up's rows of its share of gate and of up, down's columns of that share, lm_head's
    rows of its vocab shard (zero rows past vocab); the rest whole (a tied embedding padded
    with zero rows to vocab_shard * size). The tensors may be views of the given ones."""
    check_tensor_parallel(cfg, tp)
    hd, q, kv = cfg.head_dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    heads, kv_heads = tp.shard(cfg.heads, "heads"), tp.shard(cfg.kv_heads, "kv_heads")
    inter = tp.shard(cfg.intermediate, "intermediate")
    rows = vocab_shard(cfg, tp)

    def per_head(s: slice) -> slice:
        return slice(s.start * hd, s.stop * hd)

    def qkv(t):
        tq, tk, tv = t.split([q, kv, kv])
        return torch.cat([tq[per_head(heads)], tk[per_head(kv_heads)], tv[per_head(kv_heads)]])

    def gate_up(t):
        gate, up = t.chunk(2)
        return torch.cat([gate[inter], up[inter]])

    def padded_vocab(t):   # [vocab, hidden] -> [rows * size, hidden], zero rows past vocab
        return F.pad(t, (0, 0, 0, rows * tp.size - t.shape[0]))

    layer_rules = {"attn.qkv.weight": qkv, "attn.qkv.bias": qkv,
                   "attn.o.weight": lambda t: t[:, per_head(heads)],
                   "mlp.gate_up.weight": gate_up, "mlp.gate_up.bias": gate_up,
                   "mlp.down.weight": lambda t: t[:, inter]}
    out = {}
    for name, t in state_dict.items():
        layer = re.fullmatch(r"layers\.\d+\.(.+)", name)
        if layer is not None and layer[1] in layer_rules:
            out[name] = layer_rules[layer[1]](t)
        elif layer is not None and layer[1] in _REPLICATED or name == "norm.weight":
            out[name] = t
        elif name == "lm_head.weight":
            out[name] = padded_vocab(t)[rows * tp.rank:rows * (tp.rank + 1)]
        elif name == "embed.weight":
            out[name] = padded_vocab(t) if cfg.tie_embeddings else t
        else:
            raise ValueError(f"shard_state_dict: {name!r} is not a LlamaDecoder parameter")
    return out


def resolve_kernels(kernels: str, prompt_kernels: str, device: torch.device,
                    head_dim: int, invariant: bool = False) -> tuple[str, str]:
    """("vt" or "torch", "vt" or "torch"): what a decode step and a step with prompt tokens
    run (the module docstring), "auto" resolved: vt's kernels (on cuda where head_dim is a
    power of two, the Triton kernels' shape), and prompt steps follow decode steps.
    ValueError for a choice that is not one of those, prompt steps on vt's kernels without
    decode steps on them, or, with invariant (batch_invariant), either on the torch ops,
    whose attention is not row-invariant, or cuda without a power-of-two head_dim."""
    if kernels not in ("auto", "vt", "torch"):
        raise ValueError(f"LlamaDecoder: kernels={kernels!r} must be 'auto', 'vt' or 'torch'")
    if prompt_kernels not in ("auto", "torch", "vt"):
        raise ValueError(f"LlamaDecoder: prompt_kernels={prompt_kernels!r} must be 'auto', "
                         f"'torch' or 'vt'")
    pow2 = head_dim & (head_dim - 1) == 0
    if invariant and "torch" in (kernels, prompt_kernels):
        raise ValueError(f"LlamaDecoder: batch_invariant=True runs every step on vt's kernels; "
                         f"kernels={kernels!r} and prompt_kernels={prompt_kernels!r} must be "
                         f"'auto' or 'vt'")
    if invariant and device.type == "cuda" and not pow2:
        raise ValueError(f"LlamaDecoder: batch_invariant=True on cuda needs a power-of-two "
                         f"head_dim (the Triton kernels' shape), got head_dim={head_dim}")
    if kernels == "auto":
        kernels = "vt" if device.type != "cuda" or pow2 else "torch"
    if prompt_kernels == "auto":
        prompt_kernels = kernels
    if prompt_kernels == "vt" and kernels != "vt":
        raise ValueError("LlamaDecoder: prompt_kernels='vt' needs kernels='vt' (or 'auto' "
                         "resolving to it)")
    return kernels, prompt_kernels


def resolve_linear(linear: str, kernels: str, invariant: bool) -> str:
    """What computes a decode step's projections: "torch", "triton" or, with invariant
    (batch_invariant), "invariant" (vt.torch.fused.invariant_linear, in every step). "auto"
    is "triton" where decode steps run vt's kernels. ValueError for another choice, "triton"
    without vt's kernels, or any choice but "auto" with invariant."""
    if linear not in ("auto", "torch", "triton"):
        raise ValueError(f"LlamaDecoder: linear={linear!r} must be 'auto', 'torch' or "
                         f"'triton'")
    if invariant:
        if linear != "auto":
            raise ValueError(f"LlamaDecoder: linear={linear!r} with batch_invariant=True: its "
                             f"linears are the row-invariant ones; leave linear='auto'")
        return "invariant"
    if linear == "triton" and kernels != "vt":
        raise ValueError("LlamaDecoder: linear='triton' runs in decode steps on vt's "
                         "kernels; it needs kernels='vt' (or 'auto' resolving to it)")
    if linear == "auto":
        return "triton" if kernels == "vt" else "torch"
    return linear


def rope(x, cos, sin):
    """Rotary embedding, Hugging Face's layout (the two halves of head_dim rotate together)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope_table(cfg: LlamaConfig, max_context: int):
    """cos, sin [max_context, head_dim] f32 (linear or Llama 3's frequency scaling if set).
    In float32 throughout, as Hugging Face computes them, so that the tables are the same."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
                                    / cfg.head_dim))
    inv = inv / cfg.rope_linear_factor
    if cfg.rope_llama3 is not None:
        inv = _llama3_frequencies(inv, *cfg.rope_llama3)
    freqs = torch.outer(torch.arange(max_context, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _llama3_frequencies(inv, factor, low_freq_factor, high_freq_factor, original_max):
    """Llama 3.1's rope scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between (Hugging Face's _compute_llama3_parameters)."""
    low_wavelen, high_wavelen = original_max / low_freq_factor, original_max / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)
