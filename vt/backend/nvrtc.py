"""Runtime CUDA compilation shared by every kernel family: a cache of CuPy RawModule functions
keyed on source, kernel name and compile-time defines, the NVRTC options of a build, and the
SM count that sizes split-work grids.

Compiled and loaded on first use, so the first call of a kernel must be eager (not under
capture): callers run every kernel once before capturing.
"""
from __future__ import annotations

_FUNCS: dict[tuple, object] = {}


def nvrtc_options(defines: dict) -> tuple[str, ...]:
    """The NVRTC options of a kernel build (CuPy adds the target architecture); the compile
    tests build with the same ones."""
    return ("-std=c++17",) + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def cuda_function(code: str, name: str, **defines):
    """The compiled CuPy function `name` of `code` built with `defines` (cached)."""
    key = (code, name, tuple(sorted(defines.items())))
    fn = _FUNCS.get(key)
    if fn is None:
        import cupy as cp

        fn = _FUNCS[key] = cp.RawModule(code=code, options=nvrtc_options(defines)).get_function(name)
    return fn


_SM_COUNT: list[int] = []


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (cached)."""
    if not _SM_COUNT:
        import cupy as cp

        _SM_COUNT.append(int(cp.cuda.Device().attributes["MultiProcessorCount"]))
    return _SM_COUNT[0]
