"""Serving compiles no prompt kernel after start-up: Triton compiles a kernel once per pattern
of 16-byte aligned pointer arguments, and a flat step's vectors (vt/forward/flat.py) are all
aligned whatever its token and sequence counts, so the patterns the start-up warm-up compiles
are every step's. (The sim twin: tests/executor/test_flat_staging.py, every staged vector on
a 16-byte boundary.)"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")

from vt.backend import get_backend  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.engine import Engine  # noqa: E402

from _torch_util import step_model, tiny_llama  # noqa: E402

# prompts served together: steps of token counts and sequence counts of every residue mod 4
# (prompts alone, and with decode rows once the first ones decode)
BATCHES = [[1], [2], [3], [1, 2], [3, 3, 3], [1, 2, 3, 4], [5, 1, 2], [7, 7, 7, 7, 7],
           [2, 2, 2, 2, 2, 2], [9, 2, 1, 3, 1, 1, 2]]


def _compiled(kernel) -> int:
    """How many variants of a Triton kernel are compiled (Triton 3.3+: device_caches; before:
    cache), over every device."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.gpu
def test_serving_steps_of_any_counts_compile_no_prompt_kernel_after_start_up():
    from vt.torch.triton_attention import _varlen
    from vt.torch.triton_fused import _rope_and_cache
    be = get_backend("cuda")
    try:
        module = tiny_llama(be, kernels="vt")
        cfg = ExecutorConfig(mode="ring", serving_conc=8, capture_sizes=(1, 2, 4, 8))
        with Engine(be, step_model(be, module), cfg, max_prefill_tokens=16) as eng:
            before = {"varlen": _compiled(_varlen), "rope_and_cache": _compiled(_rope_and_cache)}
            assert before["varlen"] > 0, "the start-up warm-up ran no prompt step on vt's kernels"
            rng = np.random.default_rng(0)
            for lengths in BATCHES:
                eng.generate([rng.integers(0, 96, n).tolist() for n in lengths], max_new_tokens=3)
            after = {"varlen": _compiled(_varlen), "rope_and_cache": _compiled(_rope_and_cache)}
        assert after == before, f"compiled while serving: before {before}, after {after}"
    finally:
        be.close()
