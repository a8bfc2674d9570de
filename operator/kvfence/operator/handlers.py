"""kopf handlers: thin. Each one turns a watch event into a key for the work queue; the
:class:`~kvfence.operator.reconciler.Reconciler` does the work, level-based, in worker threads.

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
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from kopf._core.reactor.inventory import ResourceMemories, ResourceMemory

from kvfence.api.common import GROUP, VERSION
from kvfence.kube.connection import Connection
from kvfence.kube.connection import load as load_connection
from kvfence.operator import metrics
from kvfence.operator.apply import LIST_PAGE
from kvfence.operator.bindings import accepted_key
from kvfence.operator.builders import (
    ANNOTATION_ROTATE,
    LABEL_MANAGED_BY,
    LABEL_TRUST_CLASS,
    SIGNING_SECRET_NAME,
)
from kvfence.operator.builders import FIELD_MANAGER as MANAGER
from kvfence.operator.keys import ROUTING, BindingSecretKey, ClassKey, ClassSecretKey, Key
from kvfence.operator.reconciler import Reconciler, Requeue, child_digest
from kvfence.operator.secretwatch import (
    DELETED,
    SIGNING_SECRET_FIELD_SELECTOR,
    ApiKeyIndex,
    MetadataWatchClient,
    NamespaceSecretWatches,
    signing_secret_class,
    stale_readers,
)

log = logging.getLogger("kvfence.operator")

MANAGED = {LABEL_MANAGED_BY: MANAGER}
#: Events caused by the operator's own writes come in bursts (a child's creation, its status, the
#: ReplicaSet's pods, every binding's status patch): a short delay lets a burst collapse into one
#: reconcile of the key, since a key already waiting in the queue is not queued again.
COALESCE_SECONDS = 0.5

#: How often a tenant namespace whose Secrets the operator may not watch is tried again: a RoleBinding
#: granted there is noticed within this time (its bindings are then decided again, without being
#: touched). Each try is one metadata-only LIST that RBAC refuses before it reaches storage.
FORBIDDEN_RETRY_SECONDS = 3.0

#: Set by ``main``: the connection kopf's own watches use (the reconciler's: ``--kubeconfig`` or
#: in-cluster).
LOGIN: dict[str, Connection] = {}


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


def _controller(memo: Any) -> Controller:
    c: Controller = memo.controller
    return c


# --- kopf wiring ---------------------------------------------------------------------------------
@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the same credentials as the reconciler (``--kubeconfig`` or in-cluster). A
    token from an exec plugin carries its expiry: kopf logs in again then (and on any 401)."""
    conn = LOGIN.get("connection") or load_connection()
    auth = conn.authorization()
    scheme, token = auth.split(" ", 1) if auth and auth.startswith("Bearer ") else (None, None)
    return kopf.ConnectionInfo(
        server=conn.server,
        ca_path=conn.ca_file,
        insecure=conn.insecure,
        scheme=scheme,
        token=token,
        username=conn.username,
        password=conn.password,
        certificate_path=conn.cert_file,
        private_key_path=conn.key_file,
        expiration=conn.token_expiration(),
        trust_env=settings.networking.trust_env,
    )


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base for an operator that has only event handlers (``@kopf.on.event``).

    kopf builds an object's "essence" on every watch event (a deep copy of its body without the
    status, then compared with the last handled one kept in an annotation) for its create, update,
    resume and daemon handlers. This operator registers none of those (each event only queues a key:
    see the module docstring), so the copy is never read; at 1,000 classes and 10,000 bindings it and
    reading the last one back were 15% of the operator's CPU (bench/bench_operator.py --profile).
    Nothing is stored either: the operator writes no bookkeeping onto the objects.
    ``ensure_only_event_handlers`` refuses to start with a handler that would need a real diff base."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class EventOnlyMemories(ResourceMemories):
    """kopf's record of every object it has seen, not kept between events.

    kopf remembers each watched object (its memo, error throttler, daemons, index and resume state:
    ~1 KB) until the object is deleted: 19,000 records at 1,000 classes and 10,000 bindings. Every
    part of it serves a handler kind this operator does not register (daemons, indexes, resume and
    change handlers; :func:`ensure_only_event_handlers` refuses them), so each event gets a fresh
    record, as kopf's admission webhooks do for an object not created yet (``ephemeral``). The
    ``memo`` handlers receive is still a copy of the operator's (it carries the controller)."""

    async def recall(
        self,
        raw_body: Any,
        *,
        memobase: Any = None,
        noticed_by_listing: bool = False,
        ephemeral: bool = False,
    ) -> ResourceMemory:
        return await super().recall(
            raw_body, memobase=memobase, noticed_by_listing=noticed_by_listing, ephemeral=True
        )


def ensure_only_event_handlers(registry: kopf.OperatorRegistry) -> None:
    """Raise if ``registry`` holds a handler kind that reads kopf's diff base (:class:`NoDiffBase`) or
    its per-object records (:class:`EventOnlyMemories`)."""
    others = [
        h.id
        for h in (
            *registry._changing.get_all_handlers(),
            *registry._spawning.get_all_handlers(),
            *registry._indexing.get_all_handlers(),
        )
    ]
    if others:
        raise RuntimeError(
            f"handlers {others} need kopf's diff base or its per-object records, which this operator "
            "does not keep (NoDiffBase, EventOnlyMemories): use @kopf.on.event"
        )


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    ensure_only_event_handlers(kopf.get_default_registry())
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.enabled = False  # the reconciler posts its own, meaningful Events
    settings.scanning.disabled = True  # no CRD/namespace scanning: fewer permissions needed
    settings.watching.server_timeout = 300
    # Secrets are watched by name only: RBAC grants list/watch of this one name (resourceNames), so
    # the server-side field selector is what makes the watch allowed at all.
    settings.watching.field_selectors["", "v1", "secrets"] = SIGNING_SECRET_FIELD_SELECTOR
    settings.networking.request_timeout = 60
    # Memory: kopf's first list of each kind is read a page at a time (as Kube.list reads), not as one
    # answer holding every object, and the per-object worker that holds an object's last event exits
    # after one idle second instead of five (a start-up burst of thousands of objects is not all held).
    settings.watching.chunk_size = LIST_PAGE
    settings.queueing.idle_timeout = 1.0
    await _controller(memo).start()


@kopf.on.cleanup()
async def shutdown(memo: Any, **_: Any) -> None:
    await _controller(memo).stop()


@kopf.on.event(GROUP, VERSION, "trustclasses")
async def trustclass_event(
    name: str, type: str | None, meta: kopf.Meta, body: kopf.Body, memo: Any, **_: Any
) -> None:
    c = _controller(memo)
    c.watched_body(("TrustClass", "", name), type, body)
    decide = True
    if type == "DELETED":
        c.known_classes.discard(name)
        c.class_signatures.pop(name, None)
    else:
        c.known_classes.add(name)
        # The operator's own status patches change nothing it reconciles from: skip them.
        signature = (
            meta.get("generation"),
            meta.get("deletionTimestamp"),
            tuple(meta.get("finalizers") or ()),
            (meta.get("annotations") or {}).get(ANNOTATION_ROTATE),
        )
        seen = c.class_signatures.get(name)
        if seen == signature:
            return
        c.class_signatures[name] = signature
        # A routing decision reads a class's spec and whether it is being deleted (a new key, the
        # rotation's included, is told by the class reconcile that makes it). Its finalizer, added by
        # its first reconcile, is not news to the decision: at 1,000 classes those events queued a
        # decision over every binding that found nothing to do.
        decide = seen is None or seen[:2] != signature[:2]
    c.enqueue(ClassKey(name))
    if decide:
        c.enqueue(ROUTING, COALESCE_SECONDS)


def _secret_name(spec: Any) -> str | None:
    """The API-key Secret a binding spec (as stored) names, or None."""
    ref = spec.get("apiKeySecretRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None


@kopf.on.event(GROUP, VERSION, "tenantbindings")
async def tenantbinding_event(
    namespace: str | None,
    name: str,
    type: str | None,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: Any,
    **_: Any,
) -> None:
    c = _controller(memo)
    key = f"{namespace}/{name}"
    generation = meta.get("generation")
    seen = c.binding_generations.get(key)
    if type == "DELETED" or (seen is not None and seen != generation):
        # The spec changed (or the binding is gone): its API keys are read again. Not on a binding's
        # first event: whatever is cached for it was read, moments ago, by a decision that listed it
        # (the first events of 10,000 bindings arrive while the first decision reads their keys, and
        # would have it read most of them a second time, one GET each), and the Secret's own watch
        # still invalidates a cached read of an older version.
        c.reconciler.forget_api_keys(key)
    if type == "DELETED":
        if key in c.binding_generations:
            del c.binding_generations[key]
            c.binding_namespaces[namespace or ""] -= 1
            if c.binding_namespaces[namespace or ""] <= 0:
                del c.binding_namespaces[namespace or ""]
        c.track_binding(key, namespace or "", None)
        c.track_binding(accepted_key(key), namespace or "", None)
    else:
        if key not in c.binding_generations:
            c.binding_namespaces[namespace or ""] += 1
        c.binding_generations[key] = generation
        name_now = _secret_name(spec)
        c.track_binding(key, namespace or "", name_now)
        # While an edit is refused the tenant is served with its last accepted spec: the Secret that one
        # names is watched too, so removing its keys still revokes within seconds.
        name_then = _secret_name(dict(status or {}).get("acceptedSpec"))
        c.track_binding(accepted_key(key), namespace or "", name_then if name_then != name_now else None)
        if seen == generation:
            # The same generation: the spec a decision reads is unchanged, and so is the status part
            # it reads (the accepted spec, which only the operator writes). This is the operator's
            # own status write coming back (10,000 of them after a decision over 10,000 bindings,
            # which would queue a second decision over them all to find nothing to do), or a relist.
            # A status edited by someone else is decided again at the next decision or the resync,
            # as a TrustClass's is.
            return
    c.enqueue(ROUTING, COALESCE_SECONDS)


@kopf.on.event("", "v1", "namespaces")
async def namespace_event(
    name: str, type: str | None, labels: kopf.Labels, meta: kopf.Meta, memo: Any, **_: Any
) -> None:
    c = _controller(memo)
    new = dict(labels) if type != "DELETED" else None
    if c.namespace_labels.get(name) != new:
        if new is None:
            c.namespace_labels.pop(name, None)
        else:
            c.namespace_labels[name] = new
        # A namespace's labels decide which classes admit the bindings it holds: news to a decision
        # only where it holds some (a decision lists the namespaces afresh, so a binding seen before
        # its namespace's event is decided with its labels). Not the namespaces the operator creates
        # for new classes: at 1,000 classes their events queued a decision over every binding that
        # found nothing to do.
        if c.binding_namespaces.get(name):
            c.enqueue(ROUTING, COALESCE_SECONDS)
    owner = (labels or {}).get(LABEL_TRUST_CLASS)
    # Every namespace's version is recorded: one that lost the operator's labels is read again at its
    # class's next reconcile (NamespaceConflict).
    news = _news(c, "Namespace", "", name, type, meta)
    if owner and (labels or {}).get(LABEL_MANAGED_BY) == MANAGER and news:
        c.enqueue(ClassKey(owner), COALESCE_SECONDS)


def _news(
    c: Controller,
    kind: str,
    namespace: str,
    name: str,
    type: str | None,
    meta: kopf.Meta,
    body: kopf.Body | None = None,
) -> bool:
    """Whether an event of an object the operator applies is news (not its own write coming back, nor a
    change only where the operator never looks: ``body`` given, see :func:`child_digest`)."""
    version = DELETED if type == "DELETED" else str(meta.get("resourceVersion") or "")
    digest = None if body is None or type == "DELETED" else child_digest(dict(body))
    return c.reconciler.child_event(kind, namespace, name, version, digest)


def _child_handler(group: str, version: str, plural: str, kind: str) -> Callable[..., Any]:
    @kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}")
    async def child_event(
        name: str,
        namespace: str | None,
        type: str | None,
        meta: kopf.Meta,
        labels: kopf.Labels,
        body: kopf.Body,
        memo: Any,
        **_: Any,
    ) -> None:
        owner = labels.get(LABEL_TRUST_CLASS)
        c = _controller(memo)
        c.watched_body((kind, namespace or "", name), type, body)
        if owner and _news(c, kind, namespace or "", name, type, meta, body):
            c.enqueue(ClassKey(owner), COALESCE_SECONDS)

    return child_event


@kopf.on.event("", "v1", "secrets", id="signing-key-secrets")
async def signing_key_secret_event(
    namespace: str | None,
    name: str,
    type: str | None,
    body: kopf.Body,
    labels: kopf.Labels,
    memo: Any,
    **_: Any,
) -> None:
    """The signing-key Secret of a class was created, edited or deleted (the watch's field selector
    lets only that name through): nothing to do when it holds the keys the router has (the operator's
    own write coming back); else check the class's key at once (one GET; a full reconcile only if the
    Secret is gone or not what was applied)."""
    c = _controller(memo)
    owner = (
        signing_secret_class(namespace, labels, c.namespace_labels, c.known_classes)
        if name == SIGNING_SECRET_NAME
        else None
    )
    if owner is None:
        metrics.SECRET_EVENTS.labels("signing-key", "ignored").inc()
        return
    c.watched_body(("Secret", namespace or "", name), type, body)
    secret = {"data": dict(body.get("data") or {}), "metadata": dict(body.get("metadata") or {})}
    if type != "DELETED" and c.reconciler.signing_secret_is_current(owner, secret):
        metrics.SECRET_EVENTS.labels("signing-key", "current").inc()
        return
    metrics.SECRET_EVENTS.labels("signing-key", "enqueued").inc()
    c.enqueue(ClassSecretKey(owner), COALESCE_SECONDS)


#: Label of user ConfigMaps holding a class's shared prefixes (sharedPrefixes[].configMapKeyRef): labelled
#: ones are watched, so an edit reaches the engines within seconds (others at the resync).
LABEL_SHARED_PREFIXES = "kvfence.dev/shared-prefixes"


@kopf.on.event("", "v1", "configmaps", labels={LABEL_SHARED_PREFIXES: "true"}, id="shared-prefix-configmaps")
async def shared_prefix_configmap_event(namespace: str | None, memo: Any, **_: Any) -> None:
    """A labelled ConfigMap changed: reconcile the class whose namespace holds it (only a namespace
    the operator created for a class has one)."""
    c = _controller(memo)
    labels = c.namespace_labels.get(namespace or "") or {}
    owner = labels.get(LABEL_TRUST_CLASS)
    if owner and labels.get(LABEL_MANAGED_BY) == MANAGER:
        c.enqueue(ClassKey(owner), COALESCE_SECONDS)


# Children the operator watches: an edit or a delete of one of them is repaired at once. The
# signing-key Secret has its own watch (above); the routing-table Secret is checked by each routing
# reconcile and the resync.
CHILD_WATCHERS = [
    _child_handler("apps", "v1", "deployments", "Deployment"),
    _child_handler("", "v1", "services", "Service"),
    _child_handler("", "v1", "configmaps", "ConfigMap"),
    _child_handler("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
    _child_handler("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    _child_handler("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
]
