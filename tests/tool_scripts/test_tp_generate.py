"""tools/tp_generate.py's floor: the bytes one rank's decode step reads of its weights."""
import pytest

pytest.importorskip("torch")

from tools import tp_generate  # noqa: E402


def test_a_ranks_weight_bytes_are_its_share_of_the_projections_and_the_head():
    p = tp_generate.PRESETS["llama3-8b"]
    one, embed = tp_generate.weight_bytes_per_rank(p, 1, 2)
    # Llama-3-8B in bf16: 15.01 GB besides the 1.05 GB embedding (docs/benchmarks.md)
    assert (one, embed) == (15_009_849_344, 1_050_673_152)
    four, _ = tp_generate.weight_bytes_per_rank(p, 4, 2)
    norms = 2 * (p.layers * 2 * p.hidden + p.hidden)       # replicated on every rank
    assert four - norms == (one - norms) // 4
