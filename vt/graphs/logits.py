"""ForwardLogits: the logits of one step, either a view into a graph's retained block or an
array the step owns. The runner's drain decision reads `non_owning_view`."""
from __future__ import annotations

from vt.errors import VtError


class StaleLogitsError(VtError, RuntimeError):
    """A logits view was read after its graph was replayed again (it now holds another step)."""


class GraphOutput:
    """A step captured as two graphs, the forward (which writes the retained [S, vocab] logits
    block) and the sampler (which reads it), and `whole`, the two joined into one graph
    (be.join_graphs: nothing captured twice). launch() is the whole step in one graph launch;
    launch_forward() and launch_sampler() launch the halves apart, so the host may queue work
    between them (a grammar's masks, vt/engine/serving.py). `generation` counts the
    forward's launches, whole or alone, so a view taken at one launch can tell that a later
    one overwrote it. A forward's sampler must be launched before the next forward, and only
    then (RuntimeError otherwise): the logits it reads are the last forward's."""

    def __init__(self, forward, sampler, whole, logits, name: str):
        self.forward, self.sampler, self.whole = forward, sampler, whole
        self.logits = logits   # [S, vocab] f32, retained: never returned to the scratch arena
        self.name = name
        self.generation = 0
        self.sampler_pending = False   # a forward was launched alone and its sampler not yet

    def launch(self, stream) -> int:
        """The whole step, one launch: a forward and its sampler."""
        self._check_no_sampler_pending()
        self.whole.launch(stream)
        self.generation += 1
        return self.generation

    def launch_forward(self, stream) -> int:
        self._check_no_sampler_pending()
        self.forward.launch(stream)
        self.generation += 1
        self.sampler_pending = True
        return self.generation

    def launch_sampler(self, stream) -> None:
        if not self.sampler_pending:
            raise RuntimeError(f"{self.name}: launch_sampler() without a forward to sample "
                               f"(generation {self.generation} is sampled already)")
        self.sampler.launch(stream)
        self.sampler_pending = False

    def close(self):
        for graph in (self.whole, self.forward, self.sampler):
            if graph is not None:
                graph.close()
        self.forward = self.sampler = self.whole = None
        self.logits = None

    def _check_no_sampler_pending(self) -> None:
        if self.sampler_pending:
            raise RuntimeError(f"{self.name}: forward launched again before the sampler of "
                               f"generation {self.generation}; launch_sampler() first")


class ForwardLogits:
    """Logits rows [:n] of one step.

    non_owning_view: True when the array is the graph's retained block (the next replay of
    that graph overwrites it); False when the step allocated its logits (eager, mixed).
    """

    def __init__(self, array, n: int, output: GraphOutput | None = None, generation: int = 0):
        self._array = array
        self.n = n
        self.output = output
        self.generation = generation
        self.non_owning_view = output is not None   # read by every launch's drain decision

    @property
    def stale(self) -> bool:
        return self.output is not None and self.output.generation != self.generation

    @property
    def array(self):
        """The full [S, vocab] device array (padded rows included); raises if stale."""
        if self.stale:
            raise StaleLogitsError(
                f"logits view of {self.output.name} generation {self.generation} is stale: the "
                f"graph was replayed again (now generation {self.output.generation}); copy the "
                f"logits before the next replay of this slot if you need them later")
        return self._array

    @property
    def rows(self):
        """The n real rows, [n, vocab]."""
        return self.array[:self.n]
