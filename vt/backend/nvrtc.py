"""Run-time compiled CUDA kernels: one cache of CuPy RawModule functions for every kernel vt
builds (the model's and the sampler's), and the device facts that size their grids."""
from __future__ import annotations

_FUNCS: dict[tuple, object] = {}
_SM_COUNT: list[int] = []


def build_options(defines: dict) -> tuple[str, ...]:
    """The NVRTC options of a build (CuPy adds the target architecture); the CPU compile
    tests build with the same ones."""
    return ("-std=c++17",) + tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def compiled_function(code: str, name: str, defines: dict | None = None):
    """The CuPy function `name` of `code` built with `defines` (cached per code and defines).

    Compiled and loaded on first use, so that first call must be eager (not under capture)."""
    defines = defines or {}
    key = (code, name, tuple(sorted(defines.items())))
    fn = _FUNCS.get(key)
    if fn is None:
        import cupy as cp

        fn = _FUNCS[key] = cp.RawModule(code=code, options=build_options(defines)).get_function(name)
    return fn


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (cached; sizes split-work grids)."""
    if not _SM_COUNT:
        import cupy as cp

        _SM_COUNT.append(int(cp.cuda.Device().attributes["MultiProcessorCount"]))
    return _SM_COUNT[0]
