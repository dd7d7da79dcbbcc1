"""vt.torch.triton_pdl: which launches take programmatic dependent launch. On CUDA it is the
kernels of one-row steps on compute capability 9.0 and newer (tests/vt_torch/
test_llama_kernels.py runs such a step with and without it on the GPU); never on CPU tensors,
which Triton's interpreter runs, and never with VT_TRITON_PDL=0."""
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install vt-graphs[torch])")
pytest.importorskip("triton", reason="vt.torch.triton_pdl needs Triton (CUDA builds of torch)")

from vt.torch import triton_pdl  # noqa: E402


def test_cpu_tensors_never_take_pdl():
    assert triton_pdl.launch_options(torch.device("cpu"), 1) == {"PDL": False}
    assert triton_pdl.launch_options(torch.device("cpu"), 32, any_rows=True) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 32])
@pytest.mark.parametrize("any_rows", [False, True])
@pytest.mark.parametrize("enabled", [True, False])
def test_cuda_launches_take_pdl_at_one_row_or_any_rows_on_hopper_only(monkeypatch, rows,
                                                                      any_rows, enabled):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    monkeypatch.setattr(triton_pdl, "ENABLED", enabled)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    want = ({"PDL": True, "launch_pdl": True} if enabled and (rows == 1 or any_rows) and hopper
            else {"PDL": False})
    assert triton_pdl.launch_options(torch.device("cuda"), rows, any_rows=any_rows) == want
