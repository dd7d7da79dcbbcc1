"""The bridge between HTTP requests and the engine: admission (at most `serving_conc +
max_queued` requests in the server, the rest refused with a retry hint), one Generation per
request (submit, tokens and text as they arrive, the outcome), cancellation when the client
goes away, the abort of whatever is left when the server stops, and the metrics of every
request. It also says when the engine can serve no more (engine_failure: a tensor-parallel
rank died), and bounds what a request may send (limits).

Everything here runs on the server's event loop; the engine serves from its own thread, and a
Generation awaits its tokens through RequestHandle.stream_async, which never blocks the loop.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from vt.backend.errors import ClosedError
from vt.engine.errors import KVCacheExhaustedError, PromptTooLongError, RequestTooLargeError
from vt.parallel.errors import TensorParallelError
from vt.serve.grammar import GrammarEngine
from vt.serve.metrics import ServeMetrics
from vt.serve.model_source import ServedModel
from vt.sampling.params import MAX_MIN_TOKENS_STOPS
from vt.serve.protocol import GenerationSpec, RequestError, RequestLimits
from vt.errors import VtError


class Overloaded(VtError):
    """More requests than the server takes: answered 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceClosed(VtError):
    """The server is shutting down: answered 503."""


class EngineStopped(VtError):
    """The engine can serve no more (the reason says why): answered 503 while the server
    exits (vt/serve/server.py)."""


class GenerationFailed(VtError):
    """The request's step failed on the engine (or its logits could not be sampled): 500."""


# One token's logprobs: (its id, its logprob, [(id, logprob)] of the most likely tokens).
TokenLogprobs = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None   # one per token id, when the request asks


@dataclass
class Outcome:
    finish_reason: str           # "stop", "length", or "abort" (the server closed it)
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None   # one per token id, when the request asks


class GenerationService:
    def __init__(self, engine, model: ServedModel, metrics: ServeMetrics, *, serving_conc: int,
                 max_queued: int):
        self.engine, self.model, self.metrics = engine, model, metrics
        self.capacity = serving_conc + max_queued
        self.closing = False
        self.limits = RequestLimits.for_model(model.geometry.max_context, model.text)
        # structured output's compiler over the served tokenizer (None: a preset has none)
        self.grammars = (GrammarEngine(model.text.tokenizer, model.vocab, model.eos_ids)
                         if model.text is not None else None)
        self._live: set[Generation] = set()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self._live)

    def start(self, prompt_ids: list[int], spec: GenerationSpec, prompt_param: str) -> "Generation":
        """Admit and submit one request (RequestError, Overloaded, ServiceClosed or
        EngineStopped if not)."""
        if self.closing:
            raise ServiceClosed("the server is shutting down")
        failure = self.engine_failure()
        if failure is not None:
            raise EngineStopped(failure)
        if self.in_flight >= self.capacity:
            self.metrics.rejected("overloaded")
            raise Overloaded(f"the server holds {self.in_flight} requests, its limit "
                             f"(--max-concurrency + --max-queued); retry later")
        gen = Generation(self, prompt_ids, spec, prompt_param)
        self._live.add(gen)
        return gen

    def leave(self, gen: "Generation") -> None:
        """`gen` has ended: its place in the server is free."""
        self._live.discard(gen)

    def abort_all(self) -> None:
        """End every request in the server at the engine's next step: each response still
        ends well-formed, its finish_reason "abort"."""
        for gen in list(self._live):
            gen.abort()

    def engine_failure(self) -> str | None:
        """Why the engine can take no more steps (a stopped tensor-parallel group), or None."""
        try:
            self.engine.runner.check_usable()
        except TensorParallelError as e:
            return str(e)
        return None

    def stats(self) -> dict:
        return self.engine.stats()


def _check_min_tokens(min_tokens: int, max_new: int, stops: int) -> None:
    """min_tokens within the tokens the request may have (max_tokens given or, when not, the
    rest of the context: protocol.py checked the first), and stop tokens the sampler can ban."""
    if min_tokens > max_new:
        raise RequestError(f"min_tokens={min_tokens} exceeds the {max_new} tokens the request "
                           f"may generate", param="min_tokens")
    if min_tokens and stops > MAX_MIN_TOKENS_STOPS:
        raise RequestError(f"min_tokens with {stops} stop token ids (stop_token_ids and EOS); "
                           f"at most {MAX_MIN_TOKENS_STOPS}", param="min_tokens")


class Generation:
    """One request on the engine. Iterate deltas() once; `outcome` is set when it ends."""

    def __init__(self, service: GenerationService, prompt_ids: list[int], spec: GenerationSpec,
                 prompt_param: str):
        self._service = service
        model, geo = service.model, service.model.geometry
        n = len(prompt_ids)
        if n > geo.max_context:
            raise RequestError(f"the prompt has {n} tokens; the model's context holds "
                               f"{geo.max_context}", param=prompt_param)
        max_new = spec.max_tokens if spec.max_tokens is not None else geo.max_context - n + 1
        stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(model.eos_ids))
        _check_min_tokens(spec.sampling.min_tokens, max_new, len(stops))
        self.spec, self.prompt_tokens = spec, n
        self.outcome: Outcome | None = None
        self._text = (model.text.stream(spec.stop, include_stop=spec.include_stop,
                                        skip_special_tokens=spec.skip_special_tokens,
                                        min_tokens=spec.sampling.min_tokens)
                      if model.text is not None else None)
        self._submitted = self._first_at = self._last_at = time.perf_counter()
        sampling, self._grammar = spec.sampling, None
        if spec.compiled_grammar is not None:     # this choice's own matcher
            self._grammar = service.grammars.grammar(spec.compiled_grammar)
            sampling = dataclasses.replace(sampling, grammar=self._grammar)
        try:
            self._handle = service.engine.submit(prompt_ids, max_new_tokens=max_new,
                                                 stop_token=sorted(stops) or None,
                                                 sampling=sampling)
        except PromptTooLongError:
            raise RequestError(f"the prompt has {n} tokens; the model's context holds "
                               f"{geo.max_context}", param=prompt_param) from None
        except KVCacheExhaustedError as e:
            raise RequestError(str(e), param="max_tokens") from None
        except RequestTooLargeError:
            raise RequestError(f"the prompt's {n} tokens + max_tokens {max_new} - 1 exceed the "
                               f"context of {geo.max_context}: max_tokens may be at most "
                               f"{geo.max_context - n + 1}", param="max_tokens") from None
        except ClosedError:
            raise ServiceClosed("the server is shutting down") from None
        except TensorParallelError as e:     # the group stopped since start() looked
            raise EngineStopped(str(e)) from None
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param=prompt_param) from None
        self._released = False

    async def deltas(self):
        """Text (and ids) as the tokens arrive; stops at a stop string by cancelling the
        request. GenerationFailed if its step failed. Leaving early cancels it."""
        tokens, text, sent = [], self._text, 0
        agen = self._handle.stream_async()
        try:
            async for tok in agen:
                self._last_at = time.perf_counter()
                if not tokens:
                    self._first_at = self._last_at
                tokens.append(tok)
                piece = text.push([tok]) if text is not None else ""
                # Every token is a delta, its text "" while the detokenizer holds it back (a
                # partial UTF-8 character, a possible stop string, an id the tokenizer has
                # no text for): a client sees each token when the engine made it, and the
                # ids of the deltas add up to the completion. Except, with stop strings, the
                # tokens of a partial character: a stop string found in their text when the
                # request ends cuts them, so their ids wait for the delta that settles them.
                settled = text.settled if text is not None else len(tokens)
                if settled > sent or piece:
                    yield Delta(piece, tokens[sent:settled], self._logprobs(tokens, sent, settled))
                    sent = settled
                if text is not None and text.stopped:
                    self._handle.cancel()
                    self._finish("stop", tokens[:text.tokens])
                    return
            result = self._handle.result(timeout=5.0)
            if result.finish_reason == "error":
                if self._grammar is not None and self._grammar.error is not None:
                    raise GenerationFailed(self._grammar.error)
                raise GenerationFailed(result.error or "the model's logits could not be sampled")
            tail = text.finish() if text is not None else ""
            end = text.tokens if text is not None else len(tokens)
            if tail or end > sent:
                yield Delta(tail, tokens[sent:end], self._logprobs(tokens, sent, end))
            reason = {"stop": "stop", "length": "length"}.get(result.finish_reason, "abort")
            self._finish("stop" if text is not None and text.stopped else reason, tokens[:end])
        except GenerationFailed:
            self._fail()
            raise
        except Exception as e:   # noqa: BLE001 (the step's error, reported to this request's client)
            self._fail()
            raise GenerationFailed(f"the engine step failed: {type(e).__name__}: {e}") from e
        finally:
            await agen.aclose()
            self.cancel()

    def _logprobs(self, tokens: list[int], start: int, stop: int) -> list[TokenLogprobs] | None:
        """The logprobs of tokens [start, stop) (all stored), or None when none are asked."""
        if self.spec.sampling.logprobs is None:
            return None
        return [(tokens[i], *self._handle.logprobs(i)) for i in range(start, stop)]

    def abort(self) -> None:
        """The server stops it: the engine ends it at the next step, and deltas() then ends
        with finish_reason "abort"."""
        self._handle.cancel()

    def cancel(self) -> None:
        """Stop the request at the next step (a no-op once it ended) and leave the server."""
        self._handle.cancel()
        if not self._released:
            self._released = True
            self._service.leave(self)
            if self.outcome is None:
                self._service.metrics.finished("abort", self.prompt_tokens, 0, None)

    def _finish(self, reason: str, tokens: list[int]) -> None:
        self.outcome = Outcome(reason, self.prompt_tokens, len(tokens), tokens,
                               self._logprobs(tokens, 0, len(tokens)))
        times = ((self._first_at - self._submitted, self._last_at - self._first_at, len(tokens))
                 if tokens else None)
        self._service.metrics.finished(reason, self.prompt_tokens, len(tokens), times)

    def _fail(self) -> None:
        self.outcome = Outcome("error", self.prompt_tokens, 0)
        self._service.metrics.finished("error", self.prompt_tokens, 0, None)
