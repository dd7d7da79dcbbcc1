"""The step contract: what one decode or prefill step is made of (contract.py) and the one
contiguous block its per-row vectors travel in (inputblock.py). Every layer above imports it;
it imports none of them."""
from vt.step.contract import (FIELDS, FORWARD_FIELDS, GREEDY, LOGITS_DTYPE, SAMPLING_FIELDS,
                              DecodeInputs, DecodeRows, KVGeometry, PadRow, PrefillSeq, SamplingParams,
                              StepModel, kv_slot, prefill_last_rows)
from vt.step.inputblock import InputBlock

__all__ = ["FIELDS", "FORWARD_FIELDS", "GREEDY", "LOGITS_DTYPE", "SAMPLING_FIELDS",
           "DecodeInputs", "DecodeRows", "KVGeometry", "PadRow", "PrefillSeq", "SamplingParams",
           "StepModel", "kv_slot", "prefill_last_rows", "InputBlock"]
