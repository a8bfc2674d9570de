"""Watching the Secrets the operator depends on, without reading every Secret in the cluster.

Two kinds of Secret matter, and each is watched as narrowly as RBAC can express it:

* **Signing keys** (``kvfence-signing-key`` in the class namespaces): one cluster-wide kopf watch with
  the server-side field selector ``metadata.name=kvfence-signing-key``. The RBAC rule that allows it
  names that Secret (``resourceNames``), so the operator may list and watch only Secrets it could
  already ``get``. An event maps to its trust class by the namespace's labels
  (:func:`signing_secret_class`) and enqueues the cheap key check of that class.
* **Tenants' API keys**: Secrets with any name in tenant namespaces. Only namespaces that opt in (a
  RoleBinding to ``kvfence-operator-tenant-secrets``) let the operator read them at all. One
  metadata-only watch runs per namespace that holds TenantBindings (:class:`NamespaceSecretWatches`),
  and the :class:`ApiKeyIndex` of the ``(namespace, name)`` pairs bindings reference drops every event
  of any other Secret before anything is queued. A namespace that did not opt in answers 403: its
  bindings are ``Denied`` anyway, and the watch is tried again every few seconds, so that a RoleBinding
  granted later is noticed at once (the first list reports the Secrets the bindings read, which
  decides them again).

The index and the mapping functions are pure; :class:`MetadataWatchClient` and
:class:`NamespaceSecretWatches` do the I/O (aiohttp, on kopf's event loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfence.kube.connection import Connection
from kvfence.kube.watch import ApiError, AsyncApi
from kvfence.operator import metrics
from kvfence.operator.builders import FIELD_MANAGER, LABEL_MANAGED_BY, LABEL_TRUST_CLASS, SIGNING_SECRET_NAME

log = logging.getLogger("kvfence.operator.secretwatch")

Obj = dict[str, Any]
SecretRef = tuple[str, str]  # (namespace, name)

#: The server-side field selector of the signing-key watch (RBAC allows list/watch of this name only).
SIGNING_SECRET_FIELD_SELECTOR = f"metadata.name={SIGNING_SECRET_NAME}"
#: Metadata only: the operator needs names and resourceVersions, not the Secrets' data.
ACCEPT_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
ACCEPT_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
#: ``resourceVersion`` recorded for a Secret that was deleted (never a real resourceVersion).
DELETED = ""


# --- pure: which class / which bindings an event concerns -----------------------------------------
def signing_secret_class(
    namespace: str | None,
    secret_labels: Mapping[str, str] | None,
    namespace_labels: Mapping[str, Mapping[str, str]],
    known_classes: Collection[str],
) -> str | None:
    """The trust class whose signing-key Secret this is, or ``None`` (not the operator's: ignore).

    The namespace decides: a class namespace carries the class in its labels, set by the operator.
    Only while the namespace has not been seen yet (the watches start together) the Secret's own labels
    are used. Either way the class must exist.
    """
    if not namespace:
        return None
    labels = namespace_labels.get(namespace, secret_labels or {})
    owner = labels.get(LABEL_TRUST_CLASS) if labels.get(LABEL_MANAGED_BY) == FIELD_MANAGER else None
    return owner if owner in known_classes else None


@dataclass
class ApiKeyIndex:
    """Which TenantBindings (``namespace/name``) read which API-key Secret ``(namespace, name)``."""

    _refs: dict[str, SecretRef] = field(default_factory=dict)
    _readers: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # ns -> secret -> bindings

    def ref(self, binding: str) -> SecretRef | None:
        return self._refs.get(binding)

    def track(self, binding: str, namespace: str, secret_name: str | None) -> bool:
        """Record (or, with ``secret_name=None``, forget) what ``binding`` references. Returns whether
        the set of namespaces to watch changed."""
        new = (namespace, secret_name) if secret_name else None
        old = self._refs.get(binding)
        if old == new:
            return False
        changed = False
        if old is not None:
            del self._refs[binding]
            in_ns = self._readers[old[0]]
            in_ns[old[1]].discard(binding)
            if not in_ns[old[1]]:
                del in_ns[old[1]]
            if not in_ns:
                del self._readers[old[0]]
                changed = True
        if new is not None:
            self._refs[binding] = new
            if new[0] not in self._readers:
                self._readers[new[0]] = {}
                changed = True
            self._readers[new[0]].setdefault(new[1], set()).add(binding)
        return changed

    def readers(self, namespace: str, name: str) -> frozenset[str]:
        return frozenset(self._readers.get(namespace, {}).get(name, ()))

    def secrets(self, namespace: str) -> frozenset[str]:
        return frozenset(self._readers.get(namespace, {}))

    def namespaces(self) -> frozenset[str]:
        return frozenset(self._readers)

    def __contains__(self, ref: object) -> bool:
        if not isinstance(ref, tuple) or len(ref) != 2:
            return False
        return ref[1] in self._readers.get(ref[0], {})


def stale_readers(
    index: ApiKeyIndex,
    namespace: str,
    name: str,
    resource_version: str,
    cached_version: Callable[[str], str | None],
) -> frozenset[str] | None:
    """The bindings whose cached API keys an event of Secret ``namespace/name`` at
    ``resource_version`` (:data:`DELETED` for a deletion) makes stale; ``None`` when no binding
    references the Secret (the event is ignored).

    A binding whose keys were read at that very version is not stale (a restarted watch lists every
    Secret again), nor is one with nothing cached when the Secret is gone (it was never found)."""
    readers = index.readers(namespace, name)
    if not readers:
        return None
    stale = set()
    for b in readers:
        cached = cached_version(b)
        if cached == resource_version or (cached is None and resource_version == DELETED):
            continue
        stale.add(b)
    return frozenset(stale)


# --- I/O: metadata-only list and watch of one namespace's Secrets ---------------------------------
class WatchForbidden(Exception):
    """The operator may not list/watch Secrets in this namespace (it did not opt in)."""


class WatchExpired(Exception):
    """The resourceVersion is too old (410 Gone): list again."""


class MetadataWatchClient:
    """Lists and watches ``PartialObjectMetadata`` of Secrets with the operator's own connection
    (:mod:`kvfence.kube`: kubeconfig or in-cluster, the same credentials as
    :class:`kvfence.operator.apply.Kube`)."""

    def __init__(self, conn: Connection, *, watch_timeout: int = 300) -> None:
        self.api = AsyncApi(conn)
        self.watch_timeout = watch_timeout

    async def close(self) -> None:
        await self.api.close()

    @staticmethod
    def _raise(e: ApiError) -> None:
        if e.status == 403:
            raise WatchForbidden(str(e)) from None
        if e.status == 410:
            raise WatchExpired(str(e)) from None
        raise e

    async def list(self, namespace: str) -> tuple[dict[str, str], str]:
        """Every Secret's name in ``namespace`` with its resourceVersion, and the list's resourceVersion.
        Only those two strings of each are kept, page by page (a tenant namespace may hold thousands of
        Secrets, and their metadata carries their managed fields)."""
        listed: dict[str, str] = {}
        version = ""
        try:
            path = f"/api/v1/namespaces/{namespace}/secrets"
            async for page in self.api.pages(path, {}, accept=ACCEPT_LIST):
                for it in page.get("items") or ():
                    it_meta = it.get("metadata") or {}
                    listed[str(it_meta.get("name"))] = str(it_meta.get("resourceVersion", ""))
                version = str((page.get("metadata") or {}).get("resourceVersion", ""))
        except ApiError as e:
            self._raise(e)
        return listed, version

    async def watch(self, namespace: str, resource_version: str) -> AsyncIterator[tuple[str, Obj]]:
        """``(type, object)`` events from ``resource_version`` on, bookmarks included, until the server
        ends the watch (``watch_timeout``)."""
        try:
            async for event in self.api.watch(
                f"/api/v1/namespaces/{namespace}/secrets",
                {},
                resource_version,
                accept=ACCEPT_WATCH,
                seconds=self.watch_timeout,
                bookmarks=True,
            ):
                yield event
        except ApiError as e:
            self._raise(e)


#: ``(namespace, secret name, resourceVersion or DELETED)`` -> None
OnEvent = Callable[[str, str, str], None]


class NamespaceSecretWatches:
    """One metadata-only Secret watch per wanted namespace, reporting every event to ``on_event``
    (which filters by the :class:`ApiKeyIndex`). A re-list after a gap reports the Secrets that are gone
    as deleted."""

    def __init__(
        self,
        client: MetadataWatchClient,
        on_event: OnEvent,
        *,
        forbidden_retry_seconds: float = 300.0,
        referenced: Callable[[str], Collection[str]] = lambda ns: (),
    ) -> None:
        self.client = client
        self.on_event = on_event
        self.forbidden_retry_seconds = forbidden_retry_seconds
        self.referenced = referenced
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.forbidden: set[str] = set()

    def want(self, namespaces: Collection[str]) -> None:
        for ns in set(self._tasks) - set(namespaces):
            self._tasks.pop(ns).cancel()
            self.forbidden.discard(ns)
        for ns in set(namespaces) - set(self._tasks):
            self._tasks[ns] = asyncio.get_running_loop().create_task(self._run(ns), name=f"secrets/{ns}")
        self._gauge()

    def _gauge(self) -> None:
        metrics.SECRET_WATCH_NAMESPACES.labels("forbidden").set(len(self.forbidden))
        metrics.SECRET_WATCH_NAMESPACES.labels("watching").set(len(self._tasks) - len(self.forbidden))

    @property
    def namespaces(self) -> frozenset[str]:
        return frozenset(self._tasks)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self.forbidden.clear()
        self._gauge()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    async def _run(self, ns: str) -> None:
        rv: str | None = None
        seen: set[str] = set()
        backoff = 1.0
        while True:
            try:
                if rv is None:
                    listed, rv = await self.client.list(ns)
                    if ns in self.forbidden:
                        self.forbidden.discard(ns)
                        self._gauge()
                        log.info("watching the Secrets of namespace %s", ns)
                    # Gone while nobody watched (or never there): reported as deleted.
                    for name in (seen | set(self.referenced(ns))) - set(listed):
                        self.on_event(ns, name, DELETED)
                    for name, version in listed.items():
                        self.on_event(ns, name, version)
                    seen = set(listed)
                async for etype, obj in self.client.watch(ns, rv):
                    meta = obj.get("metadata") or {}  # an ERROR event raised in the client
                    rv = str(meta.get("resourceVersion") or rv)
                    if etype == "BOOKMARK":
                        continue
                    name = str(meta.get("name"))
                    if etype == "DELETED":
                        seen.discard(name)
                        self.on_event(ns, name, DELETED)
                    else:
                        seen.add(name)
                        self.on_event(ns, name, rv)
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except WatchForbidden:
                if ns not in self.forbidden:
                    self.forbidden.add(ns)
                    self._gauge()
                    log.info(
                        "may not watch the Secrets of namespace %s (no RoleBinding to the tenant-secrets "
                        "ClusterRole, or an old one without list/watch); trying again in %.0fs",
                        ns,
                        self.forbidden_retry_seconds,
                    )
                rv = None
                await asyncio.sleep(self.forbidden_retry_seconds)
            except WatchExpired:
                rv = None
            except Exception as e:
                log.warning("watch of the Secrets in %s failed (retry in %.0fs): %s", ns, backoff, e)
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
