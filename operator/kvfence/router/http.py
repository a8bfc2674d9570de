"""The router's HTTP/1.1 server: an asyncio protocol around httptools (llhttp, the parser of Node.js).

Why not a framework: the router's data path is "parse a small request, answer or relay it". Measured
on the benchmark machine (bench/bench_router.py), aiohttp's server and client alone cost ~110 us of
CPU per proxied request, three times what all of ``vllm-router`` (Rust) spends; this module and
:mod:`kvfence.router.upstream` do the same work for a fraction of that, which is what lets a Python
router keep up with a Rust one. Everything a user of an HTTP server expects is here:

* keep-alive, pipelined requests answered in order, HTTP/1.0 clients;
* chunked request bodies; ``Expect: 100-continue`` (curl sends it for bodies over 1 KiB);
* limits: request head size (431), body size (413: up front from Content-Length, or as a chunked
  body grows), a slow-client timeout for a started request (408), an idle keep-alive timeout;
* answers with a length, or streamed with chunked encoding and write backpressure
  (:meth:`Request.stream`);
* a client that disconnects cancels its handler (so the engine request is aborted and quotas are
  released at once);
* graceful shutdown: stop accepting, close idle connections, let in-flight handlers finish.

Not here, on purpose: TLS (terminated in front of the router), HTTP/2, protocol upgrades (the
request is answered as plain HTTP, as RFC 9110 allows, and the connection then closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

import httptools

log = logging.getLogger("kvfence.router.http")

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
#: Requests parsed ahead of the one being answered before the server stops reading the connection.
MAX_PIPELINE = 16
#: Seconds an idle client connection is kept open (above common load balancers' 60 s idle timeout).
KEEPALIVE_TIMEOUT = 75.0
#: Seconds a client has to send a whole request, head and body, once it started (slow clients: 408).
REQUEST_TIMEOUT = 60.0
#: Seconds a client may leave an answer unread (the router's writes to it blocked) before it is cut off.
WRITE_TIMEOUT = 60.0
#: How long a connection answered early (413, 431, ...) keeps draining the client's bytes.
LINGER_SECONDS = 2.0


class Response:
    """A complete answer: status, headers, body."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> None:
        self.status = status
        self.body = body
        self.headers = [("Content-Type", content_type), *headers] if content_type else list(headers)


class ClientGone(ConnectionError):
    """The client closed its connection before the answer was written."""


class Stream:
    """A streamed answer: the head is written by :meth:`Request.stream`, then :meth:`write` each
    chunk (it waits while the client reads slower than we write) and :meth:`end`."""

    __slots__ = ("_chunked", "_conn", "ended", "status")

    def __init__(self, conn: _Connection, status: int, chunked: bool) -> None:
        self._conn = conn
        self.status = status
        self._chunked = chunked
        self.ended = False

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        if conn.transport is None:
            raise ClientGone("client disconnected")
        if self._chunked:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            conn.transport.write(data)
        if conn.write_paused:
            await conn.drain()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._conn.transport is not None and self._chunked:
            self._conn.transport.write(b"0\r\n\r\n")


class Request:
    """One parsed request. ``headers`` keeps what the client sent, in order (``names``: their names in
    lower case); :meth:`header` looks a header up by its lower-case name (the first occurrence)."""

    __slots__ = (
        "_conn",
        "body",
        "headers",
        "keep_alive",
        "method",
        "names",
        "path",
        "query",
        "streamed",
        "tenant",
        "version",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        target: bytes,
        version: str,
        headers: list[tuple[str, str]],
        keep_alive: bool,
        body: bytes,
        names: list[str] | None = None,
    ) -> None:
        self._conn = conn
        self.method = method
        text = target.decode("latin-1")
        if not text.startswith("/"):
            text = _origin_form(text)
        path, _, query = text.partition("?")
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        self.names = names if names is not None else [k.lower() for k, _ in headers]
        self.keep_alive = keep_alive
        self.body = body
        self.streamed = False  # stream() wrote the head of the answer
        self.tenant: str | None = None  # who the application authenticated (for its access log)

    def header(self, name: str) -> str | None:
        try:
            return self.headers[self.names.index(name)][1]
        except ValueError:
            return None

    @property
    def peer(self) -> str:
        """The client's address, ``host:port``."""
        t = self._conn.transport
        addr = t.get_extra_info("peername") if t is not None else None
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "-"

    def header_count(self, name: str) -> int:
        return self.names.count(name)

    def stream(self, status: int, headers: Iterable[tuple[str, str]]) -> Stream:
        """Write the head of a streamed answer now; the body follows through the returned
        :class:`Stream`. HTTP/1.0 clients get the body unframed, ended by closing the connection."""
        conn = self._conn
        self.streamed = True
        chunked = self.version != "1.0"
        if not chunked:
            self.keep_alive = False
        framing = [("Transfer-Encoding", "chunked")] if chunked else []
        conn.write_head(status, [*headers, *framing], self.keep_alive)
        return Stream(conn, status, chunked)


def _origin_form(target: str) -> str:
    """A request target in absolute form (``http://host/path?query``, RFC 9112 3.2.2: a server must
    accept it) as the origin form the router routes by: the authority is dropped. Other forms (``*``,
    an authority alone) are kept as they are: no route matches them."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return target
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    rest = rest[cut:]
    return rest if rest.startswith("/") else "/" + rest


Handler = Callable[[Request], Awaitable[Response | Stream]]


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


#: Status lines, made once.
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %b\r\n" % (s.value, s.phrase.encode("latin-1")) for s in HTTPStatus}


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, dispatch one request at a time, write answers in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.write_paused = False
        self.write_paused_since = 0.0
        self._drain: asyncio.Future[None] | None = None
        self.pending: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.read_paused = False
        self.closing = False  # answer what is being answered, then close
        self.discarding = False  # answered early and closing: what arrives is dropped
        # the request being parsed
        self._reading = False
        self._started = 0.0
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._names: list[str] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._method = ""
        self._version = "1.1"
        self._keep_alive = True
        self.idle_since = time.monotonic()

    # --- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._wake_writer()

    def eof_received(self) -> bool:
        # A client that closes its side is gone, even with an answer in flight (as aiohttp and nginx
        # see it): closing cancels the handler, which aborts the engine request and frees the quota.
        return False

    def pause_writing(self) -> None:
        self.write_paused = True
        self.write_paused_since = time.monotonic()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.transport is None:
            raise ClientGone("client disconnected")
        if self.write_paused:
            self._drain = self.loop.create_future()
            await self._drain
            if self.transport is None:
                raise ClientGone("client disconnected")

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        if self.closing and self.task is not None:
            return  # the connection ends after the answer in flight; nothing more is read
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Reject):
                self._fail(cause.status, str(cause))
            else:  # a bug in this module: never leave the client hanging
                log.error("HTTP parser callback failed", exc_info=cause)
                self._fail(500, "Internal router error.")
        except httptools.HttpParserUpgrade:
            # Raised after the request was parsed (and dispatched): answer it, then close.
            self._fail(400, "Protocol upgrades are not supported.")
        except httptools.HttpParserError as e:
            self._fail(400, f"Malformed HTTP request: {e}.")

    # --- httptools callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reading = True
        self._started = time.monotonic()
        self._url = b""
        self._headers = []
        self._names = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Reject(414, "Request target too long.")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES or len(self._headers) >= MAX_HEADERS:
            raise _Reject(431, "Request header fields too large.")
        k = name.decode("latin-1")
        self._headers.append((k, value.decode("latin-1")))
        self._names.append(k.lower())

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._method = parser.get_method().decode("ascii")
        self._version = parser.get_http_version()
        self._keep_alive = parser.should_keep_alive()
        expect = None
        for kl, (_, v) in zip(self._names, self._headers, strict=True):
            if kl == "content-length":
                if not v.strip().isdigit():
                    raise _Reject(400, "Invalid Content-Length.")
                if int(v) > self.server.max_body:
                    raise _Reject(413, f"Request body larger than {self.server.max_body} bytes.")
            elif kl == "expect":
                expect = v.lower()
        if expect is not None:
            if expect != "100-continue":
                raise _Reject(417, "Only 'Expect: 100-continue' is supported.")
            # Only when nothing is being answered on this connection: an interim answer must not
            # overtake the answer to an earlier pipelined request (that client sends the body anyway).
            if self.transport is not None and self._version == "1.1" and self.task is None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body:
            raise _Reject(413, f"Request body larger than {self.server.max_body} bytes.")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._reading = False
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(
            self, self._method, self._url, self._version, self._headers, self._keep_alive, body, self._names
        )
        if self.closing:
            return  # answering the last request of this connection: drop what follows
        if self.task is None:
            self.task = self.loop.create_task(self._serve(req))
        else:
            self.pending.append(req)
            if len(self.pending) >= MAX_PIPELINE and not self.read_paused and self.transport is not None:
                self.read_paused = True
                self.transport.pause_reading()

    # --- answering --------------------------------------------------------------------------------
    async def _serve(self, req: Request) -> None:
        while True:
            try:
                out = await self.server.handler(req)
            except asyncio.CancelledError:
                return  # the client is gone (or the server is stopping without grace)
            except Exception:
                log.exception("unhandled error answering %s %s", req.method, req.path)
                out = self.server.error_response(500, "Internal router error.")
            if self.transport is None:
                return
            if isinstance(out, Stream):
                out.end()
            elif req.streamed:
                # The handler failed after its streamed answer began: the status line is gone, so
                # the only honest signal left is to cut the connection.
                log.error("%s %s failed after its answer began; closing", req.method, req.path)
                self.transport.close()
                return
            else:
                keep = req.keep_alive and not self.closing
                self.write_head(out.status, out.headers, keep, out.body, req.method == "HEAD")
            if not req.keep_alive or self.closing:
                self.transport.close()
                return
            if not self.pending:
                break
            req = self.pending.popleft()
            if self.read_paused and self.transport is not None:
                self.read_paused = False
                self.transport.resume_reading()
        self.task = None
        self.idle_since = time.monotonic()

    def write_head(
        self,
        status: int,
        headers: Iterable[tuple[str, str]],
        keep_alive: bool,
        body: bytes | None = None,
        head_only: bool = False,
    ) -> None:
        if self.transport is None:
            raise ClientGone("client disconnected")
        status_line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
        lines = [status_line, self.server.date_line]
        for k, v in headers:
            lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        if body is not None:
            lines.append(b"Content-Length: %d\r\n" % len(body))
        if not keep_alive:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        if body and not head_only:
            lines.append(body)
        self.transport.write(b"".join(lines))

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that could not be parsed or is over a limit, then close: the rest of the
        byte stream cannot be trusted to start at a request boundary."""
        self.closing = True
        if self.transport is None:
            return
        if self.task is None:
            out = self.server.error_response(status, message)
            self.write_head(out.status, out.headers, False, out.body)
            self._linger()
        # else: the request in flight is answered, then the connection closes (closing is set)

    def _linger(self) -> None:
        """Close after an early answer (413 while the client still sends its body): half-close and
        discard what still arrives for a moment, since closing a socket with unread data resets the
        connection and the client would lose the answer."""
        transport = self.transport
        if transport is None:
            return
        self.discarding = True
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()

    def check_timeouts(self, now: float) -> None:
        if self.transport is None:
            return
        if self._reading and now - self._started > self.server.request_timeout:
            self._reading = False
            self._fail(408, "The request was not sent in time.")
        elif self.write_paused and now - self.write_paused_since > self.server.write_timeout:
            # The client stopped reading what it asked for: cut it off, so that its answer does not
            # hold an engine connection (and the engine's work) for as long as it likes.
            self.transport.abort()
            if self.server.on_slow_client is not None:
                self.server.on_slow_client()
        elif (
            not self._reading
            and self.task is None
            and not self.pending
            and now - self.idle_since > self.server.keepalive_timeout
        ):
            self.transport.close()

    def close_if_idle(self) -> None:
        self.closing = True
        if self.transport is not None and self.task is None and not self._reading:
            self.transport.close()


class HttpServer:
    """Serve ``handler`` on a TCP port. ``error_response(status, message)`` builds the body of the
    errors the server answers itself (400, 408, 413, 414, 417, 431, 500)."""

    def __init__(
        self,
        handler: Handler,
        error_response: Callable[[int, str], Response],
        *,
        max_body: int,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        write_timeout: float = WRITE_TIMEOUT,
        on_slow_client: Callable[[], None] | None = None,
    ) -> None:
        self.handler = handler
        #: Seconds a client may leave an answer unread (writing to it blocked) before it is cut off.
        self.write_timeout = write_timeout
        self.on_slow_client = on_slow_client
        self.error_response = error_response
        self.max_body = max_body
        self.keepalive_timeout = keepalive_timeout
        self.request_timeout = request_timeout
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self.date_line = b""
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._tick()

    def _tick(self) -> None:
        self.date_line = b"Date: %b\r\n" % formatdate(usegmt=True).encode("ascii")

    async def _run_ticker(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._tick()
            now = time.monotonic()
            for conn in list(self.connections):
                conn.check_timeouts(now)

    async def start(self, host: str, port: int, backlog: int = 2048, reuse_port: bool = False) -> None:
        """Listen; with ``reuse_port`` (SO_REUSEPORT) several worker processes each listen on the same
        port and the kernel spreads new connections over them."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port
        )
        self._ticker = self.loop.create_task(self._run_ticker())

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, close idle connections, give in-flight requests ``grace`` seconds."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._server is not None:
            await self._server.wait_closed()
