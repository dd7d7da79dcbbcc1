"""How many KV blocks a served checkpoint gets, and the line that says so.

As vLLM sizes its cache from `gpu_memory_utilization`, so does vt on cuda: of the GPU memory
free at start-up, the fraction `gpu_memory_utilization` (0.9 by default) goes to the model,
and what the weights and the largest prompt step's activations leave of it goes to the KV
cache. The activations are an estimate (kv_budget_bytes), not a measurement: the engine's
warm-up then runs that largest step, so an estimate that falls short fails at start-up,
not while serving. On the sim the cache is host memory on a machine that runs tests:
SIM_KV_CACHE_BYTES, a modest fixed budget.

Either way the cache never holds more than a whole context for every row (the scheduler
reserves a request's blocks when it admits it, so more blocks could never be used), and never
less than one whole context (else a request of max_context tokens could never run): a budget
below that is refused, naming the numbers and what to change. `kv_blocks` (vt serve
--kv-blocks) sets the count itself.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
SIM_KV_CACHE_BYTES = 512 << 20
# Beyond the weights and the activations: the graphs' and eager steps' logits blocks, cuBLAS
# and Triton workspaces, the sampler's, the CUDA graphs themselves.
GPU_RESERVE_BYTES = 512 << 20


@dataclass(frozen=True)
class KVCacheSize:
    """num_kv_blocks for KVGeometry (its scratch block included) and how it was chosen."""
    num_kv_blocks: int
    block_size: int
    bytes_per_block: int     # on each rank (tensor parallelism splits the KV heads)
    why: str

    @property
    def tokens(self) -> int:
        """Tokens the requests' blocks hold (the scratch block not counted)."""
        return (self.num_kv_blocks - 1) * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"KV cache {self.num_kv_blocks:,} blocks of {self.block_size} tokens "
                f"({self.tokens:,} tokens for requests, one block is scratch; "
                f"{_mib(self.nbytes)}): {self.why}")


def kv_element_bytes(dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one cached K or V element: the model dtype's ("auto"), or 1 ("fp8": e4m3
    codes; the per-layer scales are a few bytes in all)."""
    if kv_cache_dtype == "fp8":
        return 1
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} must be 'auto' or 'fp8'")
    return dtype_bytes


def kv_bytes_per_token(cfg, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """K and V of every layer for one token, on one rank (a vt.torch.llama.LlamaConfig)."""
    return 2 * cfg.layers * (cfg.kv_heads // tensor_parallel) * cfg.head_dim * dtype_bytes


def size_kv_cache(*, bytes_per_token: int, block_size: int, max_seqs: int, max_context: int,
                  budget_bytes: int, budget_why: str, kv_blocks: int | None = None
                  ) -> KVCacheSize:
    """The blocks a budget of `budget_bytes` (described by `budget_why`) gives, within [one
    whole context, a whole context for every row] (module docstring); `kv_blocks`: that
    count, whatever the budget. ValueError when the budget holds less than one context."""
    per_block = bytes_per_token * block_size
    per_context = -(-max_context // block_size)
    if kv_blocks is not None:
        return KVCacheSize(kv_blocks, block_size, per_block, "set by --kv-blocks")
    every_row = max_seqs * per_context
    fits = max(budget_bytes, 0) // per_block
    if fits >= every_row:
        return KVCacheSize(every_row + 1, block_size, per_block,
                           f"a whole context for every row ({max_seqs} x {max_context} "
                           f"tokens; {budget_why} holds more)")
    if fits < per_context:
        raise ValueError(f"the KV cache budget ({budget_why}: {_mib(budget_bytes)}) holds "
                         f"{fits} blocks of {block_size} tokens ({_mib(per_block)} each); one "
                         f"sequence of max_context {max_context} needs {per_context}: lower "
                         f"--max-context, or set --kv-blocks (or, on cuda, raise "
                         f"--gpu-memory-utilization)")
    return KVCacheSize(fits, block_size, per_block,
                       f"{budget_why}, {fits * block_size // max_context} whole contexts of "
                       f"{max_context:,} tokens; --kv-blocks to change")


def kv_budget_bytes(*, free_bytes: int, utilization: float, weight_bytes: int,
                    activation_bytes: int) -> int:
    """cuda: what `utilization` of the free GPU memory leaves for the KV cache once the
    weights, the largest prompt step's activations and GPU_RESERVE_BYTES are in."""
    return int(free_bytes * utilization) - weight_bytes - activation_bytes - GPU_RESERVE_BYTES


def prefill_activation_bytes(cfg, tokens: int, dtype_bytes: int,
                             tensor_parallel: int = 1) -> int:
    """An estimate of the activations of a prompt step of `tokens` tokens through one layer
    (the layers run one after another, each freeing its temporaries): the residual stream and
    its normed copy, q/k/v, the attention output, the o projection, gate|up and their SiLU
    product, twice over for the allocator's rounding and the copies between ops."""
    tp = tensor_parallel
    per_token = (4 * cfg.hidden + 2 * cfg.heads // tp * cfg.head_dim
                 + 2 * cfg.kv_heads // tp * cfg.head_dim + 3 * cfg.intermediate // tp)
    return 2 * tokens * per_token * dtype_bytes


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
