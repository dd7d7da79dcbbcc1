"""vt.torch: PyTorch forwards on vt's step contract (the optional extra: pip install ".[torch]").

TorchForwardModel runs a torch forward(inputs, logits_out) as a vt step model; vt.torch.llama
is a Llama-family decoder written on that contract, loading Hugging Face checkpoints
(vt.torch.hf). docs/torch.md says what a captured torch forward may and may not do.
"""
from vt.torch.capture import TorchCaptureError
from vt.torch.forward import TorchForwardModel, torch_device
from vt.torch.views import TorchInputs

__all__ = ["TorchCaptureError", "TorchForwardModel", "TorchInputs", "torch_device"]
