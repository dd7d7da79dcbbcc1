"""The reference hybrid decoder (GDN linear attention + full attention, dense or MoE)."""
from .config import PRESETS, ModelConfig
from .inputs import DecodeInputs, PrefillInputs, upload_decode_inputs
from vt.step.contract import SamplingParams
from .model import HybridModel
from .weights import check_weights, init_weights, load_weights, save_weights, weight_shapes

__all__ = ["ModelConfig", "PRESETS", "HybridModel", "DecodeInputs", "PrefillInputs",
           "upload_decode_inputs",
           "SamplingParams", "init_weights", "load_weights", "save_weights", "check_weights",
           "weight_shapes"]
