"""vt: decode steps as captured CUDA graphs, with the host's next-step preparation overlapped
with the GPU's replay of the current one, safely (slot ring, drain skip, pool warm-up).

The heavy pieces are imported lazily so that `import vt` stays cheap and never touches CUDA.
"""
__version__ = "0.1.0"

_LAZY = {
    "get_backend": "vt.backend",
    "available_backends": "vt.backend",
    "ModelConfig": "vt.bundled",
    "PRESETS": "vt.bundled",
    "HybridModel": "vt.bundled",
    "init_weights": "vt.bundled",
    "ExecutorConfig": "vt.config",
    "MODES": "vt.config",
    "Engine": "vt.engine.engine",
    "Progress": "vt.engine.engine",
    "StartUpProgress": "vt.engine.engine",
    "ForwardModel": "vt.forward.user",
    "KVGeometry": "vt.step.contract",
    "SamplingParams": "vt.sampling",
    "DecodeInputs": "vt.step.contract",
    "RequestResult": "vt.engine.requests",
    "RequestHandle": "vt.engine.handle",
    "RequestTooLargeError": "vt.engine.errors",
    "EngineBusyError": "vt.engine.errors",
    "ClosedError": "vt.backend.errors",
    "VtError": "vt.errors",
}

__all__ = ["__version__", *_LAZY]


def __dir__():
    """The public names (lazy ones included), so that dir(vt) and completion list them."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vt' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)
