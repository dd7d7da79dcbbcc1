"""Every sampler kernel compiles for sm_90 with NVRTC (no GPU needed), with and without float4
loads, with the options the Sampler builds it with."""
import re

import pytest

from vt.backend.nvrtc import nvrtc_options
from vt.sampling import kernels

from tests.bundled.test_cuda_compile import _assert_holds_kernels, _cubin

_KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(')


@pytest.mark.parametrize("vec4", [0, 1], ids=["scalar", "float4"])
def test_sampler_kernels_compile_for_sm90(vec4):
    _assert_holds_kernels(_cubin(kernels.CODE, nvrtc_options(dict(VEC4=vec4))), kernels.CODE)


def test_every_sampler_kernel_is_launched():
    """The kernels in the source are exactly the ones the Sampler launches."""
    assert set(_KERNEL.findall(kernels.CODE)) == set(kernels.KERNELS)
