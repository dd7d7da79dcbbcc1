"""`vt bench --workload torch`: refused without a GPU; on one, the hand-written CUDA-graph
peer around the same module samples the tokens vt's engines sample."""
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

from vt.backend import get_backend  # noqa: E402
from vt.cli.bench import torch_workload  # noqa: E402
from vt.cli.bench.cli import main  # noqa: E402
from vt.torch.llama import LlamaConfig  # noqa: E402

from _torch_util import generate  # noqa: E402

pytestmark = pytest.mark.torch_allocator


def test_the_torch_workload_is_refused_on_the_sim(capsys):
    """A usage error (exit 2) naming the flag, before any model is built."""
    assert main(["--workload", "torch", "--backend", "sim"]) == 2
    assert "--workload torch needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["torch_sync", "torch_async"])
def test_the_graph_loop_peer_samples_vts_tokens(variant):
    """A small bf16 decoder: the peer's greedy tokens == vt ring's, prompt for prompt."""
    be = get_backend("cuda")
    try:
        cfg = LlamaConfig(vocab=256, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                          head_dim=32)
        module, model = torch_workload.build(be, 4, 48, seed=0, cfg=cfg)
        prompts = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(1)).tolist()
        peer = torch_workload.TorchLlamaPeer(module, 4)
        got = peer.run(variant, prompts, 20)["tokens"]
        peer.close()
        want = generate(be, model, "ring", prompts, 21, sizes=(4,))
        assert got == want
    finally:
        torch.cuda.synchronize()
        be.close()
