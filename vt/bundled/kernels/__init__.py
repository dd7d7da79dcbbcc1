"""The model's kernels: each object has run_numpy (what the sim backend executes) and
run_cupy (the CUDA kernel), with a float64 `reference` function beside it in its module."""
from .attention import PagedAttention
from .embedding import EmbedTokens, GatherRows
from .fill import Fill
from .gdn import GDN
from .gemm import Gemm, RoutedGemm
from .kvcache import KVWrite
from .mlp import SiluMul
from .moe import Combine, CombineRouted, Router
from .norm import RMSNorm
from .rope import RoPE

__all__ = ["PagedAttention", "EmbedTokens", "GatherRows", "Fill", "GDN", "Gemm", "RoutedGemm", "KVWrite", "SiluMul",
           "Combine", "CombineRouted", "Router", "RMSNorm", "RoPE"]
