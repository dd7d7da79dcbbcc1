"""Every CUDA kernel of vt compiles for sm_90 with NVRTC, fp16 and bf16, without a GPU.

NVRTC comes from PyPI with the `test` extra (cuda-bindings' nvrtc module over the
nvidia-cuda-nvrtc library of `cuda-toolkit[nvrtc]`), so CI, which has no GPU, compiles every
kernel on every push. Each build must give an sm_90 cubin holding every kernel of its source.
"""
import importlib
import re

import pytest

from vt.bundled.kernels import _common, attention, embedding, gdn, gemm, kvcache, mlp, moe, norm, rope

SOURCES = {
    "gather f16->f32": (embedding._CODE, dict(IN_F32=0, OUT_F32=1)),
    "gather f32->f32": (embedding._CODE, dict(IN_F32=1, OUT_F32=1)),
    "rmsnorm f32 in": (norm._CODE, dict(IN_F32=1)),
    "rmsnorm storage in": (norm._CODE, dict(IN_F32=0)),
    "rope": (rope._CODE, {}), "kv_write": (kvcache._CODE, {}),
    "attention D=128": (attention._CODE, dict(LPK=16, EPL=8, G=4)),
    "attention D=32": (attention._CODE, dict(LPK=4, EPL=8, G=2)),
    "attention D=64 G=4": (attention._CODE, dict(LPK=8, EPL=8, G=4)),
    "attention D=256 G=8": (attention._CODE, dict(LPK=32, EPL=8, G=8)),
    "attention D=96 G=1": (attention._CODE, dict(LPK=8, EPL=12, G=1)),
    "gdn 128x128": (gdn._CODE, dict(DK=128, DV=128)), "gdn 32x32": (gdn._CODE, dict(DK=32, DV=32)),
    "gdn 64x32": (gdn._CODE, dict(DK=64, DV=32)), "gdn 256x256": (gdn._CODE, dict(DK=256, DV=256)),
    "silu_mul": (mlp._CODE, {}), "moe": (moe._CODE, {}),
    "routed_ptrs": (gemm._PTRS, {}),
}
# Kernel sources compiled by cupy.RawKernel as they are (no prelude, no options); the sampler's
# own compile test is tests/sampling/test_sampler_compile.py.
RAW_SOURCES = {"busy_wait": "vt.backend.cuda._spin._SOURCE"}
# Modules whose string constants hold CUDA kernels (each kernel must be compiled above).
KERNEL_MODULES = [f"vt.bundled.kernels.{m}" for m in ("attention", "embedding", "gdn", "gemm", "kvcache",
                                                    "mlp", "moe", "norm", "rope")] + ["vt.backend.cuda._spin"]
ARCH = "sm_90"
_KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(')


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()
        return nvrtc
    except Exception as exc:  # noqa: BLE001 (cuda-bindings or libnvrtc missing)
        pytest.fail(f"NVRTC unavailable ({type(exc).__name__}: {exc}); install the test extra: "
                    f"python3 -m pip install '.[test]'")


def _cubin(source: str, options) -> bytes:
    """NVRTC's cubin for `source` (fails the test with NVRTC's log if it does not compile)."""
    nvrtc = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    assert err == ok, err
    try:
        opts = [o.encode() for o in (*options, f"-arch={ARCH}")]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != ok:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            pytest.fail(f"{err}: {log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        assert err == ok, err
        cubin = b" " * size  # the binding writes into this buffer
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        assert err == ok, err
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _assert_holds_kernels(cubin: bytes, source: str):
    names = _KERNEL.findall(source)
    assert names, "no kernel found in the source"
    assert cubin[:4] == b"\x7fELF", "NVRTC gave no ELF cubin"
    for name in names:  # each kernel's machine code is an ELF section .text.<name>
        assert f".text.{name}\0".encode() in cubin, f"{name} is not in the {ARCH} cubin"


@pytest.mark.parametrize("bf16", [0, 1], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(SOURCES))
def test_kernel_source_compiles_for_sm90(name, bf16):
    """NVRTC builds the kernel with the same prelude and options CuPy is given."""
    code, defines = SOURCES[name]
    _assert_holds_kernels(_cubin(_common.PRELUDE + code, _common.nvrtc_options(bf16, defines)), code)


@pytest.mark.parametrize("name", list(RAW_SOURCES))
def test_raw_kernel_compiles_for_sm90(name):
    module, attr = RAW_SOURCES[name].rsplit(".", 1)
    code = getattr(importlib.import_module(module), attr)
    _assert_holds_kernels(_cubin(code, ()), code)


def test_every_kernel_is_compiled_here():
    """A kernel added to a module without a line above fails here, not in CI's blind spot."""
    listed = {n for code, _ in SOURCES.values() for n in _KERNEL.findall(code)}
    for path in RAW_SOURCES.values():
        module, attr = path.rsplit(".", 1)
        listed |= set(_KERNEL.findall(getattr(importlib.import_module(module), attr)))
    found = {n for m in KERNEL_MODULES for v in vars(importlib.import_module(m)).values()
             if isinstance(v, str) for n in _KERNEL.findall(v)}
    assert found - listed == set()
    assert {"gdn", "paged_attn_split", "paged_attn_combine", "vt_busy_wait"} <= found
