"""The router <-> engine wire contract: the one place that defines it.

Every party that speaks the contract (the router, the reference engine, the vLLM middleware) imports
this module; nothing else re-implements any part of it. ``docs/contract.md`` describes the same thing
for humans.

What the contract says
----------------------
* Tenants never talk to engines. The router authenticates a tenant, then forwards the request with an
  *identity* (tenant id, trust class, cache namespace) signed with the trust class's key
  (HMAC-SHA256 over a canonical string that also covers method, path, a timestamp, a nonce and the
  SHA-256 of the exact body bytes).
* The engine serves a request only if the signature verifies with one of its trust class's keys, the
  timestamp is within ``MAX_SKEW_SECONDS`` and the nonce has not been seen inside that window.
* The cache namespace is never taken from the request body. The router derives a cache salt from the
  trust class key and the namespace (:func:`derive_cache_salt`) and puts it in the body as
  ``cache_salt`` (what stock vLLM expects); engines recompute it from the signed identity and refuse a
  body whose ``cache_salt`` differs.
* Clients cannot choose a namespace or an identity: the router removes :data:`CLIENT_FORBIDDEN_HEADERS`
  (and every header with the ``x-kvfence-`` prefix) and :data:`CLIENT_FORBIDDEN_BODY_FIELDS`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import itertools
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

CONTRACT_VERSION = "v1"

# --- headers ------------------------------------------------------------------------------------
HEADER_PREFIX = "x-kvfence-"
HEADER_TENANT = "X-Kvfence-Tenant"
HEADER_TRUST_CLASS = "X-Kvfence-Trust-Class"
HEADER_CACHE_NAMESPACE = "X-Kvfence-Cache-Namespace"
HEADER_TIMESTAMP = "X-Kvfence-Timestamp"
HEADER_NONCE = "X-Kvfence-Nonce"
HEADER_KEY_ID = "X-Kvfence-Key-Id"
HEADER_SIGNATURE = "X-Kvfence-Signature"

#: Headers a client may send to pick an identity or a cache namespace; the router drops them all
#: (compare lower-cased), as well as every header that starts with :data:`HEADER_PREFIX`.
CLIENT_FORBIDDEN_HEADERS = frozenset(
    {
        "x-tenant-id",
        "x-tenant",
        "x-user-id",
        "x-cache-salt",
        "x-cache-namespace",
        "x-forwarded-user",
        "x-remote-user",
        "x-auth-request-user",
    }
)

#: Body fields that choose a KV-cache namespace or carry KV state in engines we know of
#: (vLLM: cache_salt, kv_transfer_params, and vllm_xargs, which reaches vLLM's engine core as the
#: request's extra_args, where kv_transfer_params is read too; SGLang: extra_key). The router
#: removes them.
CLIENT_FORBIDDEN_BODY_FIELDS = ("cache_salt", "extra_key", "kv_transfer_params", "vllm_xargs")

#: vLLM: the body field the kvfence middleware sets (after verifying the router's signature) to carry
#: the tenant to the engine core, where the kvfence scheduler accounts KV blocks to it.
BODY_VLLM_XARGS = "vllm_xargs"
#: Keys of :data:`BODY_VLLM_XARGS`: the tenant, and its :func:`tenant_tag`.
XARG_TENANT = "kvfence_tenant"
XARG_TENANT_TAG = "kvfence_tenant_tag"
#: A key of :data:`BODY_VLLM_XARGS`: the middleware's reference for the request (32 hex digits), under
#: which the kvfence scheduler leaves a refusal the middleware answers in OpenAI's shape
#: (:mod:`kvfence.vllm.refusals`).
XARG_REQUEST_REF = "kvfence_ref"

#: The body field the router sets to the derived salt (what stock vLLM reads).
BODY_CACHE_SALT = "cache_salt"

# --- metrics ------------------------------------------------------------------------------------
# prometheus_client appends ``_total`` to counters; these are the names as exported.
METRIC_HASH_COLLISION = "kv_cache_hash_collision_total"
METRIC_CROSS_ACCESS_REJECTED = "kv_cache_tenant_cross_access_rejected_total"
METRIC_STALE_REFERENCE = "kv_cache_stale_reference_error_total"
METRIC_SIGNATURE_REJECTED = "kvfence_engine_signature_rejected_total"
#: Each tenant's cumulative fair-share service units (kvfence.isolation.fairshare's costs), as the
#: engine's scheduler charged them: VTC's per-client service, the engine's own view.
METRIC_TENANT_SERVICE_UNITS = "kvfence_engine_tenant_service_units_total"
#: A histogram per tenant of the engine steps that ran while a new request of the tenant waited, before
#: the step that first scheduled it (both engines): 0 when the next step took it.
METRIC_TENANT_QUEUE_STEPS = "kvfence_engine_tenant_queue_steps"
#: Its buckets' upper bounds, in steps (exported as ``le="0"``, ``le="1"``, ... and ``le="+Inf"``).
QUEUE_STEP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)

# --- limits -------------------------------------------------------------------------------------
MAX_SKEW_SECONDS = 30
SIGNING_KEY_BYTES = 32


class CacheScope(StrEnum):
    """Who may share prefix-cache entries inside one trust class."""

    TENANT = "Tenant"  # only requests of the same tenant (the default)
    TRUST_CLASS = "TrustClass"  # every tenant of the trust class


def cache_namespace(trust_class: str, tenant: str, scope: CacheScope | str) -> str:
    """The prefix-cache namespace a request of ``tenant`` lives in."""
    scope = CacheScope(scope)
    if scope is CacheScope.TRUST_CLASS:
        return f"class/{trust_class}"
    return f"tenant/{trust_class}/{tenant}"


def new_signing_key() -> bytes:
    return secrets.token_bytes(SIGNING_KEY_BYTES)


def key_id(key: bytes) -> str:
    """A short public fingerprint of a signing key, so a verifier can hold several during rotation."""
    return hashlib.sha256(b"kvfence-key-id\x00" + key).hexdigest()[:16]


def derive_cache_salt(key: bytes, trust_class: str, namespace: str) -> str:
    """The cache salt for ``namespace``: unguessable without the trust class key, stable across
    router replicas and restarts, and different for every namespace."""
    mac = hmac.new(key, b"kvfence-cache-salt-v1\x00" + _b(trust_class) + b"\x00" + _b(namespace), "sha256")
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode("ascii")


def tenant_tag(key: bytes, trust_class: str, tenant: str, cache_salt: str) -> str:
    """Binds a tenant to the cache salt of its request under the trust class key: what the vLLM
    middleware hands the engine core with the tenant, so the scheduler accounts KV blocks only to a
    tenant whose signature was verified (it checks the tag with the same keys)."""
    msg = b"kvfence-tenant-tag-v1\x00" + _b(trust_class) + b"\x00" + _b(tenant) + b"\x00" + _b(cache_salt)
    return base64.urlsafe_b64encode(hmac.new(key, msg, "sha256").digest()).rstrip(b"=").decode("ascii")


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request is for, as the router asserts it."""

    tenant: str
    trust_class: str
    namespace: str


def canonical_string(
    identity: Identity, method: str, path: str, timestamp: str, nonce: str, digest: str
) -> bytes:
    fields = (
        "KVFENCE-HMAC-SHA256",
        CONTRACT_VERSION,
        method.upper(),
        path,
        identity.tenant,
        identity.trust_class,
        identity.namespace,
        timestamp,
        nonce,
        digest,
    )
    for f in fields:
        if "\n" in f:
            raise ValueError("contract fields must not contain newlines")
    return "\n".join(fields).encode("utf-8")


class _Nonces:
    """Nonces unique per request without a system call each: 64 random bits drawn once per process
    (again in a forked child) followed by a 64-bit counter, 32 hex digits. A nonce only has to be
    unique (the engine refuses one it saw); a signature cannot be forged by guessing one."""

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count(secrets.randbits(62))

    def next(self) -> str:
        return f"{self._prefix}{next(self._count) & 0xFFFFFFFFFFFFFFFF:016x}"


_nonces = _Nonces()


class Signer:
    """:func:`sign` for one key and one identity, with everything that does not change per request
    computed once: the key's HMAC-SHA256 inner and outer states (RFC 2104: a request then costs two
    SHA-256 state copies instead of an HMAC set-up), the key id, the canonical string's fixed head per
    method and path, and the identity header lines. The router keeps one per tenant of its table."""

    __slots__ = ("_fixed", "_inner", "_outer", "_prefixes", "identity", "key_id")

    def __init__(self, key: bytes, identity: Identity) -> None:
        for f in (identity.tenant, identity.trust_class, identity.namespace):
            if "\n" in f or "\r" in f:
                raise ValueError("contract fields must not contain line breaks")
        block = hashlib.sha256(key).digest() if len(key) > 64 else key
        block = block.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))
        self.identity = identity
        self.key_id = key_id(key)
        self._fixed = (
            f"{HEADER_TENANT}: {identity.tenant}\r\n{HEADER_TRUST_CLASS}: {identity.trust_class}\r\n"
            f"{HEADER_CACHE_NAMESPACE}: {identity.namespace}\r\n{HEADER_KEY_ID}: {self.key_id}\r\n"
        ).encode()
        self._prefixes: dict[tuple[str, str], bytes] = {}

    def _prefix(self, method: str, path: str) -> bytes:
        got = self._prefixes.get((method, path))
        if got is None:
            # canonical_string() up to the timestamp, with its trailing separator
            got = canonical_string(self.identity, method, path, "", "", "")[:-2]
            if len(self._prefixes) < 64:  # the router signs a handful of paths
                self._prefixes[(method, path)] = got
        return got

    def mac(self, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
        """The signature of a request (hex). Each field is one line of the canonical string, so a
        ``ts`` or ``nonce`` holding a line break is a ValueError (the identity is checked when the Signer is
        made, the method and path by :meth:`_prefix`; :meth:`head`, the router's hot path, makes its own)."""
        if "\n" in ts or "\n" in nonce:
            raise ValueError("contract fields must not contain newlines")
        return self._mac(self._prefix(method, path), ts, nonce, body)

    def _mac(self, prefix: bytes, ts: str, nonce: str, body: bytes) -> str:
        inner = self._inner.copy()
        inner.update(prefix + f"{ts}\n{nonce}\n{hashlib.sha256(body).hexdigest()}".encode())
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()

    def headers(
        self, method: str, path: str, body: bytes, *, now: float | None = None, nonce: str | None = None
    ) -> dict[str, str]:
        ts = str(int(time.time() if now is None else now))
        nonce = nonce or _nonces.next()
        mac = self.mac(method, path, ts, nonce, body)
        identity = self.identity
        return {
            HEADER_TENANT: identity.tenant,
            HEADER_TRUST_CLASS: identity.trust_class,
            HEADER_CACHE_NAMESPACE: identity.namespace,
            HEADER_TIMESTAMP: ts,
            HEADER_NONCE: nonce,
            HEADER_KEY_ID: self.key_id,
            HEADER_SIGNATURE: f"{CONTRACT_VERSION}={mac}",
        }

    def head(self, method: str, path: str, body: bytes) -> bytes:
        """The same headers as :meth:`headers`, as HTTP/1.1 header lines (the router's hot path)."""
        ts = str(int(time.time()))
        nonce = _nonces.next()
        mac = self._mac(self._prefix(method, path), ts, nonce, body)
        return self._fixed + (
            f"{HEADER_TIMESTAMP}: {ts}\r\n{HEADER_NONCE}: {nonce}\r\n"
            f"{HEADER_SIGNATURE}: {CONTRACT_VERSION}={mac}\r\n"
        ).encode("ascii")


@functools.lru_cache(maxsize=256)
def _signer(key: bytes, identity: Identity) -> Signer:
    return Signer(key, identity)


def sign(
    key: bytes,
    identity: Identity,
    method: str,
    path: str,
    body: bytes,
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """The identity headers the router adds to a request it forwards."""
    return _signer(key, identity).headers(method, path, body, now=now, nonce=nonce)


@dataclass(frozen=True, slots=True)
class Verified:
    """A request whose identity headers verified: who it is for and the cache salt that goes with it."""

    identity: Identity
    cache_salt: str
    #: :func:`tenant_tag` of the identity and salt, under the key that signed (vLLM's engine core
    #: checks it); empty where no key signed (an engine that does not require signatures)
    tenant_tag: str = ""


class SignatureError(Exception):
    """A request's identity headers do not verify. ``reason`` is a CamelCase word for metrics/logs."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NonceCache:
    """Remembers nonces for the validity window so a captured request cannot be replayed."""

    def __init__(self, window_seconds: float = 2 * MAX_SKEW_SECONDS, max_entries: int = 1_000_000) -> None:
        self._window = window_seconds
        self._max = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check_and_add(self, nonce: str, now: float) -> bool:
        """True if ``nonce`` is new (and records it); False if it was already used."""
        with self._lock:
            while self._seen:
                _, t = next(iter(self._seen.items()))
                if now - t <= self._window and len(self._seen) < self._max:
                    break
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


class Verifier:
    """Engine-side check of the contract for one trust class."""

    def __init__(
        self,
        trust_class: str,
        keys: Iterable[bytes],
        *,
        max_skew: float = MAX_SKEW_SECONDS,
        nonces: NonceCache | None = None,
    ) -> None:
        self.trust_class = trust_class
        self._keys = {key_id(k): k for k in keys}
        if not self._keys:
            raise ValueError("a verifier needs at least one signing key")
        self._max_skew = max_skew
        self._nonces = nonces or NonceCache(window_seconds=2 * max_skew)

    def verify(
        self,
        headers: Mapping[str, str],
        method: str,
        path: str,
        body: bytes,
        *,
        now: float | None = None,
    ) -> Verified:
        """Return the signed identity and its cache salt, or raise :class:`SignatureError`."""
        h = {k.lower(): v for k, v in headers.items()}

        def get(name: str) -> str:
            v = h.get(name.lower())
            if not v:
                raise SignatureError("MissingSignature", f"missing header {name}")
            return v

        sig = get(HEADER_SIGNATURE)
        identity = Identity(get(HEADER_TENANT), get(HEADER_TRUST_CLASS), get(HEADER_CACHE_NAMESPACE))
        ts, nonce, kid = get(HEADER_TIMESTAMP), get(HEADER_NONCE), get(HEADER_KEY_ID)
        if identity.trust_class != self.trust_class:
            raise SignatureError("WrongTrustClass", f"this engine serves trust class {self.trust_class!r}")
        key = self._keys.get(kid)
        if key is None:
            raise SignatureError("UnknownKey", "signature made with a key this engine does not hold")
        prefix = f"{CONTRACT_VERSION}="
        if not sig.startswith(prefix):
            raise SignatureError("BadSignature", "unsupported signature version")
        try:
            t = int(ts)
        except ValueError:
            raise SignatureError("BadTimestamp", "timestamp is not an integer") from None
        try:
            expected = _signer(key, identity).mac(method, path, ts, nonce, body)
        except ValueError as e:
            raise SignatureError("BadSignature", str(e)) from None
        if not hmac.compare_digest(expected, sig[len(prefix) :]):
            raise SignatureError("BadSignature", "signature does not match the request")
        current = time.time() if now is None else now
        if abs(current - t) > self._max_skew:
            raise SignatureError("StaleSignature", "signature timestamp outside the allowed window")
        if not self._nonces.check_and_add(nonce, current):
            raise SignatureError("ReplayedSignature", "signature nonce was already used")
        # The salt is derived with the key that signed, so a key rotation also starts fresh cache
        # namespaces, and router and engine agree on it during the rotation window.
        return _verified(key, identity)


@functools.lru_cache(maxsize=1024)
def _verified(key: bytes, identity: Identity) -> Verified:
    """What a verified identity stands for under ``key``: its cache salt and tenant tag, the same for
    every request of the identity (two HMACs it would otherwise pay per request). Only identities
    whose signature verified reach it."""
    salt = derive_cache_salt(key, identity.trust_class, identity.namespace)
    return Verified(identity, salt, tenant_tag(key, identity.trust_class, identity.tenant, salt))


def strip_client_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop every header a client could use to choose an identity or a cache namespace."""
    out = []
    for name, value in headers:
        low = name.lower()
        if low.startswith(HEADER_PREFIX) or low in CLIENT_FORBIDDEN_HEADERS:
            continue
        out.append((name, value))
    return out


def strip_client_body(body: dict[str, object]) -> dict[str, object]:
    """A copy of an OpenAI request body without the fields that choose a cache namespace."""
    if body.keys().isdisjoint(CLIENT_FORBIDDEN_BODY_FIELDS):
        return dict(body)
    return {k: v for k, v in body.items() if k not in CLIENT_FORBIDDEN_BODY_FIELDS}


def _b(s: str) -> bytes:
    return s.encode("utf-8")
