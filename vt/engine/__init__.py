"""The engine: continuous batching of requests over the runner (engine.py), with its scheduler,
persistent decode batch, requests and per-call outputs."""
from vt.engine.engine import Engine, Progress, StartUpProgress
from vt.engine.handle import RequestHandle
from vt.engine.errors import EngineBusyError, RequestTooLargeError
from vt.engine.requests import RequestResult

__all__ = ["Engine", "Progress", "EngineBusyError", "RequestHandle", "RequestResult",
           "RequestTooLargeError", "StartUpProgress"]
