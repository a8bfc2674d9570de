"""The router's own HTTP/1.1 layer over real sockets: the server (:mod:`kvfence.router.http`) driven by
a raw-bytes client, and the upstream pool (:mod:`kvfence.router.upstream`) against raw-bytes servers
that misbehave on purpose. Every test runs on both event loops the router may run on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from router.support import standard_table

from kvfence.router.endpoints import Member
from kvfence.router.errors import RouterError, error_response
from kvfence.router.http import HttpServer, Request, Response, Stream
from kvfence.router.metrics import RouterMetrics
from kvfence.router.proxy import Proxy, ProxyConfig, build_body
from kvfence.router.table import parse_table
from kvfence.router.upstream import Pool, Slots, UpstreamError


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    def runner(coro: Coroutine[Any, Any, None]) -> None:
        wrapped = asyncio.wait_for(coro, 30)
        if request.param == "uvloop":
            uvloop.run(wrapped)
        else:
            asyncio.run(wrapped)

    return runner


def _error(status: int, message: str) -> Response:
    return error_response(status, message, f"e{status}")


async def start(
    handler: Callable[[Request], Awaitable[Response | Stream]], **kw: Any
) -> tuple[HttpServer, int]:
    server = HttpServer(handler, _error, max_body=kw.pop("max_body", 1024), **kw)
    await server.start("127.0.0.1", 0)
    return server, server.port


async def echo(req: Request) -> Response:
    doc = {"method": req.method, "path": req.path, "query": req.query, "body": req.body.decode()}
    return Response(200, json.dumps(doc).encode())


async def read_response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response from a raw stream (Content-Length, chunked, or until EOF)."""
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await r.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            chunk = await r.readexactly(size + 2)
            if size == 0:
                return status, headers, body
            body += chunk[:-2]
    return status, headers, await r.read()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


# --- server ---------------------------------------------------------------------------------------------
def test_keep_alive_and_pipelined_requests_answered_in_order(run: Any) -> None:
    async def slow_first(req: Request) -> Response:
        if req.path == "/1":
            await asyncio.sleep(0.2)  # the later requests are parsed meanwhile; answers stay in order
        return await echo(req)

    async def main() -> None:
        server, port = await start(slow_first)
        r, w = await connect(port)
        # /2 asks for 100-continue while /1 is being answered: no interim answer may overtake /1's.
        expect = "Expect: 100-continue\r\n"
        w.write(post("/1", b"one") + post("/2?q=1", b"two", expect) + b"GET /3 HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = [await read_response(r) for _ in range(3)]
        assert [json.loads(b)["path"] for _, _, b in answers] == ["/1", "/2", "/3"]
        assert json.loads(answers[1][2]) == {"method": "POST", "path": "/2", "query": "q=1", "body": "two"}
        assert all(s == 200 and "date" in h and "connection" not in h for s, h, _ in answers)
        w.write(post("/4", b"again"))  # still open
        assert json.loads((await read_response(r))[2])["body"] == "again"
        # Upgrade is ignored (RFC 9110 lets a server do so): a plain answer, then the connection ends.
        w.write(b"GET /5 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n")
        status, headers, _ = await read_response(r)
        assert status == 200 and "upgrade" not in headers
        assert await r.read() == b""
        w.close()
        await server.shutdown(1)

    run(main())


def test_a_request_target_in_absolute_form_is_served_by_its_path(run: Any) -> None:
    """``POST http://host/v1/completions`` (absolute form, what a client configured with the router as
    its HTTP proxy sends): a server must accept it (RFC 9112, 3.2.2) and route it by its path and
    query, whatever the authority says."""

    async def main() -> None:
        server, port = await start(echo)
        r, w = await connect(port)
        for target in (b"http://router.example:8080/v1/x?q=1", b"HTTPS://other/v1/x?q=1"):
            w.write(b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi" % target)
            status, _, body = await read_response(r)
            assert status == 200 and json.loads(body) == {
                "method": "POST",
                "path": "/v1/x",
                "query": "q=1",
                "body": "hi",
            }
        w.write(b"GET http://router.example HTTP/1.1\r\nHost: x\r\n\r\n")  # no path: the root
        assert json.loads((await read_response(r))[2])["path"] == "/"
        w.close()
        await server.shutdown(1)

    run(main())


def test_chunked_request_body_and_expect_100_continue(run: Any) -> None:
    async def main() -> None:
        server, port = await start(echo)
        r, w = await connect(port)
        w.write(b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert json.loads((await read_response(r))[2])["body"] == "abcde"
        w.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert await r.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # before the body
        w.write(b"hello")
        assert json.loads((await read_response(r))[2])["body"] == "hello"
        w.write(post("/x", b"", "Expect: something-else\r\n"))
        assert (await read_response(r))[0] == 417
        w.close()
        await server.shutdown(1)

    run(main())


def test_http_1_0_answers_close_the_connection(run: Any) -> None:
    async def streamed(req: Request) -> Stream:
        s = req.stream(200, [("Content-Type", "text/event-stream")])
        await s.write(b"data: a\n\n")
        await s.write(b"data: b\n\n")
        return s

    async def main() -> None:
        server, port = await start(echo)
        r, w = await connect(port)
        w.write(b"GET /old HTTP/1.0\r\n\r\n")
        status, headers, body = await read_response(r)
        assert status == 200 and headers["connection"] == "close" and json.loads(body)["path"] == "/old"
        assert await r.read() == b""  # closed by the server
        await server.shutdown(1)
        server, port = await start(streamed)
        r, w = await connect(port)
        w.write(b"GET /s HTTP/1.0\r\n\r\n")
        status, headers, body = await read_response(r)  # no chunked framing for 1.0: ends at EOF
        assert "transfer-encoding" not in headers and body == b"data: a\n\ndata: b\n\n"
        await server.shutdown(1)

    run(main())


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (70 * 1024) + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431),
        (b"GET /" + b"a" * (70 * 1024) + b" HTTP/1.1\r\n\r\n", 414),
        (b"BLAH\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400),  # obsolete line folding
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400),
        # request smuggling: both framings at once
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (post("/big", b"x" * 2000), 413),  # refused from Content-Length, before the body is read
    ],
)
def test_bad_requests_get_a_clear_error_and_the_connection_closes(run: Any, raw: bytes, status: int) -> None:
    async def main() -> None:
        server, port = await start(echo)
        r, w = await connect(port)
        w.write(raw)
        got, headers, body = await read_response(r)
        assert got == status and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == f"e{status}"
        assert await r.read() == b""
        await server.shutdown(1)

    run(main())


def test_chunked_body_over_the_limit_is_answered_while_the_client_still_sends(run: Any) -> None:
    async def main() -> None:
        server, port = await start(echo, max_body=10_000)
        r, w = await connect(port)
        w.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(24):  # keeps sending after the 413 was written: the answer must not be lost
            w.write(b"400\r\n" + b"a" * 1024 + b"\r\n")
            await w.drain()
            if i in (12, 23):
                await asyncio.sleep(0.2)  # the 413 is written meanwhile
        status, _, body = await read_response(r)
        assert status == 413 and json.loads(body)["error"]["code"] == "e413"
        await server.shutdown(1)

    run(main())


def test_slow_client_gets_408_and_idle_connections_are_closed(run: Any) -> None:
    async def main() -> None:
        server, port = await start(echo, request_timeout=0.5, keepalive_timeout=0.5)
        r, w = await connect(port)
        w.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")  # never finishes
        status, headers, _ = await read_response(r)
        assert status == 408 and headers["connection"] == "close"
        r, w = await connect(port)
        w.write(post("/", b"ok"))
        assert (await read_response(r))[0] == 200
        assert await asyncio.wait_for(r.read(), 5) == b""  # idle past keepalive_timeout: closed
        await server.shutdown(1)

    run(main())


def test_client_disconnect_cancels_the_handler(run: Any) -> None:
    async def main() -> None:
        cancelled = asyncio.Event()
        entered = asyncio.Event()

        async def forever(req: Request) -> Response:
            entered.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return Response()

        server, port = await start(forever)
        _, w = await connect(port)
        w.write(post("/", b"x"))
        await entered.wait()
        w.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        await server.shutdown(1)

    run(main())


def test_streamed_answer_waits_for_a_slow_client_and_arrives_intact(run: Any) -> None:
    async def main() -> None:
        written = 0
        chunk = bytes(range(256)) * 256  # 64 KiB

        async def big(req: Request) -> Stream:
            nonlocal written
            s = req.stream(200, [("Content-Type", "application/octet-stream")])
            for _ in range(256):  # 16 MiB
                await s.write(chunk)
                written += 1
            return s

        server, port = await start(big)
        r, w = await connect(port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.5)
        assert written < 256, "the handler ran ahead of a client that reads nothing"
        status, headers, body = await read_response(r)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == chunk * 256 and written == 256
        w.close()
        await server.shutdown(1)

    run(main())


def test_handler_crash_is_a_500_and_the_connection_lives_on(run: Any) -> None:
    async def crash(req: Request) -> Response:
        if req.path == "/boom":
            raise RuntimeError("bug")
        if req.path == "/boom-mid-stream":
            s = req.stream(200, [])
            await s.write(b"partial")
            raise RuntimeError("bug after the head")
        return await echo(req)

    async def main() -> None:
        server, port = await start(crash)
        r, w = await connect(port)
        w.write(post("/boom", b""))
        status, _, body = await read_response(r)
        assert status == 500 and json.loads(body)["error"]["code"] == "e500"
        w.write(post("/fine", b""))
        assert (await read_response(r))[0] == 200
        # Failing after a streamed answer began: no second status line, the connection is cut
        # (the chunked body never gets its terminating chunk, so the client knows it is incomplete).
        w.write(post("/boom-mid-stream", b""))
        with pytest.raises(asyncio.IncompleteReadError):
            await read_response(r)
        w.close()
        await server.shutdown(1)

    run(main())


def test_shutdown_finishes_in_flight_requests_and_closes_idle_ones(run: Any) -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def gated(req: Request) -> Response:
            if req.path == "/slow":
                await release.wait()
            return await echo(req)

        server, port = await start(gated)
        r1, w1 = await connect(port)
        w1.write(post("/slow", b"in-flight"))
        r2, w2 = await connect(port)
        w2.write(post("/quick", b""))
        assert (await read_response(r2))[0] == 200
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(server.shutdown(10))
        assert await asyncio.wait_for(r2.read(), 5) == b""  # the idle connection is closed
        with pytest.raises(OSError):
            await connect(port)  # no longer accepting
        release.set()
        status, headers, body = await read_response(r1)
        assert status == 200 and json.loads(body)["body"] == "in-flight" and headers["connection"] == "close"
        await stopping

    run(main())


# --- upstream pool ----------------------------------------------------------------------------------
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A TCP server whose every connection runs ``script(reader, writer)``; counts connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.open = 0
        self.max_open = 0

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            await self.script(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            w.close()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await r.readexactly(length)


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)


async def serve_forever(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        _, body = await read_request(r)
        w.write(ok(body))


def test_pool_reuses_connections_and_respects_its_limit(run: Any) -> None:
    async def main() -> None:
        async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                _, body = await read_request(r)
                await asyncio.sleep(0.05)
                w.write(ok(body))

        srv = RawServer(slow)
        pool = Pool("127.0.0.1", await srv.start(), limit=2)

        async def one(i: int) -> bytes:
            resp = await pool.request("POST", "/", {"X-I": str(i)}, b"%d" % i)
            try:
                return await resp.read()
            finally:
                resp.release()

        assert await asyncio.gather(*(one(i) for i in range(10))) == [b"%d" % i for i in range(10)]
        assert srv.max_open == 2 and srv.connections == 2  # at most two at once, both reused
        pool.close()

    run(main())


def test_pool_slots_are_first_come_first_served_and_never_lost_to_a_cancelled_wait(run: Any) -> None:
    async def main() -> None:
        slots = Slots(1, asyncio.get_running_loop())
        assert slots.take_now() and not slots.take_now()
        order: list[str] = []

        async def waits(name: str) -> None:
            await slots.take()
            order.append(name)

        first = asyncio.ensure_future(waits("first"))
        gone = asyncio.ensure_future(waits("gone"))
        last = asyncio.ensure_future(waits("last"))
        await asyncio.sleep(0)
        assert len(slots.waiters) == 3
        gone.cancel()  # cancelled while waiting: it takes nothing
        await asyncio.sleep(0)
        assert gone.cancelled() and len(slots.waiters) == 2
        slots.give()
        await first
        slots.give()
        await last
        assert order == ["first", "last"]
        # A slot handed over at the moment its waiter is cancelled goes on to the next one.
        late = asyncio.ensure_future(waits("late"))
        after = asyncio.ensure_future(waits("after"))
        await asyncio.sleep(0)
        slots.give()  # resolves late's waiter...
        late.cancel()  # ...but late is cancelled before it runs
        await asyncio.sleep(0)
        await after
        assert late.cancelled() and order == ["first", "last", "after"]
        slots.give()
        assert slots.free == 1 and not slots.waiters and slots.take_now()  # nothing was lost

    run(main())


def test_pool_never_writes_on_a_connection_the_engine_closed_and_a_written_request_is_closed(
    run: Any,
) -> None:
    """A kept-alive connection the engine closed while idle is never written on, even when the loop
    has not read its end of file yet: the request goes on a new connection. A request written and then
    dropped unanswered is ``closed`` on a reused connection as on a new one (the engine received it)."""

    async def main() -> None:
        close_now, closed = asyncio.Event(), asyncio.Event()

        async def answer_once_then_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if closed.is_set():
                return await serve_forever(r, w)
            await read_request(r)
            w.write(ok())
            await close_now.wait()
            w.close()
            await w.wait_closed()
            closed.set()

        srv = RawServer(answer_once_then_close)
        pool = Pool("127.0.0.1", await srv.start())
        resp = await pool.request("POST", "/", {}, b"1")
        assert await resp.read() == b"ok"
        resp.release()
        conn = pool._idle[-1]
        assert conn.transport is not None and not conn.readable()
        conn.transport.pause_reading()  # the loop does not see the engine's end of file...
        close_now.set()
        await closed.wait()
        assert conn.transport is not None and conn.readable()  # ...but the pool does
        resp = await pool.request("POST", "/", {}, b"2")
        assert await resp.read() == b"2" and srv.connections == 2
        resp.release()

        received: list[bytes] = []

        async def answer_once_then_drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            received.append((await read_request(r))[1])
            w.write(ok())
            received.append((await read_request(r))[1])  # read, then closed unanswered

        pool2 = Pool("127.0.0.1", await RawServer(answer_once_then_drop).start())
        resp = await pool2.request("POST", "/", {}, b"1")
        assert await resp.read() == b"ok"
        resp.release()
        with pytest.raises(UpstreamError) as e:
            await pool2.request("POST", "/", {}, b"2")
        assert e.value.kind == "closed" and received == [b"1", b"2"]

        async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)

        pool3 = Pool("127.0.0.1", await RawServer(drop).start())
        with pytest.raises(UpstreamError) as e:
            await pool3.request("POST", "/", {}, b"1")
        assert e.value.kind == "closed"
        for p in (pool, pool2, pool3):
            p.close()

    run(main())


def test_pool_a_new_connection_lost_before_the_request_was_sent_is_an_unsent_error(run: Any) -> None:
    """An engine killed right after the kernel accepted the connection: its reset can arrive between
    the connect and the write. Nothing was sent, so the error is ``unsent`` (the proxy sends the
    request to another replica), never an exception the proxy does not know (a 500)."""

    async def main() -> None:
        async def reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.transport.abort()

        pool = Pool("127.0.0.1", await RawServer(reset).start())
        real_open = pool._open

        async def open_then_lose_it() -> Any:
            conn = await real_open()
            for _ in range(200):  # the reset is processed before the request is written
                if conn.transport is None:
                    break
                await asyncio.sleep(0.005)
            assert conn.transport is None, "the server did not reset the connection"
            return conn

        pool._open = open_then_lose_it  # type: ignore[method-assign]
        for _ in range(3):  # and the connection slot comes back each time
            with pytest.raises(UpstreamError) as e:
                await pool.request("POST", "/", {}, b"1")
            assert e.value.kind == "unsent"
        assert pool._slots.free == 256 and not pool._slots.waiters  # the default limit, all free
        pool.close()

    run(main())


def test_pool_streams_chunks_as_they_arrive_and_reads_bodies_ended_by_close(run: Any) -> None:
    async def main() -> None:
        go_on = asyncio.Event()

        async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await go_on.wait()
            w.write(b"6\r\nsecond\r\n0\r\n\r\n")

        pool = Pool("127.0.0.1", await RawServer(chunked).start())
        resp = await pool.request("POST", "/", {}, b"")
        it = resp.chunks_iter()
        assert await it.__anext__() == b"first"  # before the engine sent the rest
        go_on.set()
        assert b"".join([c async for c in it]) == b"second"
        resp.release()

        async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")

        pool2 = Pool("127.0.0.1", await RawServer(until_close).start())
        resp = await pool2.request("GET", "/", {})
        assert await resp.read() == b"all of it" and not resp.keep_alive
        resp.release()
        pool.close()
        pool2.close()

    run(main())


def test_pool_read_timeout_holds_on_a_reused_connection(run: Any) -> None:
    """One timer per connection, armed across its answers: a request on a kept-alive connection
    whose earlier answers came fast still times out when the engine goes silent, whether that
    connection's timer was still armed from the answers before (sent at once) or had run out (sent
    after the read timeout), and a fast answer in between never trips it."""

    async def main() -> None:
        async def fast_then_silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            for _ in range(3):
                await read_request(r)
                w.write(ok(b"fast"))
            await read_request(r)
            await asyncio.sleep(3600)

        for pause in (0.0, 0.5):
            server = RawServer(fast_then_silent)
            pool = Pool("127.0.0.1", await server.start(), read_timeout=0.3, total_timeout=5.0)
            for i in range(3):
                resp = await pool.request("POST", "/", {}, b"x")
                assert resp.status == 200 and await resp.read() == b"fast"
                resp.release()
                if i == 1:
                    await asyncio.sleep(pause)  # past the read timeout: the timer ran out meanwhile
            with pytest.raises(UpstreamError) as e:
                await pool.request("POST", "/", {}, b"x")
            assert e.value.kind == "timeout" and "read timeout" in str(e.value)  # not the total one
            assert server.connections == 1  # all four on the one kept-alive connection
            pool.close()

    run(main())


def test_pool_never_lets_a_second_answer_in_one_read_overwrite_the_first(run: Any) -> None:
    """An engine out of step sends two answers to one request in one write: the first is the
    answer, its status and body untouched by the second, and the connection is never reused (its
    next bytes cannot be trusted to start an answer)."""

    async def main() -> None:
        async def two_answers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                await read_request(r)
                w.write(ok(b"first") + b"HTTP/1.1 500 Oops\r\nContent-Length: 6\r\n\r\nsecond")

        server = RawServer(two_answers)
        pool = Pool("127.0.0.1", await server.start())
        for _ in range(2):
            resp = await pool.request("POST", "/", {}, b"x")
            assert resp.status == 200 and await resp.read() == b"first"
            resp.release()
        assert server.connections == 2  # the first connection was closed, not reused
        pool.close()

    run(main())


def test_pool_skips_interim_1xx_answers_before_the_final_one(run: Any) -> None:
    """An engine (or a proxy beside it) may send interim answers (``103 Early Hints``, an unasked
    ``100 Continue``) before the final one (RFC 9110, 15.2: a client must accept them). They are not
    the answer: the final status, headers and body are, and the connection stays reusable."""

    async def main() -> None:
        async def hints_first(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while True:
                await read_request(r)
                w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await asyncio.sleep(0.01)  # in separate reads, and in one below
                w.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\nX-Hint: 1\r\n\r\n" + ok(b"final"))

        server = RawServer(hints_first)
        pool = Pool("127.0.0.1", await server.start())
        for _ in range(2):
            resp = await pool.request("POST", "/", {}, b"x")
            assert resp.status == 200 and await resp.read() == b"final"
            assert "link" not in resp.headers and "x-hint" not in resp.headers
            resp.release()
        assert server.connections == 1  # reused
        pool.close()

    run(main())


def test_pool_errors_connect_timeout_protocol_and_injection(run: Any) -> None:
    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            await asyncio.sleep(3600)

        pool = Pool("127.0.0.1", await RawServer(silent).start(), read_timeout=0.3)
        with pytest.raises(UpstreamError) as e:
            await pool.request("POST", "/", {}, b"")
        assert e.value.kind == "timeout"

        async def trickle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(8):  # a byte every 0.1 s: never silent for 0.3 s, but 0.8 s in total
                await asyncio.sleep(0.1)
                w.write(b"1\r\na\r\n")

        pool2 = Pool("127.0.0.1", await RawServer(trickle).start(), read_timeout=0.3, total_timeout=0.5)
        resp = await pool2.request("POST", "/", {}, b"")
        with pytest.raises(UpstreamError) as e:
            await resp.read()
        assert e.value.kind == "timeout" and "total" in str(e.value)
        resp.release()

        async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"NOT HTTP AT ALL\r\n\r\n")

        pool3 = Pool("127.0.0.1", await RawServer(garbage).start())
        with pytest.raises(UpstreamError) as e:
            await pool3.request("POST", "/", {}, b"")
        assert e.value.kind == "protocol"

        with socket_port() as closed_port:
            pool4 = Pool("127.0.0.1", closed_port)
            with pytest.raises(UpstreamError) as e:
                await pool4.request("POST", "/", {}, b"")
            assert e.value.kind == "connect"

        srv = RawServer(serve_forever)
        pool5 = Pool("127.0.0.1", await srv.start())
        with pytest.raises(ValueError, match="line break"):
            await pool5.request("POST", "/", {"X-A": "b\r\nX-Kvfence-Tenant: eve"}, b"")
        assert srv.connections == 0  # refused before anything was sent
        for p in (pool, pool2, pool3, pool5):
            p.close()

    run(main())


@contextlib.contextmanager
def socket_port() -> Any:
    """A port nobody listens on."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_pool_release_mid_answer_closes_the_engine_connection(run: Any) -> None:
    async def main() -> None:
        saw_eof = asyncio.Event()

        async def endless(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            w.write(b"3\r\nabc\r\n")
            await w.drain()
            if await r.read() == b"":
                saw_eof.set()

        srv = RawServer(endless)
        pool = Pool("127.0.0.1", await srv.start())
        resp = await pool.request("POST", "/", {}, b"")
        assert await resp.chunks_iter().__anext__() == b"abc"
        resp.release()  # the client went away: the engine must see its connection close
        await asyncio.wait_for(saw_eof.wait(), 5)
        resp = await pool.request("POST", "/", {}, b"")  # a new connection, not the dropped one
        assert srv.connections == 2
        resp.release()
        pool.close()

    run(main())


def test_pool_stops_reading_an_engine_faster_than_its_consumer(run: Any) -> None:
    async def main() -> None:
        data = bytes(range(256)) * 4096 * 8  # 8 MiB

        async def flood(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data))
            w.write(data)
            await w.drain()

        pool = Pool("127.0.0.1", await RawServer(flood).start())
        resp = await pool.request("GET", "/", {})
        await asyncio.sleep(0.3)
        assert resp.buffered < len(data) // 2  # not the whole answer in memory
        assert await resp.read() == data
        resp.release()
        pool.close()

    run(main())


def test_proxy_sends_a_request_an_engine_received_and_died_on_to_no_other_replica(run: Any) -> None:
    """A query of death: three replicas, each of which reads a request and closes the connection
    unanswered. The request costs one replica, not three: the client gets a 502 and the engines saw
    one request in all. A replica that refuses connections is skipped (nothing reached it) for one that
    answers."""

    async def main() -> None:
        seen: list[bytes] = []

        async def die(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            seen.append((await read_request(r))[0])

        ports = [await RawServer(die).start() for _ in range(3)]
        table = parse_table(
            json.dumps(standard_table(f"http://127.0.0.1:{ports[0]}", "http://silver:8000")).encode()
        )
        plan = table.tenants["alice"]
        proxy = Proxy(RouterMetrics(), ProxyConfig())
        proxy.sync(table.classes)
        ce = proxy.classes["gold"]
        ce.set_members([Member("127.0.0.1", p) for p in ports])
        payload = build_body(plan, {"model": "tiny", "prompt": "p"})
        with pytest.raises(RouterError) as e:
            await proxy._send(plan, "/v1/completions", payload, [])
        assert e.value.status == 502 and len(seen) == 1
        assert proxy.metrics.retries.values == {}

        good = await RawServer(serve_forever).start()
        with contextlib.closing(socket.socket()) as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = int(s.getsockname()[1])
        ce.set_members([Member("127.0.0.1", dead), Member("127.0.0.1", good)])
        for _ in range(4):
            resp, ce2, ep = await proxy._send(plan, "/v1/completions", payload, [])
            assert resp.status == 200
            resp.release()
            ce2.end(ep)
        assert len(seen) == 1  # nothing more reached a dying replica
        await proxy.close()

    run(main())


def test_pool_resolves_once_per_ttl_and_bounds_the_wait_for_a_connection(run: Any) -> None:
    async def main() -> None:
        srv = RawServer(serve_forever)
        port = await srv.start()  # listens on 127.0.0.1 only: "localhost" may resolve to ::1 first
        pool = Pool("localhost", port, limit=1, total_timeout=0.5)
        resp = await pool.request("POST", "/", {}, b"a")
        assert await resp.read() == b"a"
        resp.release()
        pool.host = "no-such-host.invalid"  # DNS would now fail; the cached address still serves
        resp = await pool.request("POST", "/", {}, b"b", fresh=True)
        assert await resp.read() == b"b"
        # The one connection is held (answer read, not released): the next request may wait for it
        # no longer than the total timeout.
        with pytest.raises(UpstreamError) as e:
            await pool.request("POST", "/", {}, b"c")
        assert e.value.kind == "timeout" and "no free connection" in str(e.value)
        resp.release()
        pool._addrs_expiry = 0.0  # the cache expired: resolving the bogus name fails, clearly
        with pytest.raises(UpstreamError) as e:
            await pool.request("POST", "/", {}, b"d", fresh=True)
        assert e.value.kind == "connect" and "no-such-host.invalid" in str(e.value)
        pool.close()

    run(main())


def test_pool_gives_each_tenant_a_bounded_share_of_its_connections(run: Any) -> None:
    """With a share of two, a tenant holding two connections waits for one of them; another tenant
    is served meanwhile, and the waiter goes on when the first tenant frees one."""

    async def main() -> None:
        srv = RawServer(serve_forever)
        pool = Pool("127.0.0.1", await srv.start(), limit=8, tenant_limit=2)
        held = [await pool.request("POST", "/", {}, b"a%d" % i, tenant="a") for i in range(2)]
        third = asyncio.ensure_future(pool.request("POST", "/", {}, b"a2", tenant="a"))
        for _ in range(100):  # until it waits (a few loop turns: wait_for runs it in a task)
            if pool._share_waiters.get("a"):
                break
            await asyncio.sleep(0)
        assert not third.done() and len(pool._share_waiters["a"]) == 1 and pool._used == {"a": 2}
        other = await pool.request("POST", "/", {}, b"b", tenant="b")
        assert await other.read() == b"b"
        other.release()
        assert "b" not in pool._used  # counted while used only
        assert not third.done() and srv.connections == 3
        assert await held[0].read() == b"a0"
        held[0].release()
        resp = await third
        assert await resp.read() == b"a2"
        for r in (resp, held[1]):
            await r.read()
            r.release()
        assert pool._used == {} and not pool._share_waiters and pool._slots.free == 8
        pool.close()

    run(main())


def test_proxy_hold_gives_back_what_a_cancelled_or_timed_out_request_held(run: Any) -> None:
    """A held request whose client leaves is withdrawn from its tenant's queue; one released at the
    moment it leaves gives its sequences back; one held past the hold timeout is a 429 with
    Retry-After. Nothing stays counted in flight."""

    async def main() -> None:
        table = parse_table(json.dumps(standard_table("http://127.0.0.1:9", "http://silver:8000")).encode())
        plan = table.tenants["alice"]
        proxy = Proxy(RouterMetrics(), ProxyConfig(sequences_per_engine=1, hold_timeout=0.05))
        proxy.sync(table.classes)
        flow = proxy.flows["gold"]
        assert flow.capacity == 1 and flow.try_admit("alice", 1, 1) and not flow.try_admit("alice", 1, 1)
        gone = asyncio.ensure_future(proxy.hold(flow, plan, 1))
        await asyncio.sleep(0)
        assert flow.queued("alice") == 1
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        assert flow.held == 0 and flow.inflight == 1
        racing = asyncio.ensure_future(proxy.hold(flow, plan, 1))
        await asyncio.sleep(0)
        proxy.finish(flow, "alice", 1)  # releases it...
        racing.cancel()  # ...as its client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await racing
        assert flow.held == 0 and flow.inflight in (0, 1)
        if flow.inflight:  # it went through before the cancel reached it
            proxy.finish(flow, "alice", 1)
        assert flow.try_admit("alice", 1, 1) and flow.inflight == 1
        with pytest.raises(RouterError) as e:
            await proxy.hold(flow, plan, 1)
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        assert flow.held == 0 and flow.inflight == 1
        assert proxy.metrics.flow_rejections.values == {("alice", "timeout"): 1.0}
        proxy.finish(flow, "alice", 1)
        assert flow.inflight == 0 and flow.inflight_of == flow.weight_of == {} and flow.weights == 0
        await proxy.close()

    run(main())


def test_proxy_wakes_a_request_whose_share_a_withdrawn_one_widened(run: Any) -> None:
    """Capacity two, filled by Alice. Dave's request (two sequences) and Bob's (one) wait: with three
    tenants active Bob's share, 2 x 1/3, is less than a sequence. Dave's client leaves: Bob's share
    becomes 2 x 1/2 and his request goes at once, while Alice's are still in flight."""

    async def main() -> None:
        table = parse_table(json.dumps(standard_table("http://127.0.0.1:9", "http://silver:8000")).encode())
        proxy = Proxy(RouterMetrics(), ProxyConfig(sequences_per_engine=2, hold_timeout=30))
        proxy.sync(table.classes)
        flow = proxy.flows["gold"]
        assert flow.try_admit("alice", 1, 1) and flow.try_admit("alice", 1, 1)
        assert not flow.try_admit("dave", 1, 2)
        dave = asyncio.ensure_future(proxy.hold(flow, table.tenants["dave"], 2))
        await asyncio.sleep(0)
        assert not flow.try_admit("bob", 1, 1)
        bob = asyncio.ensure_future(proxy.hold(flow, table.tenants["bob"], 1))
        await asyncio.sleep(0)
        assert flow.queued("bob") == 1 and flow.queued("dave") == 1
        dave.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dave
        await asyncio.wait_for(bob, 5)
        assert flow.held == 0 and flow.inflight == 3 and flow.reserved == 1
        for tenant in ("alice", "alice", "bob"):
            proxy.finish(flow, tenant, 1)
        assert flow.inflight == 0 and flow.inflight_of == {} and flow.reserved_of == {}
        await proxy.close()

    run(main())
