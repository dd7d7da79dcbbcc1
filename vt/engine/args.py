"""The checks of Engine(...)'s and generate()'s own arguments (the requests themselves are
vt/engine/submit.py's): a wrong type is a TypeError and a wrong value a ValueError, each naming the
argument, raised before anything is allocated or launched."""
from __future__ import annotations

from vt.config import ExecutorConfig
from vt.validate import integer

_BACKEND_CALLS = ("stream", "event", "empty", "pinned_empty", "launch", "capture")


def check_engine_args(backend, config, record_logits, max_prefill_tokens, profile,
                      start_up_progress=None) -> None:
    missing = [c for c in _BACKEND_CALLS if not callable(getattr(backend, c, None))]
    if missing:
        raise TypeError(f"Engine: backend must be a vt backend (vt.backend.get_backend()), got "
                        f"{type(backend).__name__} (it lacks {', '.join(missing)})")
    if config is not None and not isinstance(config, ExecutorConfig):
        raise TypeError(f"Engine: config must be a vt.ExecutorConfig or None, got "
                        f"{type(config).__name__}")
    for name, value in (("record_logits", record_logits), ("profile", profile)):
        if not isinstance(value, bool):
            raise TypeError(f"Engine: {name} must be a bool, got {value!r}")
    if max_prefill_tokens is not None:
        integer("Engine: max_prefill_tokens (None: the default)", max_prefill_tokens, 1)
    if start_up_progress is not None and not callable(start_up_progress):
        raise TypeError(f"Engine: start_up_progress must be a callable or None, got "
                        f"{type(start_up_progress).__name__}")


def check_generate_args(prompts, progress) -> None:
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"generate: prompts must be a list of token-id sequences, got "
                        f"{type(prompts).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"generate: progress must be a callable or None, got {type(progress).__name__}")


def check_speculative_args(speculative, record_logits, tensor_parallel) -> None:
    """Engine(..., speculative=...): a SpeculativeConfig, on one device, without recorded
    logits (a verify step keeps one row of logits per row, not one per token)."""
    if speculative is None:
        return
    from vt.forward.speculative import SpeculativeConfig
    if not isinstance(speculative, SpeculativeConfig):
        raise TypeError(f"Engine: speculative must be a vt.forward.speculative.SpeculativeConfig "
                        f"or None, got {type(speculative).__name__}")
    if record_logits:
        raise ValueError("Engine: record_logits=True with speculative decoding: a verify step "
                         "keeps the logits of one position per row, not of every token")
    if tensor_parallel != 1:
        raise ValueError(f"Engine: tensor_parallel={tensor_parallel} with speculative decoding, "
                         f"which runs on one device")
