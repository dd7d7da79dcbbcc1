"""The FastAPI application of `vt serve`: OpenAI's /v1/completions and /v1/chat/completions
(whole or streamed as server-sent events), /v1/models, /health and /metrics, over one
GenerationService.

A request is refused before it reaches the engine when its body is malformed or asks for
what vt cannot do (400; a chat template that refuses the messages: 400 with its message), is
larger than any prompt that fits (413), when the server is full (429 + Retry-After), closing
(503 + Retry-After) or its engine has stopped (503; /health too, and the server exits). A
request whose step fails gets a 500 (a streamed one: an error event, then [DONE]); the engine
frees its row and blocks and the server goes on serving. A client that goes away has its
request cancelled: its row and KV blocks are free again after the next step. Every answer,
errors included, is an OpenAI body.

The body is read up to its limit and a text prompt's length checked before the tokenizer runs;
the tokenizer and the chat template run in a worker thread (the tokenizer lets go of the GIL),
so a long prompt holds up neither /health nor the streams in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from vt.serve.generation import (EngineStopped, Generation, GenerationFailed, GenerationService,
                                 Overloaded, ServiceClosed)
from vt.serve.protocol import (ChatBody, CompletionBody, DetokenizeBody, RequestError, RequestLimits,
                               TokenizeBody,
                               completion_prompts, generation_spec, parse_body)
from vt.serve.responses import DONE, ResponseShape, error_body, sse, usage
from vt.serve.tools import ToolCallStream, format_of, parse_tool_calls

RETRY_AFTER_S = 1


def create_app(service: GenerationService, *, api_key: str | None = None) -> FastAPI:
    """api_key: every endpoint but /health asks for `Authorization: Bearer <api_key>` (401
    without it); None: none does."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.closing = True        # from here on: 503, until the engine is closed

    app = FastAPI(title="vt serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app, service)
    if api_key is not None:
        app.add_middleware(_BearerAuth, key=api_key)
    model = service.model

    @app.get("/version")
    async def version():
        from vt import __version__
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = parse_body(await _read_body(request, service.limits), TokenizeBody)
        _check_model(body.model, model.name)
        text = _text_of(model, "prompt" if body.prompt is not None else "messages")
        if body.prompt is not None:
            service.limits.check_prompt_chars(len(body.prompt), "prompt")
            ids = await asyncio.to_thread(text.encode, body.prompt, body.add_special_tokens)
        else:
            ids = await _chat_prompt(text, [m.dict_for_template() for m in body.messages],
                                     **body.template_variables())
        return {"count": len(ids), "max_model_len": model.geometry.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = parse_body(await _read_body(request, service.limits), DetokenizeBody)
        _check_model(body.model, model.name)
        if any(not 0 <= t < model.vocab for t in body.tokens):
            raise RequestError(f"tokens must be token ids in [0, {model.vocab})", param="tokens")
        text = _text_of(model, "tokens")
        return {"prompt": await asyncio.to_thread(text.decode, body.tokens, False)}

    @app.get("/health")
    async def health():
        failure = service.engine_failure()
        if failure is not None:
            return JSONResponse({"status": "engine_stopped", "reason": failure}, status_code=503)
        if service.closing:
            return JSONResponse({"status": "closing"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "vt",
                                            "max_model_len": model.geometry.max_context,
                                            "vocab_size": model.vocab}]}

    @app.get("/metrics")
    async def metrics():
        text = service.metrics.render(service.stats(), service.in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(await _read_body(request, service.limits), CompletionBody)
        _check_model(body.model, model.name)
        spec = await _with_grammar(service, generation_spec(body, model.vocab))
        prompts = []
        for prompt in completion_prompts(body):
            if isinstance(prompt, str):
                if model.text is None:
                    raise RequestError("this model has no tokenizer (a preset): send the prompt "
                                       "as token ids", param="prompt")
                service.limits.check_prompt_chars(len(prompt), "prompt")
                prompts.append(await asyncio.to_thread(model.text.encode, prompt))
            else:
                if min(prompt) < 0 or max(prompt) >= model.vocab:
                    raise RequestError(f"prompt token ids must be in [0, {model.vocab})",
                                       param="prompt")
                prompts.append(prompt)
        return await _respond(request, service, prompts, spec,
                              ResponseShape(model.name, chat=False, token_text=_token_text(model)),
                              "prompt")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse_body(await _read_body(request, service.limits), ChatBody)
        _check_model(body.model, model.name)
        spec = generation_spec(body, model.vocab)
        if model.text is None or not model.text.has_chat_template:
            raise RequestError("this model has no chat template (a preset, or a tokenizer "
                               "without one): use /v1/completions", param="messages")
        messages = [m.dict_for_template() for m in body.messages]
        service.limits.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        variables = body.template_variables()
        if body.tools:
            variables["tools"] = [t.for_template() for t in body.tools]
        ids = await _chat_prompt(model.text, messages, **variables)
        shape = ResponseShape(model.name, chat=True, token_text=_token_text(model))
        if body.tools and body.tool_choice != "none":
            shape.tool_format = format_of(model.text.tokenizer.chat_template)
        spec = await _with_grammar(service, spec, shape.tool_format)
        return await _respond(request, service, [ids], spec, shape, "messages")

    return app


class _BearerAuth:
    """ASGI middleware: a request to any path but /health without `Authorization: Bearer
    <key>` is answered 401 with an OpenAI error body (a plain ASGI wrapper: Starlette's
    BaseHTTPMiddleware would stand between a streamed response and its disconnect)."""

    def __init__(self, app, key: str):
        self.app, self._want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._want):
                body = json.dumps(error_body("a valid API key is needed: send it as "
                                             "'Authorization: Bearer <key>'",
                                             code="invalid_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _text_of(model, param: str):
    """The model's TextCodec, or a RequestError: a preset has no tokenizer."""
    if model.text is None:
        raise RequestError("this model has no tokenizer (a preset)", param=param)
    return model.text


async def _read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, refused (413) as soon as it is known to pass limits.body_bytes: by its
    Content-Length before any of it is read, else once what has come passes it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        limits.check_body_size(int(declared))
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        limits.check_body_size(size)
        parts.append(chunk)
    return b"".join(parts)


async def _chat_prompt(text, messages: list[dict], **variables) -> list[int]:
    """The messages through the chat template, in a worker thread. A template that raises
    (raise_exception: Mistral's, Llama-2's and Gemma's do for a role they do not take, or
    roles that do not alternate) refuses the request: 400 with its message. One that cannot
    be parsed is the server's fault: it stays an error of the server."""
    from jinja2 import TemplateError, TemplateSyntaxError   # transformers renders with jinja2
    try:
        return await asyncio.to_thread(text.chat_prompt, messages, **variables)
    except TemplateSyntaxError:
        raise
    except TemplateError as e:
        raise RequestError(f"the chat template refused the messages: {e}",
                           param="messages") from None


async def _with_grammar(service: GenerationService, spec, tool_format: str | None = None):
    """`spec` with its constraint compiled (in a worker thread: a large schema takes a while),
    or as it is without one."""
    if spec.constraint is None:
        return spec
    if service.grammars is None:
        raise RequestError(f"{spec.constraint.param}: structured output needs the model's "
                           f"tokenizer; this model (a preset) has none", param=spec.constraint.param)
    compiled = await asyncio.to_thread(service.grammars.compile, spec.constraint, tool_format)
    return dataclasses.replace(spec, compiled_grammar=compiled)


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise RequestError(f"the model {asked!r} does not exist; this server serves {served!r}",
                           param="model", status=404, code="model_not_found")


async def _respond(request: Request, service: GenerationService, prompts: list[list[int]], spec,
                   shape: ResponseShape, prompt_param: str):
    """The answer to `prompts` (a chat's one, a completion's one or more), each with n choices."""
    if spec.stop and service.model.text is None:
        raise RequestError("stop strings need a tokenizer; this model (a preset) has none: use "
                           "stop_token_ids", param="stop")
    if spec.n > 1 or len(prompts) > 1:
        return await _respond_choices(request, service, prompts, spec, shape, prompt_param)
    gen = service.start(prompts[0], spec, prompt_param)
    if spec.stream:
        return _EventStream(_events(gen, shape, spec.include_usage,
                                    spec.include_usage and spec.continuous_usage), gen)
    collect = asyncio.ensure_future(_collect(gen))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():        # the client went away (or this task was cancelled)
            collect.cancel()
            gen.cancel()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    text, token_ids = collect.result()   # GenerationFailed: the 500 handler
    out = gen.outcome
    calls, reason = None, out.finish_reason
    if shape.tool_format is not None:
        text, calls = parse_tool_calls(text, shape.tool_format)
        reason = "tool_calls" if calls else reason
    return shape.whole(text, token_ids, reason, usage(out.prompt_tokens, out.completion_tokens),
                       out.logprobs, tool_calls=calls)


class _Choices:
    """The Generations of one request with several choices: n per prompt (choice index
    prompt * n + i, as vLLM numbers a completion's prompts), one engine request each with its
    own seed (GenerationSpec.choice_spec). A prompt's choices start together, so the engine
    computes it once and the others take its cached KV blocks (prefix caching)."""

    def __init__(self, service: GenerationService, prompts: list[list[int]], spec, prompt_param: str):
        self.gens: list[Generation] = []
        self._prompt_tokens = sum(map(len, prompts))
        try:
            for ids in prompts:
                for i in range(spec.n):
                    self.gens.append(service.start(ids, spec.choice_spec(i), prompt_param))
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for gen in self.gens:
            gen.cancel()

    def usage(self) -> dict:
        """Each prompt counted once, the completions of every choice."""
        return usage(self._prompt_tokens, sum(g.outcome.completion_tokens for g in self.gens))


def _numbered(obj: dict, i: int) -> dict:
    for choice in obj["choices"]:
        choice["index"] = i
    return obj


async def _respond_choices(request: Request, service: GenerationService, prompts: list[list[int]],
                           spec, shape: ResponseShape, prompt_param: str):
    """_respond for n > 1 choices: whole (choices in index order) or streamed (each chunk
    names its choice's index)."""
    choices = _Choices(service, prompts, spec, prompt_param)
    if spec.stream:
        return _EventStream(_choice_events(choices, shape, spec.include_usage), choices)
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(g) for g in choices.gens)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
            choices.cancel()
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    parts = collect.result()     # GenerationFailed: the 500 handler
    use = choices.usage()
    body = None
    for i, ((text, token_ids), gen) in enumerate(zip(parts, choices.gens)):
        out = gen.outcome
        one = _numbered(shape.whole(text, token_ids, out.finish_reason, use, out.logprobs, i), i)
        if body is None:
            body = one
        else:
            body["choices"].extend(one["choices"])
    return body


async def _choice_events(choices: _Choices, shape: ResponseShape, include_usage: bool):
    """The streamed events of n choices, interleaved as their tokens arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation):
        try:
            async for d in gen.deltas():
                await queue.put((i, d))
            await queue.put((i, None))
        except GenerationFailed as e:
            await queue.put((i, e))

    if shape.chat:
        for i in range(len(choices.gens)):
            yield sse(_numbered(shape.chunk("", [], role=True), i))
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(choices.gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, GenerationFailed):
                yield sse(error_body(str(item), type="server_error", code=500))
                yield DONE
                return
            if item is None:
                left -= 1
                reason = choices.gens[i].outcome.finish_reason
                yield sse(_numbered(shape.chunk(None if shape.chat else "", [], reason), i))
            else:
                yield sse(_numbered(shape.chunk(item.text, item.token_ids,
                                                logprobs=item.logprobs, index=i), i))
        if include_usage:
            yield sse(shape.usage_chunk(choices.usage()))
        yield DONE
    finally:
        for t in tasks:
            t.cancel()


async def _collect(gen: Generation) -> tuple[str, list[int]]:
    parts = [d async for d in gen.deltas()]
    return "".join(d.text for d in parts), gen.outcome.token_ids


def _token_text(model):
    """A token's name in logprobs: its decoded text, or vLLM's "token_id:N" without a
    tokenizer (a preset)."""
    if model.text is None:
        return None
    tok = model.text.tokenizer
    return lambda t: tok.decode([t])


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone: after its body, the next ASGI message is the
    disconnect (the response being complete also ends the wait, which is then moot)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(gen: Generation, shape: ResponseShape, include_usage: bool,
                  continuous_usage: bool = False):
    """continuous_usage (vLLM's continuous_usage_stats, with include_usage): every chunk also
    carries the usage so far."""
    if shape.chat:
        yield sse(shape.chunk("", [], role=True))
    done = 0
    calls = ToolCallStream(shape.tool_format) if shape.tool_format is not None else None
    try:
        async for d in gen.deltas():
            text = calls.push(d.text) if calls is not None else d.text
            chunk = shape.chunk(text, d.token_ids, logprobs=d.logprobs)
            if continuous_usage:
                done += len(d.token_ids)
                chunk["usage"] = usage(gen.prompt_tokens, done)
            yield sse(chunk)
    except GenerationFailed as e:
        yield sse(error_body(str(e), type="server_error", code=500))
        yield DONE
        return
    out = gen.outcome
    reason = out.finish_reason
    if calls is not None:
        rest, made = calls.finish()
        if rest:
            yield sse(shape.chunk(rest, []))
        if made:
            yield sse(shape.chunk(None, [], tool_calls=made))
            reason = "tool_calls"
    yield sse(shape.chunk(None if shape.chat else "", [], reason))
    if include_usage:
        yield sse(shape.usage_chunk(usage(out.prompt_tokens, out.completion_tokens)))
    yield DONE


class _EventStream(StreamingResponse):
    """Server-sent events whose request is cancelled however the response ends (done, the
    client gone, the server's task cancelled at shutdown)."""

    def __init__(self, events, gen):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.cancel()


def _add_error_handlers(app: FastAPI, service: GenerationService) -> None:
    @app.exception_handler(RequestError)
    async def refused(request, e: RequestError):
        service.metrics.rejected("invalid")
        return JSONResponse(error_body(e.message, type=e.type, param=e.param, code=e.code),
                            status_code=e.status)

    @app.exception_handler(Overloaded)
    async def overloaded(request, e: Overloaded):
        return JSONResponse(error_body(str(e), type="rate_limit_error", code="overloaded"),
                            status_code=429, headers={"Retry-After": str(e.retry_after_s)})

    @app.exception_handler(ServiceClosed)
    async def closing(request, e: ServiceClosed):
        return JSONResponse(error_body(str(e), type="server_error", code="shutting_down"),
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request, e: EngineStopped):
        return JSONResponse(error_body(f"the engine has stopped and the server is exiting: {e}",
                                       type="server_error", code="engine_stopped"),
                            status_code=503)

    @app.exception_handler(GenerationFailed)
    async def failed(request, e: GenerationFailed):
        return JSONResponse(error_body(str(e), type="server_error", code=500), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), type="invalid_request_error"),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        # A bug of the server: the client still gets an error body; Starlette then re-raises
        # the exception for uvicorn to log with its traceback.
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}",
                                       type="server_error", code=500), status_code=500)
