"""Sim capture and graphs: a capture records a stream's ops, a replay re-enqueues them."""
from __future__ import annotations

import weakref

from ..errors import ClosedError, CudaError


class Capture:
    """The ops recorded on one capturing stream; `graph` exists once the capture ended cleanly."""

    def __init__(self, name: str, stream):
        self.name = name
        self.stream = stream
        self.nodes: list = []
        self.first_error: BaseException | None = None
        self.active = True
        self._graph = None

    @property
    def graph(self) -> "Graph":
        if self._graph is None:
            raise RuntimeError(f"capture {self.name!r} has no graph: it is still open or failed")
        return self._graph

    def record(self, node) -> None:
        if self.first_error is not None:
            raise CudaError("cudaErrorStreamCaptureInvalidated", node.label,
                            f"capture {self.name!r} was invalidated by: {self.first_error}")
        self.nodes.append(node)

    def invalidate(self, error: BaseException) -> None:
        self.first_error = self.first_error or error

    def fail(self, error: BaseException):
        """Invalidate the capture with `error` (if it is the first) and raise it."""
        self.invalidate(error)
        raise error


class Graph:
    """An executable sim graph. Each launch re-enqueues every node: memory is read when it runs."""

    def __init__(self, nodes: list, name: str):
        self.name = name
        self._nodes = list(nodes)
        self._closed = False
        # Nothing of the OS to release: the finalizer only drops the nodes' array references.
        self._finalizer = weakref.finalize(self, self._nodes.clear)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def upload(self, stream) -> None:
        self._check_open()
        stream._check_open()

    def launch(self, stream) -> None:
        self._check_open()
        stream._check_open()
        for node in self._nodes:
            node.replay(stream)

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"graph {self.name!r} is closed")
