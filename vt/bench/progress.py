"""Progress over the bench's set-up, captures and cells: a tqdm bar when tqdm is installed and
stdout is a terminal, else one plain line per task (logs and CI stay readable)."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """`with ProgressBar(total) as p: p.step("capture ring S=32")` after each task;
    p.log(msg) prints a line without breaking the bar."""

    def __init__(self, total: int, *, desc: str = "vt bench", bar: bool | None = None, out=None):
        self.total, self.done, self.desc = total, 0, desc
        self.out = out or sys.stdout
        self._t0 = time.perf_counter()
        self._tqdm = None
        if bar is None:
            bar = _isatty(self.out)
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._tqdm = tqdm(total=total, desc=desc, file=self.out, dynamic_ncols=True,
                                  leave=True)

    def step(self, what: str, n: int = 1) -> None:
        self.done += n
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(what, refresh=False)
            self._tqdm.update(n)
        else:
            print(f"[{self.done}/{self.total} {time.perf_counter() - self._t0:6.1f}s] {what}",
                  file=self.out, flush=True)

    def log(self, msg: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(msg, file=self.out)
        else:
            print(msg, file=self.out, flush=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _isatty(out) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
