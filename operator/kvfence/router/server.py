"""The router's HTTP server: ``kvfence-router --routing-table FILE``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (the calling
tenant's models and adapters only), ``GET /metrics``, ``GET /healthz`` (the process runs),
``GET /readyz`` (a valid routing table is loaded and the router is not draining).

The request path, in order: read the body with a size limit (413, in :mod:`.http`) -> authenticate
(401) -> parse and check the few fields the router needs (400) -> model/adapter allowlist (403) ->
quotas (429 + Retry-After) -> forward to the trust class's engine (503 fast when it is down) ->
correct the token reservation with the engine's usage. See docs/router.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvfence.contract.routing import ROUTING_SECRET_KEY
from kvfence.kube import connection
from kvfence.router.auth import AuthError, authenticate
from kvfence.router.endpoints import Member
from kvfence.router.errors import RouterError, error_response
from kvfence.router.flowcontrol import ClassFlow
from kvfence.router.http import (
    KEEPALIVE_TIMEOUT,
    REQUEST_TIMEOUT,
    WRITE_TIMEOUT,
    HttpServer,
    Request,
    Response,
    Stream,
)
from kvfence.router.metrics import RouterMetrics
from kvfence.router.proxy import RECOVERY_PROBE_INTERVAL, Proxy, ProxyConfig, build_body, forwarded_headers
from kvfence.router.quota_store import QuotaStore, SharedQuotaStore
from kvfence.router.quotas import QuotaManager, Rejection, Reservation
from kvfence.router.siblings import SiblingError, Siblings
from kvfence.router.slices import ENGINE_SERVICE, ServiceKey, SliceSource
from kvfence.router.source import SecretSource
from kvfence.router.surface import CHAT_COMPLETIONS, COMPLETIONS, check_request
from kvfence.router.table import CompiledTable, TableWatcher, TenantPlan

log = logging.getLogger("kvfence.router")
access_log = logging.getLogger("kvfence.router.access")

GC_YOUNG_THRESHOLD = 10_000


@dataclass(frozen=True, slots=True)
class RouterConfig:
    routing_table: str = ""  # a file (the mounted Secret), polled; or:
    routing_secret: str = ""  # NAMESPACE/NAME of the Secret, followed through the Kubernetes API
    routing_secret_key: str = ROUTING_SECRET_KEY
    kubeconfig: str | None = None  # for routing_secret and the EndpointSlices; default: in-cluster
    endpoint_slices: bool = False  # pick engine replicas from the classes' EndpointSlices
    router_service: str = ""  # NAMESPACE/NAME of the router's Service: quotas follow its ready endpoints
    reload_interval: float = 1.0
    replicas: int = 1
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 1024  # reserved when a request does not say max_tokens
    metrics_port: int = 0  # serve /metrics (and the probes) on this port only; 0: on the API port
    access_log: bool = False  # one JSON line per API request on the logger kvfence.router.access
    keepalive_timeout: float = KEEPALIVE_TIMEOUT  # idle client connections
    request_timeout: float = REQUEST_TIMEOUT  # a client's whole request, once started
    client_write_timeout: float = WRITE_TIMEOUT  # an answer left unread by its client: cut off after
    workers: int = 1  # processes serving the port (SO_REUSEPORT), sharing the quota counters
    proxy: ProxyConfig = field(default_factory=ProxyConfig)


class RouterState:
    def __init__(self, config: RouterConfig, store: QuotaStore | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        # Following the router Service, this replica may join others that admitted requests already.
        # ``store``: the counters shared by this replica's worker processes (None: one worker).
        self.quotas = QuotaManager(
            replicas=config.replicas, join_empty=bool(config.router_service), store=store
        )
        self.metrics.router_replicas.set(config.replicas)
        self.proxy = Proxy(self.metrics, config.proxy)
        self.router_service: ServiceKey | None = None
        self.slices: SliceSource | None = None
        names = [ENGINE_SERVICE] if config.endpoint_slices else []
        if config.router_service:
            namespace, _, name = config.router_service.partition("/")
            self.router_service = (namespace, name)
            names.append(name)
        # The API server's connection, loaded once for the sources that follow it (main checked it).
        self.kube = connection.load(config.kubeconfig) if names or config.routing_secret else None
        if names:
            assert self.kube is not None
            self.slices = SliceSource(names, self._on_slices, self.kube)
            if config.endpoint_slices:
                self.proxy.slices = self.slices
        self.watcher = TableWatcher(
            config.routing_table,
            interval=config.reload_interval,
            on_change=self._on_table,
            on_result=lambda r: self.metrics.reloads.inc((r,)),
        )
        self.draining = False
        self.worker = 0  # which of the --workers processes this is
        self.siblings: Siblings | None = None  # the other workers' metrics (--workers N)
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def table(self) -> CompiledTable:
        return self.watcher.table

    def _on_table(self, table: CompiledTable) -> None:
        self.quotas.sync((name, p.quotas) for name, p in table.tenants.items())
        self.proxy.sync(table.classes)
        self.proxy.reweigh(table.tenants)
        self.metrics.table_generation.inc()
        self.metrics.table_tenants.set(len(table.tenants))

    def _on_slices(self, service: ServiceKey, members: list[Member]) -> None:
        if service == self.router_service:
            ready = sum(1 for m in members if m.ready)
            if self.quotas.set_replicas(ready):
                log.info("%d router replicas ready: each enforces 1/%d of every quota", ready, max(1, ready))
            self.metrics.router_replicas.set(self.quotas.replicas)
        if self.config.endpoint_slices:
            self.proxy.on_slices(service, members)

    @property
    def not_ready_reason(self) -> str:
        if not self.watcher.loaded:
            return f"No valid routing table loaded yet ({self.watcher.last_error or 'not read yet'})."
        if self.slices is not None and not self.slices.synced:
            return "The EndpointSlices have not been listed yet."
        return ""

    async def start(self) -> None:
        if self.slices is not None:
            self.tasks.append(asyncio.create_task(self.slices.run()))
        if self.config.routing_secret:
            namespace, _, name = self.config.routing_secret.partition("/")
            assert self.kube is not None
            source = SecretSource(namespace, name, self.config.routing_secret_key, self.kube)
            self.tasks.append(asyncio.create_task(source.run(self.watcher)))
        else:
            self.watcher.check()
            self.tasks.append(asyncio.create_task(self.watcher.run()))
        self.tasks.append(asyncio.create_task(self.health_loop()))

    async def stop(self) -> None:
        self.draining = True
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.proxy.close()

    async def health_loop(self) -> None:
        while True:
            try:
                await self.proxy.probe_all()
            except Exception:
                log.exception("health probe round failed")
            await asyncio.sleep(min(self.config.proxy.health_interval, RECOVERY_PROBE_INTERVAL))


# --- request parsing --------------------------------------------------------------------------------
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e400: re-sent as Infinity, which is not JSON
        raise ValueError(f"{text} is out of range")
    return value


_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_finite_float
)  # built once: json.loads(**kw) builds one per call


#: The decoder's scanner (C), called directly.
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
#: JSON's insignificant whitespace (RFC 8259, section 2).
_WHITESPACE = " \t\n\r"


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        # _DECODER.decode(text), without its two Python frames: the C scanner after leading
        # whitespace, then nothing but whitespace may follow the document.
        text = raw.decode("utf-8")
        body, end = _SCAN(text, 0 if text[:1] == "{" else len(text) - len(text.lstrip(_WHITESPACE)))
        if end != len(text) and text[end:].strip(_WHITESPACE):
            raise ValueError("extra data after the JSON document")
    except (StopIteration, ValueError, UnicodeDecodeError, RecursionError):
        raise RouterError(400, "The request body is not valid JSON.", "invalid_json") from None
    if not isinstance(body, dict):
        raise RouterError(400, "The request body must be a JSON object.", "invalid_json")
    return body


def reserve_tokens(raw_len: int, sequences: int, max_tokens: int) -> int:
    """Tokens to reserve: an upper bound of the prompts (the body's length in bytes: every tokenizer
    in use yields at most one token per byte, and the JSON keys cover the chat template) plus the
    completion allowance of every sequence."""
    return raw_len + max_tokens * sequences


def _refusal(r: Rejection) -> RouterError:
    """A quota's refusal: 429 with Retry-After for what waiting cures; a 400 that clients do not retry,
    naming the limit, for a request that exceeds the limit itself and can never be admitted."""
    if r.limit:
        return RouterError(400, r.message, "request_exceeds_quota", param=r.limit)
    return RouterError(
        429,
        r.message,
        f"{r.quota}_quota_exceeded",
        "rate_limit_error",
        headers={"Retry-After": str(r.retry_after)},
    )


# --- handlers ---------------------------------------------------------------------------------------
Answer = Response | Stream


def _json(doc: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(doc, separators=(",", ":")).encode())


def _authenticate(state: RouterState, request: Request) -> TenantPlan:
    if not state.watcher.loaded:
        raise RouterError(503, "The router has no routing table yet.", "not_ready", "service_unavailable")
    if request.header_count("authorization") > 1:
        state.metrics.auth_failures.inc(("malformed",))
        raise RouterError(401, "Send exactly one Authorization header.", "invalid_api_key")
    try:
        plan = authenticate(state.table, request.header("authorization"))
    except AuthError as e:
        state.metrics.auth_failures.inc((e.reason,))
        raise RouterError(401, str(e), "invalid_api_key") from None
    request.tenant = plan.name
    return plan


async def _hold(
    state: RouterState,
    flow: ClassFlow[asyncio.Future[None]],
    plan: TenantPlan,
    sequences: int,
    grant: Reservation,
) -> None:
    """Flow control held the request: wait for its turn (:meth:`Proxy.hold`); refused or gone while
    held, it was never sent and its quota is given back whole."""
    try:
        await state.proxy.hold(flow, plan, sequences)
    except BaseException:
        state.quotas.release(grant, 0)
        raise


class Prepared(NamedTuple):
    """An inference request as the engine will get it (:func:`_prepare`)."""

    payload: bytes
    headers: list[tuple[str, str]]
    #: tokens reserved against the tenant's quotas (:func:`reserve_tokens`)
    tokens: int
    #: sequences the request asks for (prompts times choices): flow control's and the quotas' unit
    sequences: int


def _prepare(state: RouterState, plan: TenantPlan, request: Request, path: str) -> Prepared:
    """Check an inference request and build what the engine gets, or raise the client's 4xx: the model
    must be one the key may use, the body within the class's request limits (what is not allowlisted
    is stripped or refused, :func:`~kvfence.router.surface.check_request`), the headers allowlisted,
    and the class's engine available."""
    raw = request.body
    body = parse_body(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RouterError(400, "'model' must be a non-empty string.", "invalid_value", param="model")
    if model not in plan.allowed_models:
        state.metrics.forbidden.inc((plan.name,))
        raise RouterError(
            403,
            f"The model or adapter '{model[:200]}' is not available to this API key.",
            "model_not_allowed",
            "permission_error",
            param="model",
        )
    cls = plan.trust_class
    sequences, max_tokens, stripped_fields, dropped = check_request(
        body, path, cls.request_limits, state.config.default_max_tokens
    )
    tokens = reserve_tokens(len(raw), sequences, max_tokens)
    if stripped_fields:
        state.metrics.stripped.inc(("body",), len(stripped_fields))
    if dropped:
        state.metrics.stripped.inc(("dropped",), len(dropped))
        body = {k: v for k, v in body.items() if k not in dropped}
    client_headers, stripped = forwarded_headers(request.headers, request.names)
    if stripped:
        state.metrics.stripped.inc(("header",), stripped)
    state.proxy.check_available(cls)
    return Prepared(build_body(plan, body), client_headers, tokens, sequences)


# 61 lines: the benchmarked hot path, where one more coroutine would add a frame to every request.
async def _inference(state: RouterState, request: Request, path: str) -> Answer:
    started = time.perf_counter()
    plan = _authenticate(state, request)
    cls = plan.trust_class
    code = "500"
    try:
        payload, client_headers, tokens, sequences = _prepare(state, plan, request, path)
        grant = state.quotas.acquire(plan.name, plan.quotas, tokens, sequences)
        if isinstance(grant, Rejection):
            state.metrics.quota_rejections.inc((plan.name, grant.quota))
            raise _refusal(grant)
        flow = state.proxy.flows.get(cls.name)
        if flow is not None and not flow.try_admit(plan.name, plan.weight, sequences):
            await _hold(state, flow, plan, sequences, grant)
        inflight = state.metrics.inflight
        inflight.inc((cls.name,))
        used: int | None = None
        try:
            try:
                relay = await state.proxy.forward(
                    request, plan, path, payload, client_headers, want_usage=grant.quota.tpm is not None
                )
            except RouterError:
                used = 0  # the engine could not be reached or failed before answering: refund
                raise
            used = relay.total_tokens
            if used is None and relay.stream_events:
                # A stream without a usage event: the prompt estimate plus one token per event.
                used = len(request.body) + relay.stream_events
            status = relay.response.status
            code = "499" if relay.client_gone else str(status)
            if status >= 400 and used is None:
                used = 0  # the engine refused the request: nothing was generated
            return relay.response
        finally:
            inflight.inc((cls.name,), -1)
            if flow is not None:
                woken = flow.release(plan.name, sequences)
                if woken:
                    state.proxy.wake(woken)
            charged = state.quotas.release(grant, used)
            if charged:
                state.metrics.tokens.inc((plan.name,), charged)
    except RouterError as e:
        code = str(e.status)
        raise
    except (ConnectionError, asyncio.CancelledError):
        code = "499"  # the client went away
        raise
    finally:
        state.metrics.requests.inc((plan.name, cls.name, path, code))
        state.metrics.duration.observe(time.perf_counter() - started, (cls.name, path))


# Plain functions returning _inference's coroutine: one coroutine frame less on every request.
def completions(state: RouterState, request: Request) -> Awaitable[Answer]:
    return _inference(state, request, COMPLETIONS)


def chat_completions(state: RouterState, request: Request) -> Awaitable[Answer]:
    return _inference(state, request, CHAT_COMPLETIONS)


async def models(state: RouterState, request: Request) -> Answer:
    plan = _authenticate(state, request)
    return Response(200, plan.models_body)


async def metrics(state: RouterState, request: Request) -> Answer:
    if state.siblings is None:
        body = state.metrics.render()
    else:
        try:
            body = await state.siblings.render()
        except SiblingError as e:
            log.warning("metrics scrape failed: %s", e)
            return Response(503, f"{e}\n".encode(), content_type="text/plain; charset=utf-8")
    return Response(200, body, content_type="text/plain; charset=utf-8")


async def healthz(state: RouterState, request: Request) -> Answer:
    return _json({"status": "ok"})


async def readyz(state: RouterState, request: Request) -> Answer:
    if state.draining:
        return error_response(503, "The router is shutting down.", "draining", "service_unavailable")
    why = state.not_ready_reason
    if why:
        return error_response(503, why, "not_ready", "service_unavailable")
    return _json({"status": "ready", "tenants": len(state.table.tenants), "worker": state.worker})


Route = Callable[[RouterState, Request], Awaitable[Answer]]
#: path -> (method, handler). GET routes answer HEAD as well.
API_ROUTES: dict[str, tuple[str, Route]] = {
    COMPLETIONS: ("POST", completions),
    CHAT_COMPLETIONS: ("POST", chat_completions),
    "/v1/models": ("GET", models),
    "/metrics": ("GET", metrics),
    "/healthz": ("GET", healthz),
    "/readyz": ("GET", readyz),
}
#: The separate listener of ``--metrics-port``: metrics and probes, no tenant API.
OPS_ROUTES = {p: API_ROUTES[p] for p in ("/metrics", "/healthz", "/readyz")}

#: The codes of the errors the HTTP layer answers itself (see :class:`kvfence.router.http.HttpServer`).
PROTOCOL_ERROR_CODES = {
    400: "invalid_request",
    408: "request_timeout",
    413: "request_too_large",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "headers_too_large",
    500: "internal_error",
}


def protocol_error(status: int, message: str) -> Response:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(status, message, PROTOCOL_ERROR_CODES.get(status, "http_error"), type_)


Dispatch = Callable[[Request], Awaitable[Answer]]


def dispatcher(state: RouterState, routes: dict[str, tuple[str, Route]], logged: bool = False) -> Dispatch:
    """The HTTP server's handler: route by path and method, answer the router's errors in the API's
    error shape; with ``logged``, write the access log."""

    async def route(request: Request) -> Answer:
        found = routes.get(request.path)
        if found is None:
            return error_response(404, "Not Found", "not_found")
        method, handler = found
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            allow = "GET, HEAD" if method == "GET" else method
            return error_response(405, "Method Not Allowed", "method_not_allowed", headers={"Allow": allow})
        try:
            return await handler(state, request)
        except RouterError as e:
            return e.response()

    if not logged:
        return route

    async def dispatch(request: Request) -> Answer:
        if request.path in UNLOGGED:
            return await route(request)
        started = time.perf_counter()
        status = 500
        try:
            out = await route(request)
            status = out.status
            return out
        except (asyncio.CancelledError, ConnectionError):
            status = 499  # the client went away
            raise
        finally:
            log_access(request, status, time.perf_counter() - started)

    return dispatch


#: Probes and scrapes, every few seconds from the kubelet and Prometheus: not in the access log.
UNLOGGED = frozenset({"/healthz", "/readyz", "/metrics"})


def log_access(request: Request, status: int, seconds: float) -> None:
    """One JSON line per request: who (the authenticated tenant, never the key), what, the outcome.
    Never the body, the query string or any header but X-Request-Id."""
    entry = {
        "remote": request.peer,
        "method": request.method[:16],
        "path": request.path[:256],  # JSON-escaped: a client's odd path cannot forge a log line
        "status": status,
        "tenant": request.tenant,
        "duration_ms": round(seconds * 1000, 3),
        "request_id": (request.header("x-request-id") or "")[:128] or None,
    }
    access_log.info(json.dumps(entry, separators=(",", ":")))


# --- serving ----------------------------------------------------------------------------------------
async def _listen(
    state: RouterState, config: RouterConfig, host: str, port: int
) -> tuple[HttpServer, HttpServer | None]:
    """Start the API server, and the metrics and probes server when it has its own port."""
    routes = (
        API_ROUTES if not config.metrics_port else {p: r for p, r in API_ROUTES.items() if p != "/metrics"}
    )
    api = HttpServer(
        dispatcher(state, routes, logged=config.access_log),
        protocol_error,
        max_body=config.max_body_bytes,
        keepalive_timeout=config.keepalive_timeout,
        request_timeout=config.request_timeout,
        write_timeout=config.client_write_timeout,
        on_slow_client=state.metrics.slow_clients.inc,
    )
    shared_port = config.workers > 1
    await api.start(host, port, reuse_port=shared_port)
    ops: HttpServer | None = None
    if config.metrics_port:
        ops = HttpServer(dispatcher(state, OPS_ROUTES), protocol_error, max_body=64 * 1024)
        await ops.start(host, config.metrics_port, reuse_port=shared_port)
        log.info("metrics and probes on %s:%d", host, config.metrics_port)
    return api, ops


def _tune_gc() -> None:
    # Everything alive now (modules, the app, the table) lives as long as the process: keep it out of
    # the cyclic GC's generations, so that full collections stay short (they show up in p99 latency).
    gc.collect()
    gc.freeze()
    # A request allocates a few dozen tracked objects that die with it: a young-generation collection
    # every GC_YOUNG_THRESHOLD allocations instead of every 700 (each one scans only what is alive,
    # the requests in flight, so it costs about the same and runs ~14x less often).
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


async def serve(
    config: RouterConfig,
    host: str,
    port: int,
    shutdown_timeout: float,
    drain_delay: float,
    store: QuotaStore | None = None,
    worker: int = 0,
    siblings_token: str | None = None,
) -> None:
    state = RouterState(config, store)
    state.worker = worker
    if siblings_token is not None:
        state.siblings = Siblings(siblings_token, worker, config.workers, state.metrics)
        await state.siblings.start()
    await state.start()
    api, ops = await _listen(state, config, host, port)
    _tune_gc()
    log.info("kvfence-router listening on %s:%d (pid %d)", host, port, os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: fail readiness first so that load balancers stop sending, keep serving meanwhile, then
    # stop listening and give in-flight requests (streams included) up to shutdown_timeout to end.
    state.draining = True
    log.info(
        "shutting down: draining for %.1fs, then up to %.1fs for in-flight requests",
        drain_delay,
        shutdown_timeout,
    )
    if drain_delay > 0:
        await asyncio.sleep(drain_delay)
    await api.shutdown(shutdown_timeout)
    if ops is not None:
        await ops.shutdown(1.0)
    if state.siblings is not None:
        await state.siblings.stop()
    await state.stop()


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfence-router", description=__doc__.split("\n")[0])
    _table_args(p)
    _listen_args(p)
    _replica_args(p)
    p.add_argument("--reload-interval", type=float, default=1.0, help="seconds between routing table checks")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        help="tokens reserved for the completion when a request does not set max_tokens",
    )
    _upstream_args(p)
    _flow_control_args(p)
    _lifecycle_args(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--routing-table",
        default=_env("KVFENCE_ROUTING_TABLE", ""),
        help="routing table JSON file (the mounted kvfence-routing Secret), polled [KVFENCE_ROUTING_TABLE]",
    )
    p.add_argument(
        "--routing-secret",
        default=_env("KVFENCE_ROUTING_SECRET", ""),
        metavar="NAMESPACE/NAME",
        help="follow the routing table Secret through the Kubernetes API instead of a file: changes "
        "(a revoked key) apply within a second, not at the kubelet's next volume refresh "
        "[KVFENCE_ROUTING_SECRET]",
    )
    p.add_argument("--routing-secret-key", default=ROUTING_SECRET_KEY, help="the Secret's data key")
    p.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="for --routing-secret (default: in-cluster) [KUBECONFIG]",
    )


def _listen_args(p: argparse.ArgumentParser) -> None:
    """Where the router listens, and in how many processes."""
    p.add_argument("--host", default=_env("KVFENCE_ROUTER_HOST", "0.0.0.0"))  # noqa: S104
    p.add_argument("--port", type=int, default=int(_env("KVFENCE_ROUTER_PORT", "8080")))
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(_env("KVFENCE_ROUTER_METRICS_PORT", "0")),
        help="serve /metrics (and /healthz, /readyz) on this port only, not on the API port, so that "
        "tenants cannot read other tenants' names and traffic; 0: on the API port "
        "[KVFENCE_ROUTER_METRICS_PORT]",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=int(_env("KVFENCE_ROUTER_WORKERS", "1")),
        help="worker processes serving the same port (SO_REUSEPORT: the kernel spreads connections); "
        "per-tenant quotas are counted in memory they share, so the limits hold exactly across them "
        "[KVFENCE_ROUTER_WORKERS]",
    )


def _lifecycle_args(p: argparse.ArgumentParser) -> None:
    """Shutdown, logging and client connection timeouts."""
    p.add_argument("--shutdown-timeout", type=float, default=60.0)
    p.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds to keep serving with /readyz failing after SIGTERM",
    )
    p.add_argument("--log-level", default=_env("KVFENCE_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--access-log",
        action="store_true",
        default=_env("KVFENCE_ROUTER_ACCESS_LOG", "") in ("1", "true"),
        help="log one JSON line per API request (tenant, path, status, duration; never keys or bodies) "
        "on the logger kvfence.router.access; about 20 us of CPU a request [KVFENCE_ROUTER_ACCESS_LOG=1]",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        default=KEEPALIVE_TIMEOUT,
        help="seconds an idle client connection stays open; keep it above your load balancer's idle timeout",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT,
        help="seconds a client has to send a whole request once it started (408 after)",
    )


def _replica_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicas",
        type=int,
        default=int(_env("KVFENCE_ROUTER_REPLICAS", "1")),
        help="router replicas sharing the quotas; each enforces limit // replicas; with --router-service "
        "only until the router Service's EndpointSlices are read [KVFENCE_ROUTER_REPLICAS]",
    )
    p.add_argument(
        "--router-service",
        default=_env("KVFENCE_ROUTER_SERVICE", ""),
        metavar="NAMESPACE/NAME",
        help="the router's own Service: each tenant's quotas are divided by the number of its ready "
        "endpoints, followed through its EndpointSlices [KVFENCE_ROUTER_SERVICE]",
    )
    p.add_argument(
        "--endpoint-slices",
        action="store_true",
        default=_env("KVFENCE_ROUTER_ENDPOINT_SLICES", "") in ("1", "true"),
        help="send each request to an engine replica the router picks from the EndpointSlices of the "
        "class's Service (tenant affinity, bounded load, per-replica health, drain), instead of "
        "dialing the Service by name [KVFENCE_ROUTER_ENDPOINT_SLICES=1]",
    )
    p.add_argument(
        "--balance",
        choices=("affinity", "random"),
        default="affinity",
        help="replica choice: affinity (a tenant's requests stay on one replica, consistent hashing with "
        "bounded load) or random (the baseline, for comparison)",
    )


def _upstream_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--read-timeout", type=float, default=300.0, help="longest silence from an engine")
    p.add_argument("--total-timeout", type=float, default=1800.0)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--health-path", default="/health")
    p.add_argument("--pool-per-engine", type=int, default=256, help="keep-alive connections per engine")
    p.add_argument(
        "--pool-per-tenant",
        type=int,
        default=128,
        help="connections to one engine one tenant may hold at once (more of its requests wait for one "
        "of them); 0: the whole pool",
    )
    p.add_argument(
        "--client-write-timeout",
        type=float,
        default=WRITE_TIMEOUT,
        help="seconds a client may leave an answer unread (the router's writes to it blocked) before "
        "its connection is cut off, freeing the engine connection and the engine's work",
    )


def _flow_control_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sequences-per-engine",
        type=int,
        default=256,
        help="flow control: sequences (prompts x n) in flight per serving engine replica of a trust "
        "class above which requests are held per tenant and released by weight; 0: never held",
    )
    p.add_argument(
        "--queue-per-tenant",
        type=int,
        default=64,
        help="flow control: requests held per tenant and trust class at most (more: 429 + Retry-After)",
    )
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=30.0,
        help="flow control: seconds a request may be held before it is answered 429 + Retry-After",
    )


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if bool(args.routing_table) == bool(args.routing_secret):
        p.error("give exactly one of --routing-table FILE and --routing-secret NAMESPACE/NAME")
    if args.routing_secret:
        namespace, _, name = args.routing_secret.partition("/")
        if not namespace or not name or "/" in name:
            p.error("--routing-secret must be NAMESPACE/NAME")
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    if not 1 <= args.workers <= 256:
        p.error("--workers must be between 1 and 256")
    if args.router_service:
        namespace, _, name = args.router_service.partition("/")
        if not namespace or not name or "/" in name:
            p.error("--router-service must be NAMESPACE/NAME")
    for flag, least in (("pool_per_engine", 1), ("pool_per_tenant", 0), ("sequences_per_engine", 0)):
        if getattr(args, flag) < least:
            p.error(f"--{flag.replace('_', '-')} must be >= {least}")
    if args.queue_per_tenant < 1:
        p.error("--queue-per-tenant must be >= 1")
    if not args.hold_timeout > 0 or not args.client_write_timeout > 0:
        p.error("--hold-timeout and --client-write-timeout must be > 0")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        routing_table=args.routing_table,
        routing_secret=args.routing_secret,
        routing_secret_key=args.routing_secret_key,
        kubeconfig=args.kubeconfig,
        endpoint_slices=args.endpoint_slices,
        router_service=args.router_service,
        reload_interval=args.reload_interval,
        replicas=args.replicas,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        metrics_port=args.metrics_port,
        access_log=args.access_log,
        keepalive_timeout=args.keepalive_timeout,
        request_timeout=args.request_timeout,
        client_write_timeout=args.client_write_timeout,
        workers=args.workers,
        proxy=ProxyConfig(
            connect_timeout=args.connect_timeout,
            read_timeout=args.read_timeout,
            total_timeout=args.total_timeout,
            pool_per_engine=args.pool_per_engine,
            health_path=args.health_path,
            health_interval=args.health_interval,
            balance=args.balance,
            pool_per_tenant=args.pool_per_tenant,
            sequences_per_engine=args.sequences_per_engine,
            queue_per_tenant=args.queue_per_tenant,
            hold_timeout=args.hold_timeout,
            workers=args.workers,
        ),
    )


def run_worker(
    config: RouterConfig,
    args: argparse.Namespace,
    store: QuotaStore | None,
    worker: int = 0,
    siblings_token: str | None = None,
) -> None:
    """One serving process: its own event loop, the API port shared with its siblings."""
    run = serve(
        config, args.host, args.port, args.shutdown_timeout, args.drain_delay, store, worker, siblings_token
    )
    try:
        import uvloop  # the faster event loop; the router runs (slower) without it
    except ImportError:
        log.warning("uvloop is not installed: running on the default asyncio event loop")
        asyncio.run(run)
    else:
        uvloop.run(run)


def supervise(config: RouterConfig, args: argparse.Namespace) -> int:
    """``--workers N``: fork N serving processes that share the port and the quota counters, pass
    SIGTERM/SIGINT on to them (each drains as one router would), and wait. A worker that dies on
    its own takes the others down (exit 1): its in-flight counts would otherwise stay charged, so
    the whole router restarts clean rather than run with quotas it can no longer count exactly."""
    store = SharedQuotaStore()
    token = secrets.token_hex(8)  # names the workers' metrics sockets (siblings.py)
    children: dict[int, int] = {}
    for i in range(config.workers):
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                run_worker(config, args, store, i, token)
            except BaseException:
                log.exception("router worker %d failed", i)
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        children[pid] = i
    log.info("kvfence-router: %d workers (pids %s)", config.workers, ", ".join(map(str, children)))
    stopping = False
    forwarded = 0  # the signal passed on to the workers

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping, forwarded
        stopping, forwarded = True, signum
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in children:
            continue
        i = children.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        if not stopping:
            log.error("router worker %d (pid %d) exited with %d: stopping the others", i, pid, rc)
            code = 1
            forward(signal.SIGTERM, None)
            # A worker that died holding the shared lock would leave the others stuck in it: give
            # them the drain time, then kill what is left.
            signal.signal(signal.SIGALRM, lambda *_: forward(signal.SIGKILL, None))
            signal.alarm(int(args.drain_delay + args.shutdown_timeout) + 5)
        elif rc not in (0, -forwarded):
            # (-forwarded: a worker still starting, before its own handlers, ended by the very signal
            # it was asked to stop with: a clean stop all the same)
            code = 1
    return code


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = config_from_args(args)
    if config.routing_secret or config.endpoint_slices or config.router_service:
        try:  # the sources load it again in each worker; a kubeconfig that cannot work stops us here
            connection.load(config.kubeconfig)
        except connection.ConfigError as e:
            raise SystemExit(f"kvfence-router: {e}") from None
    if config.workers > 1:
        raise SystemExit(supervise(config, args))
    run_worker(config, args, None)


if __name__ == "__main__":
    main()
