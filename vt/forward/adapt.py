"""Which step model the engine drives for what the user passed (the one place that knows
both the user-forward adapter and the bundled model's)."""
from __future__ import annotations


def as_step_model(be, model_or_forward):
    """The step model the runner drives: one already (ForwardModel, an adapter) as is, a
    vt.model.HybridModel adapted."""
    if all(hasattr(model_or_forward, a) for a in ("geometry", "pad", "vocab", "decode", "prefill", "sample")):
        return model_or_forward
    if all(hasattr(model_or_forward, a) for a in ("decode", "prefill", "sample", "token_table")):
        from vt.forward.hybrid import HybridStepModel
        return HybridStepModel(be, model_or_forward)
    raise TypeError(f"Engine needs a vt.model.HybridModel or a vt.ForwardModel wrapping a "
                    f"user-written forward, got {type(model_or_forward).__name__}; wrap a bare "
                    f"forward as ForwardModel(be, forward, vocab=..., token_table=..., geometry=...)")
