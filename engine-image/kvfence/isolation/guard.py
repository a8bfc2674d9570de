"""The engine side of the router -> engine contract, once, for both engines: the reference engine's
server (:mod:`kvfence.engine.server`) and the vLLM middleware (:mod:`kvfence.vllm.middleware`).

What it holds, and the invariants it keeps:

* :class:`KeySource`: where a trust class's signing keys live (the mounted Secret: ``current`` and,
  during a rotation, ``previous``) and how a change of those files is noticed (inode, mtime, size).
  A reload that fails keeps the keys already held (a half-written Secret heals); the vLLM scheduler
  plugin calls :meth:`KeySource.reload_if_changed` too.
* :class:`Guard`: the checks, in this order: no query string, each identity header at most once, the
  signature (:class:`kvfence.contract.Verifier`; one nonce cache for the life of the process, so a key
  reload never reopens the replay window), the cache namespace against the engine's prefix-cache
  scope (where the engine knows it), then on the JSON body: no field that chooses KV-cache state
  (:data:`kvfence.contract.CLIENT_FORBIDDEN_BODY_FIELDS`), and a ``cache_salt`` only if it is the
  signed identity's.
* :data:`REFUSALS`: the one table from a refusal reason to its HTTP status and OpenAI error code; a
  :class:`Refusal` answers with :func:`kvfence.contract.errors.error_body`. Every 401/403 refusal is
  counted in ``kvfence_engine_signature_rejected_total{reason}`` by the engine that made it, a salt
  mismatch also in ``kv_cache_tenant_cross_access_rejected_total`` (:attr:`Refusal.counted`,
  :attr:`Refusal.cross_access`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfence.contract import (
    BODY_CACHE_SALT,
    CLIENT_FORBIDDEN_BODY_FIELDS,
    HEADER_PREFIX,
    MAX_SKEW_SECONDS,
    CacheScope,
    NonceCache,
    SignatureError,
    Verified,
    Verifier,
    cache_namespace,
)
from kvfence.contract.engine_config import (
    SIGNING_KEY_CURRENT,
    SIGNING_KEY_PREVIOUS,
    ConfigError,
    load_signing_keys,
)
from kvfence.contract.errors import error_body, error_type

log = logging.getLogger("kvfence.isolation.guard")

#: Seconds between checks of the key files (a stat each).
KEY_RELOAD_INTERVAL = 1.0

#: Refusal reason -> (HTTP status, OpenAI error code). The verifier's reasons first
#: (:class:`kvfence.contract.SignatureError`), then the guard's own, then the edge's.
REFUSALS: Mapping[str, tuple[int, str]] = {
    "MissingSignature": (401, "missing_signature"),
    "WrongTrustClass": (401, "wrong_trust_class"),
    "UnknownKey": (401, "unknown_signing_key"),
    "BadSignature": (401, "invalid_signature"),
    "BadTimestamp": (401, "invalid_timestamp"),
    "StaleSignature": (401, "stale_signature"),
    "ReplayedSignature": (401, "replayed_signature"),
    "DuplicateHeader": (401, "duplicate_identity_header"),
    "NoKey": (401, "no_signing_key"),
    "QueryString": (403, "query_string_not_allowed"),
    "NamespaceMismatch": (403, "cache_namespace_mismatch"),
    "ForbiddenBodyField": (403, "forbidden_field"),
    "CacheSaltMismatch": (403, "cache_salt_mismatch"),
    "BadBody": (400, "invalid_json"),
    "Disconnect": (400, "disconnected"),
    "PathNotAllowed": (404, "not_found"),
    "MethodNotAllowed": (405, "method_not_allowed"),
    "BodyTooLarge": (413, "request_too_large"),
}
REASON_SALT_MISMATCH = "CacheSaltMismatch"
REASON_FORBIDDEN_FIELD = "ForbiddenBodyField"

#: Sent with every 401, as HTTP asks.
WWW_AUTHENTICATE = 'KvfenceHMAC realm="kvfence-engine"'


class Refusal(Exception):
    """A request an engine answers itself: status and code come from :data:`REFUSALS`."""

    def __init__(self, reason: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.param = reason, message, param
        self.status, self.code = REFUSALS[reason]
        self.type = error_type(self.status)

    @property
    def counted(self) -> bool:
        """A refusal of the contract (401/403), counted in ``..._signature_rejected_total{reason}``."""
        return self.status in (401, 403)

    @property
    def cross_access(self) -> bool:
        """An attempt at another cache namespace (also counted in the cross-access counter)."""
        return self.reason == REASON_SALT_MISMATCH

    def body(self) -> bytes:
        return error_body(self.message, self.code, self.type, self.param)

    def headers(self) -> list[tuple[str, str]]:
        out = [("Content-Type", "application/json")]
        if self.status == 401:
            out.append(("WWW-Authenticate", WWW_AUTHENTICATE))
        return out


#: What identifies the key files' current contents: (inode, mtime, size) of each.
Stamp = tuple[tuple[int, int, int], ...]


class KeySourceError(Exception):
    """The trust class's signing keys cannot be read; an engine must not serve without them."""


@dataclass(frozen=True, slots=True)
class KeySource:
    """Where the trust class name and its signing keys come from."""

    trust_class: str
    key_dir: Path

    def stamp(self) -> Stamp:
        """Changes whenever a key file is replaced (kubelet swaps the Secret volume's symlink)."""
        out = []
        for name in (SIGNING_KEY_CURRENT, SIGNING_KEY_PREVIOUS):
            try:
                st = (self.key_dir / name).stat()
            except OSError:
                out.append((0, 0, -1))
                continue
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def load(self) -> list[bytes]:
        """The keys, current first (:func:`kvfence.contract.engine_config.load_signing_keys`)."""
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


def identity_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The contract's headers of a request (lower-cased names); each may be sent once."""
    out: dict[str, str] = {}
    for name, value in headers:
        low = name.lower()
        if low.startswith(HEADER_PREFIX):
            if low in out:
                raise Refusal("DuplicateHeader", f"identity header {low} sent twice")
            out[low] = value
    return out


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of an inference request."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal("BadBody", f"malformed JSON body: {e}") from None
    if not isinstance(doc, dict):
        raise Refusal("BadBody", "the request body must be a JSON object")
    return doc


class Guard:
    """The contract check of one engine (see the module docstring for the order of the checks).

    ``scope``: the engine's prefix-cache scope, when it knows it; the signed namespace must then be
    the one that scope gives the tenant. ``required``: without keys at start, fail (the default) or
    serve and refuse every signed request with ``NoKey`` until keys appear.
    """

    def __init__(
        self,
        keys: KeySource,
        *,
        scope: CacheScope | str | None = None,
        required: bool = True,
        max_skew: float = MAX_SKEW_SECONDS,
        clock: Callable[[], float] = time.time,
        reload_interval: float | None = None,
    ) -> None:
        self.keys = keys
        self.trust_class = keys.trust_class
        self.scope = None if scope is None else CacheScope(scope)
        self._max_skew = max_skew
        self._clock = clock
        self._interval = KEY_RELOAD_INTERVAL if reload_interval is None else reload_interval
        self._nonces = NonceCache(window_seconds=2 * max_skew)
        self._stamp = keys.stamp()
        try:
            loaded = keys.load()
        except KeySourceError:
            if required:
                raise  # fails closed at start
            log.warning("kvfence: no signing keys in %s yet: signed requests are refused", keys.key_dir)
            loaded = []
        self.verifier: Verifier | None = None
        self.current_key: bytes | None = None
        self._install(loaded)
        self._next_check = time.monotonic() + self._interval

    def _install(self, keys: list[bytes]) -> None:
        if keys:
            self.verifier = Verifier(self.trust_class, keys, max_skew=self._max_skew, nonces=self._nonces)
            self.current_key = keys[0]

    def reload(self, *, now: float | None = None) -> None:
        """Pick up rotated key files (at most once per reload interval; ``now=inf`` forces it)."""
        t = time.monotonic() if now is None else now
        if t < self._next_check:
            return
        self._next_check = time.monotonic() + self._interval
        got = self.keys.reload_if_changed(self._stamp)
        if got is not None:
            self._stamp, keys = got
            self._install(keys)

    def verify(
        self, method: str, path: str, query: str, headers: Iterable[tuple[str, str]], body: bytes
    ) -> Verified:
        """The signed identity of a request and its cache salt, or a :class:`Refusal`."""
        if query:
            # The signature covers the path only; nothing the router sends has a query string.
            raise Refusal("QueryString", "query strings are not accepted on inference paths")
        signed = identity_headers(headers)
        self.reload()
        if self.verifier is None:
            raise Refusal("NoKey", "this engine holds no signing key")
        try:
            verified = self.verifier.verify(signed, method, path, body, now=self._clock())
        except SignatureError as e:
            raise Refusal(e.reason, f"router signature rejected: {e}") from None
        if self.scope is not None:
            ident = verified.identity
            if ident.namespace != cache_namespace(self.trust_class, ident.tenant, self.scope):
                raise Refusal(
                    "NamespaceMismatch",
                    f"cache namespace {ident.namespace!r} does not match this engine's prefix-cache "
                    f"scope ({self.scope.value}) for the tenant",
                )
        return verified

    @staticmethod
    def check_body(doc: Mapping[str, Any], verified: Verified) -> None:
        """No field that chooses KV-cache state; a ``cache_salt`` only if it is the verified one."""
        for name in CLIENT_FORBIDDEN_BODY_FIELDS:
            if name != BODY_CACHE_SALT and name in doc:
                raise Refusal(
                    REASON_FORBIDDEN_FIELD, f"{name} chooses KV-cache state and is not accepted", param=name
                )
        if BODY_CACHE_SALT in doc and doc[BODY_CACHE_SALT] != verified.cache_salt:  # null included
            raise Refusal(
                REASON_SALT_MISMATCH,
                "cache_salt does not match the salt of the signed identity",
                param=BODY_CACHE_SALT,
            )
