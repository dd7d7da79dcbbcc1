"""On the sim a captured decode step of vt.torch's decoder costs what its live tokens cost, as
on CUDA: LlamaDecoder's default kernels on the CPU attend over each row's live tokens through
custom ops (vt.torch.cpu_ops), which the sim's capture records as one op each, and the work of
a step at the same live tokens does not grow with max_context. The plain torch ops
(kernels="torch": every row gathers max_context slots and masks them) do grow, so the count
can fail."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytestmark = pytest.mark.torch_allocator   # PyTorch's caching allocator keeps its blocks

from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vt.step import KVGeometry  # noqa: E402
from vt.torch import cpu_ops  # noqa: E402
from vt.torch.llama import LlamaDecoder  # noqa: E402
from vt.torch.simcapture import record  # noqa: E402

from test_batch_invariance import LLAMA  # noqa: E402

BLOCK = 16
LIVE = [20, 37]   # each row's tokens, the new one included


class _Produced(TorchDispatchMode):
    """Counts the elements of every tensor the dispatched ops return."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.elements += sum(t.numel() for t in pytree.tree_leaves(out)
                             if isinstance(t, torch.Tensor))
        return out


def step_work(kernels: str, max_context: int, monkeypatch) -> tuple[int, int, int]:
    """(the ops recorded, elements their outputs hold, cache elements the attention gathers) of a
    recorded two-row decode step at LIVE tokens, replayed once on real tensors. The KV cache
    holds the live blocks whatever max_context (a view of it, or an in-place write, returns
    all of it); table entries past a row's live blocks name the scratch block, 0."""
    live = [-(-n // BLOCK) for n in LIVE]
    geo = KVGeometry(max_seqs=2, num_kv_blocks=sum(live) + 1, block_size=BLOCK,
                     max_context=max_context)
    m = LlamaDecoder(LLAMA, geo, dtype=torch.float32, device="cpu", kernels=kernels)
    tables = np.zeros((2, max_context // BLOCK), np.int32)
    tables[0, :live[0]] = np.arange(1, live[0] + 1)
    tables[1, :live[1]] = np.arange(live[0] + 1, sum(live) + 1)
    pos = np.array(LIVE, np.int32) - 1
    slots = tables[[0, 1], pos // BLOCK] * BLOCK + pos % BLOCK
    table = np.array([3, 9, 0], np.int32)
    arrays = [np.array([0, 1], np.int32), pos, pos + 1, slots.astype(np.int32), tables,
              np.zeros(2, np.int32), np.zeros((2, LLAMA.vocab), np.float32)]
    recording = record(m, table, arrays)
    gathered = []
    real_context = cpu_ops.context

    def counting_context(cache, table_row, length, block_size, *fp8_scale_and_dtype):
        out = real_context(cache, table_row, length, block_size, *fp8_scale_and_dtype)
        gathered.append(out.numel())
        return out
    monkeypatch.setattr(cpu_ops, "context", counting_context)
    tensors = [torch.from_numpy(a) for a in (table, *arrays)]
    produced = _Produced()
    with torch.inference_mode(), produced:
        recording.replay(*tensors)
    assert np.isfinite(arrays[-1]).all() and arrays[-1].any()
    return [str(func) for func, *_ in recording.steps], produced.elements, sum(gathered)


def test_the_default_sim_decode_step_does_the_same_work_at_any_max_context(monkeypatch):
    small = step_work("auto", 64, monkeypatch)
    large = step_work("auto", 8192, monkeypatch)
    assert small == large
    per_layer = 2 * sum(LIVE) * LLAMA.kv_heads * LLAMA.head_dim   # K and V of the live tokens
    assert small[2] == LLAMA.layers * per_layer


def test_the_dense_torch_ops_grow_with_max_context(monkeypatch):
    small = step_work("torch", 64, monkeypatch)
    large = step_work("torch", 8192, monkeypatch)
    assert large[1] > 20 * small[1]


def test_the_recording_holds_one_attention_op_a_layer_and_no_query(monkeypatch):
    """The sim's capture records each custom attention op as one op (its CPU body runs at
    replay), and leaves out what a replay would not need: queries such as a tensor's device
    and conversions to the dtype a tensor has (.float() of a float32 tensor)."""
    ops = step_work("auto", 64, monkeypatch)[0]
    assert ops.count("vt.paged_decode_attention.default") == LLAMA.layers
    assert not [op for op in ops if op.startswith("prim.")]
    assert len(ops) < 70 * LLAMA.layers
