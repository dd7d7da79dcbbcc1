"""Running the app: uvicorn on a socket bound before serving (so the address printed is the
one listened on, port 0 included), and a graceful stop on SIGINT or SIGTERM.

On the first signal the server stops accepting connections, lets the responses in flight run
for up to `shutdown_timeout_s` seconds, then cancels what is left (their requests cancelled on
the engine: rows and KV blocks freed) and returns; `vt serve` then closes the engine and exits
0. A second SIGINT stops at once. uvicorn re-raises a caught signal after its own shutdown
(so that a parent sees it); this server does not: a stop asked for is a clean exit.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn

HANDLED = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose signals end serve() without being raised again."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.stopped_by: int | None = None

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
            self.force_exit = True
        self.should_exit = True
        self.stopped_by = self.stopped_by or sig


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port); ValueError when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def make_server(app, *, shutdown_timeout_s: float, log_level: str = "warning") -> GracefulServer:
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout_s, timeout_keep_alive=30)
    return GracefulServer(config)


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
