"""ModelConfig: the shape of the hybrid decoder (GDN linear attention + full attention)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from vt.validate import integer

_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """A hybrid decoder in the spirit of Qwen3-Next.

    layer_pattern is repeated to `layers` entries: "G" = gated-delta-rule linear attention
    (one fp32 recurrent state [gdn_heads, gdn_dk, gdn_dv] per sequence), "A" = full
    attention over a paged KV cache (GQA: `heads` query heads share `kv_heads` K/V heads).
    experts == 0 means a dense gated MLP of width `ffn`; otherwise `experts` routed experts
    of width `expert_ffn`, top_k per token, plus a shared expert of width `shared_ffn`
    (0 = none). Storage is `dtype`; every kernel accumulates in fp32; the residual stream
    is fp32.
    """

    hidden: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int
    layer_pattern: str
    gdn_heads: int
    gdn_dk: int
    gdn_dv: int
    vocab: int
    ffn: int = 0
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    dtype: str = "float16"
    kv_block_size: int = 16
    max_seqs: int = 64
    max_context: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self):
        pos = {k: getattr(self, k) for k in ("hidden", "layers", "heads", "head_dim", "kv_heads",
                                             "gdn_heads", "gdn_dk", "gdn_dv", "vocab",
                                             "kv_block_size", "max_seqs", "max_context")}
        for k, v in pos.items():
            integer(f"ModelConfig.{k}", v, 1)
        if not self.layer_pattern or set(self.layer_pattern) - {"G", "A"}:
            raise ValueError(f"ModelConfig: layer_pattern {self.layer_pattern!r} must be a "
                             f"non-empty string of 'G' (GDN) and 'A' (attention)")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelConfig: heads={self.heads} is not a multiple of "
                             f"kv_heads={self.kv_heads}")
        # The kernels split head vectors over a warp (32 lanes) and keep <= 8 per lane.
        for name in ("head_dim", "gdn_dk", "gdn_dv"):
            v = getattr(self, name)
            if v % 32 or v > 256:
                raise ValueError(f"ModelConfig: {name}={v} must be a multiple of 32 and <= 256")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig: dtype {self.dtype!r} is not one of {_DTYPES}")
        if self.experts:
            if not (0 < self.top_k <= self.experts) or self.expert_ffn <= 0:
                raise ValueError(f"ModelConfig: MoE needs 0 < top_k ({self.top_k}) <= experts "
                                 f"({self.experts}) and expert_ffn > 0 ({self.expert_ffn})")
            if self.shared_ffn < 0:
                raise ValueError(f"ModelConfig: shared_ffn={self.shared_ffn} must be >= 0")
        elif self.ffn <= 0 or self.top_k or self.expert_ffn or self.shared_ffn:
            raise ValueError(f"ModelConfig: a dense model needs ffn > 0 (got {self.ffn}) and no "
                             f"top_k/expert_ffn/shared_ffn")

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def kinds(self) -> str:
        """Per-layer kind, the pattern repeated (and cut) to `layers` entries."""
        reps = -(-self.layers // len(self.layer_pattern))
        return (self.layer_pattern * reps)[: self.layers]

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "A"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "G"]

    @property
    def storage_dtype(self) -> np.dtype:
        """numpy dtype of stored tensors. numpy has no bfloat16: bf16 is raw uint16 bits."""
        return np.dtype(np.float16 if self.dtype == "float16" else np.uint16)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_context // self.kv_block_size)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_TINY = dict(hidden=128, layers=4, heads=4, head_dim=32, kv_heads=2, layer_pattern="GGGA",
             gdn_heads=4, gdn_dk=32, gdn_dv=32, vocab=512, kv_block_size=8, max_seqs=16,
             max_context=256)
# Bench presets: hidden 4096 so that each decode GEMM reads enough bytes to approach the
# bandwidth floor (docs/design.md; measured: 4096x14336 GEMMs read at 3.6-3.8 TB/s); ~4 GB of fp16 weights
# for the dense one, i.e. ~1 ms per decode step at the copy bandwidth. 16 GDN heads of 128x128
# (Qwen3-Next's q/k head count): the fp32 state read + written per step is then 0.4 GB at
# batch 32, next to ~4.5 GB of weights.
_BENCH = dict(hidden=4096, layers=8, heads=32, head_dim=128, kv_heads=8, layer_pattern="GGGA",
              gdn_heads=16, gdn_dk=128, gdn_dv=128, vocab=32000, kv_block_size=16,
              max_seqs=64, max_context=4096)

# bench-small: a model whose captured decode step at batch 32 should take ~0.15 ms on the H200
# (0.1-0.2 ms asked), where the host's cost per step decides throughput. Estimated from the
# per-kernel times of bench-dense's step (measured on the H200): ~35 us per GDN layer and
# ~55 us for the attention one at hidden 1024 (latency-bound kernels), ~25 us for the 1024x32000
# logits GEMM and ~35 us for sampling 32 x 32000 logits; `vt bench --workload model --preset
# bench-small` reports its step's device time (ceiling_us).
_BENCH_SMALL = dict(hidden=1024, layers=3, heads=8, head_dim=128, kv_heads=2, layer_pattern="GGA",
                    gdn_heads=8, gdn_dk=64, gdn_dv=64, vocab=32000, kv_block_size=16,
                    max_seqs=64, max_context=2048)

PRESETS: dict[str, ModelConfig] = {
    "tiny-dense": ModelConfig(**_TINY, ffn=256),
    "tiny-moe": ModelConfig(**_TINY, experts=8, top_k=2, expert_ffn=64, shared_ffn=128),
    "bench-small": ModelConfig(**_BENCH_SMALL, ffn=2816),
    "bench-dense": ModelConfig(**_BENCH, ffn=14336),
    "bench-moe": ModelConfig(**_BENCH, experts=32, top_k=4, expert_ffn=1024, shared_ffn=2048),
}
