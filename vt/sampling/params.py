"""Per-request sampling knobs, validated on construction, and the per-row device vectors the
sampler reads them from (one entry per batch row, so requests with different knobs share one
captured graph)."""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import numpy as np

# The per-row vectors the sampler reads, in its argument order: name -> numpy dtype.
# top_k 0 means the whole vocabulary; temperature 0 means greedy.
ROW_VECTORS: dict[str, np.dtype] = {
    "temperature": np.dtype(np.float32),
    "top_k": np.dtype(np.int32),
    "top_p": np.dtype(np.float32),
    "min_p": np.dtype(np.float32),
    "seed": np.dtype(np.uint64),
    "logprobs": np.dtype(np.int32),
    "penalized": np.dtype(np.int32),
    "presence_penalty": np.dtype(np.float32),
    "frequency_penalty": np.dtype(np.float32),
    "repetition_penalty": np.dtype(np.float32),
}
# logprobs: -1 = none; n >= 0 = the sampled token's logprob and the n most likely tokens'.
NO_LOGPROBS = -1
# penalized: which of the penalize kernel's stages a row runs (bits; 0: none, the kernel returns
# at once). PENALIZE: penalties and logit bias; MIN_TOKENS: its stop tokens banned while the
# row's min_tokens are not all out (vt/sampling/penalties.py).
PENALIZE, MIN_TOKENS = 1, 2
MAX_MIN_TOKENS_STOPS = 256      # the most stop tokens a min_tokens request bans (a row's list on the device)
MAX_LOGPROBS = 20               # the most top tokens a row asks for (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 1024           # the most logit_bias entries of a request (a row's table on the device)

_SEED_END = 2**63
_TOP_K_END = 2**31              # the sampler reads top_k as int32
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"SamplingParams.{name} must be a real number, got {type(v).__name__} {v!r}")
    try:
        f = float(v)
    except OverflowError:   # a Python int past a float's range
        f = math.inf
    if not math.isfinite(f):
        beyond = isinstance(v, (int, np.integer)) or bool(np.isfinite(v))   # e.g. a longdouble
        raise ValueError(f"SamplingParams.{name}={_shown(v)} "
                         + ("is beyond a float's range" if beyond else "must be finite"))
    return f


def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


def _shown(v) -> str:
    """v for a one-line message: a huge int by its size, not its hundreds of digits."""
    if isinstance(v, (int, np.integer)) and abs(int(v)) >= 10**20:
        return f"<an int of {len(str(abs(int(v))))} digits>"
    return repr(v)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax, lowest index on ties); otherwise sample from
    softmax(logits / temperature) restricted, in this order, to the top_k most likely tokens
    (None or 0: all), the smallest most-likely prefix whose probability reaches top_p, and the
    tokens with probability >= min_p * the largest. The draws are keyed on (seed, position,
    token id) only, so a request's tokens never depend on its row, its batch or the padded size.

    The sampler reads the knobs as float32: a temperature that rounds to 0 there is greedy, and
    one so small that the largest logit / temperature overflows takes the limit, the argmax.

    Penalties and bias change the logits before all of that (vt/sampling/penalties.py), in
    vLLM's order: logit_bias (token id -> added to its logit), then repetition_penalty
    (transformers' definition: a token seen in the prompt or the output so far has its logit
    divided by it when positive, multiplied when not), then frequency_penalty * (its count in
    the output so far) + presence_penalty * (1 if it is there) subtracted (OpenAI's).

    grammar: the tokens a constrained request samples are those its grammar allows at each
    step (vt/sampling/token_mask.py), applied after penalties and bias.

    min_tokens: until the request has this many tokens its stop tokens (the engine's
    stop_token: EOS and the like) cannot be sampled, their logits -inf (vLLM's definition).

    logprobs: None (none), or n in [0, MAX_LOGPROBS]: the sampler also returns the sampled
    token's log-probability and the n most likely tokens with theirs, of the distribution it
    samples from after temperature and before top_k/top_p/min_p (log_softmax(logits /
    temperature); greedy rows: log_softmax(logits)).
    """
    temperature: float = 0.0
    # The rest by name only: a positional SamplingParams(0.8, 8, seed) of an older order would
    # otherwise land the seed in top_p.
    _: KW_ONLY
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()          # ((token id, bias), ...), or a dict of them
    min_tokens: int = 0
    # A grammar the tokens must follow (vt/sampling/token_mask.py): an object per request with
    # fill_mask(bits) (the allowed next tokens into an int32 [ceil(V / 32)] bitmask) and
    # accept(token) (the token the request sampled). Stateful: never share one between requests.
    grammar: object = field(default=None, compare=False)

    def __post_init__(self):
        t = _real("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"SamplingParams.temperature={t!r} must be >= 0 (0 = greedy)")
        with np.errstate(over="ignore"):
            t32 = np.float32(t)
        if np.isinf(t32):   # the sampler's 1 / t would be 0, and a masked token's -inf * 0 NaN
            raise ValueError(f"SamplingParams.temperature={t!r} exceeds float32's largest value "
                             f"{_FLOAT32_MAX:.7g} (the sampler reads float32)")
        if self.top_k is not None and not 0 <= _int("top_k", self.top_k) < _TOP_K_END:
            raise ValueError(f"SamplingParams.top_k={_shown(self.top_k)} must be None, 0 (all) or a "
                             f"positive int below 2**31")
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p={p!r} must be in (0, 1]")
        m = _real("min_p", self.min_p)
        if not 0 <= m < 1:
            raise ValueError(f"SamplingParams.min_p={m!r} must be in [0, 1)")
        if not 0 <= _int("seed", self.seed) < _SEED_END:
            raise ValueError(f"SamplingParams.seed={_shown(self.seed)} must be in [0, 2**63)")
        if self.logprobs is not None and not 0 <= _int("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs={_shown(self.logprobs)} must be None or in "
                             f"[0, {MAX_LOGPROBS}]")
        pres, freq = _real("presence_penalty", self.presence_penalty), _real("frequency_penalty", self.frequency_penalty)
        rep = _real("repetition_penalty", self.repetition_penalty)
        if not rep > 0:
            raise ValueError(f"SamplingParams.repetition_penalty={rep!r} must be > 0 (1: none)")
        bias = _logit_bias(self.logit_bias)
        if _int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"SamplingParams.min_tokens={_shown(self.min_tokens)} must be >= 0")
        g = self.grammar
        if g is not None and not (callable(getattr(g, "fill_mask", None)) and callable(getattr(g, "accept", None))):
            raise TypeError(f"SamplingParams.grammar must have fill_mask(bits) and accept(token), "
                            f"got {type(g).__name__}")
        # Plain Python numbers from here on: numpy scalars compare, hash and serialize the same.
        for name, v in (("temperature", t), ("top_p", p), ("min_p", m), ("seed", int(self.seed)),
                        ("top_k", None if self.top_k is None else int(self.top_k)),
                        ("logprobs", None if self.logprobs is None else int(self.logprobs)),
                        ("presence_penalty", pres), ("frequency_penalty", freq),
                        ("repetition_penalty", rep), ("logit_bias", bias),
                        ("min_tokens", int(self.min_tokens))):
            object.__setattr__(self, name, v)

    @property
    def penalized(self) -> bool:
        """Whether penalties or a logit bias change this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def penalize_stages(self) -> int:
        """The row's `penalized` value: PENALIZE if penalties or a bias change its logits, plus
        MIN_TOKENS if it bans its stop tokens until min_tokens."""
        return (PENALIZE if self.penalized else 0) | (MIN_TOKENS if self.min_tokens else 0)

    @property
    def greedy(self) -> bool:
        """The sampler takes the argmax: temperature 0, or one that rounds to 0 in float32."""
        return bool(np.float32(self.temperature) == 0)

    def check_vocab(self, vocab: int) -> None:
        """Raise if top_k exceeds the vocabulary (known only where the model is)."""
        if self.top_k is not None and self.top_k > vocab:
            raise ValueError(f"SamplingParams.top_k={self.top_k} exceeds the vocabulary size {vocab}")
        for tok, _ in self.logit_bias:
            if tok >= vocab:
                raise ValueError(f"SamplingParams.logit_bias names token {tok}, outside the "
                                 f"vocabulary of {vocab}")


def _logit_bias(bias) -> tuple:
    """logit_bias as ((token, bias), ...) sorted by token: plain ints and finite floats."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(_int("logit_bias token", k), _real("logit_bias value", v)) for k, v in items]
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} (logit_bias maps token ids to biases)") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"SamplingParams.logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS}")
    toks = [k for k, _ in pairs]
    if any(k < 0 for k in toks) or len(set(toks)) != len(toks):
        raise ValueError("SamplingParams.logit_bias token ids must be distinct and >= 0")
    return tuple(sorted(pairs))


GREEDY = SamplingParams()


def row_vectors(params: list[SamplingParams]) -> dict[str, np.ndarray]:
    """The sampler's per-row vectors (ROW_VECTORS) for a list of requests, one row each."""
    return {
        "temperature": np.array([p.temperature for p in params], np.float32),
        "top_k": np.array([p.top_k or 0 for p in params], np.int32),
        "top_p": np.array([p.top_p for p in params], np.float32),
        "min_p": np.array([p.min_p for p in params], np.float32),
        "seed": np.array([p.seed for p in params], np.uint64),
        "logprobs": np.array([NO_LOGPROBS if p.logprobs is None else p.logprobs for p in params],
                             np.int32),
        "penalized": np.array([p.penalize_stages for p in params], np.int32),
        "presence_penalty": np.array([p.presence_penalty for p in params], np.float32),
        "frequency_penalty": np.array([p.frequency_penalty for p in params], np.float32),
        "repetition_penalty": np.array([p.repetition_penalty for p in params], np.float32),
    }
