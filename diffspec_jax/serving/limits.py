"""The HTTP layer's limits, and running the application under uvicorn with them.

What a client can hold of the server is bounded (docs/serving.md, "Limits and failures"):

* **request bodies**: at most :attr:`HTTPLimits.max_request_bytes` (default :func:`default_max_request_bytes`),
  answered 413 before anything is parsed: at once from ``Content-Length``, or once a chunked upload has sent one
  byte more (:class:`BodyLimits`, an ASGI middleware that reads the body into memory only up to the limit);
* **slow clients**: a request's headers must be complete within :attr:`HTTPLimits.header_timeout` of the
  connection opening or of the request's first byte (:func:`timed_h11_protocol`, uvicorn's h11 protocol with a
  deadline), and its body within :attr:`HTTPLimits.body_timeout` of its headers (:class:`BodyLimits`); past
  either the client gets 408 and the connection closes. An idle keep-alive connection closes after
  :attr:`HTTPLimits.keep_alive_timeout` (uvicorn's ``timeout_keep_alive``);
* **connections**: at most :attr:`HTTPLimits.max_connections` open at once (uvicorn's ``limit_concurrency``: a
  request beyond it is answered 503; a connection opened beyond it gets 503 and is closed at once).

:func:`run_server` serves the application and returns the process's exit status: 1 when the engine failed, which
stops the server (so that a supervisor restarts the process), else 0. It shuts down in two steps
(:class:`GracefulServer`): the first SIGINT or SIGTERM stops accepting requests and lets those in flight finish
for up to :attr:`HTTPLimits.shutdown_timeout` seconds, then aborts them (``finish_reason`` ``"abort"``); a second
signal aborts them at once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from diffspec_jax.serving.protocol import error_body
from diffspec_jax.validation import check_int, check_real

#: request bytes allowed whatever ``max_model_len`` (the JSON around the prompt, stop strings, messages' roles)
REQUEST_BYTES_BASE = 1 << 20
#: request bytes allowed per token of ``max_model_len``: a token of text is a few characters, each at most 6 bytes
#: as a JSON ``\\uXXXX`` escape; a token id is at most 11 bytes as JSON
REQUEST_BYTES_PER_TOKEN = 64
#: seconds aborted requests get to send their last event before the server exits anyway
ABORT_GRACE_S = 3.0


def default_max_request_bytes(max_model_len: int) -> int:
    """The default body limit: :data:`REQUEST_BYTES_BASE` + :data:`REQUEST_BYTES_PER_TOKEN` x ``max_model_len``
    (1 MiB + 64 bytes per token: 1.25 MiB at 4096 tokens, 9 MiB at 128K)."""
    return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_TOKEN * max_model_len


@dataclass(frozen=True)
class HTTPLimits:
    """What one client may hold of the server (validated at construction).

    Attributes:
        max_request_bytes: the largest request body (``None``: :func:`default_max_request_bytes` of the engine's
            ``max_model_len``); a larger one gets 413.
        header_timeout: seconds for a request's headers, from the connection opening or the request's first byte
            [20]; past it: 408, and the connection closes.
        body_timeout: seconds for a request's whole body, from its headers [60]; past it: 408.
        keep_alive_timeout: seconds an idle keep-alive connection stays open [5].
        max_connections: open connections at most [512]; beyond it: 503.
        shutdown_timeout: seconds the requests in flight may take to finish after the first SIGINT / SIGTERM
            [10]; then they are aborted (:class:`GracefulServer`).
    """

    max_request_bytes: int | None = None
    header_timeout: float = 20.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 512
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        check_int(self.max_request_bytes, "max_request_bytes", min=1, none_ok=True)
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            check_real(getattr(self, name), name, min=0.0, min_open=True)
        check_int(self.max_connections, "max_connections", min=1)
        check_real(self.shutdown_timeout, "shutdown_timeout", min=0.0)


def _error_json(message: str, code: str) -> bytes:
    return json.dumps(error_body(message, code=code)).encode()


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection (for answers before any request was parsed)."""
    body = _error_json(message, code)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class BodyLimits:
    """ASGI middleware: reads each request's body up to ``max_bytes`` within ``timeout`` seconds, then hands it
    to ``app`` (later ``receive`` calls, e.g. a disconnect, go to the server). 413 past the size (at once when
    ``Content-Length`` says so), 408 past the time; both close the connection."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, 413, self._too_large(int(declared)), "request_too_large")
        body, more = bytearray(), True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within {self.timeout:g} s",
                                          "request_timeout")
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(send, 413, self._too_large(None), "request_too_large")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    def _too_large(self, size: int | None) -> str:
        got = f"{size} bytes" if size is not None else f"over {self.max_bytes} bytes"
        return f"the request body is {got}; this server takes at most {self.max_bytes} (--max-request-bytes)"

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        body = _error_json(message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def timed_h11_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a connection cap: a request whose headers are not
    complete ``header_timeout`` seconds after the connection opened (or after the request's first byte, on a
    keep-alive connection) gets 408 and the connection closes; a connection opened while ``max_connections``
    are open gets 503 and is closed."""

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._close_with(_raw_response(503, "Service Unavailable", f"this server takes at most "
                                               f"{max_connections} connections; retry later", "too_many_connections"))
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first byte of a request on a keep-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # its headers are in
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._close_with(_raw_response(408, "Request Timeout", f"the request headers did not arrive "
                                               f"within {header_timeout:g} s", "request_timeout"))

        def _close_with(self, response: bytes) -> None:
            self._unset_keepalive_if_required()
            self.transport.write(response)
            self.transport.close()

    return TimedH11Protocol


def _say(message: str) -> None:
    print(f"[diffspec-serve] {message}", file=sys.stderr, flush=True)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with this server's shutdown. The first SIGINT or SIGTERM stops accepting connections
    (uvicorn closes the listening socket and idle keep-alive connections), says how many requests it is finishing,
    and aborts those still running ``shutdown_timeout`` seconds later (:meth:`SlotEngine.abort_all`: each ends with
    ``finish_reason`` ``"abort"`` and the text it had). A second signal aborts them at once. Once aborted, requests
    get :data:`ABORT_GRACE_S` seconds to send their last event; then the server exits whatever is left.

    The signal handler only records the signal: the work runs on the event loop (the handler may interrupt the
    main thread while it holds the engine's lock). Unlike uvicorn's, it does not raise the signal again once the
    server has stopped, so the process exits with :func:`run_server`'s status, not a ``KeyboardInterrupt``."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aborted = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals += 1
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_signal, sig, self.signals)

    def _in_flight(self) -> str:
        """``"N request(s)"`` in the engine (running or waiting), or ``""`` when there are none."""
        m = self.engine.metrics()
        n = m["requests_running"] + m["requests_waiting"]
        return f"{n} request{'s' if n != 1 else ''}" if n else ""

    def _on_signal(self, sig: int, nth: int) -> None:
        name = signal.Signals(sig).name
        if nth == 1:
            if n := self._in_flight():
                _say(f"{name}: not accepting new requests; finishing {n} (Ctrl-C again to abort); those still "
                     f"running in {self.shutdown_timeout:g} s are aborted")
            else:
                _say(f"{name}: no requests in flight; stopping")
            self._loop.call_later(self.shutdown_timeout, self._abort, f"after {self.shutdown_timeout:g} s "
                                                                      f"(--shutdown-timeout)")
        elif nth == 2:
            self._abort(f"on the second {name}")
        else:
            self.force_exit = True

    def _abort(self, why: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        if n := self._in_flight():
            _say(f"aborting {n} {why}")
        self.engine.abort_all()
        self._loop.call_later(ABORT_GRACE_S, setattr, self, "force_exit", True)


def run_server(app, engine, limits: HTTPLimits, *, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "warning", sock: socket.socket | None = None) -> int:
    """Serve ``app`` (with :class:`BodyLimits` around it; ``engine``, its :class:`SlotEngine`, started) under
    uvicorn with ``limits`` until a signal (then shut down as :class:`GracefulServer` says, within
    ``limits.shutdown_timeout`` + :data:`ABORT_GRACE_S` seconds), or until the engine fails. Returns the exit
    status: 1 if the engine failed, else 0. ``sock``: a bound socket to serve on instead of ``host:port``.

    The engine's failure hook (:attr:`SlotEngine.on_failure`, called on the engine thread once its requests have
    been failed and ``/health`` answers 503) stops the server, after calling the hook the engine had before.
    """
    max_bytes = limits.max_request_bytes or default_max_request_bytes(engine.max_model_len)
    config = uvicorn.Config(BodyLimits(app, max_bytes, limits.body_timeout), host=host, port=port,
                            log_level=log_level, http=timed_h11_protocol(limits.header_timeout, limits.max_connections),
                            timeout_keep_alive=limits.keep_alive_timeout, limit_concurrency=limits.max_connections + 1,
                            timeout_graceful_shutdown=limits.shutdown_timeout + ABORT_GRACE_S)
    server = GracefulServer(config, engine, limits.shutdown_timeout)
    before = engine.on_failure

    def stop(exc: BaseException) -> None:
        try:
            if before is not None:
                before(exc)
        finally:
            server.should_exit = True

    engine.on_failure = stop
    server.run(sockets=[sock] if sock is not None else None)
    return 1 if engine.error is not None else 0
