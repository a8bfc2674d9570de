"""The work queue: typed keys (:mod:`kvfence.operator.keys`) from the kopf handlers
(:mod:`kvfence.operator.handlers`) and the API-key Secret watches, reconciled by the
:class:`~kvfence.operator.reconciler.Reconciler` in worker threads.

Why a queue rather than kopf's create/update/delete handlers: every reconcile here is idempotent and
looks at the whole picture (a binding's fate depends on the other bindings), so a burst of events for
one key collapses into one reconcile, a failure is retried with backoff, and the operator writes no
bookkeeping of its own onto the objects (no last-handled-configuration annotation): a restarted
operator with nothing to do sends no write request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvfence.kube.connection import Connection
from kvfence.operator import metrics
from kvfence.operator.keys import ROUTING, BindingSecretKey, ClassSecretKey, Key
from kvfence.operator.reconcile_base import Requeue
from kvfence.operator.reconciler import Reconciler
from kvfence.operator.secretwatch import (
    DELETED,
    ApiKeyIndex,
    MetadataWatchClient,
    NamespaceSecretWatches,
    stale_readers,
)

log = logging.getLogger("kvfence.operator")

#: Events caused by the operator's own writes come in bursts (a child's creation, its status, the
#: ReplicaSet's pods, every binding's status patch): a short delay lets a burst collapse into one
#: reconcile of the key, since a key already waiting in the queue is not queued again.
COALESCE_SECONDS = 0.5

#: How often a tenant namespace whose Secrets the operator may not watch is tried again: a RoleBinding
#: granted there is noticed within this time (its bindings are then decided again, without being
#: touched). Each try is one metadata-only LIST that RBAC refuses before it reaches storage.
FORBIDDEN_RETRY_SECONDS = 3.0


class Controller:
    """A de-duplicating work queue with per-key exclusivity, retries with backoff, and a resync.

    With ``secrets_conn`` it also watches the tenants' API-key Secrets (see
    :mod:`kvfence.operator.secretwatch`): one metadata-only watch per namespace that holds bindings,
    filtered by the index of the Secrets bindings reference."""

    def __init__(
        self,
        reconciler: Reconciler,
        *,
        workers: int = 4,
        resync_seconds: float = 300.0,
        on_stop: Callable[[], None] | None = None,
        secrets_conn: Connection | None = None,
    ) -> None:
        self.reconciler = reconciler
        self._on_stop = on_stop
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.known_classes: set[str] = set()
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self.binding_generations: dict[str, Any] = {}
        #: namespace -> how many TenantBindings it holds (as the binding events told)
        self.binding_namespaces: Counter[str] = Counter()
        self.class_signatures: dict[str, tuple[Any, ...]] = {}
        self.api_keys = ApiKeyIndex()
        self._secrets_conn = secrets_conn
        self.secret_watches: NamespaceSecretWatches | None = None
        self._queue: asyncio.Queue[Key] | None = None
        self._queued: set[Key] = set()
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # One thread per worker: asyncio's default executor has min(32, CPUs + 4) threads, fewer
        # than ``workers`` on a small node, and is shared with anything else that uses it.
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="kvfence-reconcile")

    # --- queue ---------------------------------------------------------------------------------
    def enqueue(self, key: Key, delay: float = 0.0) -> None:
        if self._loop is None or self._queue is None:
            raise RuntimeError("controller not started")
        if delay > 0:
            self._loop.call_later(delay, self.enqueue, key)
            return
        if key in self._queued:
            return
        if key in self._processing:
            self._dirty.add(key)
            return
        self._queued.add(key)
        self._queue.put_nowait(key)
        metrics.QUEUE_DEPTH.set(len(self._queued))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]
        self._tasks.append(asyncio.create_task(self._resync()))
        if self._secrets_conn is not None:
            self.secret_watches = NamespaceSecretWatches(
                MetadataWatchClient(self._secrets_conn),
                self.api_key_secret_event,
                forbidden_retry_seconds=min(FORBIDDEN_RETRY_SECONDS, self.resync_seconds),
                referenced=self.api_keys.secrets,
            )
            self.secret_watches.want(self.api_keys.namespaces())
        loop = self._loop

        def notify() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the operator is stopping
                loop.call_soon_threadsafe(self._take_later)

        self.reconciler.notify = notify
        self.reconciler.renders_meanwhile = self.workers > 1
        self.enqueue(ROUTING)

    def _take_later(self) -> None:
        for f, delay in self.reconciler.take_later().items():
            self.enqueue(f, delay)

    async def stop(self) -> None:
        if self._on_stop is not None:
            self._on_stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.secret_watches is not None:
            await self.secret_watches.stop()

    def watched_body(self, ref: tuple[str, str, str], type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event carried ``body``: the reconciler's reads of it come from memory
        (:mod:`kvfence.operator.watchcache`)."""
        cache = self.reconciler.kube.cache
        if cache is not None:
            cache.event(ref, None if type == "DELETED" else dict(body))

    # --- API-key Secrets ------------------------------------------------------------------------
    def track_binding(self, binding: str, namespace: str, secret_name: str | None) -> None:
        """Record which Secret a binding reads (``None``: the binding is gone); start or stop the
        namespace watches accordingly."""
        old = self.api_keys.ref(binding)
        if self.api_keys.track(binding, namespace, secret_name) and self.secret_watches is not None:
            self.secret_watches.want(self.api_keys.namespaces())
        if old is not None and old not in self.api_keys:
            self.reconciler.secret_untracked(old)

    def api_key_secret_event(self, namespace: str, name: str, resource_version: str) -> None:
        """A Secret in a watched namespace was added, changed or deleted (``DELETED``): re-decide the
        bindings that read it, unless their keys were read at this very version. Any other Secret's
        event stops here."""
        stale = stale_readers(
            self.api_keys, namespace, name, resource_version, self.reconciler.cached_secret_version
        )
        if stale is None:
            metrics.SECRET_EVENTS.labels("api-key", "ignored").inc()
            return
        self.reconciler.secret_changed(namespace, name, resource_version)
        if not stale:
            metrics.SECRET_EVENTS.labels("api-key", "current").inc()
            return
        metrics.SECRET_EVENTS.labels("api-key", "enqueued").inc()
        log.info(
            "API-key Secret %s/%s %s: re-deciding %s",
            namespace,
            name,
            "deleted" if resource_version == DELETED else "changed",
            ", ".join(sorted(stale)),
        )
        for b in stale:
            ns, bname = b.split("/", 1)
            self.enqueue(BindingSecretKey(ns, bname), COALESCE_SECONDS)

    async def _worker(self, _: int) -> None:
        assert self._queue is not None
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            metrics.QUEUE_DEPTH.set(len(self._queued))
            self._processing.add(key)
            kind = key.kind
            started = time.monotonic()
            follow: set[Key] = set()
            try:
                follow = await asyncio.get_running_loop().run_in_executor(
                    self._threads, self.reconciler.reconcile, key
                )
                self._failures.pop(key, None)
                metrics.RECONCILES.labels(kind=kind, result="ok").inc()
            except Requeue as r:
                metrics.RECONCILES.labels(kind=kind, result="requeue").inc()
                log.debug("requeue %s in %.1fs: %s", key, r.delay, r)
                self.enqueue(key, r.delay)
            except Exception as e:
                n = self._failures.get(key, 0) + 1
                self._failures[key] = n
                delay = min(60.0, 0.5 * 2 ** min(n, 7))
                metrics.RECONCILES.labels(kind=kind, result="error").inc()
                metrics.RECONCILE_ERRORS.labels(kind=kind).inc()
                log.warning("reconcile %s failed (attempt %d, retry in %.1fs): %s", key, n, delay, e)
                self.enqueue(key, delay)
            finally:
                metrics.RECONCILE_SECONDS.labels(kind=kind).observe(time.monotonic() - started)
                self._processing.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)
            for f in follow:
                self.enqueue(f)
            self._take_later()

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            # A safety net behind the Secret watches, and the only way to see a change in a tenant
            # namespace that lets the operator read but not watch its Secrets: API keys are re-read,
            # and each class's signing-key Secret is checked (one GET per class).
            self.reconciler.forget_api_keys()
            self.reconciler.forget_children()
            self.enqueue(ROUTING)
            for name in sorted(self.known_classes):
                self.enqueue(ClassSecretKey(name))
