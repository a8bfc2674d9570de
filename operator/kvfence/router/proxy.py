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
clear body instead of waiting on a connect timeout. Timeouts: connect, per-read and total. The
connections themselves are :mod:`kvfence.router.upstream` pools, one per engine endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvfence.contract import BODY_CACHE_SALT, sign, strip_client_body, strip_client_headers
from kvfence.contract.errors import error_body
from kvfence.router.errors import RouterError
from kvfence.router.http import Request, Response, Stream
from kvfence.router.metrics import RouterMetrics
from kvfence.router.table import ClassPlan, TenantPlan
from kvfence.router.upstream import Pool, UpstreamError
from kvfence.router.upstream import Response as UpstreamResponse

log = logging.getLogger("kvfence.router.proxy")

#: Client headers that may travel to the engine (after the contract's strip as well).
FORWARD_HEADERS = frozenset({"accept", "user-agent", "x-request-id", "traceparent", "tracestate"})
#: Engine response headers relayed to the client (lower-case, as the upstream client keeps them).
RELAY_HEADERS = (
    ("content-type", "Content-Type"),
    ("content-encoding", "Content-Encoding"),
    ("x-request-id", "X-Request-Id"),
    ("cache-control", "Cache-Control"),
)
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

    response: Response | Stream  # its status is the engine's
    total_tokens: int | None  # usage.total_tokens as the engine reported it, if it did
    stream_events: int = 0  # SSE events relayed (streams only)
    client_gone: bool = False  # the client disconnected before the end of the answer


#: Failed health probes in a row that make an engine unhealthy (one slow probe under load is not
#: enough); a refused connection on a real request counts at once.
PROBE_FAILURE_THRESHOLD = 2
#: Seconds between probes of an engine that is unhealthy or failed its last probe, so that one that
#: comes back (a new class's engine starting, a restarted pod) serves again within about this long.
RECOVERY_PROBE_INTERVAL = 0.5


class EngineState:
    __slots__ = ("failures", "healthy", "last_error", "last_probe")

    def __init__(self) -> None:
        self.healthy = True  # optimistic until a probe or a connection says otherwise
        self.last_error = ""
        self.failures = 0
        self.last_probe = -1e9  # never: probed at the next round


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


def _unavailable(cls: ClassPlan, why: str) -> RouterError:
    return RouterError(
        503,
        f"The engine for trust class '{cls.name}' is {why}. Retry later.",
        "engine_unavailable",
        "service_unavailable",
        headers={"Retry-After": "1"},
    )


def _timeout(cls: ClassPlan) -> RouterError:
    message = f"The engine for trust class '{cls.name}' did not answer in time."
    return RouterError(504, message, "engine_timeout", "upstream_error")


def _bad_gateway(cls: ClassPlan, what: str) -> RouterError:
    return RouterError(
        502, f"The engine for trust class '{cls.name}' {what}.", "bad_gateway", "upstream_error"
    )


class Proxy:
    def __init__(self, metrics: RouterMetrics, config: ProxyConfig | None = None) -> None:
        self.metrics = metrics
        self.config = config or ProxyConfig()
        self.engines: dict[str, EngineState] = {}
        self._pools: dict[str, tuple[Pool, str]] = {}  # endpoint -> (pool, base path)

    # --- lifecycle ---------------------------------------------------------------------------
    async def close(self) -> None:
        for pool, _ in self._pools.values():
            pool.close()
        self._pools.clear()

    def pool(self, endpoint: str) -> tuple[Pool, str]:
        """The connection pool of an engine endpoint (``http(s)://host[:port][/base]``)."""
        entry = self._pools.get(endpoint)
        if entry is None:
            u = urlsplit(endpoint)
            https = u.scheme == "https"
            pool = Pool(
                u.hostname or "",
                u.port or (443 if https else 80),
                limit=self.config.pool_per_engine,
                connect_timeout=self.config.connect_timeout,
                read_timeout=self.config.read_timeout,
                total_timeout=self.config.total_timeout,
                tls=ssl.create_default_context() if https else None,
            )
            entry = self._pools[endpoint] = (pool, u.path.rstrip("/"))
        return entry

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

    async def _get_status(self, endpoint: str, path: str) -> int:
        pool, base = self.pool(endpoint)
        resp = await pool.request("GET", base + path, {})
        try:
            await resp.read()
            return resp.status
        finally:
            resp.release()

    async def probe(self, cls: ClassPlan) -> bool:
        st = self.engine(cls)
        st.last_probe = time.monotonic()
        error = ""
        try:
            status = await asyncio.wait_for(
                self._get_status(cls.endpoint, self.config.health_path), self.config.health_timeout
            )
            if status != 200:
                error = f"health check answered {status}"
        except (UpstreamError, TimeoutError) as e:
            error = f"health check failed: {type(e).__name__}: {e}"
        if not error:
            st.failures = 0
            self._mark(cls, True)
        else:
            st.failures += 1
            if st.failures >= PROBE_FAILURE_THRESHOLD:
                self._mark(cls, False, error)
        return st.healthy

    def _due(self, cls: ClassPlan, now: float) -> bool:
        st = self.engine(cls)
        suspect = not st.healthy or st.failures > 0
        interval = RECOVERY_PROBE_INTERVAL if suspect else self.config.health_interval
        return now - st.last_probe >= interval

    async def probe_all(self, classes: list[ClassPlan]) -> None:
        """Probe the engines that are due: every ``health_interval`` seconds, and every
        :data:`RECOVERY_PROBE_INTERVAL` while one is unhealthy or has just failed a probe (a new
        endpoint is probed at once). Forgets engines no longer in the table."""
        seen: dict[str, ClassPlan] = {}
        for c in classes:
            seen.setdefault(c.endpoint, c)
        now = time.monotonic()
        await asyncio.gather(*(self.probe(c) for c in seen.values() if self._due(c, now)))
        for endpoint in [e for e in self.engines if e not in seen]:
            del self.engines[endpoint]
        for endpoint in [e for e in self._pools if e not in seen]:
            self._pools.pop(endpoint)[0].close()

    # --- forwarding ----------------------------------------------------------------------------
    def check_available(self, cls: ClassPlan) -> None:
        st = self.engines.get(cls.endpoint)
        if st is not None and not st.healthy:
            self.metrics.upstream_errors.inc((cls.name, "unhealthy"))
            raise _unavailable(cls, f"unavailable ({st.last_error})")

    async def _send(
        self, plan: TenantPlan, path: str, payload: bytes, headers: dict[str, str]
    ) -> UpstreamResponse:
        cls = plan.trust_class
        pool, base = self.pool(cls.endpoint)
        try:
            try:
                return await pool.request("POST", base + path, headers, payload)
            except UpstreamError as e:
                if e.kind != "stale":
                    raise
                # A pooled keep-alive connection the engine had just closed: nothing was processed.
                # Retry once on a fresh connection, with a fresh nonce (the engine refuses replays).
                headers.update(sign(cls.signing_key, plan.identity, "POST", path, payload))
                return await pool.request("POST", base + path, headers, payload, fresh=True)
        except UpstreamError as e:
            if e.kind == "connect":
                self._mark(cls, False, f"connection failed: {e}")
                self.metrics.upstream_errors.inc((cls.name, "connect"))
                raise _unavailable(cls, "unreachable") from None
            if e.kind == "timeout":
                self.metrics.upstream_errors.inc((cls.name, "timeout"))
                raise _timeout(cls) from None
            self.metrics.upstream_errors.inc((cls.name, "protocol"))
            raise _bad_gateway(cls, f"gave a bad answer ({e})") from None

    async def forward(
        self,
        request: Request,
        plan: TenantPlan,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        want_usage: bool,
    ) -> Relay:
        """Send ``payload`` to the engine and relay its answer."""
        cls = plan.trust_class
        self.check_available(cls)
        resp = await self._send(plan, path, payload, headers)
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
            if resp.status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._relay_stream(request, resp, cls, want_usage)
            body = await resp.read()
            used = None
            if want_usage and resp.status == 200:
                with contextlib.suppress(ValueError, UnicodeDecodeError):
                    used = _total_tokens(json.loads(body))
            out = Response(resp.status, body, self._relay_headers(resp), content_type="")
            return Relay(out, used)
        except UpstreamError as e:
            kind = "timeout" if e.kind == "timeout" else "read"
            self.metrics.upstream_errors.inc((cls.name, kind))
            if e.kind == "timeout":
                raise _timeout(cls) from None
            raise _bad_gateway(cls, f"failed mid-answer ({e})") from None
        finally:
            # Back to the pool when read to its end; closed otherwise (a client that went away
            # cancels this handler: closing the engine connection stops the generation).
            resp.release()

    @staticmethod
    def _relay_headers(resp: UpstreamResponse) -> list[tuple[str, str]]:
        h = [(name, v) for key, name in RELAY_HEADERS if (v := resp.headers.get(key)) is not None]
        h.append((HEADER_UPSTREAM_STATUS, str(resp.status)))
        return h

    async def _relay_stream(
        self, request: Request, resp: UpstreamResponse, cls: ClassPlan, want_usage: bool
    ) -> Relay:
        headers = [(k, v) for k, v in self._relay_headers(resp) if k != "Cache-Control"]
        headers += [("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no")]
        out = request.stream(resp.status, headers)
        scanner = _UsageScanner() if want_usage else None
        try:
            async for chunk in resp.chunks_iter():
                if scanner is not None:
                    scanner.feed(chunk)
                await out.write(chunk)
        except UpstreamError as e:
            # Headers are gone already; tell the client in-band, then end the stream.
            self.metrics.upstream_errors.inc((cls.name, "stream"))
            err = error_body(f"engine stream failed: {e}", "bad_gateway", "upstream_error")
            with contextlib.suppress(ConnectionError):
                await out.write(b"data: " + err + b"\n\n")
        except ConnectionError:
            # The client went away: the engine connection is closed on release, which stops it.
            return Relay(out, None, scanner.events if scanner else 0, client_gone=True)
        out.end()
        if scanner is None:
            return Relay(out, None)
        return Relay(out, scanner.total, scanner.events)
