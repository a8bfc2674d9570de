"""The kvfence vLLM plugin: ASGI middleware that makes a stock vLLM OpenAI server speak the contract.

Load it with ``vllm serve ... --middleware kvfence.vllm.middleware.KvfenceMiddleware`` (the operator
renders that flag, see ``kvfence.operator.builders.vllm_args``). vLLM adds a middleware *class* with
``app.add_middleware(cls)``, so the class takes only ``app``; everything else comes from the
environment:

``KVFENCE_TRUST_CLASS`` and ``KVFENCE_SIGNING_KEY_DIR``
    The trust class this engine serves and the directory holding its signing keys (files ``current``
    and, during a rotation, ``previous``: raw 32-byte keys, the mounted signing-key Secret).
``KVFENCE_ENGINE_CONFIG``
    Used when the two above are unset: the engine config file the operator mounts into every engine
    pod (``trustClass`` and ``signingKeyDir`` are read from it).
``KVFENCE_MAX_BODY_BYTES``
    Largest request body accepted (default 16 MiB); larger bodies get 413.

What it does, per HTTP request:

* ``GET``/``HEAD`` of the open paths (:data:`OPEN_PATHS`: health, metrics, models, version) pass
  through unsigned; the kubelet probes and Prometheus use them.
* ``GET``/``HEAD`` of ``/ready`` (:data:`kvfence.contract.engine_config.READY_PATH`, the readiness
  probe the operator renders): 503 while the engine config (``KVFENCE_ENGINE_CONFIG``) says
  ``tenantsPending`` (a new class's engine started before the routing decision gave it its tenants'
  quotas), else vLLM's ``/health``.
* ``POST`` to an inference path (:data:`SALTED_PATHS`) must carry the router's identity headers. The
  body is buffered (up to the limit) and checked by :class:`kvfence.isolation.guard.Guard`, the same
  check the reference engine runs; unsigned, forged, stale, replayed or wrong-class requests get the
  same OpenAI-shaped 401/403 (:data:`kvfence.isolation.guard.REFUSALS`) and never reach vLLM.
* The verified identity decides the cache salt (:func:`kvfence.contract.derive_cache_salt`, computed by
  the verifier). The JSON body's ``cache_salt`` is set to it; a body that carries a *different* salt
  (or another field that could choose KV state: ``extra_key``, ``kv_transfer_params``) is refused with
  403, because only a party holding the key could have signed it and the contract says it must match.
* The identity headers are removed, ``Content-Length`` is fixed, and vLLM receives the rewritten body.
* Every other request (other paths, other methods, websockets) is refused: new vLLM endpoints stay
  closed until they are reviewed and listed here.

* ``vllm_xargs`` is set to the verified tenant and its tag (:func:`kvfence.contract.tenant_tag`): the
  kvfence scheduler (:mod:`kvfence.vllm.scheduler`) accounts KV blocks to that tenant and refuses
  requests without a valid tag. It also carries a reference for the request
  (:mod:`kvfence.vllm.refusals`): when the scheduler refuses the request (a prompt that alone exceeds
  the tenant's ``maxKVBlocks``) it leaves its answer under that reference, and vLLM's generic error
  (``500``, or a streamed error event) is replaced by it: ``400 max_kv_blocks_exceeded``, as the
  reference engine answers. To replace a stream's ``200``, its start is held until the first event,
  for the tenants the engine config (``KVFENCE_ENGINE_CONFIG``) gives a KV maximum (all of them when
  there is no config); another tenant's stream starts as vLLM starts it, and a refusal that still
  comes (a maximum set since) replaces vLLM's error event inside it.

Rejections are counted in ``kvfence_engine_signature_rejected_total{reason}`` (the contract's name,
the same series the reference engine exports) and salt mismatches also in
``kv_cache_tenant_cross_access_rejected_total``; both are exported with the engine core's counters
(:mod:`kvfence.vllm.stats`) by one collector in the process's default Prometheus registry, which
vLLM's ``/metrics`` serves. Log lines go to vLLM's output (:mod:`kvfence.vllm.logs`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from kvfence.contract import (
    BODY_CACHE_SALT,
    BODY_VLLM_XARGS,
    HEADER_PREFIX,
    MAX_SKEW_SECONDS,
    XARG_REQUEST_REF,
    XARG_TENANT,
    XARG_TENANT_TAG,
    Verified,
)
from kvfence.contract.engine_config import (
    ENV_ENGINE_CONFIG,
    READY_PATH,
    ConfigError,
    EngineConfig,
    file_stamp,
    load_config,
)
from kvfence.isolation import guard
from kvfence.isolation.guard import KeySourceError, Refusal
from kvfence.vllm.logs import ensure_handler
from kvfence.vllm.refusals import EngineRefusal, RefusalBox, new_ref
from kvfence.vllm.stats import EdgeCounters, FenceCollector

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("kvfence.vllm")

ENV_TRUST_CLASS = "KVFENCE_TRUST_CLASS"
ENV_SIGNING_KEY_DIR = "KVFENCE_SIGNING_KEY_DIR"
ENV_MAX_BODY_BYTES = "KVFENCE_MAX_BODY_BYTES"

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

#: Inference endpoints of vLLM's OpenAI server whose requests take ``cache_salt``.
SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
#: Read-only endpoints served without a signature (GET/HEAD only).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/v1/models", "/version"})


class KeySource(guard.KeySource):
    """:class:`kvfence.isolation.guard.KeySource`, found the way the vLLM plugin finds it: from the
    environment (the scheduler plugin builds its own with :meth:`from_env`)."""

    __slots__ = ()

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> KeySource:
        e = os.environ if env is None else env
        tc, kd = e.get(ENV_TRUST_CLASS, ""), e.get(ENV_SIGNING_KEY_DIR, "")
        if tc and kd:
            return cls(tc, Path(kd))
        cfg_path = e.get(ENV_ENGINE_CONFIG, "")
        if cfg_path:
            try:
                cfg = load_config(cfg_path)
            except ConfigError as err:
                raise KeySourceError(str(err)) from None
            return cls(tc or cfg.trust_class, Path(kd or cfg.signing_key_dir))
        raise KeySourceError(
            f"set {ENV_TRUST_CLASS} and {ENV_SIGNING_KEY_DIR} (or {ENV_ENGINE_CONFIG}): "
            "the kvfence middleware refuses to serve without the trust class's signing keys"
        )


class _Metrics:
    """The middleware's counters and the engine core's (:mod:`kvfence.vllm.stats`), registered as one
    collector once per registry (vLLM imports the class once, tests build several)."""

    _lock = threading.Lock()
    _by_registry: dict[int, EdgeCounters] = {}

    @classmethod
    def get(cls, registry: Any) -> EdgeCounters:
        if registry is None:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        with cls._lock:
            edge = cls._by_registry.get(id(registry))
            if edge is None:
                edge = cls._by_registry[id(registry)] = EdgeCounters()
                registry.register(FenceCollector(edge))
            return edge


class EngineConfigView:
    """The mounted engine config as the middleware needs it, read again whenever the file changes (the
    kubelet swaps it in place): whether it still waits for its tenants' quotas (``tenantsPending``),
    and which tenants have a KV maximum. No file named: never pending, and any tenant may have one."""

    def __init__(self, path: str | None) -> None:
        self._path = Path(path) if path else None
        self._stamp: tuple[int, int, int] | None = None
        self._config: EngineConfig | None = None

    def _current(self) -> EngineConfig | None:
        if self._path is None:
            return None
        stamp = file_stamp(self._path)
        if stamp is not None and stamp != self._stamp:
            self._stamp = stamp
            try:
                self._config = load_config(self._path)
            except ConfigError as e:
                log.warning("kvfence: the engine config changed but does not load; kept the last: %s", e)
        return self._config

    def tenants_pending(self) -> bool:
        cfg = self._current()
        return cfg is not None and cfg.tenants_pending

    def may_refuse(self, tenant: str) -> bool:
        """Whether the kvfence scheduler may refuse a request of ``tenant`` for its KV maximum (a prompt
        that alone exceeds it): the tenant has one, or no config says it has none."""
        cfg = self._current()
        return cfg is None or cfg.quotas.for_tenant(tenant).max_blocks is not None


class KvfenceMiddleware:
    """Pure ASGI middleware: verify the router's signature, set ``cache_salt``, refuse the rest."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeySource | None = None,
        max_body_bytes: int | None = None,
        registry: Any = None,
        clock: Callable[[], float] = time.time,
        max_skew: float = MAX_SKEW_SECONDS,
        refusals: RefusalBox | None = None,
        config_path: str | None = None,
    ) -> None:
        ensure_handler()
        self.app = app
        self.config = EngineConfigView(
            config_path if config_path is not None else os.environ.get(ENV_ENGINE_CONFIG)
        )
        self.refusals = refusals if refusals is not None else RefusalBox.from_env()
        self.keys = keys if keys is not None else KeySource.from_env()
        if max_body_bytes is None:
            max_body_bytes = int(os.environ.get(ENV_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES))
        self.max_body_bytes = max_body_bytes
        self.metrics = _Metrics.get(registry)
        # Fails closed at start. vLLM's prefix cache is keyed by the salt alone, so the signed
        # namespace is not held against a scope here (the router chose it under the class's scope).
        self.guard = guard.Guard(self.keys, max_skew=max_skew, clock=clock)

    # --- ASGI -----------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind != "http":  # websockets and anything newer: not part of the contract
            await send({"type": "websocket.close", "code": 1008})
            return
        method, path = scope["method"].upper(), scope["path"]
        if path == READY_PATH and method in ("GET", "HEAD"):
            if self.config.tenants_pending():
                body = json.dumps({"status": "waiting for the tenants' quotas"}).encode()
                await _send_whole(send, 503, [(b"content-type", b"application/json")], body)
                return
            await self.app({**scope, "path": "/health", "raw_path": b"/health"}, receive, send)
            return
        if path in OPEN_PATHS and method in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        try:
            if path not in SALTED_PATHS or method != "POST":
                reason = "PathNotAllowed" if path not in SALTED_PATHS else "MethodNotAllowed"
                raise Refusal(reason, f"{method} {path} is not served through kvfence")
            body = await self._read_body(receive)
            verified = self._verify(scope, body)
            ref = new_ref()
            new_body = self._salted(body, verified, ref)
        except Refusal as r:
            if r.counted:
                self.metrics.rejected(r.reason)
            if r.cross_access:
                self.metrics.cross_access()
            log.info("kvfence: refused %s %s: %s (%s)", method, path, r.message, r.reason)
            await _respond(send, r)
            return
        await self.app(
            _downstream_scope(scope, verified, len(new_body)),
            _replay(new_body, receive),
            _answering_refusals(
                send, self.refusals, ref, hold=self.config.may_refuse(verified.identity.tenant)
            ),
        )

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise Refusal("Disconnect", "client disconnected")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise Refusal("BodyTooLarge", f"request body larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def _verify(self, scope: Scope, body: bytes) -> Verified:
        headers = ((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", []))
        query = scope.get("query_string", b"").decode("latin-1")
        return self.guard.verify(scope["method"], scope["path"], query, headers, body)

    def _salted(self, body: bytes, verified: Verified, ref: str) -> bytes:
        doc = guard.parse_body(body)
        self.guard.check_body(doc, verified)
        doc[BODY_CACHE_SALT] = verified.cache_salt
        # The tenant, for the kvfence scheduler in vLLM's engine core (its KV quotas), bound to the
        # salt by a tag it verifies with the same keys. The router never sends vllm_xargs (refused
        # above with the other forbidden fields), so nothing of the client's reaches the engine core.
        doc[BODY_VLLM_XARGS] = {
            XARG_TENANT: verified.identity.tenant,
            XARG_TENANT_TAG: verified.tenant_tag,
            XARG_REQUEST_REF: ref,
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _downstream_scope(scope: Scope, verified: Verified, length: int) -> Scope:
    headers = [
        (k, v)
        for k, v in scope.get("headers", [])
        if not k.lower().startswith(HEADER_PREFIX.encode())
        and k.lower() not in (b"content-length", b"transfer-encoding")
    ]
    headers.append((b"content-length", str(length).encode("ascii")))
    out = dict(scope)
    out["headers"] = headers
    state = dict(scope.get("state") or {})
    state["kvfence_identity"] = verified.identity
    out["state"] = state
    return out


#: How a streamed answer's error event begins (vLLM's, when the request finished with an error).
_SSE_ERROR = b'data: {"error"'


def _answering_refusals(send: Send, box: RefusalBox, ref: str, *, hold: bool) -> Send:
    """``send``, except that vLLM's error answer for a request the kvfence scheduler refused is replaced
    by the scheduler's own answer (a refusal comes before any token). A 5xx answer's start is held
    until its body, and replaced. A stream's start (``200``, sent by vLLM before the engine has seen
    the request) is held until its first event when ``hold``: the refusal then replaces the whole
    answer (its status included). Without ``hold`` (a tenant the scheduler cannot refuse for its KV
    maximum) the start goes at once, as vLLM sends it: holding it would put its write and the first
    token's write back to back, and on a busy CPU the client woken by the first often takes the CPU
    before the second; should a refusal still come (a maximum set since), it replaces vLLM's error
    event inside the stream (same status as vLLM's, and the answer never silently lost)."""
    start: Message | None = None  # the answer's start, once vLLM sent it
    held = False  # whether that start is held here
    decided = False
    replaced = False

    async def send_(msg: Message) -> None:
        nonlocal start, held, decided, replaced
        if decided:
            if not replaced:
                await send(msg)
            return  # the rest of vLLM's error answer, replaced
        kind = msg["type"]
        if kind == "http.response.start":
            start, status = msg, int(msg["status"])
            held = hold or status >= 500
            if not held:
                await send(msg)
                decided = status != 200 or not _is_stream(msg)  # no refusal can come as this answer
            return
        if kind != "http.response.body" or start is None:
            await send(msg)
            return
        decided = True
        status, body = int(start["status"]), bytes(msg.get("body", b""))
        refused = status >= 500 or (status == 200 and body.startswith(_SSE_ERROR))
        refusal = box.take(ref) if refused else None
        if refusal is None:
            if held:
                await send(start)
            await send(msg)
        elif held:
            replaced = True
            await _answer(send, refusal)
        else:  # the start went: the refusal as the stream's error event, then the rest of vLLM's
            await send({**msg, "body": b"data: " + refusal.body() + b"\n\n"})

    return send_


def _is_stream(start: Message) -> bool:
    return any(
        k.lower() == b"content-type" and v.startswith(b"text/event-stream")
        for k, v in start.get("headers", [])
    )


async def _answer(send: Send, r: EngineRefusal) -> None:
    await _send_whole(send, r.status, [(b"content-type", b"application/json")], r.body())


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # After the body, the app only waits for a disconnect: hand it the real channel.
        return await receive()

    return replay


async def _respond(send: Send, r: Refusal) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in r.headers()]
    await _send_whole(send, r.status, headers, r.body())


async def _send_whole(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """One whole answer the middleware makes itself (never vLLM's), with its Content-Length."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
