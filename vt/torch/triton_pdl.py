"""Programmatic dependent launch (PDL) for vt's Triton kernels on Hopper and newer GPUs
(imported only on CUDA: this module needs Triton).

A kernel launched with PDL may start while the kernel before it on the stream still runs.
Its programs become resident, load what no earlier kernel writes (weights), and then wait in
griddepcontrol.wait until the kernel before has completed and its writes are visible. The
kernel before lets the next one launch early with griddepcontrol.launch_dependents. A one-row
decode step is about 260 short kernels in a row (8 in each of the 8B shape's 32 layers, then
the head); PDL hides the gap between one kernel's end and the next one's start, and the
next one's first weight loads, behind the kernel before. A CUDA graph captures the launches
as programmatic edges.

Every kernel that takes PDL keeps two rules:
- it calls wait(PDL) in every program before it loads anything that a kernel still running
  may write, and before any store: a store may land in memory that an earlier kernel still
  reads (torch's allocator hands a freed buffer to the next op, in a capture too), and a
  kernel's wait covers the kernels before the one it waits on only because that one waited
  too. Those still running can reach back to the last kernel launched without PDL, so what
  a kernel may load before its wait is what none of them writes: weights, the step's inputs,
  and its layer's KV cache as earlier steps left it (vt.torch.triton_attention's
  _rope_split);
- it calls launch_next(PDL), which lets the next kernel's programs become resident; the
  next kernel still waits for this one's completion before it reads.
A kernel launched without PDL (torch's ops, vt's sampler) waits for the whole of the kernel
before it, as always, so the kernels around vt's need nothing.

launch_options(device, rows) is what a launch passes: PDL for a kernel over one row (every
kernel of a one-row decode step), and for vt.torch.triton_fp8's W8A8 linear and its
quantizations at any row count (any_rows), on a GPU of compute capability 9.0 or newer, unless
VT_TRITON_PDL=0 in the environment (read when this module is imported), which launches every
kernel the ordinary way (for comparison, and to rule PDL out when bisecting). One row only,
by measurement on an H100 (docs/torch.md): the 8B shape's one-row step is 2.3 % faster with
PDL, but its steps of 8 and 32 rows were 10-16 % and 1.6 % slower with PDL on their kernels
too (not broken down further; at 32 rows cuBLAS's projections take no PDL, so the small
kernels between them alone made that step slower). An FP8 step of 32 rows runs W8A8 Triton
projections instead: with PDL on every kernel it measured 1.2 % faster (5.81 against 5.88 ms,
FP8 cache, 2,048 live tokens), where the bf16 one measured 0.4 % slower again; the W8A8 linear
and the quantizations around it take PDL at every row count.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vt import env

ENABLED: bool = env.get("VT_TRITON_PDL")


def launch_options(device: torch.device, rows: int, *, any_rows: bool = False) -> dict:
    """The PDL constexpr and launch option for a kernel of a rows-row step on device (off
    but on CUDA: Triton's CPU interpreter runs these kernels on CPU tensors in the tests).
    any_rows: PDL at every row count (vt.torch.triton_fp8's W8A8 linear and the quantizations
    around it)."""
    if (ENABLED and (rows == 1 or any_rows) and device.type == "cuda" and _hopper_or_newer(
            device.index if device.index is not None else torch.cuda.current_device())):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel before has completed and its writes are visible (PDL only)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel on the stream launch now (PDL only); it still waits for this one
    before it reads."""
    if PDL:
        gdc_launch_dependents()
