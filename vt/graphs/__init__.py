"""Decode steps as captured graphs: SizeSlot, SlotRing, the driver, capture with warm-up."""
from vt.graphs.driver import DecodeGraphDriver
from vt.graphs.inputs import FIELDS, DecodeInputs, DecodeRows, PadRow
from vt.graphs.logits import ForwardLogits, GraphOutput, StaleLogitsError
from vt.graphs.slot import SizeSlot, SlotRing

__all__ = ["DecodeGraphDriver", "DecodeInputs", "DecodeRows", "PadRow", "FIELDS", "ForwardLogits",
           "GraphOutput", "StaleLogitsError", "SizeSlot", "SlotRing"]
