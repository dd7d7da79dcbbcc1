"""be.join_graphs: one graph that runs two captured graphs in order, with nothing captured
again; the two stay launchable, closing any of the three leaves the others whole, and a closed
graph is refused. Every test runs on the sim and, marked gpu, on cuda."""
import numpy as np
import pytest

from vt.backend import ClosedError

from ._kernels import Axpb

N = 4096
A1, B1 = 3.0, -2.0   # first: y = A1 * x + B1
A2, B2 = 0.5, 7.0    # second: z = A2 * y + B2


class _TwoGraphs:
    """first: x's H2D, y = A1 x + B1 (y stays on the device); second: z = A2 y + B2, z's D2H,
    then `done` recorded as an external event node (as the sampler graph's last node)."""

    def __init__(self, be, s):
        self.be, self.s = be, s
        self.x_h, self.z_h = be.pinned_empty((N,), np.float32), be.pinned_empty((N,), np.float32)
        x_d, self.y_d, z_d = (be.empty((N,), np.float32) for _ in range(3))
        self.done = be.event()
        with be.capture(s, name="first") as cap:
            be.copy_h2d(x_d, self.x_h, s)
            be.launch(s, Axpb(), self.y_d, x_d, a=A1, b=B1)
        self.first = cap.graph
        with be.capture(s, name="second") as cap:
            be.launch(s, Axpb(), z_d, self.y_d, a=A2, b=B2)
            be.copy_d2h(self.z_h, z_d, s)
            self.done.record(s, external=True)
        self.second = cap.graph

    def run(self, rng, launch):
        """Fresh x, z poisoned, `launch()`, wait on `done`: (x, z)."""
        self.x_h[:] = rng.standard_normal(N).astype(np.float32)
        self.z_h[:] = np.nan
        launch()
        self.done.synchronize()
        return self.x_h.copy(), self.z_h.copy()

    def separately(self):
        self.first.launch(self.s)
        self.second.launch(self.s)


def _expected(x):
    return Axpb.reference(Axpb.reference(x, A1, B1), A2, B2)


def test_a_joined_graph_gives_the_results_of_its_two_graphs_back_to_back(backend):
    """Fresh inputs at every launch: the joined graph's output equals the two graphs launched
    one after the other, byte for byte, and the reference."""
    rng = np.random.default_rng(0)
    s = backend.stream()
    two = _TwoGraphs(backend, s)
    joined = backend.join_graphs(two.first, two.second, name="first+second")
    assert joined.name == "first+second" and joined.num_nodes == two.first.num_nodes + two.second.num_nodes
    joined.upload(s)
    for _ in range(3):
        x, apart = two.run(rng, two.separately)
        two.x_h[:] = x
        two.z_h[:] = np.nan
        joined.launch(s)
        two.done.synchronize()
        np.testing.assert_array_equal(two.z_h, apart)
        np.testing.assert_allclose(apart, _expected(x), rtol=1e-5, atol=1e-5)


def test_the_two_graphs_still_launch_after_joining_and_interleave_with_the_joined_one(backend):
    """Joining takes nothing from the two: on one stream the joined graph and the pair, in
    turn, each compute their own fresh inputs."""
    rng = np.random.default_rng(1)
    s = backend.stream()
    two = _TwoGraphs(backend, s)
    joined = backend.join_graphs(two.first, two.second)
    for launch in (lambda: joined.launch(s), two.separately) * 2:
        x, z = two.run(rng, launch)
        np.testing.assert_allclose(z, _expected(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("closed_first", ["first", "second", "both", "joined"])
def test_closing_in_any_order_leaves_the_others_whole(backend, closed_first):
    """The joined graph holds its own copy of the work (a child node clones its graph):
    closing the originals leaves it launchable, and closing it leaves them launchable."""
    rng = np.random.default_rng(2)
    s = backend.stream()
    two = _TwoGraphs(backend, s)
    joined = backend.join_graphs(two.first, two.second)
    for graph in {"first": [two.first], "second": [two.second], "both": [two.second, two.first],
                  "joined": [joined]}[closed_first]:
        graph.close()
    if closed_first == "joined":
        launch = two.separately
        with pytest.raises(ClosedError):
            joined.launch(s)
    else:
        launch = lambda: joined.launch(s)   # noqa: E731
    for _ in range(2):
        x, z = two.run(rng, launch)
        np.testing.assert_allclose(z, _expected(x), rtol=1e-5, atol=1e-5)
    joined.close()
    joined.close()   # idempotent, like every graph's


def test_joining_a_closed_graph_or_a_non_graph_is_refused(backend):
    """CUDA has no graph left to clone once one is destroyed: the join names the closed one
    instead of handing the driver a dead handle; anything not a graph of this backend is a
    TypeError."""
    s = backend.stream()
    two = _TwoGraphs(backend, s)
    two.second.close()
    with pytest.raises(ClosedError, match="join_graphs 'step': graph 'second' is closed"):
        backend.join_graphs(two.first, two.second, name="step")
    with pytest.raises(ClosedError, match="graph 'second' is closed"):
        backend.join_graphs(two.second, two.first, name="step")
    with pytest.raises(TypeError, match="join_graphs 'step': .* is not a graph of the "
                                        f"{backend.name} backend"):
        backend.join_graphs(two.first, "second", name="step")


def test_joining_allocates_nothing_from_the_pool(backend):
    """Nothing is captured again: the pool's counters are those before the join."""
    s = backend.stream()
    two = _TwoGraphs(backend, s)
    before = backend.pool.stats()
    backend.join_graphs(two.first, two.second).upload(s)
    assert backend.pool.stats() == before
