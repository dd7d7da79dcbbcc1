"""FlatStaging (vt/forward/flat.py): every vector of a staged flat step starts on a 16-byte
boundary whatever its token and sequence counts (Triton compiles a kernel once per pattern of
aligned pointer arguments: an unaligned vector would compile the prompt kernels again in the
middle of serving), and the staged values reach the device unchanged."""
import numpy as np
import pytest

from vt.forward.flat import FlatStaging
from vt.step import KVGeometry
from vt.step.contract import PrefillSeq
from vt.step.flat import SEQ_FIELDS, TOKEN_FIELDS, flatten

GEO = KVGeometry(max_seqs=8, num_kv_blocks=64, block_size=4, max_context=32)
FIELDS = (*TOKEN_FIELDS, "query_start_loc", *SEQ_FIELDS, "block_tables")


def _address(arr) -> int:
    iface = getattr(arr, "__cuda_array_interface__", None) or arr.__array_interface__
    return iface["data"][0]


def _step(lengths):
    """A flat step of prompts of these lengths (rows 0, 1, ...), each its own blocks."""
    seqs = []
    for i, n in enumerate(lengths):
        table = np.arange(i * GEO.max_blocks, (i + 1) * GEO.max_blocks, dtype=np.int32) % 63 + 1
        seqs.append(PrefillSeq(i, np.arange(n, dtype=np.int32) + 7 * i, table, i))
    return flatten(None, seqs, GEO.block_size)


# token counts T of every residue mod 4 with sequence counts B of every residue mod 4
STEPS = [(1,), (2,), (3,), (5,), (1, 1), (2, 3), (3, 3, 3), (1, 2, 3, 4), (5, 1, 2),
         (7, 7, 7, 7, 7), (1, 1, 1, 1, 1, 1), (9, 2, 1, 3, 1, 1, 2)]


@pytest.mark.parametrize("lengths", STEPS, ids=lambda s: f"T{sum(s)}-B{len(s)}")
def test_every_staged_vector_starts_on_a_16_byte_boundary(backend, lengths):
    staging = FlatStaging(backend, GEO)
    staged = staging.stage(_step(lengths))
    misaligned = {f: _address(getattr(staged, f)) % 16 for f in FIELDS
                  if _address(getattr(staged, f)) % 16}
    assert not misaligned, f"T={sum(lengths)} B={len(lengths)}: byte offsets mod 16 {misaligned}"


def test_the_staged_values_reach_the_device_unchanged(backend):
    staging = FlatStaging(backend, GEO)
    stream = backend.stream()
    token_table = backend.empty((GEO.max_seqs + 1,), np.int32)
    for lengths in STEPS:
        flat = _step(lengths)
        staged = staging.stage(flat)
        staging.upload(stream, staged, token_table)
        for f in FIELDS:
            host = backend.pinned_empty(getattr(staged, f).shape, np.int32)
            backend.copy_d2h(host, getattr(staged, f), stream)
            stream.synchronize()
            np.testing.assert_array_equal(host, getattr(flat, f), err_msg=f"{lengths}: {f}")
