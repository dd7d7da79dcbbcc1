"""The speculative step's CUDA source (vt/forward/spec_kernels.py: CODE) compiled as C++ and run
on the CPU, one thread after another, so that each kernel's run_cupy (its launch: the
arguments, their order, the grid) can be checked against its numpy twin without a GPU.

The kernels use no shared memory, no barrier and no atomics, and their threads write
disjoint elements, so running the threads in sequence is one of the interleavings a GPU may
run. `cuda_function_on_cpu` stands in for vt.backend.nvrtc.cuda_function; numpy stands in for
CuPy (the slicing and copies a run_cupy makes are array operations both libraries share).
Every array a launch passes must be a C-contiguous array of its pointer's type (int32,
float32 or uint64: a kernel indexes its pointer as one), and the arguments must match the
kernel's signature in number and kind.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np

PRELUDE = r"""
struct vt_dim3 { unsigned x, y, z; };
extern "C" { vt_dim3 blockIdx, blockDim, threadIdx; }
#define __global__
"""


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def compiler() -> str | None:
    return shutil.which("g++")


def build(code: str, workdir) -> ctypes.CDLL:
    """CODE with the prelude, compiled by g++ into a shared library in `workdir`."""
    src, lib = workdir / "kernels.cpp", workdir / "kernels.so"
    src.write_text(PRELUDE + code)
    subprocess.run([compiler(), "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


POINTEES = {"int": np.int32, "float": np.float32, "unsigned long long": np.uint64}


def signatures(code: str) -> dict[str, list]:
    """kernel name -> each parameter's kind: the numpy dtype its pointer points at (int*,
    float*, unsigned long long*), or "int"."""
    out = {}
    for name, params in re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", code):
        kinds = []
        for p in params.split(","):
            p = " ".join(p.split())
            ptr = re.fullmatch(r"(?:const )?(int|float|unsigned long long)\* \w+", p)
            if ptr:
                kinds.append(np.dtype(POINTEES[ptr.group(1)]))
            elif re.fullmatch(r"int \w+", p):
                kinds.append("int")
            else:
                raise ValueError(f"{name}: parameter {p!r} is neither a pointer to "
                                 f"{', '.join(POINTEES)} nor int")
        out[name] = kinds
    return out


def cuda_function_on_cpu(lib: ctypes.CDLL, code: str):
    """A stand-in for vt.backend.nvrtc.cuda_function(code, name): the kernel `name` of the
    compiled `lib`, launched as kernel(grid, block, args) by running every thread in turn."""
    sigs = signatures(code)
    block_idx, block_dim, thread_idx = (Dim3.in_dll(lib, n) for n in
                                        ("blockIdx", "blockDim", "threadIdx"))

    def cuda_function(source: str, name: str):
        assert source == code, "a launch compiled another source"
        kinds, fn = sigs[name], getattr(lib, name)

        def launch(grid, block, args):
            if len(args) != len(kinds):
                raise TypeError(f"{name}: {len(args)} arguments for {len(kinds)} parameters")
            c_args = []
            for i, (a, kind) in enumerate(zip(args, kinds)):
                if kind != "int":
                    if not (isinstance(a, np.ndarray) and a.dtype == kind
                            and a.flags.c_contiguous):
                        raise TypeError(f"{name}: argument {i} must be a C-contiguous {kind} "
                                        f"array, got {type(a).__name__} "
                                        f"{getattr(a, 'dtype', '')} {getattr(a, 'strides', '')}")
                    c_args.append(ctypes.c_void_p(a.ctypes.data))
                else:
                    if not isinstance(a, np.int32):
                        raise TypeError(f"{name}: argument {i} must be an np.int32, got {a!r}")
                    c_args.append(ctypes.c_int(int(a)))
            (gx,), (bx,) = grid, block
            block_dim.x, block_dim.y, block_dim.z = bx, 1, 1
            for b in range(gx):
                for t in range(bx):
                    block_idx.x, thread_idx.x = b, t
                    fn(*c_args)
        return launch
    return cuda_function
