"""The engine: continuous batching of requests over the runner (engine.py), with its scheduler,
persistent decode batch, requests and per-call outputs."""
from vt.engine.engine import Engine, Progress
from vt.engine.handle import RequestHandle
from vt.engine.requests import EngineBusyError, RequestResult, RequestTooLargeError

__all__ = ["Engine", "Progress", "EngineBusyError", "RequestHandle", "RequestResult",
           "RequestTooLargeError"]
