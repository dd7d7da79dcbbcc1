"""Turning generate()'s and submit()'s arguments into Requests, refusing in the caller's
thread, before any step runs, whatever cannot be served whole (one policy for context
overflow and KV exhaustion: raise)."""
from __future__ import annotations

import numpy as np

from vt.engine.errors import KVCacheExhaustedError, PromptTooLongError, RequestTooLargeError
from vt.engine.requests import Request
from vt.engine.scheduler import kv_blocks_needed
from vt.sampling.params import MAX_MIN_TOKENS_STOPS
from vt.step.contract import GREEDY, KVGeometry, SamplingParams


def make_requests(prompts, max_new_tokens, stop_token, sampling, geo: KVGeometry, vocab: int,
                  kv_capacity: int, *, speculative: int = 0) -> list[Request]:
    """Validated Requests (index = the prompt's position). stop_token: None, one token id or
    a collection of them (any of them ends the request; a min_tokens request cannot sample
    them before it has min_tokens tokens). speculative: k of the engine's speculative decoding
    (0: none): requests have no logprobs, penalties, min_tokens or grammar (a verify step
    samples the model's own logits, and its record holds its tokens), and hold KV for k more
    positions."""
    prompts = list(prompts)
    budgets = _per_prompt(max_new_tokens, len(prompts), "max_new_tokens")
    samplings = _per_prompt(GREEDY if sampling is None else sampling, len(prompts), "sampling")
    stops = stop_tokens(stop_token, vocab)
    reqs = []
    for i, (p, max_new, sp) in enumerate(zip(prompts, budgets, samplings)):
        if isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer)) or max_new < 1:
            raise ValueError(f"max_new_tokens must be positive ints, got {max_new!r} for prompt {i}")
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling for prompt {i} must be a vt.SamplingParams, got "
                            f"{type(sp).__name__}")
        try:
            sp.check_vocab(vocab)
        except ValueError as e:
            raise ValueError(f"sampling for prompt {i}: {e}") from None
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of token ids, got "
                             f"shape {arr.shape} dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        _check_min_tokens(i, sp, int(max_new), stops)
        if speculative:
            check_speculative_sampling(i, sp)
        _check_fits(i, arr.size, int(max_new), geo, kv_capacity, speculative)
        reqs.append(Request(i, arr.astype(np.int32), int(max_new), stops, sp))
    return reqs


def stop_tokens(stop_token, vocab: int) -> tuple[int, ...]:
    """None -> (); an id (a 0-d array too) -> (id,); a collection of ids -> sorted unique ids."""
    if stop_token is None:
        return ()
    if isinstance(stop_token, np.ndarray) and stop_token.ndim == 0:
        stop_token = stop_token[()]   # a 0-d array is its one value (an id, or refused below)
    many = not isinstance(stop_token, (int, np.integer))
    values = list(stop_token) if many and isinstance(stop_token, (list, tuple, set, frozenset,
                                                                  np.ndarray)) else [stop_token]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < vocab:
            raise ValueError(f"stop_token must be a token id in [0, {vocab}), a collection of "
                             f"them, or None, got {stop_token!r}")
    return tuple(sorted({int(v) for v in values}))


def check_one_request(max_new_tokens, sampling) -> None:
    """submit() serves one prompt: one budget and one SamplingParams or None, not generate()'s
    per-prompt lists (a list of one would otherwise pass as "one per prompt")."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"submit: sampling must be a vt.SamplingParams or None (one request; "
                        f"generate() takes one per prompt), got {type(sampling).__name__}")
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        raise TypeError(f"submit: max_new_tokens must be an int (one request; generate() "
                        f"takes one per prompt), got {type(max_new_tokens).__name__}")


def check_speculative_sampling(i: int, sp: SamplingParams) -> None:
    """Speculative decoding serves greedy and sampled requests (temperature, top_k, top_p,
    min_p, seed), without logprobs, grammar, penalties or min_tokens."""
    if sp.logprobs is not None:
        raise ValueError(f"sampling for prompt {i}: logprobs={sp.logprobs} with speculative "
                         f"decoding, which returns no logprobs")
    if sp.grammar is not None:
        raise ValueError(f"sampling for prompt {i}: a grammar with speculative decoding, which "
                         f"verifies drafts without grammar masks")
    if sp.penalized:
        raise ValueError(f"sampling for prompt {i}: penalties or logit_bias with speculative "
                         f"decoding, whose acceptance reads the model's own logits")
    if sp.min_tokens:
        raise ValueError(f"sampling for prompt {i}: min_tokens={sp.min_tokens} with speculative "
                         f"decoding, whose verify step samples several tokens of a row at once")


def _check_min_tokens(i: int, sp: SamplingParams, max_new: int, stops: tuple) -> None:
    """min_tokens at most max_new_tokens (vLLM's rule), and stop tokens few enough for the
    sampler's per-row ban list."""
    if sp.min_tokens > max_new:
        raise ValueError(f"sampling for prompt {i}: min_tokens={sp.min_tokens} exceeds "
                         f"max_new_tokens={max_new}")
    if sp.min_tokens and len(stops) > MAX_MIN_TOKENS_STOPS:
        raise ValueError(f"sampling for prompt {i}: min_tokens={sp.min_tokens} with "
                         f"{len(stops)} stop tokens; at most {MAX_MIN_TOKENS_STOPS} can be banned")


def _check_fits(i: int, prompt_len: int, max_new: int, geo: KVGeometry, kv_capacity: int,
                k: int = 0) -> None:
    """The last generated token needs no KV slot: a request occupies prompt + max_new - 1
    (+ k with speculation: kv_blocks_needed)."""
    if prompt_len > geo.max_context:
        raise PromptTooLongError(f"prompt {i} has {prompt_len} tokens; the context holds "
                                 f"{geo.max_context}: shorten the prompt")
    if prompt_len + max_new - 1 > geo.max_context:
        raise RequestTooLargeError(
            f"request {i}: prompt {prompt_len} + max_new_tokens {max_new} - 1 = "
            f"{prompt_len + max_new - 1} tokens exceed the context of {geo.max_context}: lower "
            f"max_new_tokens to at most {geo.max_context - prompt_len + 1}")
    need = kv_blocks_needed(prompt_len, max_new, geo, k)
    if need > kv_capacity:
        extra = f", {k} speculative" if k else ""
        raise KVCacheExhaustedError(
            f"request {i} needs {need} KV blocks (prompt {prompt_len} + {max_new} new tokens{extra}, "
            f"block size {geo.block_size}) but the whole cache has {kv_capacity}: lower "
            f"max_new_tokens or build the model with more KV blocks")


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
        if len(values) != n:
            raise ValueError(f"{len(values)} {name} values for {n} prompts")
        return values
    return [value] * n
