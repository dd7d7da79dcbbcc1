"""Running the app: uvicorn on a socket bound before serving (so the address printed is the
one listened on, port 0 included), a graceful stop on SIGINT or SIGTERM, and an exit when the
engine can serve no more.

On the first signal the server stops accepting connections and new requests (503), lets the
responses in flight run for up to `shutdown_timeout_s` seconds, then aborts the requests left
on the engine: each response still ends well-formed, its choice's finish_reason "abort" (a
stream: its last chunk, then [DONE]). A second SIGINT aborts them at once. Only a response
whose client does not read it is cut, ABORT_GRACE_S after the abort. `vt serve` then closes
the engine and exits 0. uvicorn re-raises a caught signal after its own shutdown (so that a
parent sees it); this server does not: a stop asked for is a clean exit.

An engine that stops for good (a tensor-parallel rank died) is seen within a tick (0.1 s):
/health answers 503 from then on, and the server shuts down as above, with
`engine_failure` saying why; `vt serve` exits 1, for its supervisor to start it again (as
vLLM's server exits when its engine dies). Restarting the engine inside the process would
reload the model and recapture every graph while clients wait: a fresh process does the same,
cleanly.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time

import uvicorn

from vt.serve.app import create_app
from vt.serve.generation import GenerationService

HANDLED = (signal.SIGINT, signal.SIGTERM)
# How long the aborted responses get to write their last chunk before uvicorn cuts them (one
# whose client stopped reading cannot finish).
ABORT_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn.Server over `service`'s app whose signals end serve() without being raised
    again, whose stop aborts what is left on the engine, and which stops by itself when the
    engine fails (module docstring)."""

    def __init__(self, config: uvicorn.Config, service: GenerationService,
                 shutdown_timeout_s: float, on_listening=None):
        super().__init__(config)
        self.service = service
        self.on_listening = on_listening
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stopped_by: int | None = None
        self.engine_failure: str | None = None
        self._abort_now = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield                     # signals reach the main thread only
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in HANDLED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self._abort_now = True
        self.should_exit = True
        self.stopped_by = self.stopped_by or sig

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # Said only now, with this server's signal handlers installed and its sockets
        # accepting: a client (or a supervisor's signal) that acts on the line is served.
        if self.started and self.on_listening is not None:
            self.on_listening()

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.engine_failure is None:
            failure = self.service.engine_failure()
            if failure is not None:
                self.engine_failure = failure
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.service.closing = True   # from here on new requests get 503
        aborter = asyncio.ensure_future(self._abort_when_due())
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()

    async def _abort_when_due(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout_s
        while time.monotonic() < deadline and not self._abort_now:
            await asyncio.sleep(0.05)
        self.service.abort_all()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port); ValueError when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def make_server(service: GenerationService, *, shutdown_timeout_s: float,
                log_level: str = "warning", on_listening=None,
                api_key: str | None = None) -> GracefulServer:
    """The server of `service`'s app (vt/serve/app.py; `api_key`: its Bearer key, None for
    none); on_listening() is called once it accepts connections and handles SIGINT/SIGTERM."""
    config = uvicorn.Config(create_app(service, api_key=api_key), log_level=log_level, access_log=False,
                            lifespan="on", timeout_keep_alive=30,
                            timeout_graceful_shutdown=shutdown_timeout_s + ABORT_GRACE_S)
    return GracefulServer(config, service, shutdown_timeout_s, on_listening)


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
