"""Stream capture into a CUDA graph, the instantiated executable graph, and two graphs joined
into one."""
from __future__ import annotations

import contextlib
import weakref
import warnings

from cuda.bindings import runtime as cudart

from vt.backend.errors import CaptureError, ClosedError, CudaError

from ._check import SUCCESS, check, cuda_error, push_recorder
from ._memory import capture_closed, capture_opened
from .._handle import HandleOwner
from ._stream import end_orphaned_capture

_INVALIDATED = cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated
_SPECIAL_STREAMS = (0, int(cudart.cudaStreamLegacy), int(cudart.cudaStreamPerThread))


class Graph(HandleOwner):
    """An instantiated graph: `launch` replays it on a stream; close() destroys exec and graph.

    `graph_handle` is the cudaGraph_t it was instantiated from, kept (not destroyed) until
    close() so that join_graphs can clone it into a child node."""

    _kind = "graph"

    def __init__(self, graph, graph_exec, name: str, num_nodes: int):
        self.name = name
        self.num_nodes = num_nodes
        self.graph_handle = graph
        self._exec = graph_exec
        self._own(_destroy_graph, graph, graph_exec)

    def upload(self, stream) -> None:
        """Pre-load the graph's device resources on `stream` so the first launch is not slower."""
        self._require_open()
        stream._require_open()
        check(cudart.cudaGraphUpload(self._exec, stream.handle), "cudaGraphUpload")

    def launch(self, stream) -> None:
        # On every decode step's path: the open check and one error compare, nothing else.
        self._require_open()
        err = cudart.cudaGraphLaunch(self._exec, stream.handle)[0]
        if err != SUCCESS:
            stream._require_open()
            raise cuda_error(err, "cudaGraphLaunch")

    def __repr__(self) -> str:
        return f"<Graph {self.name!r} nodes={self.num_nodes}{' closed' if self.closed else ''}>"


def join_graphs(first: Graph, second: Graph, name: str) -> Graph:
    """One executable graph that runs `first`, then `second`: a new graph of two child-graph
    nodes, the second depending on the first, instantiated. Nothing is captured, so nothing
    is allocated from the pool; instantiating sizes the exec's own driver resources, as
    every instantiate does (not device memory that vt's pool hands out).

    A child node CLONES its graph (cudaGraphAddChildGraphNode), so `first` and `second` stay
    open and launchable, and closing them, before or after, leaves the joined graph whole.
    Separate execs of the same work may coexist; one stream's order keeps them from running
    at once, which is all their shared buffers need."""
    for graph in (first, second):
        if not isinstance(graph, Graph):
            raise TypeError(f"join_graphs {name!r}: {graph!r} is not a graph of the cuda backend")
        if graph.closed:
            raise ClosedError(f"join_graphs {name!r}: graph {graph.name!r} is closed")
    graph = check(cudart.cudaGraphCreate(0), "cudaGraphCreate")
    try:
        head = check(cudart.cudaGraphAddChildGraphNode(graph, None, 0, first.graph_handle),
                     "cudaGraphAddChildGraphNode")
        check(cudart.cudaGraphAddChildGraphNode(graph, [head], 1, second.graph_handle),
              "cudaGraphAddChildGraphNode")
        graph_exec = check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
    except BaseException:
        _destroy_graph(graph)
        raise
    return Graph(graph, graph_exec, name, first.num_nodes + second.num_nodes)


class Capture:
    """`with be.capture(s, name) as cap:` records the work issued on `s`; then `cap.graph`.

    Global mode (cudaStreamCaptureModeGlobal): any capture-unsafe call from any thread — a
    cudaMalloc, a synchronize, a query — fails and invalidates the capture, so a mistake is
    reported instead of baked in. Relaxed mode lets cudaMalloc silently succeed (measured,
    docs/design.md), which would hide a pool that grows during capture.

    The capture is always ended, even when the block raises. An invalidated capture, or a
    CudaError out of the block, raises CaptureError naming the capture and the first failing
    call (chained from the block's exception, if any); any other exception (e.g.
    CaptureAllocationError: the pool refuses before calling the driver) propagates as it is.
    """

    def __init__(self, stream, name: str, pool, routing: contextlib.AbstractContextManager, track):
        stream._require_open()
        if stream.borrowed or stream.handle in _SPECIAL_STREAMS:
            raise ValueError(f"capture {name!r}: the legacy/default stream ({stream!r}) cannot be captured; "
                             f"capture on a stream from be.stream()")
        if stream._capture is not None:
            raise RuntimeError(f"capture {name!r}: stream {stream.name!r} is already capturing "
                               f"{stream._capture!r}")
        self.name = name
        self._graph: Graph | None = None
        self._stream = stream
        self._pool = pool
        self._routing = routing
        self._track = track
        self._errors = _FirstError()
        self._finalizer = None

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            raise RuntimeError(f"capture {self.name!r} has no graph: it is still open or failed")
        return self._graph

    def __enter__(self) -> "Capture":
        if self._finalizer is not None:
            raise RuntimeError(f"capture {self.name!r} was already entered; make a new be.capture()")
        pool_ctx = self._pool.capturing(self.name)
        pool_ctx.__enter__()
        try:
            check(cudart.cudaStreamBeginCapture(self._stream.handle,
                                                cudart.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal),
                  "cudaStreamBeginCapture")
        except BaseException as exc:
            pool_ctx.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._pool_ctx = pool_ctx
        capture_opened()
        self._stream._capture = self.name
        self._recorders = push_recorder(self._errors.record)
        self._routing.__enter__()
        # Backstop for a capture entered and never exited: end it so the stream stays usable,
        # take the pool out of capture mode and undo the CuPy routing (no reference to self).
        self._finalizer = weakref.finalize(self, _abandon, self._stream, pool_ctx, self._routing,
                                           self._recorders, self._errors.record)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._finalizer.detach()
        self._routing.__exit__(exc_type, exc, tb)
        self._recorders.remove(self._errors.record)
        self._stream._capture = None
        try:
            graph, end_error = self._end()
        finally:
            capture_closed()
            self._pool_ctx.__exit__(exc_type, exc, tb)
        if exc is not None or end_error is not None:
            _destroy_graph(graph)
            if end_error is None and not isinstance(exc, CudaError):
                return False  # e.g. CaptureAllocationError: the capture was valid, exc propagates
            cause = exc if exc is not None else end_error
            raise CaptureError(self.name, self._errors.first or cause) from cause
        num_nodes = check(cudart.cudaGraphGetNodes(graph), "cudaGraphGetNodes")[-1]
        if num_nodes == 0:
            warnings.warn(f"capture {self.name!r} recorded no work: its graph is empty", RuntimeWarning,
                          stacklevel=2)
        try:
            graph_exec = check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        except CudaError as error:
            _destroy_graph(graph)
            raise CaptureError(self.name, error) from error
        self._graph = Graph(graph, graph_exec, self.name, int(num_nodes))
        self._track(self._graph)
        return False

    def abandon(self) -> None:
        """End this capture now if it is still open (teardown); the block's work is discarded."""
        if self._finalizer is not None:
            self._finalizer()

    def _end(self):
        """End the capture: (graph or None, CudaError or None). Invalidated counts as an error."""
        err, status = cudart.cudaStreamIsCapturing(self._stream.handle)
        invalidated = err == SUCCESS and status == _INVALIDATED
        err, graph = cudart.cudaStreamEndCapture(self._stream.handle)
        if err != SUCCESS:
            return None, cuda_error(err, "cudaStreamEndCapture")
        if invalidated:  # not expected (end reports it), kept so an invalidation is never missed
            return graph, CudaError("cudaErrorStreamCaptureInvalidated", "cudaStreamEndCapture",
                                    "the capture was invalidated")
        return graph, None


class _FirstError:
    def __init__(self):
        self.first: CudaError | None = None

    def record(self, error: CudaError) -> None:
        if self.first is None:
            self.first = error


def _abandon(stream, pool_ctx, routing, recorders: list, record) -> None:
    stream._capture = None
    end_orphaned_capture(stream.handle)
    capture_closed()
    pool_ctx.__exit__(None, None, None)
    recorders.remove(record)
    with contextlib.suppress(Exception):  # best effort: CuPy's state may have moved on since
        routing.__exit__(None, None, None)


def _destroy_graph(graph, graph_exec=None) -> None:
    if graph_exec is not None:
        check(cudart.cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")
    if graph is not None and int(graph):
        check(cudart.cudaGraphDestroy(graph), "cudaGraphDestroy")
