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
* ``POST`` to an inference path (:data:`SALTED_PATHS`) must carry the router's identity headers. The
  body is buffered (up to the limit) and verified with :class:`kvfence.contract.Verifier`; unsigned,
  forged, stale, replayed or wrong-class requests get an OpenAI-shaped 401/403 and never reach vLLM.
* The verified identity decides the cache salt (:func:`kvfence.contract.derive_cache_salt`, computed by
  the verifier). The JSON body's ``cache_salt`` is set to it; a body that carries a *different* salt
  (or another field that could choose KV state: ``extra_key``, ``kv_transfer_params``) is refused with
  403, because only a party holding the key could have signed it and the contract says it must match.
* The identity headers are removed, ``Content-Length`` is fixed, and vLLM receives the rewritten body.
* Every other request (other paths, other methods, websockets) is refused: new vLLM endpoints stay
  closed until they are reviewed and listed here.

* ``vllm_xargs`` is set to the verified tenant and its tag (:func:`kvfence.contract.tenant_tag`): the
  kvfence scheduler (:mod:`kvfence.vllm.scheduler`) accounts KV blocks to that tenant and refuses
  requests without a valid tag.

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
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfence.contract import (
    BODY_CACHE_SALT,
    BODY_VLLM_XARGS,
    CLIENT_FORBIDDEN_BODY_FIELDS,
    HEADER_PREFIX,
    MAX_SKEW_SECONDS,
    XARG_TENANT,
    XARG_TENANT_TAG,
    NonceCache,
    SignatureError,
    Verified,
    Verifier,
)
from kvfence.vllm.logs import ensure_handler
from kvfence.vllm.stats import EdgeCounters, FenceCollector

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("kvfence.vllm")

ENV_TRUST_CLASS = "KVFENCE_TRUST_CLASS"
ENV_SIGNING_KEY_DIR = "KVFENCE_SIGNING_KEY_DIR"
ENV_ENGINE_CONFIG = "KVFENCE_ENGINE_CONFIG"
ENV_MAX_BODY_BYTES = "KVFENCE_MAX_BODY_BYTES"

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
KEY_RELOAD_INTERVAL = 1.0  # seconds between checks of the key files (a stat each)

#: Inference endpoints of vLLM's OpenAI server whose requests take ``cache_salt``.
SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
#: Read-only endpoints served without a signature (GET/HEAD only).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/v1/models", "/version"})
#: Rejection reasons decided here (the verifier adds its own: MissingSignature, BadSignature, ...).
REASON_SALT_MISMATCH = "CacheSaltMismatch"
REASON_FORBIDDEN_FIELD = "ForbiddenBodyField"


#: What identifies the key files' current contents: (inode, mtime, size) of each.
Stamp = tuple[tuple[int, int, int], ...]


class KeySourceError(Exception):
    """The middleware cannot find its trust class or signing keys; vLLM must not start without them."""


@dataclass(frozen=True, slots=True)
class KeySource:
    """Where the trust class name and its signing keys come from."""

    trust_class: str
    key_dir: Path

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> KeySource:
        e = os.environ if env is None else env
        tc, kd = e.get(ENV_TRUST_CLASS, ""), e.get(ENV_SIGNING_KEY_DIR, "")
        if tc and kd:
            return cls(tc, Path(kd))
        cfg_path = e.get(ENV_ENGINE_CONFIG, "")
        if cfg_path:
            # Imported here: the engine config model is only needed in this fallback.
            from kvfence.engine.config import ConfigError, load_config

            try:
                cfg = load_config(cfg_path)
            except ConfigError as err:
                raise KeySourceError(str(err)) from None
            return cls(tc or cfg.trust_class, Path(kd or cfg.signing_key_dir))
        raise KeySourceError(
            f"set {ENV_TRUST_CLASS} and {ENV_SIGNING_KEY_DIR} (or {ENV_ENGINE_CONFIG}): "
            "the kvfence middleware refuses to serve without the trust class's signing keys"
        )

    def stamp(self) -> Stamp:
        """Changes whenever a key file is replaced (kubelet swaps the Secret volume's symlink)."""
        out = []
        for name in ("current", "previous"):
            try:
                st = (self.key_dir / name).stat()
            except OSError:
                out.append((0, 0, -1))
                continue
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def load(self) -> list[bytes]:
        from kvfence.engine.config import ConfigError, load_signing_keys

        try:
            return load_signing_keys(self.key_dir)
        except ConfigError as err:
            raise KeySourceError(str(err)) from None

    def reload_if_changed(self, stamp: Stamp) -> tuple[Stamp, list[bytes]] | None:
        """(new stamp, keys) if the key files changed since ``stamp``; None if they did not, or if
        they do not load yet (logged: whoever asks keeps the keys it has; a half-written Secret heals)."""
        new = self.stamp()
        if new == stamp:
            return None
        try:
            keys = self.load()
        except KeySourceError as e:
            log.warning("kvfence: signing keys not reloaded: %s", e)
            return None
        log.info("kvfence: signing keys reloaded from %s", self.key_dir)
        return new, keys


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


class Refusal(Exception):
    """A request the middleware answers itself, with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, code: str, type_: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.reason = status, message, code, type_, reason

    def body(self) -> bytes:
        doc = {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _auth(message: str, reason: str) -> Refusal:
    return Refusal(401, message, "invalid_signature", "authentication_error", reason)


def _forbidden(message: str, reason: str) -> Refusal:
    return Refusal(403, message, "forbidden", "permission_error", reason)


_STATUS_OF_REASON = {"WrongTrustClass": 403}


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
    ) -> None:
        ensure_handler()
        self.app = app
        self.keys = keys if keys is not None else KeySource.from_env()
        if max_body_bytes is None:
            max_body_bytes = int(os.environ.get(ENV_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES))
        self.max_body_bytes = max_body_bytes
        self.metrics = _Metrics.get(registry)
        self._clock = clock
        self._max_skew = max_skew
        # One nonce cache for the life of the process: a key reload must not forget seen nonces.
        self._nonces = NonceCache(window_seconds=2 * max_skew)
        self._stamp = self.keys.stamp()
        self._verifier = self._new_verifier(self.keys.load())  # fails closed at start
        self._next_check = time.monotonic() + KEY_RELOAD_INTERVAL

    # --- keys -----------------------------------------------------------------------------------
    def _new_verifier(self, keys: Iterable[bytes]) -> Verifier:
        return Verifier(self.keys.trust_class, keys, max_skew=self._max_skew, nonces=self._nonces)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + KEY_RELOAD_INTERVAL
        got = self.keys.reload_if_changed(self._stamp)
        if got is not None:
            self._stamp, keys = got
            self._verifier = self._new_verifier(keys)

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
        if path in OPEN_PATHS and method in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        try:
            if path not in SALTED_PATHS or method != "POST":
                raise Refusal(
                    404 if path not in SALTED_PATHS else 405,
                    f"{method} {path} is not served through kvfence",
                    "not_found" if path not in SALTED_PATHS else "method_not_allowed",
                    "invalid_request_error",
                    "PathNotAllowed",
                )
            body = await self._read_body(receive)
            verified = self._verify(scope, body)
            new_body = self._salted(body, verified)
        except Refusal as r:
            if r.status in (401, 403):
                self.metrics.rejected(r.reason)
            if r.reason == REASON_SALT_MISMATCH:
                self.metrics.cross_access()
            log.info("kvfence: refused %s %s: %s (%s)", method, path, r.message, r.reason)
            await _respond(send, r)
            return
        await self.app(_downstream_scope(scope, verified, len(new_body)), _replay(new_body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise Refusal(
                    400, "client disconnected", "disconnected", "invalid_request_error", "Disconnect"
                )
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise Refusal(
                    413,
                    f"request body larger than {self.max_body_bytes} bytes",
                    "request_too_large",
                    "invalid_request_error",
                    "BodyTooLarge",
                )
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def _verify(self, scope: Scope, body: bytes) -> Verified:
        if scope.get("query_string"):
            # The signature covers the path only; nothing the router sends has a query string.
            raise _forbidden("query strings are not accepted on inference paths", "QueryString")
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            if name.startswith(HEADER_PREFIX):
                if name in headers:
                    raise _auth(f"identity header {name} sent twice", "DuplicateHeader")
                headers[name] = v.decode("latin-1")
        self._maybe_reload()
        try:
            return self._verifier.verify(headers, scope["method"], scope["path"], body, now=self._clock())
        except SignatureError as e:
            status = _STATUS_OF_REASON.get(e.reason, 401)
            if status == 403:
                raise _forbidden(str(e), e.reason) from None
            raise _auth(str(e), e.reason) from None

    def _salted(self, body: bytes, verified: Verified) -> bytes:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            doc = None
        if not isinstance(doc, dict):
            raise Refusal(
                400,
                "the request body must be a JSON object",
                "invalid_json",
                "invalid_request_error",
                "BadBody",
            )
        for name in CLIENT_FORBIDDEN_BODY_FIELDS:
            if name == BODY_CACHE_SALT or name not in doc:
                continue
            raise _forbidden(f"the body field {name!r} is not accepted", REASON_FORBIDDEN_FIELD)
        sent = doc.get(BODY_CACHE_SALT)
        if sent is not None and sent != verified.cache_salt:
            raise _forbidden("cache_salt does not belong to the signed identity", REASON_SALT_MISMATCH)
        doc[BODY_CACHE_SALT] = verified.cache_salt
        # The tenant, for the kvfence scheduler in vLLM's engine core (its KV quotas), bound to the
        # salt by a tag it verifies with the same keys. The router never sends vllm_xargs (refused
        # above with the other forbidden fields), so nothing of the client's reaches the engine core.
        doc[BODY_VLLM_XARGS] = {XARG_TENANT: verified.identity.tenant, XARG_TENANT_TAG: verified.tenant_tag}
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
    body = r.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if r.status == 401:
        headers.append((b"www-authenticate", b'KvfenceHMAC realm="kvfence-engine"'))
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
