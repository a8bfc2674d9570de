"""The router's HTTP/1.1 client to the engines: one keep-alive connection pool per engine endpoint.

An asyncio protocol around httptools' response parser (see :mod:`kvfence.router.http` for why the
router does not use a framework here). Per engine: at most ``limit`` connections in use at once
(more requests wait for a free one), at most ``tenant_limit`` of them for one tenant (so that one
tenant's slow streams cannot hold them all), idle connections reused most-recent-first and closed after
``idle_timeout`` (below uvicorn's 5 s keep-alive, the shortest among the engines, so that the router
rarely picks a connection the engine is closing), addresses resolved once per :data:`DNS_TTL`.
Timeouts: connect, read (the longest silence while an answer is awaited or streamed), total (which
also bounds the wait for a free connection). A response body is read whole (:meth:`Response.read`)
or streamed (:meth:`Response.chunks_iter`) with backpressure: the engine connection stops being read while
more than ``HIGH_WATER`` bytes wait for a slow client.

Errors are :class:`UpstreamError` with a ``kind`` the proxy maps to the client's status:
``connect`` (503: no connection, nothing sent), ``unsent`` (the connection was closed before the
request was written: nothing sent), ``timeout`` (504), ``protocol`` and ``closed`` (502: the
connection closed after the request was written, so the engine may have received it).

A kept-alive connection is checked before a request is written on it: one the engine has closed (its
end of file waits to be read) or that holds bytes nobody asked for is dropped and another one taken,
so a request is written only on a connection that was open at that moment. Whatever fails after the
write is ``closed``, and the proxy never sends that request again: a request that kills its engine
must not be given to another one.
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast

import httptools

HIGH_WATER = 256 * 1024
#: Seconds an engine's resolved address is reused for new connections.
DNS_TTL = 10.0


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Response:
    """An engine's answer: ``status`` and ``headers`` (lower-case names; the first of repeated
    ones) once :meth:`Pool.request` returns, then the body. Always :meth:`release` it."""

    __slots__ = (
        "_conn",
        "_waiter",
        "buffered",
        "chunks",
        "complete",
        "error",
        "headers",
        "keep_alive",
        "progress",
        "started",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.started = False  # any byte of the answer arrived
        self.progress = time.monotonic()  # last time a byte arrived or the client took one

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        self.buffered = 0
        self.progress = time.monotonic()
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        if self.complete and self.error is None:  # all of it arrived with the head (short answers)
            return self._take() if self.chunks else b""
        parts: list[bytes] = []
        async for chunk in self.chunks_iter():
            parts.append(chunk)
        return b"".join(parts)

    async def chunks_iter(self) -> AsyncIterator[bytes]:
        """The body as it arrives (whatever has arrived since the last step, joined)."""
        while True:
            if self.chunks:
                yield self._take()
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    def release(self) -> None:
        """Give the connection back to the pool if this answer was read to its end, else close it
        (an engine streaming to a client that left stops when its connection closes)."""
        if self._conn.resp is self:
            self._conn.finish(self.complete and self.keep_alive and self.error is None)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.resp: Response | None = None
        self.uses = 0
        self.idle_since = 0.0
        self.paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._until_eof = False
        self._interim = False  # parsing a 1xx answer
        self.tenant = ""  # whose share of the pool this connection counts against while in use
        self._poller: select.poll | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._disarm()
        resp = self.resp
        if resp is None or resp.complete or resp.error is not None:
            return
        if resp.status and self._until_eof:
            resp.complete = True  # a body delimited by the end of the connection
        elif not resp.started:
            resp.error = UpstreamError("closed", "the engine closed the connection before answering")
        else:
            resp.error = UpstreamError("closed", "the engine closed the connection mid-answer")
        resp._wake()

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.complete:
            # Bytes nobody asked for: the connection is out of step, never reuse it.
            if self.transport is not None:
                self.transport.close()
            return
        resp.started = True
        resp.progress = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError("protocol", f"malformed answer from the engine: {e}"))

    # --- httptools callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        resp = self.resp
        if resp is not None and resp.complete:
            # A second answer to one request, in the same read: the engine is out of step. It must not
            # touch the first answer; raising stops the parser, and _fail closes the connection.
            raise UpstreamError("protocol", "the engine sent more than one answer to a request")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        status = self.parser.get_status_code()
        if status < 200:
            # An interim answer (100 Continue, 103 Early Hints; RFC 9110, 15.2): not the answer, and
            # not a message end either. The router upgrades nothing, so 101 is no exception.
            self._interim = True
            resp.headers.clear()
            return
        resp.status = status
        resp.keep_alive = self.parser.should_keep_alive()
        h = resp.headers
        self._until_eof = "content-length" not in h and "transfer-encoding" not in h
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        resp.chunks.append(body)
        resp.buffered += len(body)
        if resp.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        resp._wake()

    def on_message_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        if self._interim:
            self._interim = False
            return
        resp.complete = True
        resp._wake()

    # --- request life cycle -----------------------------------------------------------------------
    def send(self, data: bytes) -> Response:
        if self.transport is None or self.transport.is_closing():
            # The engine reset the connection before the request was written (an engine killed right
            # after the kernel accepted it): nothing was sent, so another replica may take it.
            raise UpstreamError("unsent", "the engine closed the connection before the request was sent")
        self.uses += 1
        self.resp = resp = Response(self)
        self._until_eof = False
        self._deadline = resp.progress + self.pool.total_timeout
        if self._timer is None:
            # One timer per connection, not per request: it stays armed across the answers of a
            # kept-alive connection and re-arms itself for what is left when it fires early.
            self._timer = self.loop.call_later(
                min(self.pool.read_timeout, self.pool.total_timeout), self._check
            )
        self.transport.write(data)
        return resp

    def readable(self) -> bool:
        """Whether an idle connection has something to read: the engine's end of file (it closed the
        connection) or bytes nobody asked for. Either way it must not carry a request."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True
        poller = self._poller
        if poller is None:
            sock = transport.get_extra_info("socket")
            if sock is None:
                return False
            poller = self._poller = select.poll()  # made once per connection, on its first reuse
            poller.register(sock.fileno(), select.POLLIN)
        try:
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def _check(self) -> None:
        self._timer = None
        resp = self.resp
        if resp is None or resp.complete:
            return  # idle: the next request arms it again
        now = time.monotonic()
        read_left = resp.progress + self.pool.read_timeout - now
        total_left = self._deadline - now
        if read_left <= 0 or total_left <= 0:
            what = "read" if read_left <= 0 else "total"
            self._fail(UpstreamError("timeout", f"the engine did not answer in time ({what} timeout)"))
        else:
            self._timer = self.loop.call_later(min(read_left, total_left), self._check)

    def _fail(self, error: UpstreamError) -> None:
        resp = self.resp
        if resp is not None and resp.error is None and not resp.complete:
            resp.error = error
            resp._wake()
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def finish(self, reusable: bool) -> None:
        self.resp = None
        tenant, self.tenant = self.tenant, ""
        if not reusable or self.transport is None or self.paused:
            self._disarm()
            if self.transport is not None:
                self.transport.close()
            self.pool._done(None, tenant)
        else:
            self.pool._done(self, tenant)


class Slots:
    """The pool's limit on connections in use: ``asyncio.Semaphore``'s acquire and release, first come
    first served, where taking a free slot is a plain method call (the semaphore's ``acquire`` is a
    coroutine, created and run on every request)."""

    __slots__ = ("free", "loop", "waiters")

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        self.free = limit
        self.loop = loop
        self.waiters: deque[asyncio.Future[None]] = deque()

    def take_now(self) -> bool:
        """Take a slot if one is free and nobody waits for one."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a slot (after :meth:`take_now` said no). Cancelled while waiting: no slot taken,
        and one handed over at that very moment goes on to the next waiter."""
        if self.take_now():
            return
        waiter = self.loop.create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give()  # it was handed a slot, but its request is going away
            elif waiter in self.waiters:
                self.waiters.remove(waiter)
            raise

    def give(self) -> None:
        """Return a slot: to the longest waiter if there is one."""
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class Pool:
    """Keep-alive connections to one engine (``host:port``)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limit: int = 256,
        tenant_limit: int = 0,
        connect_timeout: float = 2.0,
        read_timeout: float = 300.0,
        total_timeout: float = 1800.0,
        idle_timeout: float = 4.0,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        # The name for TLS (SNI, certificate check) and the Host header: the Service's name when
        # ``host`` is one of its endpoints' addresses.
        self.server_name = server_name or host
        self.port = port
        self.loop = asyncio.get_running_loop()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.total_timeout = total_timeout
        self.idle_timeout = idle_timeout
        self._idle: deque[_Connection] = deque()
        self._slots = Slots(limit, self.loop)
        # Connections one tenant may hold at once (0: no share, the whole pool): one tenant's slow
        # streams cannot take every connection. A tenant's Slots exist while it holds or waits for one.
        self.tenant_limit = tenant_limit if 0 < tenant_limit < limit else 0
        self._used: dict[str, int] = {}  # tenant -> connections it holds (only tenants holding one)
        self._share_waiters: dict[str, deque[asyncio.Future[None]]] = {}  # tenants at their share
        self._host_line = f"Host: {self.server_name}:{port}\r\n".encode("latin-1")
        self._request_lines: dict[tuple[str, str], bytes] = {}
        self._addrs: list[str] = []
        self._addrs_expiry = 0.0
        self.closed = False

    async def _resolve(self) -> list[str]:
        """The engine's addresses, cached for :data:`DNS_TTL` seconds: a Service name in a pod's
        resolver (ndots:5) costs several DNS queries, and its ClusterIP does not change."""
        now = time.monotonic()
        if self._addrs and now < self._addrs_expiry:
            return self._addrs
        infos = await self.loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        self._addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
        self._addrs_expiry = now + DNS_TTL
        return self._addrs

    async def _open(self) -> _Connection:
        error: OSError | None = None
        for addr in await self._resolve():  # in the resolver's order, the first that accepts
            try:
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self),
                    addr,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.server_name if self.tls else None,
                )
                return conn
            except OSError as e:
                error = e
        assert error is not None
        raise error

    async def _connect(self) -> _Connection:
        try:
            return await asyncio.wait_for(self._open(), self.connect_timeout)
        except TimeoutError:
            raise UpstreamError("connect", f"connect to {self.host}:{self.port} timed out") from None
        except (OSError, ssl.SSLError) as e:
            self._addrs = []  # resolve again next time
            raise UpstreamError("connect", f"connect to {self.host}:{self.port} failed: {e}") from None

    def _reuse(self) -> _Connection | None:
        idle = self._idle
        oldest = time.monotonic() - self.idle_timeout
        while idle:
            conn = idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            if conn.idle_since < oldest or conn.readable():
                # Too old (the engine may be closing it right now), or closed by the engine already.
                conn.transport.close()
                continue
            return conn
        return None

    async def _wait_share(self, tenant: str) -> None:
        """Wait (within the total timeout) until ``tenant``, holding its whole share of this pool, may
        take a connection (counted for it when handed over); its waiters go first come, first served."""
        waiters = self._share_waiters.setdefault(tenant, deque())
        waiter = self.loop.create_future()
        waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, self.total_timeout)
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self._give_share(tenant)  # it was handed a connection, but its request is going away
            elif waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._share_waiters[tenant]
            if isinstance(e, TimeoutError):
                raise UpstreamError("timeout", "no free connection to the engine in time") from None
            raise

    def _give_share(self, tenant: str) -> None:
        waiters = self._share_waiters.get(tenant)
        while waiters:
            waiter = waiters.popleft()
            if not waiters:
                del self._share_waiters[tenant]
            if not waiter.done():
                waiter.set_result(None)  # handed over: the count stays
                return
        n = self._used[tenant] - 1
        if n:
            self._used[tenant] = n
        else:
            del self._used[tenant]

    def _done(self, conn: _Connection | None, tenant: str = "") -> None:
        self._slots.give()
        if tenant:
            self._give_share(tenant)
        now = time.monotonic()
        idle = self._idle
        while idle and (now - idle[0].idle_since > self.idle_timeout or idle[0].transport is None):
            old = idle.popleft()
            if old.transport is not None:
                old.transport.close()
        if conn is not None:
            if self.closed:
                if conn.transport is not None:
                    conn.transport.close()
                return
            conn.idle_since = now
            idle.append(conn)

    def _encode(
        self, method: str, path: str, headers: Mapping[str, str] | None, head: bytes, body: bytes
    ) -> bytes:
        """The request as it goes on the wire: request line, Host, ``headers`` (refused with a line
        break in them), ``head`` (lines already formatted), Content-Length, the body."""
        line = self._request_lines.get((method, path))
        if line is None:
            line = f"{method} {path} HTTP/1.1\r\n".encode("latin-1")
            if len(self._request_lines) < 64:  # the router sends a handful of paths
                self._request_lines[(method, path)] = line
        lines = [line, self._host_line]
        if headers:
            for k, v in headers.items():
                if "\n" in v or "\r" in v or "\n" in k or "\r" in k:
                    raise ValueError(f"header {k!r} contains a line break")
                lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        lines.append(head)
        if body or method == "POST":
            lines.append(b"Content-Length: %d\r\n" % len(body))
        lines.append(b"\r\n")
        lines.append(body)
        return b"".join(lines)

    # 57 lines: the per-request path (share, slot, connection, write, status line), one coroutine frame.
    async def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str] | None,
        body: bytes = b"",
        *,
        head: bytes = b"",
        fresh: bool = False,
        tenant: str = "",
    ) -> Response:
        """Send a request; returns once the answer's status and headers arrived. ``head``: header
        lines already formatted (``Name: value\\r\\n`` each), sent after ``headers``. ``fresh``: on a
        new connection. ``tenant``: whose share of the pool the connection counts against."""
        message = self._encode(method, path, headers, head, body)
        if not self.tenant_limit:
            tenant = ""
        elif tenant:
            used = self._used
            n = used.get(tenant, 0)
            if n < self.tenant_limit and tenant not in self._share_waiters:
                used[tenant] = n + 1
            else:
                await self._wait_share(tenant)  # the tenant holds its whole share of this pool
        if not self._slots.take_now():
            # Every connection to this engine is busy: wait for one, but not past the total timeout.
            try:
                await asyncio.wait_for(self._slots.take(), self.total_timeout)
            except BaseException as e:
                if tenant:
                    self._give_share(tenant)
                if isinstance(e, TimeoutError):
                    raise UpstreamError("timeout", "no free connection to the engine in time") from None
                raise
        conn: _Connection | None = None
        try:
            conn = None if fresh else self._reuse()
            if conn is None:
                conn = await self._connect()
            resp = conn.send(message)
            conn.tenant = tenant
        except BaseException:
            self._slots.give()
            if tenant:
                self._give_share(tenant)
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            raise
        try:
            while not resp.status:  # until the answer's head arrived (inline: a coroutine less)
                if resp.error is not None:
                    raise resp.error
                await resp._wait()
        except BaseException:
            resp.release()
            raise
        return resp

    def close(self) -> None:
        self.closed = True
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None:
                conn.transport.close()
