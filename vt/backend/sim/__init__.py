"""The sim backend: vt's backend contract on the CPU, with real asynchronous semantics."""
from .backend import SimBackend
from ._event import Event
from ._graph import Capture, Graph
from ._stream import Stream

__all__ = ["SimBackend", "Stream", "Event", "Capture", "Graph"]
