"""Base of every backend object that owns (or borrows) a handle: cuda and sim objects, the pool.

`close()` is idempotent, `with` closes, and a `weakref.finalize` backstop releases the handle
when the owner is collected without close(). The release function must not reference the
owner (it would keep it alive), so subclasses pass the raw handles to `_own`.
Imports nothing of CUDA: the sim backend and the pool use it too.
"""
from __future__ import annotations

import weakref

from .errors import ClosedError


class HandleOwner:
    _kind = "object"

    def _own(self, release=None, *handles) -> None:
        """Register `release(*handles)`, run once by close() or by the finalizer.

        No `release`: nothing to destroy (a sim object holding no resource); close() only marks
        this object closed.
        """
        self._finalizer = weakref.finalize(self, release or _nothing, *handles)

    def _borrow(self) -> None:
        """A borrowed handle is never destroyed: close() only marks this wrapper closed."""
        self._own()

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError(self._closed_message())

    def _closed_message(self) -> str:
        # The sim objects and the pool override this to keep their own wording, which callers
        # and tests match ("stream 'x' is closed", "DevicePool is closed").
        return f"{self._kind} {self._label()} used after close()"

    def _label(self) -> str:
        name = getattr(self, "name", "")
        return repr(name) if name else hex(id(self))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nothing() -> None:
    pass
