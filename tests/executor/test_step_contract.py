"""The step contract's pieces that need no model: the flattened batch of a mixed step, and the
StepModel base class's refusals."""
import numpy as np
import pytest

from vt.forward.adapt import as_step_model
from vt.forward.toy import ToyForward
from vt.step import DecodeInputs, PrefillSeq, StepModel, flatten


def test_flatten_lays_out_decode_rows_then_chunks():
    """The mixed step drawn in vt/step/flat.py: decode rows a, b; chunk c (3 tokens after 2
    cached); prompt d (4 tokens): every vector as drawn, slots through the block tables."""
    bt = np.arange(1, 9, dtype=np.int32)
    dec = DecodeInputs(token_rows=np.array([0, 1], np.int32), positions=np.array([7, 3], np.int32),
                       seq_lens=np.array([8, 4], np.int32), slot_mapping=np.array([99, 98], np.int32),
                       block_tables=np.stack([bt, bt]), state_idx=np.array([5, 6], np.int32))
    c = PrefillSeq(2, np.arange(10, 15, dtype=np.int32), bt, 7, start=2)
    d = PrefillSeq(3, np.arange(20, 24, dtype=np.int32), bt + 10, 8)
    f = flatten(dec, [c, d], block_size=4)
    assert f.input_ids.tolist() == [0, 0, 12, 13, 14, 20, 21, 22, 23]
    assert f.positions.tolist() == [7, 3, 2, 3, 4, 0, 1, 2, 3]
    # c's positions 2..4 in blocks 1, 1, 2; d's 0..3 in block 11
    assert f.slot_mapping.tolist() == [99, 98, 6, 7, 8, 44, 45, 46, 47]
    assert f.query_start_loc.tolist() == [0, 1, 2, 5, 9]
    assert f.seq_lens.tolist() == [8, 4, 5, 4]
    assert f.logits_indices.tolist() == [0, 1, 4, 8]
    assert f.token_rows.tolist() == [0, 1, 2, 3] and f.state_idx.tolist() == [5, 6, 7, 8]
    assert f.block_tables.tolist() == [bt.tolist()] * 3 + [(bt + 10).tolist()]
    assert (f.query_start_loc_cpu, f.seq_lens_cpu, f.num_decode) == ((0, 1, 2, 5, 9), (8, 4, 5, 4), 2)
    assert (f.num_tokens, f.batch) == (9, 4)


def test_flatten_of_prompts_alone_is_a_prefill_step():
    bt = np.arange(1, 5, dtype=np.int32)
    f = flatten(None, [PrefillSeq(0, np.array([4, 5, 6], np.int32), bt, 0)], block_size=2)
    assert f.positions.tolist() == [0, 1, 2] and f.slot_mapping.tolist() == [2, 3, 4]
    assert f.logits_indices.tolist() == [2] and f.num_decode == 0


def test_flatten_refuses_an_empty_chunk():
    bt = np.arange(1, 5, dtype=np.int32)
    with pytest.raises(ValueError, match="without tokens"):
        flatten(None, [PrefillSeq(0, np.array([4, 5], np.int32), bt, 0, start=2)], block_size=2)


def test_a_step_model_must_implement_decode_prefill_and_sample():
    class Half(StepModel):
        def decode(self, stream, inputs, logits_out): ...

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_the_base_class_defaults(sim_backend):
    """A step model that runs mixed steps apart refuses prepare_mixed, naming itself; the sim
    reserves no sampler workspace; warm-up and release have nothing to do by default."""
    model = ToyForward(sim_backend).step_model()
    assert as_step_model(sim_backend, model) is model
    assert not model.mixed_in_one_call and model.chunked_prefill
    with pytest.raises(NotImplementedError, match="ForwardModel runs a mixed step's decode rows"):
        model.prepare_mixed(None, [])
    assert model.sampler_workspaces(sim_backend, 64) == []


def test_engine_refuses_what_is_not_a_step_model(sim_backend):
    with pytest.raises(TypeError, match="vt.ForwardModel"):
        as_step_model(sim_backend, ToyForward(sim_backend))


def test_every_step_class_declares_the_sampler_row_vectors_once():
    """DecodeRows, DecodeInputs and PrefillInputs carry exactly the sampler's per-row vectors,
    keyword-only after their own positional fields."""
    import dataclasses

    from vt.bundled.inputs import PrefillInputs
    from vt.sampling import ROW_VECTORS
    from vt.step.contract import SAMPLING_FIELDS, DecodeInputs, DecodeRows, RowSampling

    assert SAMPLING_FIELDS == tuple(ROW_VECTORS)
    for cls in (DecodeRows, DecodeInputs, PrefillInputs):
        assert issubclass(cls, RowSampling)
        kw = [f.name for f in dataclasses.fields(cls) if f.kw_only]
        assert tuple(kw) == SAMPLING_FIELDS, cls.__name__
