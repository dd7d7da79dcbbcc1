"""Which step model the engine drives for what the user passed (the one place that knows
both the user-forward adapter and the bundled model's)."""
from __future__ import annotations

from vt.step.contract import StepModel


def as_step_model(be, model_or_forward):
    """The step model the runner drives: a vt.step.StepModel (ForwardModel, an adapter) as
    is, a vt.bundled.HybridModel adapted."""
    from vt.bundled import HybridModel
    if isinstance(model_or_forward, StepModel):
        return model_or_forward
    if isinstance(model_or_forward, HybridModel):
        from vt.forward.hybrid import HybridStepModel
        return HybridStepModel(be, model_or_forward)
    raise TypeError(f"Engine needs a vt.bundled.HybridModel or a vt.ForwardModel wrapping a "
                    f"user-written forward, got {type(model_or_forward).__name__}; wrap a bare "
                    f"forward as ForwardModel(be, forward, vocab=..., token_table=..., geometry=...)")
