"""Base of every object that owns (or borrows) a CUDA handle.

`close()` is idempotent, `with` closes, and a `weakref.finalize` backstop releases the handle
when the owner is collected without close(). The release function must not reference the
owner (it would keep it alive), so subclasses pass the raw handles to `_own`.
"""
from __future__ import annotations

import weakref

from vt.backend.errors import ClosedError


class HandleOwner:
    _kind = "object"

    def _own(self, release, *handles) -> None:
        """Register `release(*handles)`, run once by close() or by the finalizer."""
        self._finalizer = weakref.finalize(self, release, *handles)

    def _borrow(self) -> None:
        """A borrowed handle is never destroyed: close() only marks this wrapper closed."""
        self._finalizer = weakref.finalize(self, _nothing)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError(f"{self._kind} {self._label()} used after close()")

    def _label(self) -> str:
        name = getattr(self, "name", "")
        return repr(name) if name else hex(id(self))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nothing() -> None:
    pass
