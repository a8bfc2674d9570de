"""kopf handlers: thin. Each one turns a watch event into a key for the work queue
(:mod:`kvfence.operator.workqueue`), and skips the events that are no news to a reconcile: the
operator's own writes coming back, changes only where the operator never looks. The
:class:`~kvfence.operator.reconciler.Reconciler` does the work, level-based, in worker threads.
How kopf itself is set up is in :mod:`kvfence.operator.kopf_settings`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import kopf

from kvfence.api.common import GROUP, VERSION
from kvfence.operator import metrics
from kvfence.operator.bindings import accepted_key
from kvfence.operator.bookkeeping import child_digest
from kvfence.operator.builders import (
    ANNOTATION_ROTATE,
    LABEL_MANAGED_BY,
    LABEL_TRUST_CLASS,
    SIGNING_SECRET_NAME,
)
from kvfence.operator.builders import FIELD_MANAGER as MANAGER
from kvfence.operator.keys import ROUTING, ClassKey, ClassSecretKey
from kvfence.operator.kopf_settings import controller as _controller
from kvfence.operator.secretwatch import DELETED, signing_secret_class
from kvfence.operator.workqueue import COALESCE_SECONDS, Controller

MANAGED = {LABEL_MANAGED_BY: MANAGER}


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
