"""vt serve --quantization fp8: the flag reaches vt.torch.hf.load (the served decoder holds FP8
projections) and is refused where it cannot apply, in one line."""
import pytest

torch = pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")
pytest.importorskip("transformers", reason="the tiny checkpoint's tokenizer needs transformers")

from tools import tiny_checkpoint  # noqa: E402
from vt.serve.model_source import load_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint.build(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def test_load_checkpoint_quantizes_at_load(sim_backend, checkpoint):
    """quantization="fp8": every projection FP8, the head in the served dtype."""
    loaded = []
    load_checkpoint(sim_backend, checkpoint, max_seqs=2, max_context=64, quantization="fp8",
                    wrap_forward=lambda m: loaded.append(m) or m)
    module, = loaded
    assert module.quantization == "fp8"
    assert module.layers[0].mlp.gate_up.qweight.dtype == torch.float8_e4m3fn
    assert module.head_weight().dtype == torch.float32


def test_the_start_up_notes_say_what_runs_in_fp8(sim_backend, checkpoint):
    """A line for FP8 projections and an FP8 KV cache; none for a model in its dtype."""
    notes = {}
    for q, kv in ((None, "auto"), ("fp8", "auto"), ("fp8", "fp8"), (None, "fp8")):
        served = load_checkpoint(sim_backend, checkpoint, max_seqs=2, max_context=64,
                                 quantization=q, kv_cache_dtype=kv)
        notes[q, kv] = [n for n in served.notes if "FP8" in n]
        served.close()
    assert notes[None, "auto"] == []
    assert notes["fp8", "auto"] == ["FP8 (e4m3) projections quantized at load, a scale per "
                                    "output channel; the rest in float32"]
    assert notes["fp8", "fp8"] == ["FP8 (e4m3) projections quantized at load, a scale per "
                                   "output channel and an FP8 (e4m3) KV cache, K and V scales "
                                   "1.0 per layer; the rest in float32"]
    assert notes[None, "fp8"] == ["an FP8 (e4m3) KV cache, K and V scales 1.0 per layer; the "
                                  "rest in float32"]


def test_an_fp8_checkpoints_note_names_its_scales():
    from vt.serve.model_source import precision_note
    assert precision_note("block", None, "bfloat16", "auto") == (
        "the checkpoint's FP8 (e4m3) projections, a scale per 128 x 128 block; the rest in "
        "bfloat16")
    assert precision_note("tensor", "fp8", "bfloat16", "auto").startswith(
        "the checkpoint's FP8 (e4m3) projections, a scale per tensor")


def test_quantization_refusals(sim_backend, checkpoint):
    """Tensor parallelism and an unknown scheme are refused by name."""
    with pytest.raises(ValueError, match="quantization 'fp8' runs in one process"):
        load_checkpoint(sim_backend, checkpoint, max_seqs=2, tensor_parallel=2,
                        quantization="fp8")
    with pytest.raises(ValueError, match="quantization='int4' is not supported"):
        load_checkpoint(sim_backend, checkpoint, max_seqs=2, quantization="int4")


def test_the_cli_refuses_quantization_of_a_preset(capsys):
    """--quantization with --preset: a usage error naming both."""
    from vt.cli.main import main
    assert main(["serve", "--preset", "tiny", "--quantization", "fp8"]) == 2
    assert "--quantization needs --model" in capsys.readouterr().err
