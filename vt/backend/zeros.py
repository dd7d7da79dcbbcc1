"""zeros(be, shape, dtype) and full(be, shape, dtype, value): a device array of one value made
through the backend's own copy (a forward's persistent buffers: state it keeps across steps, a
token table)."""
from __future__ import annotations


def zeros(be, shape, dtype):
    """A zero-filled device array from be.empty: fresh device memory is garbage (the sim's is
    0xFF on purpose), so a buffer read before its first write must be zeroed once."""
    return full(be, shape, dtype, 0)


def full(be, shape, dtype, value):
    """A device array from be.empty with every element `value`, copied from pinned memory and
    waited for (made at construction, never on a step's stream)."""
    dev = be.empty(shape, dtype)
    host = be.pinned_empty(shape, dtype)
    host[...] = value
    s = be.stream(name="vt-zeros")
    be.copy_h2d(dev, host, s)
    s.synchronize()
    s.close()
    return dev
