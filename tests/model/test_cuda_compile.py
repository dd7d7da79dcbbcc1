"""Every CUDA kernel source compiles for sm_90 with NVRTC, fp16 and bf16, without a GPU
(skipped where libnvrtc is not installed: pip install nvidia-cuda-nvrtc)."""
import pytest

from vt.model.kernels import (_common, attention, embedding, gdn, kvcache, mlp, moe, norm, rope, sampling)

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
    "silu_mul": (mlp._CODE, {}), "moe": (moe._CODE, {}), "sample": (sampling._CODE, {}),
}


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception as exc:  # noqa: BLE001 (no CuPy, or no libnvrtc on this machine)
        pytest.skip(f"NVRTC unavailable: {type(exc).__name__}")


@pytest.mark.parametrize("bf16", [0, 1], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(SOURCES))
def test_kernel_source_compiles_for_sm90(name, bf16):
    """NVRTC accepts the kernel with the same prelude and options CuPy is given."""
    nvrtc = _nvrtc()
    code, defines = SOURCES[name]
    prog = nvrtc.createProgram(_common.PRELUDE + code, "k.cu", [], [])
    opts = ["-std=c++17", f"-DVT_BF16={bf16}", "-arch=sm_90"] + [f"-D{k}={v}" for k, v in defines.items()]
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
