"""The step contract: what one decode or prefill step is made of (contract.py), the flattened
batch of a step with prompt tokens (flat.py) and the one contiguous block a decode step's
per-row vectors travel in (inputblock.py). Every layer above imports it;
it imports none of them."""
from vt.step.contract import (FIELDS, FORWARD_FIELDS, GREEDY, LOGITS_DTYPE, SAMPLING_FIELDS,
                              DecodeInputs, DecodeRows, KVGeometry, PadRow, PrefillSeq, SamplingParams,
                              StepModel, context_slots, kv_slot, prefill_last_rows)
from vt.step.flat import FlatInputs, flatten
from vt.step.inputblock import InputBlock

__all__ = ["FIELDS", "FORWARD_FIELDS", "GREEDY", "LOGITS_DTYPE", "SAMPLING_FIELDS",
           "DecodeInputs", "DecodeRows", "KVGeometry", "PadRow", "PrefillSeq", "SamplingParams",
           "StepModel", "context_slots", "kv_slot", "prefill_last_rows", "InputBlock", "FlatInputs", "flatten"]
