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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from vt.serve.generation import (EngineStopped, Generation, GenerationFailed, GenerationService,
                                 Overloaded, ServiceClosed)
from vt.serve.protocol import (ChatBody, CompletionBody, RequestError, RequestLimits,
                               completion_prompt, generation_spec, parse_body)
from vt.serve.responses import DONE, ResponseShape, error_body, sse, usage

RETRY_AFTER_S = 1


def create_app(service: GenerationService) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.closing = True        # from here on: 503, until the engine is closed

    app = FastAPI(title="vt serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    _add_error_handlers(app, service)
    model = service.model

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
        spec = generation_spec(body, model.vocab)
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            if model.text is None:
                raise RequestError("this model has no tokenizer (a preset): send the prompt as "
                                   "token ids", param="prompt")
            service.limits.check_prompt_chars(len(prompt), "prompt")
            ids = await asyncio.to_thread(model.text.encode, prompt)
        else:
            ids = prompt
            if min(ids) < 0 or max(ids) >= model.vocab:
                raise RequestError(f"prompt token ids must be in [0, {model.vocab})", param="prompt")
        return await _respond(request, service, ids, spec, ResponseShape(model.name, chat=False),
                              "prompt")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse_body(await _read_body(request, service.limits), ChatBody)
        _check_model(body.model, model.name)
        spec = generation_spec(body, model.vocab)
        if model.text is None or not model.text.has_chat_template:
            raise RequestError("this model has no chat template (a preset, or a tokenizer "
                               "without one): use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        service.limits.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        ids = await _chat_prompt(model.text, messages)
        return await _respond(request, service, ids, spec, ResponseShape(model.name, chat=True),
                              "messages")

    return app


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


async def _chat_prompt(text, messages: list[dict]) -> list[int]:
    """The messages through the chat template, in a worker thread. A template that raises
    (raise_exception: Mistral's, Llama-2's and Gemma's do for a role they do not take, or
    roles that do not alternate) refuses the request: 400 with its message. One that cannot
    be parsed is the server's fault: it stays an error of the server."""
    from jinja2 import TemplateError, TemplateSyntaxError   # transformers renders with jinja2
    try:
        return await asyncio.to_thread(text.chat_prompt, messages)
    except TemplateSyntaxError:
        raise
    except TemplateError as e:
        raise RequestError(f"the chat template refused the messages: {e}",
                           param="messages") from None


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise RequestError(f"the model {asked!r} does not exist; this server serves {served!r}",
                           param="model", status=404, code="model_not_found")


async def _respond(request: Request, service: GenerationService, ids: list[int], spec,
                   shape: ResponseShape, prompt_param: str):
    if spec.stop and service.model.text is None:
        raise RequestError("stop strings need a tokenizer; this model (a preset) has none: use "
                           "stop_token_ids", param="stop")
    gen = service.start(ids, spec, prompt_param)
    if spec.stream:
        return _EventStream(_events(gen, shape, spec.include_usage), gen)
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
    return shape.whole(text, token_ids, out.finish_reason,
                       usage(out.prompt_tokens, out.completion_tokens))


async def _collect(gen: Generation) -> tuple[str, list[int]]:
    parts = [d async for d in gen.deltas()]
    return "".join(d.text for d in parts), gen.outcome.token_ids


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone: after its body, the next ASGI message is the
    disconnect (the response being complete also ends the wait, which is then moot)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(gen: Generation, shape: ResponseShape, include_usage: bool):
    if shape.chat:
        yield sse(shape.chunk("", [], role=True))
    try:
        async for d in gen.deltas():
            yield sse(shape.chunk(d.text, d.token_ids))
    except GenerationFailed as e:
        yield sse(error_body(str(e), type="server_error", code=500))
        yield DONE
        return
    out = gen.outcome
    yield sse(shape.chunk(None if shape.chat else "", [], out.finish_reason))
    if include_usage:
        yield sse(shape.usage_chunk(usage(out.prompt_tokens, out.completion_tokens)))
    yield DONE


class _EventStream(StreamingResponse):
    """Server-sent events whose request is cancelled however the response ends (done, the
    client gone, the server's task cancelled at shutdown)."""

    def __init__(self, events, gen: Generation):
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
