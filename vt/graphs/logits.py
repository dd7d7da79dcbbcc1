"""ForwardLogits: the logits of one step, either a view into a graph's retained block or an
array the step owns. The runner's drain decision reads `non_owning_view`."""
from __future__ import annotations

from vt.errors import VtError


class StaleLogitsError(VtError, RuntimeError):
    """A logits view was read after its graph was replayed again (it now holds another step)."""


class GraphOutput:
    """A captured graph and its retained [S, vocab] logits block. `generation` counts the
    launches, so a view taken at one launch can tell that a later one overwrote it."""

    def __init__(self, graph, logits, name: str):
        self.graph = graph
        self.logits = logits   # [S, vocab] f32, retained: never returned to the scratch arena
        self.name = name
        self.generation = 0

    def launch(self, stream) -> int:
        self.graph.launch(stream)
        self.generation += 1
        return self.generation

    def close(self):
        if self.graph is not None:
            self.graph.close()
            self.graph = None
        self.logits = None


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
