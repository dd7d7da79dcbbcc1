"""Forward adapters: what turns a model into the step model the runner drives. `ForwardModel`
wraps a user-written decode forward; `HybridStepModel` the bundled vt.bundled.HybridModel."""
from vt.forward.adapt import as_step_model
from vt.forward.user import ForwardModel

__all__ = ["ForwardModel", "as_step_model"]
