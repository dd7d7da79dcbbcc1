"""vt's sampler: per-request knobs (params), the CUDA kernel and its launch object (sampler,
kernels, device_code), and its numpy twin plus the sort-based reference (reference)."""
from .params import GREEDY, ROW_VECTORS, SamplingParams, row_vectors
from .sampler import Sampler, workspace_for, workspace_sizes

__all__ = ["GREEDY", "ROW_VECTORS", "SamplingParams", "Sampler", "row_vectors", "workspace_for", "workspace_sizes"]
