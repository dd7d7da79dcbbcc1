"""The peer: the synthetic workload in a hand-written `torch.cuda.CUDAGraph` loop.

What a PyTorch engineer writes for speed, with the same device work as vt's synthetic
forward (the same spin and logits kernels, launched on torch's stream) and sampling plus
token feedback inside the graph:

- static device buffers: the token table, the step's inputs [2, S] (token rows, positions),
  logits, tokens; two pinned input blocks and two pinned token buffers; one graph per
  buffer pair: H2D of the inputs, spin, logits, argmax, table[rows] = token, D2H of the
  tokens (the copies inside the graph, as vt's graph mode has them: a copy_ outside it costs
  a dispatcher call and a launch per step);
- `torch_sync`: per step write the positions into the pinned block, replay, record an
  event, wait on it, read the tokens;
- `torch_async` (depth 2): the two graphs in turn; the event recorded after step N's graph
  guards both its tokens and its input block (the host waits on it to read step N's tokens
  before rewriting that block at step N+2); step N+1 is launched before step N's tokens are
  read (one step late), as vt's ring does.

torch is optional: `unavailable_reason()` says why the peer cannot run (not installed, no
CUDA device, no CuPy for the shared kernels); the bench then marks its columns absent.
"""
from __future__ import annotations

import time

import numpy as np

from vt.bench.synthetic import SYNTH_VOCAB, launch_logits_cupy, launch_spin_cupy
from vt.backend.timing import timed_ms

VARIANTS = ("torch_sync", "torch_async")


def unavailable_reason() -> str | None:
    """None when the peer can run here, else why not."""
    try:
        import torch
    except Exception as exc:   # not installed or broken: the peer is optional
        return f"torch does not import ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device"
    except Exception as exc:
        return f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"
    try:
        import cupy  # noqa: F401  (the shared spin and logits kernels)
    except Exception as exc:
        return f"cupy does not import ({type(exc).__name__}: {exc})"
    return None


def torch_version() -> str | None:
    try:
        import torch
        return torch.__version__
    except Exception:
        return None


class TorchEvents:
    """torch.cuda events behind the interface vt.backend.timing.timed_ms expects."""

    class _Event:
        def __init__(self, torch):
            self.ev = torch.cuda.Event(enable_timing=True)

        def record(self, stream):
            self.ev.record(stream)

        def synchronize(self):
            self.ev.synchronize()

        def elapsed_ms(self, start) -> float:
            return start.ev.elapsed_time(self.ev)

    def __init__(self):
        import torch
        self._torch = torch

    def event(self, timing_enabled: bool = True):
        return self._Event(self._torch)


class GraphLoop:
    """The hand-written loops over two captured torch graphs (one per pinned buffer pair) that
    the peers share: torch_sync (fill, replay, wait, read) and torch_async (depth 2). A peer
    sets graphs, np_in, np_tok, tok_ready and stream, and writes a step's inputs in _fill."""

    def _fill(self, block, start, n: int) -> None:
        raise NotImplementedError

    def _sync_steps(self, start, out, first: int, end: int) -> float:
        graph, block, tok, ev = self.graphs[0], self.np_in[0], self.np_tok[0], self.tok_ready[0]
        clock, wait_s = time.perf_counter, 0.0
        for n in range(first, end):
            self._fill(block, start, n)
            graph.replay()
            ev.record()
            t = clock()
            ev.synchronize()
            wait_s += clock() - t
            out[n] = tok
        return wait_s

    def _async_steps(self, start, out, first: int, end: int) -> float:
        """Depth 2, one event per step: tok_ready[b] is recorded after step n's graph (b = n & 1),
        which read pinned_in[b] and wrote pinned_tok[b]. The host waits on it at step n + 1 (to
        read step n's tokens), before it rewrites pinned_in[b] at step n + 2: that one wait
        guards both the tokens and the block."""
        graphs, np_in, np_tok, tok_ready = self.graphs, self.np_in, self.np_tok, self.tok_ready
        clock, wait_s = time.perf_counter, 0.0
        for n in range(first, end + 1):
            b = n & 1
            if n < end:
                self._fill(np_in[b], start, n)
                graphs[b].replay()
                tok_ready[b].record()
            if n > first:                       # step n - 1's tokens, one step late
                t = clock()
                tok_ready[1 - b].synchronize()
                wait_s += clock() - t
                out[n - 1] = np_tok[1 - b]
        return wait_s

    def close(self) -> None:
        self.stream.synchronize()
        self.graphs = []


class TorchPeer(GraphLoop):
    """Two captured graphs for S rows (S + 1 table rows: the last is scratch, as in vt), one per
    pinned buffer pair b: copy pinned_in[b] into the static inputs, the forward, argmax,
    table[rows] = tokens, copy the tokens to pinned_tok[b]. The host's whole step is then a
    numpy write, one replay, one event record and one event wait, as in vt's graph mode."""

    def __init__(self, S: int, vocab: int = SYNTH_VOCAB, warmup: int = 3):
        import cupy
        import torch
        self.torch, self.S, self.vocab = torch, S, vocab
        dev = torch.device("cuda")
        self.stream = torch.cuda.Stream()
        self.table = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.inputs = torch.zeros(2, S, dtype=torch.int32, device=dev)     # rows, positions
        self.logits = torch.zeros(S, vocab, dtype=torch.float32, device=dev)
        self.tokens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.ns = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pinned_in = [torch.zeros(2, S, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.pinned_tok = [torch.zeros(S, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.np_in = [p.numpy() for p in self.pinned_in]
        self.np_tok = [p.numpy() for p in self.pinned_tok]
        self.tok_ready = [torch.cuda.Event() for _ in range(2)]
        torch.cuda.synchronize()
        # CuPy views of the kernels' operands, made once outside the capture (importing a
        # __cuda_array_interface__ may synchronize its stream, which a capture forbids).
        self._cp = dict(table=cupy.asarray(self.table), rows=cupy.asarray(self.inputs[0]),
                        pos=cupy.asarray(self.inputs[1]), logits=cupy.asarray(self.logits),
                        ns=cupy.asarray(self.ns))
        self._cupy = cupy
        with torch.cuda.stream(self.stream):
            for i in range(warmup):   # on a side stream before capture, as torch asks
                self._body(i % 2)
        self.stream.synchronize()
        self.graphs = []
        for b in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self._body(b)
            self.graphs.append(graph)
        self.stream.synchronize()

    def _body(self, b: int) -> None:
        """The step on the device, reading pinned_in[b] and writing pinned_tok[b]: the user
        forward (vt's synthetic kernels on torch's current stream), then sampling and token
        feedback."""
        self.inputs.copy_(self.pinned_in[b], non_blocking=True)
        cp = self._cp
        with self._cupy.cuda.ExternalStream(self.torch.cuda.current_stream().cuda_stream):
            launch_spin_cupy(cp["ns"])
            launch_logits_cupy(cp["table"], cp["rows"], cp["pos"], cp["logits"])
        self._sample_and_feed_back()
        self.pinned_tok[b].copy_(self.tokens, non_blocking=True)

    def _fill(self, block, start, n: int) -> None:
        np.add(start, n, out=block[1])   # positions; the rows stay 0..S-1

    def _sample_and_feed_back(self) -> None:
        """tokens = argmax(logits); table[rows] = tokens (the next step's input)."""
        self.tokens.copy_(self.torch.argmax(self.logits, dim=1))
        self.table.index_put_((self.inputs[0],), self.tokens)

    def set_device_us(self, us: float) -> None:
        with self.torch.cuda.stream(self.stream):
            self.ns.fill_(round(us * 1e3))
        self.stream.synchronize()

    def ceiling_us(self, replays: int = 200) -> float:
        """µs per replay of the graph replayed back to back, no host work in between."""
        with self.torch.cuda.stream(self.stream):
            ms = timed_ms(TorchEvents(), self.stream, self.graphs[0].replay, replays, 3, warmup=3)
        return 1e3 * ms

    def run(self, variant: str, prompts, steps: int) -> dict:
        """The prefill-equivalent step (untimed), then `steps` timed decode steps.

        Returns wall_s, wait_s (host time blocked on events) and tokens [S][steps + 1].
        """
        if variant not in VARIANTS:
            raise ValueError(f"unknown torch variant {variant!r}; choose from {VARIANTS}")
        torch, S = self.torch, self.S
        if len(prompts) != S:
            raise ValueError(f"{len(prompts)} prompts for a peer of {S} rows")
        last = torch.tensor([int(p[-1]) for p in prompts] + [0], dtype=torch.int32)
        start = np.array([len(p) - 1 for p in prompts], np.int32)
        out = np.zeros((steps + 1, S), np.int32)
        for h in self.np_in:      # the rows never change in this workload: written once
            h[0] = np.arange(S, dtype=np.int32)
        with torch.cuda.stream(self.stream):
            self.table.copy_(last)
            self._sync_steps(start, out, 0, 1)   # "prefill": the prompt's last position
            self.stream.synchronize()
            loop = self._sync_steps if variant == "torch_sync" else self._async_steps
            t0 = time.perf_counter()
            wait_s = loop(start, out, 1, steps + 1)
            wall_s = time.perf_counter() - t0
        return dict(wall_s=wall_s, wait_s=wait_s, tokens=out.T.tolist())

