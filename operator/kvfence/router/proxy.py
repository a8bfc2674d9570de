"""Forwarding a tenant's request to its trust class's engine.

What goes upstream is rebuilt, never passed through:

* the body is the client's JSON object minus :data:`kvfence.contract.CLIENT_FORBIDDEN_BODY_FIELDS`
  (:func:`kvfence.contract.strip_client_body`), plus ``cache_salt`` set to the salt derived from the
  trust class key and the tenant's namespace, re-serialised by the router (so duplicate keys or odd
  encodings in the client's bytes cannot smuggle anything: the engine sees the router's bytes);
* the headers are a short allowlist of harmless client headers, filtered again by
  :func:`kvfence.contract.strip_client_headers`, plus the identity headers of
  :func:`kvfence.contract.sign` computed over exactly the bytes sent.

Answers are relayed as they come: a streamed (SSE) answer chunk by chunk, each chunk written to the
client as soon as the engine sends it.

Failure behaviour: a background probe marks an engine unhealthy when its health endpoint fails, and a
refused connection marks it at once; requests for an unhealthy engine get an immediate 503 with a
clear body instead of waiting on a connect timeout. Timeouts: connect, per-read and total.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from kvfence.contract import BODY_CACHE_SALT, sign, strip_client_body, strip_client_headers
from kvfence.router.errors import RouterError
from kvfence.router.metrics import RouterMetrics
from kvfence.router.table import ClassPlan, TenantPlan

log = logging.getLogger("kvfence.router.proxy")

#: Client headers that may travel to the engine (after the contract's strip as well).
FORWARD_HEADERS = frozenset({"accept", "user-agent", "x-request-id", "traceparent", "tracestate"})
#: Engine response headers relayed to the client.
RELAY_HEADERS = ("Content-Type", "Content-Encoding", "X-Request-Id", "Cache-Control")
#: Response header on every answer that comes from the engine (its status code), so that a client or a
#: test can tell an engine's error from the router's own.
HEADER_UPSTREAM_STATUS = "X-Kvfence-Upstream-Status"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    connect_timeout: float = 2.0
    read_timeout: float = 300.0  # longest gap between two reads from the engine
    total_timeout: float = 1800.0
    pool_per_engine: int = 256
    health_path: str = "/health"
    health_interval: float = 2.0
    health_timeout: float = 1.0


@dataclass(slots=True)
class Relay:
    """What :meth:`Proxy.forward` relayed."""

    response: web.StreamResponse
    total_tokens: int | None  # usage.total_tokens as the engine reported it, if it did
    stream_events: int = 0  # SSE events relayed (streams only)
    client_gone: bool = False  # the client disconnected before the end of the answer


#: Failed health probes in a row that make an engine unhealthy (one slow probe under load is not
#: enough); a refused connection on a real request counts at once.
PROBE_FAILURE_THRESHOLD = 2


class EngineState:
    __slots__ = ("failures", "healthy", "last_error")

    def __init__(self) -> None:
        self.healthy = True  # optimistic until a probe or a connection says otherwise
        self.last_error = ""
        self.failures = 0


def build_body(plan: TenantPlan, body: dict[str, Any]) -> bytes:
    """The exact bytes sent upstream: stripped body plus the derived salt."""
    out = strip_client_body(body)
    out[BODY_CACHE_SALT] = plan.cache_salt
    return json.dumps(out, separators=(",", ":")).encode("ascii")


def build_headers(
    plan: TenantPlan, path: str, client_headers: list[tuple[str, str]], payload: bytes
) -> dict[str, str]:
    headers = {k: v for k, v in strip_client_headers(client_headers) if k.lower() in FORWARD_HEADERS}
    headers["Content-Type"] = "application/json"
    headers.update(sign(plan.trust_class.signing_key, plan.identity, "POST", path, payload))
    return headers


class _UsageScanner:
    """Finds ``usage`` in an SSE stream without parsing every event: only events that mention it."""

    __slots__ = ("buf", "events", "total")

    def __init__(self) -> None:
        self.buf = b""
        self.events = 0
        self.total: int | None = None

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while True:
            i = self.buf.find(b"\n\n")
            if i < 0:
                break
            event, self.buf = self.buf[:i], self.buf[i + 2 :]
            self.events += 1
            if b'"usage"' in event:
                self.total = _usage_from_event(event) or self.total


def _usage_from_event(event: bytes) -> int | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                return _total_tokens(json.loads(data))
    return None


def _total_tokens(doc: Any) -> int | None:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if isinstance(usage, dict):
        t = usage.get("total_tokens")
        if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
            return t
    return None


class Proxy:
    def __init__(self, metrics: RouterMetrics, config: ProxyConfig | None = None) -> None:
        self.metrics = metrics
        self.config = config or ProxyConfig()
        self.engines: dict[str, EngineState] = {}
        self._urls: dict[tuple[str, str], URL] = {}
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=self.config.total_timeout,
            sock_connect=self.config.connect_timeout,
            sock_read=self.config.read_timeout,
        )

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self.config.pool_per_engine, keepalive_timeout=30, ttl_dns_cache=10
        )
        # auto_decompress off: bytes are relayed as the engine sent them (it is never asked to
        # compress, since Accept-Encoding is not forwarded).
        # DummyCookieJar: the session is shared by every tenant, so it must never keep a cookie an
        # engine sets and send it along with someone else's request (and it is faster).
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            timeout=self._timeout,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    def engine(self, cls: ClassPlan) -> EngineState:
        st = self.engines.get(cls.endpoint)
        if st is None:
            st = self.engines[cls.endpoint] = EngineState()
        return st

    def _mark(self, cls: ClassPlan, healthy: bool, error: str = "") -> None:
        st = self.engine(cls)
        if st.healthy != healthy:
            if healthy:
                log.info("engine of trust class %s at %s is healthy again", cls.name, cls.endpoint)
            else:
                log.warning("engine of trust class %s at %s is unhealthy: %s", cls.name, cls.endpoint, error)
        st.healthy, st.last_error = healthy, error
        self.metrics.engine_healthy.set(1.0 if healthy else 0.0, (cls.name,))

    async def probe(self, cls: ClassPlan) -> bool:
        url = cls.endpoint + self.config.health_path
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        st = self.engine(cls)
        error = ""
        try:
            async with self.session.get(url, timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    error = f"health check answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            error = f"health check failed: {type(e).__name__}: {e}"
        if not error:
            st.failures = 0
            self._mark(cls, True)
        else:
            st.failures += 1
            if st.failures >= PROBE_FAILURE_THRESHOLD:
                self._mark(cls, False, error)
        return st.healthy

    async def probe_all(self, classes: list[ClassPlan]) -> None:
        seen: dict[str, ClassPlan] = {}
        for c in classes:
            seen.setdefault(c.endpoint, c)
        await asyncio.gather(*(self.probe(c) for c in seen.values()))
        for endpoint in [e for e in self.engines if e not in seen]:
            del self.engines[endpoint]

    # --- forwarding ----------------------------------------------------------------------------
    def check_available(self, cls: ClassPlan) -> None:
        st = self.engines.get(cls.endpoint)
        if st is not None and not st.healthy:
            self.metrics.upstream_errors.inc((cls.name, "unhealthy"))
            raise RouterError(
                503,
                f"The engine for trust class '{cls.name}' is unavailable ({st.last_error}). Retry later.",
                "engine_unavailable",
                "service_unavailable",
                headers={"Retry-After": "1"},
            )

    async def forward(
        self,
        request: web.Request,
        plan: TenantPlan,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        want_usage: bool,
    ) -> Relay:
        """Send ``payload`` to the engine and relay its answer."""
        cls = plan.trust_class
        self.check_available(cls)
        url = self._urls.get((cls.endpoint, path))
        if url is None:
            url = self._urls[(cls.endpoint, path)] = URL(cls.endpoint + path)
        try:
            try:
                resp = await self.session.post(url, data=payload, headers=headers)
            except aiohttp.ServerDisconnectedError:
                # A pooled keep-alive connection the engine had just closed: nothing was processed.
                # Retry once on a fresh connection, with a fresh nonce (the engine refuses replays).
                headers.update(sign(cls.signing_key, plan.identity, "POST", path, payload))
                resp = await self.session.post(url, data=payload, headers=headers)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            self._mark(cls, False, f"connection failed: {type(e).__name__}")
            self.metrics.upstream_errors.inc((cls.name, "connect"))
            raise RouterError(
                503,
                f"The engine for trust class '{cls.name}' is unreachable. Retry later.",
                "engine_unavailable",
                "service_unavailable",
                headers={"Retry-After": "1"},
            ) from None
        except TimeoutError:
            self.metrics.upstream_errors.inc((cls.name, "timeout"))
            raise RouterError(
                504,
                f"The engine for trust class '{cls.name}' did not answer in time.",
                "engine_timeout",
                "upstream_error",
            ) from None
        except (aiohttp.ClientError, ConnectionError) as e:
            self.metrics.upstream_errors.inc((cls.name, "protocol"))
            raise RouterError(
                502,
                f"Bad answer from the engine for trust class '{cls.name}': {type(e).__name__}.",
                "bad_gateway",
                "upstream_error",
            ) from None
        try:
            if resp.status == 401:
                # The client was authenticated by the router; an engine refusing the router's
                # signature is a deployment fault (key mismatch), not the client's.
                self.metrics.upstream_errors.inc((cls.name, "signature_refused"))
                body = await resp.read()
                log.error("engine %s refused the router's signature: %r", cls.endpoint, body[:300])
                raise RouterError(
                    502,
                    f"The engine for trust class '{cls.name}' refused the router's signature.",
                    "engine_refused_signature",
                    "upstream_error",
                )
            ctype = resp.headers.get("Content-Type", "")
            if resp.status == 200 and ctype.startswith("text/event-stream"):
                return await self._relay_stream(request, resp, cls, want_usage)
            body = await resp.read()
            used = None
            if want_usage and resp.status == 200:
                with contextlib.suppress(ValueError, UnicodeDecodeError):
                    used = _total_tokens(json.loads(body))
            out = web.Response(status=resp.status, body=body, headers=self._relay_headers(resp))
            return Relay(out, used)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            self.metrics.upstream_errors.inc((cls.name, "read"))
            raise RouterError(
                502,
                f"The engine for trust class '{cls.name}' failed mid-answer ({type(e).__name__}).",
                "bad_gateway",
                "upstream_error",
            ) from None
        except asyncio.CancelledError:
            # The client went away (the server cancels the handler): abort the engine's answer
            # rather than return a half-read connection to the pool.
            resp.close()
            raise
        finally:
            resp.release()

    @staticmethod
    def _relay_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
        h = {name: v for name in RELAY_HEADERS if (v := resp.headers.get(name)) is not None}
        h[HEADER_UPSTREAM_STATUS] = str(resp.status)
        return h

    async def _relay_stream(
        self, request: web.Request, resp: aiohttp.ClientResponse, cls: ClassPlan, want_usage: bool
    ) -> Relay:
        headers = self._relay_headers(resp)
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"
        out = web.StreamResponse(status=resp.status, headers=headers)
        await out.prepare(request)
        scanner = _UsageScanner() if want_usage else None
        try:
            async for chunk in resp.content.iter_any():
                if scanner is not None:
                    scanner.feed(chunk)
                await out.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as e:
            # Headers are gone already; tell the client in-band, then end the stream.
            self.metrics.upstream_errors.inc((cls.name, "stream"))
            err = {
                "error": {
                    "message": f"engine stream failed: {type(e).__name__}",
                    "type": "upstream_error",
                    "param": None,
                    "code": "bad_gateway",
                }
            }
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            # The client went away: drop the engine connection so that the engine stops generating.
            resp.close()
            return Relay(out, None, scanner.events if scanner else 0, client_gone=True)
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await out.write_eof()
        if scanner is None:
            return Relay(out, None)
        return Relay(out, scanner.total, scanner.events)
