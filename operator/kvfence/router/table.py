"""Loading, validating, compiling and hot-reloading the routing table.

The operator renders :class:`kvfence.contract.routing.RoutingTable` as JSON into a Secret; the router reads
the mounted file. Validation (pydantic) happens here, once per load, never per request: the table is
compiled into frozen, precomputed per-tenant plans (identity, cache salt, allowed models, the
``/v1/models`` answer) so the hot path is dict lookups.

Reload: :class:`TableWatcher` polls the file. Kubernetes updates a mounted Secret by swapping a
``..data`` symlink, which changes the inode and the resolved path that ``os.stat`` sees; a change of
(device, inode, size, mtime) triggers a read, and the content's SHA-256 decides whether anything really
changed. Every few polls the content is re-hashed regardless, in case a writer preserved the stat.
An invalid table is refused and the previous one stays in force. Requests that already resolved their
tenant keep the plan they resolved, so a reload never touches in-flight requests.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pydantic import ValidationError

from kvfence.contract import CacheScope, Identity, Signer, cache_namespace, derive_cache_salt, key_id
from kvfence.contract.routing import (
    KEY_HASH_PREFIX,
    Quotas,
    RequestLimits,
    RoutingTable,
    TenantRoute,
    decode_table_bytes,
)
from kvfence.router.balance import hash64

log = logging.getLogger("kvfence.router.table")


class TableError(Exception):
    """The routing table file cannot be used (unreadable, not JSON, or not a valid table)."""


@dataclass(frozen=True, slots=True)
class ClassPlan:
    """One trust class, ready for the hot path."""

    name: str
    endpoint: str  # base URL, no trailing slash
    runtime: str
    served_models: tuple[str, ...]
    adapters: frozenset[str]
    cache_scope: CacheScope
    signing_key: bytes  # the first key of the list: the one that signs
    signing_key_id: str
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # kvfence.router.surface


@dataclass(frozen=True, slots=True)
class TenantPlan:
    """One tenant, ready for the hot path: everything the router needs to forward its requests."""

    name: str
    trust_class: ClassPlan
    identity: Identity
    cache_salt: str
    allowed_models: frozenset[str]
    models_body: bytes  # the JSON answer to GET /v1/models
    quotas: Quotas
    # signs its requests with the class's key (derived from signing_key and identity: not compared)
    signer: Signer = field(compare=False, repr=False)
    # Where the tenant's requests land on its class's replica ring: the hash of its cache namespace,
    # the unit the engines' prefix caches are scoped by (kvfence.router.balance).
    affinity: int = 0

    @property
    def weight(self) -> int:
        """The tenant's fair-share weight at the router's flow control (1 when its quotas name none)."""
        return self.quotas.weight or 1


@dataclass(frozen=True, slots=True)
class CompiledTable:
    checksum: str
    classes: dict[str, ClassPlan]
    tenants: dict[str, TenantPlan]
    # lower-case hex sha256 of an API key -> (the stored digest, its tenant)
    key_hashes: dict[str, tuple[str, TenantPlan]]
    warnings: tuple[str, ...] = field(default=())

    @staticmethod
    def empty() -> CompiledTable:
        return CompiledTable(checksum="", classes={}, tenants={}, key_hashes={})


def _check_endpoint(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL")
    if parts.query or parts.fragment:
        raise ValueError(f"endpoint {url!r} must not carry a query or fragment")
    return url.rstrip("/")


def _decode_key(b64: str) -> bytes:
    try:
        key = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) < 16:
        raise ValueError("signing key is not base64 of at least 16 bytes")
    return key


def _models_body(models: list[str]) -> bytes:
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvfence"} for m in models]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode("utf-8")


# 69 lines: each entry dropped with its own warning, in the order a reader checks them.
def compile_table(table: RoutingTable, checksum: str = "") -> CompiledTable:
    """Turn a validated table into hot-path plans. Entries that cannot be served safely are dropped
    with a warning instead of failing the whole table, so that (for instance) revoking one key still
    takes effect when some other entry is broken."""
    warnings: list[str] = []
    classes = _class_plans(table, warnings)
    tenants: dict[str, TenantPlan] = {}
    key_hashes: dict[str, tuple[str, TenantPlan]] = {}
    duplicates: set[str] = set()
    for name, tr in table.tenants.items():
        cls = classes.get(tr.trust_class)
        if cls is None:
            warnings.append(f"tenant {name!r} skipped: trust class {tr.trust_class!r} is not routable")
            continue
        plan = tenants[name] = _tenant_plan(name, tr, cls, warnings)
        _bind_keys(plan, tr.api_key_hashes, key_hashes, duplicates, warnings)
    for d in duplicates:
        # One key naming two tenants is ambiguous: it authenticates nobody.
        del key_hashes[d]
        warnings.append(f"key hash sha256:{d[:12]}... is bound to several tenants; refused for all")
    return CompiledTable(
        checksum=checksum, classes=classes, tenants=tenants, key_hashes=key_hashes, warnings=tuple(warnings)
    )


def _class_plans(table: RoutingTable, warnings: list[str]) -> dict[str, ClassPlan]:
    """The plan of each trust class whose signing keys and endpoint are usable."""
    classes: dict[str, ClassPlan] = {}
    for name, tc in table.trust_classes.items():
        try:
            key = _decode_key(tc.signing_keys[0])
            for other in tc.signing_keys[1:]:
                _decode_key(other)
            endpoint = _check_endpoint(tc.endpoint)
        except ValueError as e:
            warnings.append(f"trust class {name!r} skipped: {e}")
            continue
        classes[name] = ClassPlan(
            name=name,
            endpoint=endpoint,
            runtime=tc.runtime,
            served_models=tuple(tc.served_models),
            adapters=frozenset(tc.adapters),
            cache_scope=tc.cache_scope,
            signing_key=key,
            signing_key_id=key_id(key),
            request_limits=tc.request_limits or RequestLimits(),
        )
    return classes


def _tenant_plan(name: str, tr: TenantRoute, cls: ClassPlan, warnings: list[str]) -> TenantPlan:
    """A tenant's plan in its class: the models it may name (the class's, and the adapters of the
    class it is allowed), its identity, salt and signer."""
    adapters = [a for a in tr.allowed_adapters if a in cls.adapters]
    for a in tr.allowed_adapters:
        if a not in cls.adapters:
            warnings.append(f"tenant {name!r}: adapter {a!r} is not served by {cls.name!r}; ignored")
    models = [*cls.served_models, *(a for a in adapters if a not in cls.served_models)]
    namespace = cache_namespace(cls.name, name, cls.cache_scope)
    identity = Identity(tenant=name, trust_class=cls.name, namespace=namespace)
    return TenantPlan(
        name=name,
        trust_class=cls,
        identity=identity,
        cache_salt=derive_cache_salt(cls.signing_key, cls.name, namespace),
        allowed_models=frozenset(models),
        models_body=_models_body(models),
        quotas=tr.quotas,
        signer=Signer(cls.signing_key, identity),
        affinity=hash64(namespace),
    )


def _bind_keys(
    plan: TenantPlan,
    hashes: list[str],
    key_hashes: dict[str, tuple[str, TenantPlan]],
    duplicates: set[str],
    warnings: list[str],
) -> None:
    """Bind a tenant's API key hashes to its plan in ``key_hashes`` (hex -> plan); a malformed hash is
    ignored, and one already bound to another tenant goes to ``duplicates``."""
    for h in hashes:
        hexdigest = h[len(KEY_HASH_PREFIX) :].lower() if h.startswith(KEY_HASH_PREFIX) else ""
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            warnings.append(f"tenant {plan.name!r}: key hash {h[:16]!r}... is not sha256:<64 hex>; ignored")
            continue
        if hexdigest in key_hashes and key_hashes[hexdigest][1].name != plan.name:
            duplicates.add(hexdigest)
        key_hashes[hexdigest] = (hexdigest, plan)


def parse_table(raw: bytes) -> CompiledTable:
    """Validate and compile the bytes of a routing table file."""
    checksum = hashlib.sha256(raw).hexdigest()
    try:
        # The operator gzips large tables (a Secret holds at most 1 MiB); small ones are plain JSON.
        raw = decode_table_bytes(raw)
    except (OSError, EOFError) as e:
        raise TableError(f"invalid routing table: not JSON and not valid gzip: {e}") from None
    try:
        table = RoutingTable.model_validate_json(raw)
    except ValidationError as e:
        raise TableError(f"invalid routing table: {e.error_count()} error(s): {e.errors()[:3]}") from None
    return compile_table(table, checksum)


def _stat_key(path: str) -> tuple[int, int, int, int, str] | None:
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, os.path.realpath(path))
    except OSError:
        return None


class TableWatcher:
    """Holds the current table and swaps it when the file changes."""

    def __init__(
        self,
        path: str,
        *,
        interval: float = 1.0,
        rehash_every: int = 10,
        on_change: Callable[[CompiledTable], None] | None = None,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.interval = interval
        self.rehash_every = max(1, rehash_every)
        self.table = CompiledTable.empty()
        self.loaded = False  # True once a valid table was loaded
        self.last_error = ""
        self._stat: tuple[int, int, int, int, str] | None = None
        self._polls = 0
        self._on_change = on_change
        self._on_result = on_result

    def _read_new(self) -> CompiledTable | None:
        """Stat, read and compile the file if it changed; None if it did not (or is missing).
        Raises :class:`TableError` for an invalid file. Swaps nothing: safe to run in a thread."""
        self._polls += 1
        st = _stat_key(self.path)
        if st is None:
            self.missing(f"routing table {self.path} is missing")
            return None
        if st == self._stat and self.loaded and self._polls % self.rehash_every:
            return None
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except OSError as e:
            self.last_error = str(e)
            return None
        self._stat = st
        return None if self._is_current(raw) else parse_table(raw)

    def _is_current(self, raw: bytes) -> bool:
        return self.loaded and hashlib.sha256(raw).hexdigest() == self.table.checksum

    def _refuse(self, e: TableError) -> None:
        if self.last_error != str(e):
            log.error("%s; keeping the current one", e)
        self.last_error = str(e)
        if self._on_result:
            self._on_result("invalid")

    def _install(self, table: CompiledTable) -> None:
        for w in table.warnings:
            log.warning("routing table: %s", w)
        self.table = table
        self.loaded = True
        self.last_error = ""
        log.info(
            "routing table loaded: %d trust classes, %d tenants, checksum %s",
            len(table.classes),
            len(table.tenants),
            table.checksum[:12],
        )
        if self._on_result:
            self._on_result("loaded")
        if self._on_change:
            self._on_change(table)

    def missing(self, what: str) -> None:
        """The source has no table right now (deleted, missing key): keep the current one."""
        if self.last_error != what:
            log.error("%s; keeping the current routing table", what)
        self.last_error = what

    async def offer(self, raw: bytes) -> bool:
        """A table's bytes from a source other than the file (:mod:`kvfence.router.source`):
        validated and compiled in a thread, swapped in on the event loop. True if now in force."""
        if self._is_current(raw):
            return False
        try:
            table = await asyncio.to_thread(parse_table, raw)
        except TableError as e:
            self._refuse(e)
            return False
        self._install(table)
        return True

    def check(self) -> bool:
        """Reload if the file changed. Returns True if a new table is now in force."""
        try:
            table = self._read_new()
        except TableError as e:
            self._refuse(e)
            return False
        if table is None:
            return False
        self._install(table)
        return True

    async def run(self) -> None:
        """Poll forever. Reading and compiling (pydantic, one HMAC per tenant) run in a thread so a
        large table does not stall requests; the swap itself happens on the event loop."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                try:
                    table = await asyncio.to_thread(self._read_new)
                except TableError as e:
                    self._refuse(e)
                    continue
                if table is not None:
                    self._install(table)
            except Exception:  # never let the watcher die
                log.exception("routing table check failed")
