"""Engine(..., tensor_parallel=2) on two GPUs (NCCL inside the captured graphs): the ring's
tokens equal an all-eager synchronous run of the same sharded module (every step a plain torch
forward, no graph), and, in float32, the one-GPU model's. Needs a machine of two GPUs."""
from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

from tools import tp_generate  # noqa: E402
from vt.backend import get_backend  # noqa: E402
from vt.engine import Engine  # noqa: E402
from vt.config import ExecutorConfig  # noqa: E402
from vt.step import KVGeometry  # noqa: E402
from vt.hooks import Poison  # noqa: E402
from vt.torch.tensor_parallel import TensorParallel  # noqa: E402

GEO = KVGeometry(max_seqs=8, num_kv_blocks=8 * 16 + 1, block_size=16, max_context=256)


def _tokens(be, model, mode, *, sizes=(1, 2, 4, 8), tp=2, poison=False):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 32000, int(rng.integers(1, 120))).tolist() for _ in range(8)]
    cfg = ExecutorConfig(mode=mode, serving_conc=8, capture_sizes=sizes)
    with Engine(be, model, cfg, max_prefill_tokens=64, tensor_parallel=tp,
                hooks=Poison() if poison else None) as eng:
        return [list(map(int, r.tokens)) for r in eng.generate(prompts, max_new_tokens=24)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ring_on_two_gpus_equals_an_all_eager_run_of_the_same_shards(dtype):
    be = get_backend("cuda")
    build = functools.partial(tp_generate.build, "small", dtype, 0, GEO)
    eager = _tokens(be, build, "sync", sizes=())
    assert _tokens(be, build, "ring", poison=True) == eager
    if dtype == "float32":   # sharding reorders float32 sums only: the same greedy tokens
        assert _tokens(be, build(be, TensorParallel(0, 1)), "sync", sizes=(), tp=1) == eager
