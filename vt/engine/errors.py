"""The engine's errors: what refuses a request before any step runs (RequestTooLargeError and
its two kinds), what refuses an engine while another drives its model (EngineBusyError), and
what fails requests the scheduler can never run (SchedulerStalledError). Each is raised in
one place and carries the sentence that tells the caller what to change."""
from __future__ import annotations

from vt.errors import VtError


class RequestTooLargeError(VtError, ValueError):
    """A request cannot be served whole: its prompt plus max_new_tokens exceed the model's
    context, or it needs more KV blocks than the whole cache has. generate() raises it before
    running any step, so nothing is served partially."""


class PromptTooLongError(RequestTooLargeError):
    """The prompt alone does not fit the model's context."""


class KVCacheExhaustedError(RequestTooLargeError):
    """The request needs more KV blocks than the whole cache has."""


class EngineBusyError(VtError, RuntimeError):
    """The Engine, or its model, is being driven right now: an Engine over a model another
    Engine is serving (vt/engine/model_lease.py)."""


class SchedulerStalledError(VtError, RuntimeError):
    """Requests wait and nothing can run or is in flight (a request the refusal checks let
    through that can never be admitted): they fail instead of waiting forever."""
