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

Replica choice: each trust class's engine replicas are :mod:`kvfence.router.endpoints`; a request goes
to its tenant's home replica on the class's consistent-hash ring unless that one is at its load bound
(:mod:`kvfence.router.balance`). A request that provably never reached an engine (no connection, or
one closed before the request was written: :mod:`kvfence.router.upstream` checks a kept-alive
connection before writing on it) is sent again, freshly signed, to another replica. One that was
written is never sent again, whatever happens next: an engine that dies on a request (a query of
death) costs one replica, not several.

Failure behaviour: a background probe marks an endpoint unhealthy when its health endpoint fails, and
a refused connection marks it at once; an unhealthy endpoint leaves the ring, and a class with no
serving endpoint gets an immediate 503 with a clear body instead of waiting on a connect timeout.
Timeouts: connect, per-read and total. The connections themselves are :mod:`kvfence.router.upstream`
pools, one per endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvfence.contract import (
    BODY_CACHE_SALT,
    CLIENT_FORBIDDEN_HEADERS,
    HEADER_PREFIX,
    strip_client_body,
    strip_client_headers,
)
from kvfence.contract.errors import error_body
from kvfence.router.endpoints import ClassEndpoints, Endpoint, Member, PoolFactory
from kvfence.router.errors import RouterError
from kvfence.router.flowcontrol import ClassFlow
from kvfence.router.http import Request, Response, Stream
from kvfence.router.metrics import RouterMetrics
from kvfence.router.slices import ServiceKey, SliceSource, service_of
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
    ("retry-after", "Retry-After"),  # an engine's 429 says when waiting will have cured it
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
    balance: str = "affinity"  # or "random" (the baseline: no affinity, no load bound)
    pool_per_tenant: int = 128  # connections to one engine one tenant may hold (0: the whole pool)
    # Flow control (kvfence.router.flowcontrol): sequences in flight per serving engine replica before
    # requests are held (0: never held), requests held per tenant, and the longest hold (then a 429).
    sequences_per_engine: int = 256
    queue_per_tenant: int = 64
    hold_timeout: float = 30.0
    workers: int = 1  # processes of this router replica: each holds its part of the bound


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


#: Replicas a request is sent to at most: the first, then others while it provably reached none
#: (connection refused or timed out, or closed before the request was written).
MAX_ATTEMPTS = 3
#: Upstream error kinds after which the request was not written, so another replica may take it.
RETRY_ELSEWHERE = frozenset({"connect", "unsent"})


def _compact_encoder() -> Callable[[Any], str]:
    """``json.dumps(doc, separators=(",", ":"))`` (ASCII output) without building an encoder per call:
    the C encoder made once (no circular-reference markers: the document was parsed from JSON, so it
    has no cycles); the pure-Python encoder where the C one is missing."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return json.JSONEncoder(separators=(",", ":")).encode

    def reject(o: Any) -> Any:
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

    c = make(None, reject, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)
    join = "".join
    return lambda doc: join(c(doc, 0))


_encode = _compact_encoder()


def build_body(plan: TenantPlan, body: dict[str, Any]) -> bytes:
    """The exact bytes sent upstream: stripped body plus the derived salt."""
    out = strip_client_body(body)
    out[BODY_CACHE_SALT] = plan.cache_salt
    return _encode(out).encode("ascii")


# Nothing on the allowlist is a header the contract strips (forwarding is allowlisted *and* stripped;
# tests/router/test_router_unit.py checks that the two never overlap).
_PREFIX_AFTER_NAME = "\n" + HEADER_PREFIX


def forwarded_headers(headers: list[tuple[str, str]], names: list[str]) -> tuple[list[tuple[str, str]], int]:
    """The client headers that may travel to the engine (:data:`FORWARD_HEADERS`, after
    :func:`kvfence.contract.strip_client_headers`), and how many headers the strip removed.
    ``names``: the headers' names in lower case. A request without any of those names (most of them)
    is answered by set operations, without a loop over its headers."""
    if CLIENT_FORBIDDEN_HEADERS.isdisjoint(names) and _PREFIX_AFTER_NAME not in "\n" + "\n".join(names):
        if FORWARD_HEADERS.isdisjoint(names):
            return [], 0
        return [h for h, low in zip(headers, names, strict=True) if low in FORWARD_HEADERS], 0
    kept = strip_client_headers(headers)
    return [h for h in kept if h[0].lower() in FORWARD_HEADERS], len(headers) - len(kept)


def build_head(plan: TenantPlan, path: str, client_headers: list[tuple[str, str]], payload: bytes) -> bytes:
    """The header lines sent upstream with ``payload`` (Host and Content-Length are the pool's): the
    allowlisted client headers (``client_headers`` already went through
    :func:`kvfence.contract.strip_client_headers`), Content-Type, and the identity headers signed over
    exactly ``payload``, with a fresh timestamp and nonce on every call."""
    lines = [f"{k}: {v}\r\n".encode("latin-1") for k, v in client_headers if k.lower() in FORWARD_HEADERS]
    for line in lines:
        if b"\n" in line[:-2] or b"\r" in line[:-2]:
            raise ValueError("a forwarded header contains a line break")
    lines.append(b"Content-Type: application/json\r\n")
    lines.append(plan.signer.head("POST", path, payload))
    return b"".join(lines)


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


def _saturated(plan: TenantPlan, why: str) -> RouterError:
    return RouterError(
        429,
        f"The engines of trust class '{plan.trust_class.name}' are saturated and {why}. Retry later.",
        "engine_saturated",
        "rate_limit_error",
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
        self.classes: dict[str, ClassEndpoints] = {}
        self._urls: dict[str, str] = {}  # class -> the endpoint URL its ClassEndpoints was built for
        self._services: dict[str, ServiceKey] = {}  # class -> the Service followed through slices
        self.slices: SliceSource | None = None  # when following EndpointSlices (see sync)
        self.flows: dict[str, ClassFlow[asyncio.Future[None]]] = {}  # class -> its flow control
        metrics.collect = self._collect

    def _collect(self) -> None:
        m = self.metrics
        m.endpoint_inflight.values = {
            ep.labels: float(ep.inflight) for ce in self.classes.values() for ep in ce.members.values()
        }
        m.queued.values = {
            (name, tenant): float(len(t.queue))
            for name, f in self.flows.items()
            for tenant, t in f.backlogged.items()
        }
        m.inflight_sequences.values = {(name,): float(f.inflight) for name, f in self.flows.items()}
        m.share_sequences.values = {(name,): float(f.reserved) for name, f in self.flows.items()}
        m.flow_capacity.values = {(name,): float(f.capacity) for name, f in self.flows.items()}

    # --- lifecycle ---------------------------------------------------------------------------
    async def close(self) -> None:
        for ce in self.classes.values():
            ce.close()
        self.classes.clear()

    def _factory(self, url: str) -> PoolFactory:
        u = urlsplit(url)
        https = u.scheme == "https"
        tls = ssl.create_default_context() if https else None
        c = self.config

        def make(host: str, port: int) -> Pool:
            return Pool(
                host,
                port,
                limit=c.pool_per_engine,
                tenant_limit=c.pool_per_tenant,
                connect_timeout=c.connect_timeout,
                read_timeout=c.read_timeout,
                total_timeout=c.total_timeout,
                tls=tls,
                server_name=u.hostname,
            )

        return make

    def sync(self, classes: dict[str, ClassPlan]) -> None:
        """Follow a (re)loaded table: one :class:`ClassEndpoints` per class, its members from the
        EndpointSlices of the class's Service when :attr:`slices` follows them, else the URL's own
        host and port. Classes gone from the table are closed (their in-flight requests finish)."""
        for name in [n for n in self.classes if n not in classes]:
            self.classes.pop(name).close()
            self._urls.pop(name, None)
            self._services.pop(name, None)
            gone = self.flows.pop(name, None)
            if gone is not None:  # its held requests go on, and find their class gone
                self.wake(gone.set_capacity(0))
        for name, cls in classes.items():
            ce = self.classes.get(name)
            if ce is not None and self._urls.get(name) == cls.endpoint:
                continue
            if ce is not None:
                ce.close()
            u = urlsplit(cls.endpoint)
            https = u.scheme == "https"
            ce = self.classes[name] = ClassEndpoints(
                name, u.path.rstrip("/"), self._factory(cls.endpoint), self.config.balance
            )
            self._urls[name] = cls.endpoint
            slices = self.slices
            service = service_of(cls.endpoint) if slices is not None else None
            if slices is not None and service is not None and service[1] in slices.names:
                self._services[name] = service
                ce.set_members(slices.members(service))
            else:
                self._services.pop(name, None)
                ce.set_members([Member(u.hostname or "", u.port or (443 if https else 80))])
            self._export(ce)

    def on_slices(self, service: ServiceKey, members: list[Member]) -> None:
        """A Service's EndpointSlices changed: update the classes served by it."""
        for name, svc in self._services.items():
            if svc == service:
                ce = self.classes[name]
                before = {e.key for e in ce.serving}
                for ep in ce.set_members(members):
                    log.info("trust class %s: endpoint %s left; draining it", name, ep.key)
                    self._forget(ep)
                after = {e.key for e in ce.serving}
                if before != after:
                    log.info("trust class %s: serving endpoints now %s", name, sorted(after) or "none")
                self._export(ce)

    def _forget(self, ep: Endpoint) -> None:
        # Pod IPs come and go: an endpoint's series end with it.
        self.metrics.endpoint_serving.values.pop(ep.labels, None)
        self.metrics.endpoint_requests.values.pop(ep.labels, None)

    def _export(self, ce: ClassEndpoints) -> None:
        self._resize(ce)
        for ep in ce.members.values():
            self.metrics.endpoint_serving.set(1.0 if ep.serving else 0.0, ep.labels)
        self.metrics.engine_healthy.set(1.0 if ce.serving else 0.0, (ce.name,))

    # --- flow control --------------------------------------------------------------------------
    def _resize(self, ce: ClassEndpoints) -> None:
        """The class's flow control follows its serving replicas: the bound per replica times how
        many serve, this process's part of it."""
        c = self.config
        if c.sequences_per_engine <= 0:
            return
        capacity = max(1, c.sequences_per_engine * len(ce.serving) // max(1, c.workers))
        flow = self.flows.get(ce.name)
        if flow is None:
            self.flows[ce.name] = ClassFlow(capacity, c.queue_per_tenant)
        elif flow.capacity != capacity:
            self.wake(flow.set_capacity(capacity))

    def reweigh(self, tenants: Mapping[str, TenantPlan]) -> None:
        """A reloaded table's weights reach each class's flow control at once (a share that grew may
        release a held request now, not when the next request ends)."""
        for name, flow in self.flows.items():
            weights = {t: p.weight for t, p in tenants.items() if p.trust_class.name == name}
            self.wake(flow.set_weights(weights))

    @staticmethod
    def wake(tickets: Sequence[asyncio.Future[None]]) -> None:
        for fut in tickets:
            if not fut.done():
                fut.set_result(None)
            # else: its request went away while being released; hold() gives its sequences back

    def finish(self, flow: ClassFlow[asyncio.Future[None]], tenant: str, sequences: int) -> None:
        """A request of ``tenant`` admitted by ``flow`` ended: wake what may go now (the hot path
        calls :meth:`ClassFlow.release` and :meth:`wake` itself)."""
        tickets = flow.release(tenant, sequences)
        if tickets:
            self.wake(tickets)

    async def hold(self, flow: ClassFlow[asyncio.Future[None]], plan: TenantPlan, sequences: int) -> None:
        """Wait until ``flow`` releases this request (:meth:`ClassFlow.try_admit` said no): a 429
        with Retry-After when the tenant's queue is full or the wait exceeds the hold timeout. Returns
        with ``sequences`` counted in flight; the caller ends them with :meth:`finish`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not flow.hold(plan.name, plan.weight, sequences, fut):
            self.metrics.flow_rejections.inc((plan.name, "queue_full"))
            raise _saturated(plan, f"{flow.queue_limit} of its requests are already waiting")
        self.metrics.held.inc((plan.name,))
        try:
            await asyncio.wait_for(fut, self.config.hold_timeout)
        except BaseException as e:
            if not flow.cancel(plan.name, fut):
                self.finish(flow, plan.name, sequences)  # released while it was going away
            elif flow.held:
                self.wake(flow.pump())  # the shares and the order changed without it
            if isinstance(e, TimeoutError):
                self.metrics.flow_rejections.inc((plan.name, "timeout"))
                raise _saturated(plan, f"its request waited {self.config.hold_timeout:g} s") from None
            raise

    def _mark(self, ce: ClassEndpoints, ep: Endpoint, healthy: bool, error: str = "") -> None:
        if ep.healthy != healthy:
            if healthy:
                log.info("engine of trust class %s at %s is healthy again", ce.name, ep.key)
            else:
                log.warning("engine of trust class %s at %s is unhealthy: %s", ce.name, ep.key, error)
        changed = ep.healthy != healthy
        ep.healthy, ep.last_error = healthy, error
        if changed:
            ce.refresh()
            self._export(ce)

    async def _get_status(self, ce: ClassEndpoints, ep: Endpoint, path: str) -> int:
        resp = await ep.pool.request("GET", ce.base + path, None)
        try:
            await resp.read()
            return resp.status
        finally:
            resp.release()

    async def probe(self, ce: ClassEndpoints, ep: Endpoint) -> bool:
        ep.last_probe = time.monotonic()
        error = ""
        try:
            status = await asyncio.wait_for(
                self._get_status(ce, ep, self.config.health_path), self.config.health_timeout
            )
            if status != 200:
                error = f"health check answered {status}"
        except (UpstreamError, TimeoutError) as e:
            error = f"health check failed: {type(e).__name__}: {e}"
        if ce.members.get(ep.key) is not ep:
            return False  # it left while being probed
        if not error:
            ep.failures = 0
            self._mark(ce, ep, True)
        else:
            ep.failures += 1
            if ep.failures >= PROBE_FAILURE_THRESHOLD:
                self._mark(ce, ep, False, error)
        return ep.healthy

    def _due(self, ep: Endpoint, now: float) -> bool:
        suspect = not ep.healthy or ep.failures > 0
        interval = RECOVERY_PROBE_INTERVAL if suspect else self.config.health_interval
        return now - ep.last_probe >= interval

    async def probe_all(self) -> None:
        """Probe the endpoints that are due: every ``health_interval`` seconds, and every
        :data:`RECOVERY_PROBE_INTERVAL` while one is unhealthy or has just failed a probe (a new
        endpoint is probed at once). Endpoints a slice says are not ready are not probed."""
        now = time.monotonic()
        due = [
            (ce, ep)
            for ce in list(self.classes.values())
            for ep in list(ce.members.values())
            if ep.ready and self._due(ep, now)
        ]
        await asyncio.gather(*(self.probe(ce, ep) for ce, ep in due))

    # --- forwarding ----------------------------------------------------------------------------
    def check_available(self, cls: ClassPlan) -> None:
        ce = self.classes.get(cls.name)
        if ce is not None and not ce.serving:
            self.metrics.upstream_errors.inc((cls.name, "unhealthy"))
            raise _unavailable(cls, f"unavailable ({self._why_down(ce)})")

    @staticmethod
    def _why_down(ce: ClassEndpoints) -> str:
        errors = sorted({ep.last_error for ep in ce.members.values() if not ep.healthy and ep.last_error})
        if errors:
            return "; ".join(errors)[:300]
        return "no ready endpoint" if ce.members else "no endpoints"

    async def _send(
        self, plan: TenantPlan, path: str, payload: bytes, client_headers: list[tuple[str, str]]
    ) -> tuple[UpstreamResponse, ClassEndpoints, Endpoint]:
        """Pick a replica and send; on a failure that the engine cannot have answered, another one.
        Returns the answer (status and headers read) and the endpoint it is on, whose ``inflight``
        now counts it (the caller ends it with :meth:`ClassEndpoints.end`)."""
        cls = plan.trust_class
        ce = self.classes.get(cls.name)
        if ce is None:  # a table swap raced with this request
            raise _unavailable(cls, "not known yet")
        tried: tuple[Endpoint, ...] = ()
        last: UpstreamError | None = None
        for attempt in range(MAX_ATTEMPTS):
            picked = ce.pick(plan.affinity, tried)
            if picked is None:
                break
            ep, home = picked
            if attempt == 0:
                self.metrics.affinity.inc(ce.hit_labels if home else ce.spill_labels)
            else:
                self.metrics.retries.inc((cls.name, last.kind if last else "connect"))
            self.metrics.endpoint_requests.inc(ep.labels)
            ce.begin(ep)
            try:
                # Signed for each attempt: a fresh nonce, since the engine refuses a replayed one.
                head = build_head(plan, path, client_headers, payload)
                url = ce.base + path
                resp = await ep.pool.request("POST", url, None, payload, head=head, tenant=plan.name)
                return resp, ce, ep
            except UpstreamError as e:
                ce.end(ep)
                if e.kind == "connect":
                    self._mark(ce, ep, False, f"connection failed: {e}")
                    self.metrics.upstream_errors.inc((cls.name, "connect"))
                elif e.kind == "timeout":
                    self.metrics.upstream_errors.inc((cls.name, "timeout"))
                    raise _timeout(cls) from None
                elif e.kind == "closed":
                    # Written, then the connection closed: the engine may have received it (and died
                    # of it). Not sent again.
                    self.metrics.upstream_errors.inc((cls.name, "closed"))
                    raise _bad_gateway(cls, f"closed the connection before answering ({e})") from None
                elif e.kind not in RETRY_ELSEWHERE:
                    self.metrics.upstream_errors.inc((cls.name, "protocol"))
                    raise _bad_gateway(cls, f"gave a bad answer ({e})") from None
                else:
                    self.metrics.upstream_errors.inc((cls.name, "unsent"))
                last = e
                tried += (ep,)
            except BaseException:
                ce.end(ep)
                raise
        if last is None:
            raise _unavailable(cls, f"unavailable ({self._why_down(ce)})")
        if last.kind == "connect":
            raise _unavailable(cls, "unreachable")
        raise _bad_gateway(cls, f"gave a bad answer ({last})")

    async def forward(
        self,
        request: Request,
        plan: TenantPlan,
        path: str,
        payload: bytes,
        client_headers: list[tuple[str, str]],
        want_usage: bool,
    ) -> Relay:
        """Send ``payload`` to the engine (with :func:`build_head`'s headers) and relay its answer.
        The caller checked :meth:`check_available` (a class with no serving endpoint is refused before
        its quota is taken); one that lost its last endpoint since is refused by :meth:`_send`."""
        cls = plan.trust_class
        resp, ce, ep = await self._send(plan, path, payload, client_headers)
        try:
            if resp.status == 401:
                # The client was authenticated by the router; an engine refusing the router's
                # signature is a deployment fault (key mismatch), not the client's.
                self.metrics.upstream_errors.inc((cls.name, "signature_refused"))
                body = await resp.read()
                log.error("engine %s at %s refused the router's signature: %r", cls.name, ep.key, body[:300])
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
            ce.end(ep)

    @staticmethod
    def _relay_headers(resp: UpstreamResponse) -> list[tuple[str, str]]:
        got = resp.headers
        h = [(name, got[key]) for key, name in RELAY_HEADERS if key in got]
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
