"""What `vt serve` and `vt generate` print on stderr while they start: one line per phase of
the start-up (loading weights, capturing decode graphs, warming up eager steps) with its
counts, e.g. `vt serve: capturing decode graphs 3/8 (size 4, slot 0)`.

On a terminal the phase's line is rewritten in place as it advances and ends with the
phase's time. Elsewhere (a log file, a pipe, a test) the line is printed when the phase ends,
and while a phase runs longer than PERIOD_S, once every PERIOD_S, so that a log shows where
a slow start-up is without a line per piece."""
from __future__ import annotations

import sys
import time

from vt.engine.progress import StartUpProgress

PERIOD_S = 5.0


class StartUpLog:
    """Callable with a StartUpProgress (Engine's start_up_progress, load_checkpoint's
    progress); `line(msg)` prints a message of its own, ending any line in progress."""

    def __init__(self, who: str, out=None, *, terminal: bool | None = None,
                 clock=time.monotonic):
        self.who, self.out, self.clock = who, out or sys.stderr, clock
        self.terminal = _isatty(self.out) if terminal is None else terminal
        self._phase: str | None = None
        self._started = self._printed = 0.0
        self._open = False   # a terminal line without its newline yet

    def __call__(self, p: StartUpProgress) -> None:
        now = self.clock()
        if p.phase != self._phase:
            self._end_open_line()
            self._phase, self._started, self._printed = p.phase, now, now
        text = f"{self.who}: {p.phase} {p.done}/{p.total}" + (f" ({p.detail})" if p.detail else "")
        last = p.done >= p.total
        if last:
            text += f" in {now - self._started:.1f} s"
        if self.terminal:
            self.out.write("\r\033[K" + text + ("\n" if last else ""))
            self._open = not last
        elif last or now - self._printed >= PERIOD_S:
            self.out.write(text + "\n")
            self._printed = now
        self.out.flush()
        if last:
            self._phase = None

    def line(self, msg: str) -> None:
        self._end_open_line()
        print(msg, file=self.out, flush=True)

    def _end_open_line(self) -> None:
        if self._open:
            self.out.write("\n")
            self._open = False


def _isatty(out) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
