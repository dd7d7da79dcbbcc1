"""Sim capture and graphs: a capture records a stream's ops, a replay re-enqueues them; two
graphs join into one that replays the first's ops, then the second's."""
from __future__ import annotations

from .._handle import HandleOwner
from ..errors import ClosedError, CudaError


class Capture:
    """The ops recorded on one capturing stream; `graph` exists once the capture ended cleanly.

    Not a HandleOwner: it holds nothing to release, and SimBackend.capture ends it (`active`).
    """

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


class Graph(HandleOwner):
    """An executable sim graph. Each launch re-enqueues every node: memory is read when it runs."""

    def __init__(self, nodes: list, name: str):
        self.name = name
        self._nodes = list(nodes)
        # Nothing of the OS to release: the finalizer only drops the nodes' array references.
        self._own(self._nodes.clear)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def nodes(self) -> tuple:
        """The recorded ops, in replay order (join_graphs copies them)."""
        self._require_open()
        return tuple(self._nodes)

    def upload(self, stream) -> None:
        self._require_open()
        stream._require_open()

    def launch(self, stream) -> None:
        self._require_open()
        stream._require_open()
        for node in self._nodes:
            node.replay(stream)

    def _closed_message(self) -> str:
        return f"graph {self.name!r} is closed"


def join_graphs(first: Graph, second: Graph, name: str) -> Graph:
    """The cuda join's twin: a graph replaying `first`'s ops, then `second`'s. It holds its own
    list of them, as a child node holds a clone, so the two stay launchable and closing them
    leaves it whole; a closed graph is refused, as CUDA has no graph left to clone."""
    for graph in (first, second):
        if not isinstance(graph, Graph):
            raise TypeError(f"join_graphs {name!r}: {graph!r} is not a graph of the sim backend")
        if graph.closed:
            raise ClosedError(f"join_graphs {name!r}: graph {graph.name!r} is closed")
    return Graph(first.nodes + second.nodes, name)
