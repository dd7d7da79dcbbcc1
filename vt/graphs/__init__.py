"""Captured decode graphs: SizeSlot, SlotRing, the driver, capture with pool warm-up."""
from vt.graphs.capture import StepHalves, capture_warmed
from vt.graphs.driver import DecodeGraphDriver, GraphSettings
from vt.graphs.logits import ForwardLogits, GraphOutput, StaleLogitsError
from vt.graphs.slot import SizeSlot, SlotRing

__all__ = ["StepHalves", "DecodeGraphDriver", "GraphSettings", "ForwardLogits", "GraphOutput",
           "StaleLogitsError", "SizeSlot", "SlotRing", "capture_warmed"]
