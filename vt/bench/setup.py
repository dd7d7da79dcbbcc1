"""What the workloads and `vt run` start from: the backend (by name, "auto" resolved), a bundled
preset checked against the context it must hold, a model with seeded random weights, and
random prompts. Each refusal is a UsageError naming the value."""
from __future__ import annotations

import math
import re

import numpy as np

from vt.bench.errors import UsageError


def what_to_do(error: Exception, who: str) -> str:
    """The end of a usage message: a VT_* variable named in the error is the thing to fix."""
    return "fix or unset the variable" if re.search(r"\bVT_\w+", str(error)) else f"see {who} --help"


def backend_name(name: str) -> str:
    """What get_backend(name) would open ("auto" resolved), without opening it."""
    if name != "auto":
        return name
    from vt.backend import available_backends
    return "cuda" if "cuda" in available_backends() else "sim"


def pick_backend(name: str, sim_delay_ms: float = 0.0, *, who: str = "vt"):
    """get_backend(name), with the sim-only per-op device delay when one is asked for; a bad
    name or option, a bad VT_POOL_DEBUG or cuda without a GPU is a UsageError."""
    from vt.backend import available_backends, get_backend
    try:
        return get_backend(name, **({"device_delay_s": sim_delay_ms / 1e3} if sim_delay_ms else {}))
    except ValueError as e:   # get_backend's own checks, made before it opens anything
        raise UsageError(f"{who}: {e}; {what_to_do(e, who)}") from None
    except RuntimeError as e:
        if name == "cuda" and "cuda" not in available_backends():
            raise UsageError(f"{who}: {e}; run with --backend sim (or auto) here") from None
        raise


def _weight_gb(cfg) -> float:
    from vt.bundled.weights import weight_shapes
    return sum(math.prod(shape) * np.dtype(dt).itemsize
               for shape, dt in weight_shapes(cfg).values()) / 1e9


def pick_preset(backend: str, preset: str | None, context: int, who: str, *, force: bool = False):
    """(name, ModelConfig) for backend "cuda" or "sim": the given preset, or the backend's
    default (bench-dense on cuda, tiny-dense on sim). UsageError if it is unknown, if a
    request of `context` = prompt + new tokens does not fit its max_context (the last new
    token needs no KV slot: prompt + new - 1 must fit, as generate() counts), or if it is a bench
    preset on the sim backend and not `force`."""
    from vt.bundled import PRESETS
    if preset is None:   # not given; an empty name is a name, and unknown
        preset = "bench-dense" if backend == "cuda" else "tiny-dense"
    name = preset
    if name not in PRESETS:
        raise UsageError(f"{who}: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    # The last new token needs no KV slot: prompt + new - 1 tokens must fit, as in generate().
    if context - 1 > cfg.max_context:
        raise UsageError(f"{who}: prompt + new tokens - 1 = {context - 1} exceeds {name}'s "
                         f"max_context {cfg.max_context}; use a shorter prompt or fewer new tokens")
    # Bench presets are sized for the GPU's bandwidth: numpy on the CPU needs gigabytes of
    # host memory and minutes per step, with nothing printed meanwhile.
    if backend == "sim" and name.startswith("bench-") and not force:
        raise UsageError(f"{who}: preset {name} is a GPU benchmark model ({_weight_gb(cfg):.1f} GB "
                         f"of weights, several times that in host memory while they are made, "
                         f"minutes per step on the CPU) and this run uses the sim backend; use "
                         f"tiny-dense or tiny-moe, or add --force to run it anyway")
    return name, cfg


def resolve_preset(be, preset: str | None, context: int, who: str, *, force: bool = True):
    """pick_preset for an open backend; exits with the message on bad input."""
    return pick_preset(be.name, preset, context, who, force=force)


def build_model(be, cfg, *, max_seqs: int, context: int, seed: int, log=lambda msg: None):
    """A HybridModel with seeded random weights and KV blocks for max_seqs sequences of
    `context` tokens each."""
    from vt.bundled import HybridModel, init_weights
    log(f"  initialising weights (seed {seed}) ...")
    weights = init_weights(cfg, seed=seed)
    log(f"  uploading the model and allocating KV cache for {max_seqs} sequences ...")
    return HybridModel(be, cfg, weights, max_seqs=max_seqs,
                       num_kv_blocks=max_seqs * -(-context // cfg.kv_block_size))


def random_prompts(rng, vocab: int, n: int, length: int) -> list[list[int]]:
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]
