"""The one integer check of vt's constructors: what an integer argument accepts and how a
refusal reads, the same everywhere.

A Python int or a numpy integer (what a shape, a `len` or an array element gives) is an
integer; a bool is not (True is 1 to Python, never a size to a caller), nor is a float,
even 8.0. A refusal reads "X must be an integer in [lo, hi], got V" (the command line's
bounds, vt/bench/limits.py, read the same): a TypeError when V is not an integer at all, a
ValueError when it is one outside the range.
"""
from __future__ import annotations

import numbers

INT32_MAX = 2**31 - 1   # the bound of a count stored in the device's int32 vectors


def integer(name: str, value, lo: int, hi: int = INT32_MAX) -> int:
    """`value` as a Python int, if it is an integer in [lo, hi]; else the refusal above."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)
