"""Level-based reconciliation: read what is, build what should be, apply only the difference.

Nothing here depends on kopf: :class:`Reconciler` is driven by typed keys (:mod:`kvfence.operator.keys`)
from the work queue in :mod:`kvfence.operator.workqueue`, and is safe to call again
at any time, for any reason (a watch event, a resync, a retry, a restart). A reconcile that finds the
cluster as it should be sends no write request at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfence.api import conditions
from kvfence.api.common import API_VERSION, TenantQuotas
from kvfence.api.tenantbinding import TenantBinding, TenantBindingSpec
from kvfence.api.trustclass import TrustClass
from kvfence.contract import key_id, new_signing_key
from kvfence.contract.routing import ROUTING_SECRET_NAME, hash_api_key
from kvfence.operator import builders, memory, modelcache, secretwatch
from kvfence.operator.apply import Kube, KubeError, is_subset, manages, now_rfc3339
from kvfence.operator.bindings import (
    ClassState,
    Decision,
    KeyLookup,
    accepted_key,
    api_keys_from_secret,
    decide,
    routing_secret,
)
from kvfence.operator.events import Event
from kvfence.operator.keys import ROUTING, BindingSecretKey, ClassKey, ClassSecretKey, Key, RoutingKey
from kvfence.operator.status import (
    ACCEPTED_GENERATION,
    ACCEPTED_SPEC,
    deployment_status_read,
    kstatus_conditions,
    object_condition,
    set_condition,
    status_differs,
    status_patch,
    trust_class_status,
)

log = logging.getLogger("kvfence.operator")

Obj = dict[str, Any]
#: (kind, namespace or "", name) of an object the operator applies
ChildRef = tuple[str, str, str]
FINALIZER = "kvfence.dev/cleanup"
FINALIZER_MANAGER = "kvfence-operator-finalizer"
#: Requests the routing decision has in flight at once for its per-binding reads and writes.
ROUTING_CONCURRENCY = 8
#: A namespace with at least this many API-key Secrets to read (the first routing decision after a
#: start, a namespace full of new bindings) has them read by one paged LIST instead of a GET each.
API_KEYS_LIST_MIN = 16
#: The longest a routing decision holds its bindings' status writes back while the classes it has just
#: routed for the first time write their tenants' quotas into their engine configs (see
#: :meth:`Reconciler._await_renders`).
RENDER_PRECEDENCE_SECONDS = 120.0
#: How often a class waiting for its model token Secret (missing, or not readable) looks again.
TOKEN_RETRY_SECONDS = 3.0


class Requeue(Exception):
    """Try again later (a dependency is not there yet)."""

    def __init__(self, message: str, delay: float = 2.0) -> None:
        super().__init__(message)
        self.delay = delay


def spec_hash(obj: Obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def with_spec_hash(obj: Obj) -> Obj:
    """``obj`` annotated with the hash of itself: a change of the *desired* object (also a field
    removed) is seen without reading anything but the live annotation."""
    h = spec_hash(obj)
    out = dict(obj)
    meta = dict(out["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), builders.ANNOTATION_SPEC_HASH: h}
    out["metadata"] = meta
    return out


def needs_apply(desired: Obj, live: Obj | None) -> bool:
    if live is None:
        return True
    return not is_subset(desired, live)


def accepted_trust_class(body: Obj) -> TrustClass | None:
    """The TrustClass as last accepted (``status.acceptedSpec``), or None (none, or it fails too)."""
    spec = (body.get("status") or {}).get(ACCEPTED_SPEC)
    if not isinstance(spec, dict):
        return None
    try:
        return TrustClass.model_validate({**body, "spec": spec})
    except ValidationError:
        return None


#: The metadata a routing decision reads of a binding: its identity, versions and age (the decision's
#: order), and what its status write and Events name.
BINDING_VIEW_METADATA = ("name", "namespace", "uid", "generation", "resourceVersion", "creationTimestamp")


@dataclass(frozen=True, slots=True)
class ListedBinding:
    """What a routing decision keeps of a listed TenantBinding (10,000 of them at once at scale): the
    model it decides with, validated from :data:`BINDING_VIEW_METADATA`, the spec and the status
    reduced to the accepted spec (the only part of the status a decision reads); and the whole status
    as compact JSON, which only the binding's status write reads (its conditions' transition times).
    Parsed, that status is most of a listed binding's memory (eight conditions: ~4 KB of dicts and
    strings, against ~1.2 KB of JSON)."""

    model: TenantBinding
    status_json: bytes

    def status(self) -> Obj:
        """The status as listed (a new object on every call: the caller may change it)."""
        status: Obj = json.loads(self.status_json)
        return status

    def body(self) -> Obj:
        """The binding as its status write and Events name it: identity, versions and status."""
        return {
            "apiVersion": API_VERSION,
            "kind": "TenantBinding",
            "metadata": self.model.metadata,
            "status": self.status(),
        }


def list_binding(body: Obj) -> ListedBinding | None:
    """:class:`ListedBinding` of a listed TenantBinding, made as each page of the list arrives, so a
    decision never holds the bindings' whole bodies (labels, annotations, owner references) or their
    parsed statuses; None for a binding that does not validate (the decision leaves it alone)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    try:
        model = TenantBinding.model_validate(
            {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "metadata": {k: meta[k] for k in BINDING_VIEW_METADATA if k in meta},
                "spec": body.get("spec"),
                "status": {k: status[k] for k in (ACCEPTED_SPEC, ACCEPTED_GENERATION) if k in status},
            }
        )
    except ValidationError:
        return None
    return ListedBinding(model, json.dumps(status, separators=(",", ":")).encode())


#: Children whose status the operator never reads: a change of their status alone is no news.
STATUS_NOT_READ = frozenset({"ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service"})


def child_digest(body: Obj) -> str:
    """A digest of what the operator reads of a child it applies: the whole object but its
    resourceVersion and managed fields, and of its status only what it reads (a Deployment's
    :func:`~kvfence.operator.status.deployment_status_read`; nothing of the kinds in
    :data:`STATUS_NOT_READ`; all of any other's). Two versions with one digest differ only where the
    operator never looks (a PodDisruptionBudget's status, written by the disruption controller as pods
    come and go)."""
    meta = {
        k: v for k, v in (body.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")
    }
    kind = body.get("kind")
    rest = {k: v for k, v in body.items() if k not in ("metadata", "status")}
    if kind == "Deployment":
        rest["status"] = deployment_status_read(body)
    elif kind not in STATUS_NOT_READ:
        rest["status"] = body.get("status")
    return spec_hash({**rest, "metadata": meta})


@dataclass
class State:
    """What the reconciler remembers between reconciles (all of it can be rebuilt from the cluster)."""

    signing: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    #: binding key -> ((secret name, secret key, binding resourceVersion), lookup, the Secret's
    #: resourceVersion when it was read)
    keys: dict[str, tuple[tuple[str, str | None, str], KeyLookup, str]] = field(default_factory=dict)
    #: (namespace, name) of an API-key Secret -> the latest resourceVersion its watch reported
    #: (``secretwatch.DELETED`` once deleted). A cached lookup of an older version is read again.
    secret_versions: dict[tuple[str, str], str] = field(default_factory=dict)
    tenant_quotas: dict[str, dict[str, TenantQuotas]] = field(default_factory=dict)
    bound_count: dict[str, int] = field(default_factory=dict)
    class_namespace: dict[str, str] = field(default_factory=dict)
    pending_follow: set[Key] = field(default_factory=set)
    routing_ready: threading.Event = field(default_factory=threading.Event)
    #: classes whose reconcile ran at least once in this process: until then a class without a
    #: signing key is about to get one, and the routing decision does not write "not ready yet" on
    #: its bindings (the class's reconcile queues the decision again, which can say Bound at once)
    class_tried: set[str] = field(default_factory=set)
    #: classes the last routing decision routed (they had a signing key)
    routed: set[str] = field(default_factory=set)
    #: classes waiting for a routing decision that routes them (their tenants' quotas go into the
    #: engine config): the decision wakes them, nobody polls
    awaiting_routing: set[str] = field(default_factory=set)
    #: what a class's reconcile applied while it waited for that decision (namespace, key): told in
    #: the one "Applied" Event of the reconcile that renders the rest
    applied_early: dict[str, list[str]] = field(default_factory=dict)
    #: objects the operator applied, or read and found as desired: their resourceVersion then and the
    #: spec hash of what was desired
    seen: dict[ChildRef, tuple[str, str]] = field(default_factory=dict)
    #: the latest resourceVersion the watches reported for those objects (``secretwatch.DELETED`` once gone)
    watched: dict[ChildRef, str] = field(default_factory=dict)
    #: the :func:`child_digest` of the latest watch event of each of those objects
    digests: dict[ChildRef, str] = field(default_factory=dict)


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        opts: builders.OperatorOptions,
        *,
        emit: Callable[[Event], None] | None = None,
        new_key: Callable[[], bytes] = new_signing_key,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.opts = opts
        self.state = State()
        self._emit = emit or (lambda e: None)
        self._new_key = new_key
        self._clock = clock
        self._routing_lock = threading.Lock()
        self._later_lock = threading.Lock()
        self._routed_lock = threading.Lock()
        self._later: dict[Key, float] = {}
        #: set by the work queue: called (from any thread) when :meth:`later` has keys to take
        self.notify: Callable[[], None] | None = None
        #: set by the work queue when it reconciles other keys while a decision runs (more than one
        #: worker): only then may a decision wait for the renders it queued
        self.renders_meanwhile = False
        #: classes a decision routed for the first time whose reconcile has not run since (guarded by
        #: ``_renders``): their engine configs get their tenants before the decision writes binding
        #: statuses
        self._rendering: set[str] = set()
        self._renders = threading.Condition()
        # The routing decision's per-binding requests (API-key Secret reads, status writes and their
        # Events) are independent of each other: sent ROUTING_CONCURRENCY at a time, not one by one.
        self._fanout = ThreadPoolExecutor(ROUTING_CONCURRENCY, thread_name_prefix="kvfence-routing")

    def later(self, key: Key, delay: float) -> None:
        """Ask for ``key`` to be reconciled again in ``delay`` seconds (the work queue takes these
        after each reconcile, see :meth:`take_later`, and at once when it set :attr:`notify`)."""
        with self._later_lock:
            self._later[key] = min(delay, self._later.get(key, delay))
        if self.notify is not None:
            self.notify()

    def take_later(self) -> dict[Key, float]:
        with self._later_lock:
            out, self._later = self._later, {}
        return out

    # ---------------------------------------------------------------------------------------------
    def reconcile(self, key: Key) -> set[Key]:
        """Reconcile one key; return the keys that must be reconciled because of it."""
        match key:
            case RoutingKey():
                return self.reconcile_routing()
            case ClassKey(name):
                return self.reconcile_class(name)
            case ClassSecretKey(name):
                return self.check_class_secret(name)
            case BindingSecretKey():
                # The binding's API-key Secret changed: its watch recorded the new resourceVersion
                # (:meth:`secret_changed`), so the decision reads the Secret again unless its keys
                # were read at that very version (the watch's first list of Secrets already read).
                return {ROUTING}
        raise ValueError(f"unknown key {key!r}")

    # --- TrustClass ------------------------------------------------------------------------------
    def reconcile_class(self, name: str) -> set[Key]:
        # Only a reconcile that started after the decision marked the class renders for it (one in
        # flight then had seen the class unrouted, and the decision queued another).
        with self._renders:
            marked = name in self._rendering
        try:
            return self._reconcile_class(name)
        finally:
            if marked:
                with self._renders:
                    self._rendering.discard(name)
                    if not self._rendering:
                        self._renders.notify_all()
            if name not in self.state.class_tried:
                self.state.class_tried.add(name)
                if name not in self.state.signing:
                    # No key came of its first reconcile (refused, failed): its bindings are told so.
                    self.later(ROUTING, 0)

    def _reconcile_class(self, name: str) -> set[Key]:
        body = self.kube.get(API_VERSION, "TrustClass", name)
        if body is None:
            self._forget(name)
            return {ROUTING}
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return self._finalize(body)
        if FINALIZER not in (meta.get("finalizers") or []):
            self._set_finalizer(body, present=True)
        try:
            tc = TrustClass.model_validate(body)
        except ValidationError as e:
            # Nothing is applied; the class stays routed with its last accepted spec, if it has one
            # (see :func:`accepted_trust_class`), as its engines keep running as last rendered.
            last = accepted_trust_class(body)
            msg = str(e)
            if last is not None:
                msg = (
                    f"generation {meta.get('generation')} is not accepted; serving the last accepted spec "
                    f"(generation {(body.get('status') or {}).get(ACCEPTED_GENERATION)}): {msg}"
                )
            was = object_condition(body, conditions.DEGRADED)
            if (was.get("reason"), was.get("observedGeneration")) != (
                conditions.REASON_INVALID_SPEC,
                meta.get("generation"),
            ):
                self._emit(Event(body, conditions.REASON_INVALID_SPEC, msg[:1024], "Warning"))
            self._class_status(body, None, degraded=(conditions.REASON_INVALID_SPEC, msg))
            return set()
        ns_name = tc.target_namespace
        self.state.class_namespace[name] = ns_name
        owner = builders.owner_reference(body)
        desired_ns = builders.namespace(tc, self.opts, owner)
        changed: list[str] = []
        # Ours and as desired when last seen, and its watch reported no other version since: it is
        # still ours, not terminating, nothing to read.
        known_ns = self._unchanged(desired_ns)
        live_ns = None if known_ns else self.kube.get("v1", "Namespace", ns_name)
        if (
            live_ns is not None
            and (live_ns["metadata"].get("labels") or {}).get(builders.LABEL_TRUST_CLASS) != name
        ):
            msg = f"namespace {ns_name!r} exists and does not belong to TrustClass {name!r}"
            self._class_status(body, tc, degraded=(conditions.REASON_NAMESPACE_CONFLICT, msg))
            self._emit(Event(body, conditions.REASON_NAMESPACE_CONFLICT, msg, "Warning"))
            return set()
        if live_ns is not None and live_ns["metadata"].get("deletionTimestamp"):
            raise Requeue(f"namespace {ns_name} is still terminating", delay=5)
        if not known_ns:
            self._ensure(desired_ns, live_ns, changed)
        # A namespace that did not exist a moment ago holds none of the children: nothing to read.
        fresh = live_ns is None and not known_ns

        # The signing key: kept, created once, rotated on request; a second rotation waits until the
        # first has reached every engine (the key it would retire may still be the one signing).
        live_secret = None if fresh else self.kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, ns_name)
        live_keys = builders.read_signing_secret(live_secret)
        rotation = (meta.get("annotations") or {}).get(builders.ANNOTATION_ROTATE)
        # The keys the router held before this reconcile: a key made below (a new class's, or one put
        # back after its Secret was deleted) is news to the routing decision unless the class waits
        # for one anyway.
        routed_keys = self.state.signing.get(name)
        if live_keys is None:
            # A new class's key first, before the engine is rendered: the routing decision that the
            # engine config waits for (below) can then already route the class and bind its tenants.
            live_keys = builders.plan_signing_keys(None, rotation, self._new_key(), now_rfc3339())
            live_secret = self._ensure(
                builders.signing_secret(tc, live_keys, self.opts, owner), live_secret, changed
            )
            self.state.signing[name] = builders.router_signing_keys(live_keys, propagated=True)
        with self._routed_lock:
            waiting = name not in self.state.routed
            if waiting:
                self.state.awaiting_routing.add(name)
        if waiting:
            # Told in the one "Applied" Event of the reconcile that renders the engine.
            self.state.applied_early.setdefault(name, []).extend(changed)
            changed.clear()
            if not fresh:
                # The engine config holds the class's tenants' quotas: rendered once a routing
                # decision has routed the class (that decision queues this class again). A running
                # engine keeps the config it has until then (after an operator restart, say).
                return {ROUTING}
        # A new class (its namespace made just now) renders its engine at once, its config marked
        # ``tenantsPending``: its pods start (image, model) while the routing decision computes the
        # tenants' quotas, and are not ready until the config the decision's wake-up rewrites, with
        # those quotas and without the mark, reaches them. The router routes none of its tenants
        # before that decision either (it writes the routing table).
        if live_keys is not None and rotation and rotation != live_keys.rotated_for:
            wait = builders.key_propagation_left(
                live_keys, self._clock(), self.opts.signing_key_propagation_seconds
            )
            if wait > 0:
                log.info("class %s: rotation %r waits %.0fs for the previous one", name, rotation, wait)
                self.later(ClassKey(name), wait + 0.5)
                rotation = live_keys.rotated_for
        needs_key = live_keys is None or bool(rotation and rotation != live_keys.rotated_for)
        keys = builders.plan_signing_keys(
            live_keys, rotation, self._new_key() if needs_key else b"", now_rfc3339()
        )
        if live_keys is not None and keys.current != live_keys.current:
            self._emit(
                Event(
                    body,
                    "SigningKeyRotated",
                    f"signing key rotated, new key id {key_id(keys.current)}; the router signs with it "
                    f"once every engine holds it ({self.opts.signing_key_propagation_seconds:.0f}s)",
                )
            )
        try:
            shared_texts = self._shared_prefix_texts(tc, ns_name)
        except LookupError as e:
            # Nothing is applied: the engines keep serving with the last config they were given.
            self._class_status(body, tc, degraded=(conditions.REASON_SHARED_PREFIX_UNRESOLVED, str(e)))
            self._emit(Event(body, conditions.REASON_SHARED_PREFIX_UNRESOLVED, str(e), "Warning"))
            raise Requeue(str(e), delay=10) from None
        if self._model_token_unavailable(body, tc, ns_name):
            raise Requeue("the model token Secret is not available", delay=TOKEN_RETRY_SECONDS)
        try:
            objs = builders.children(
                tc,
                signing=keys,
                tenant_quotas=None if waiting else self.state.tenant_quotas.get(name),
                tenants_pending=waiting,
                opts=self.opts,
                owner=owner,
                shared_texts=shared_texts,
            )
        except builders.RefusedExtraArgs as e:
            # Nothing is applied: the engine keeps running as last rendered, and never with the flag.
            self._class_status(body, tc, degraded=(conditions.REASON_FORBIDDEN_EXTRA_ARGS, str(e)))
            self._emit(Event(body, conditions.REASON_FORBIDDEN_EXTRA_ARGS, str(e), "Warning"))
            return set()
        except ValueError as e:
            self._class_status(body, tc, degraded=(conditions.REASON_INVALID_ENGINE_CONFIG, str(e)))
            return set()
        lives: dict[int, Obj | None] = {}
        for i, obj in enumerate(objs):
            if obj["kind"] == "Secret":
                lives[i] = live_secret
            elif fresh:
                lives[i] = None
            elif obj["kind"] not in ("Deployment", "PersistentVolumeClaim") and self._unchanged(obj):
                continue  # as desired when last seen, and its watch reported no other version since
            else:
                lives[i] = self.kube.get(obj["apiVersion"], obj["kind"], obj["metadata"]["name"], ns_name)
            if obj["kind"] == "PersistentVolumeClaim":
                objs[i], refusal = modelcache.plan_claim(obj, lives[i])
                if refusal is not None:
                    # Nothing is applied: the engine keeps the claim it mounts, as last rendered.
                    self._refuse(body, tc, conditions.REASON_MODEL_CACHE_CLAIM_REFUSED, refusal)
                    return set()
        deployment_live: Obj | None = None
        for i, obj in enumerate(objs):
            if i not in lives:
                continue  # unchanged (above): nothing to apply
            live = lives[i]
            if obj["kind"] == "Deployment" and tc.spec.replicas_managed_externally:
                self._hand_over_replicas(live)
            try:
                applied = self._ensure(obj, live, changed)
            except KubeError as e:
                if obj["kind"] != "PersistentVolumeClaim" or e.status not in (403, 422):
                    raise
                # The API server's word (say, an expansion the StorageClass does not allow): the engine
                # is left as it was, with the claim as it is.
                msg = f"engine.modelCache.volumeClaim: claim {ns_name}/{obj['metadata']['name']}: {e}"
                self._refuse(body, tc, conditions.REASON_MODEL_CACHE_CLAIM_REFUSED, msg[:2048])
                return set()
            if obj["kind"] == "Deployment":
                deployment_live = applied
        changed[:0] = self.state.applied_early.pop(name, [])
        if changed:
            self._emit(Event(body, "Applied", "applied " + ", ".join(changed)))
        # After a rotation the router keeps signing with the previous key until every engine holds the
        # new one: the kubelet refreshes the mounted Secret in place (no new pod) and the engines reload
        # it, within the propagation delay counted from the rotation time on the Secret (it survives an
        # operator restart). Then the new key goes first. Engines verify both keys throughout.
        wait = builders.key_propagation_left(keys, self._clock(), self.opts.signing_key_propagation_seconds)
        if wait > 0:
            self.later(ClassKey(name), wait + 0.5)
        router_keys = builders.router_signing_keys(keys, propagated=wait == 0)
        self._class_status(body, tc, deployment=deployment_live, key=router_keys[0])
        follow: set[Key] = set()
        old = routed_keys
        if old != router_keys:
            if old is not None and old[0] != router_keys[0]:
                self._emit(
                    Event(body, "SigningKeyActive", f"the router signs with key id {key_id(router_keys[0])}")
                )
            self.state.signing[name] = router_keys
            follow.add(ROUTING)
        return follow

    def _refuse(self, body: Obj, tc: TrustClass, reason: str, msg: str) -> None:
        """Degraded and Stalled for ``reason``; a Warning Event when that is news (not at every retry)."""
        was = object_condition(body, conditions.DEGRADED)
        if (was.get("reason"), was.get("message"), was.get("observedGeneration")) != (
            reason,
            msg,
            body["metadata"].get("generation"),
        ):
            self._emit(Event(body, reason, msg, "Warning"))
        self._class_status(body, tc, degraded=(reason, msg))

    def _model_token_unavailable(self, body: Obj, tc: TrustClass, ns: str) -> bool:
        """Whether the class's model token Secret (``engine.model.tokenSecretRef``) cannot be used yet;
        if so the class is Degraded/Stalled with a reason naming the Secret and key (never a value)."""
        ref = tc.spec.engine.model.token_secret_ref
        if ref is None:
            return False
        try:
            secret = self.kube.get("v1", "Secret", ref.name, ns)
        except KubeError as e:
            if not e.forbidden:
                raise
            msg = (
                f"engine.model.tokenSecretRef: the operator may not read Secret {ns}/{ref.name} (bind the "
                f"{self.opts.tenant_secrets_role} ClusterRole to it in namespace {ns})"
            )
            self._refuse(body, tc, conditions.REASON_MODEL_TOKEN_FORBIDDEN, msg)
            return True
        why = modelcache.token_refusal(ref, ns, secret)
        if why is None:
            return False
        self._refuse(body, tc, conditions.REASON_MODEL_TOKEN_MISSING, why)
        return True

    def _hand_over_replicas(self, live: Obj | None) -> None:
        """Before the operator applies an engine Deployment without replicas: if it owns them, another
        field manager applies the live count first, so that dropping them from the operator's apply
        keeps the count (server-side apply would otherwise remove the field: back to 1 replica) until
        the autoscaler writes its own through /scale."""
        if live is not None and "managedFields" not in live["metadata"]:
            # read from the watch cache, which keeps no managed fields: who owns the replicas is there
            meta = live["metadata"]
            live = self.kube.get("apps/v1", "Deployment", meta["name"], meta["namespace"], cached=False)
        if live is None or not manages(live, builders.FIELD_MANAGER, "spec", "replicas"):
            return
        meta = live["metadata"]
        count = (live.get("spec") or {}).get("replicas", 1)
        self.kube.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "spec": {"replicas": count},
            },
            field_manager=builders.REPLICAS_HANDOVER_MANAGER,
        )
        log.info(
            "engine replicas of %s handed over at %s (replicasManagedExternally)", meta["namespace"], count
        )

    def _shared_prefix_texts(self, tc: TrustClass, ns: str) -> dict[str, str]:
        """The text of each shared prefix kept in a ConfigMap of the class's namespace, by prefix name;
        LookupError names the first ConfigMap or key that is missing."""
        texts: dict[str, str] = {}
        for p in tc.spec.prefix_cache.shared_prefixes:
            ref = p.config_map_key_ref
            if ref is None:
                continue
            cm = self.kube.get("v1", "ConfigMap", ref.name, ns)
            text = None if cm is None else (cm.get("data") or {}).get(ref.key)
            if not text:
                what = (
                    f"ConfigMap {ns}/{ref.name}"
                    if cm is None
                    else f"key {ref.key!r} of ConfigMap {ns}/{ref.name}"
                )
                raise LookupError(f"prefixCache.sharedPrefixes[{p.name}]: {what} does not exist or is empty")
            texts[p.name] = text
        return texts

    def check_class_secret(self, name: str) -> set[Key]:
        """The resync's cheap check of what the operator cannot watch (its signing-key Secret): one GET
        per class; a full reconcile only when the Secret is gone or not what was applied. Every other
        child is watched, so its drift has already been repaired."""
        ns, keys = self.state.class_namespace.get(name), self.state.signing.get(name)
        if ns is None or keys is None:
            return {ClassKey(name)}
        secret = self.kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, ns)
        return set() if self.signing_secret_is_current(name, secret) else {ClassKey(name)}

    def signing_secret_is_current(self, name: str, secret: Obj | None) -> bool:
        """Whether ``secret`` (read, or as its watch event carried it) holds exactly the keys the
        router holds for class ``name``: its own write coming back, say, which needs no reconcile."""
        keys = self.state.signing.get(name)
        if keys is None or name not in self.state.class_namespace:
            return False
        held = builders.read_signing_secret(secret)
        live = (
            set()
            if held is None
            else {held.current}
            if held.previous is None
            else {held.current, held.previous}
        )
        return live == set(keys)

    def _ensure(self, desired: Obj, live: Obj | None, changed: list[str]) -> Obj | None:
        desired = with_spec_hash(desired)
        if not needs_apply(desired, live):
            self._saw(desired, live)
            return live
        applied = self.kube.apply(desired)
        self._saw(desired, applied)
        changed.append(f"{desired['kind']}/{desired['metadata']['name']}")
        log.info("applied %s %s", desired["kind"], desired["metadata"]["name"])
        return applied

    @staticmethod
    def _ref(obj: Obj) -> ChildRef:
        meta = obj["metadata"]
        return (obj["kind"], meta.get("namespace") or "", meta["name"])

    def _saw(self, desired: Obj, live: Obj | None) -> None:
        """``live`` (applied, or read) is as ``desired`` (annotated with its spec hash)."""
        version = ((live or {}).get("metadata") or {}).get("resourceVersion")
        if version:
            h = desired["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
            self.state.seen[self._ref(desired)] = (str(version), h)

    def _unchanged(self, obj: Obj) -> bool:
        """Whether ``obj`` (not yet annotated) is what was desired when the live object was last seen
        as desired, and no watch event has reported another version since. An event that does is
        followed by a reconcile of the class (the handlers queue it), which then reads the object:
        every change is still seen, and the operator's own writes coming back cost no read."""
        ref = self._ref(obj)
        seen = self.state.seen.get(ref)
        return (
            seen is not None and seen[1] == spec_hash(obj) and self.state.watched.get(ref, seen[0]) == seen[0]
        )

    def child_event(
        self, kind: str, namespace: str, name: str, resource_version: str, digest: str | None = None
    ) -> bool:
        """A watch saw this version of an object the operator applies (``secretwatch.DELETED``: deleted),
        whose :func:`child_digest` is ``digest`` (None: not known). Returns whether it is news: not
        the version the operator last applied or read as desired (its own write coming back needs no
        reconcile), nor a later one that differs from it only where the operator never looks (same
        digest as that version's event): that one is then remembered as seen, so the class's next
        reconcile does not read it either."""
        ref = (kind, namespace, name)
        seen = self.state.seen.get(ref)
        previous = self.state.digests.pop(ref, None)
        if resource_version == secretwatch.DELETED:
            if seen is None:
                self.state.watched.pop(ref, None)  # nothing remembered of it: nothing to keep
                return True
        elif digest is not None:
            self.state.digests[ref] = digest
            if seen is not None and previous == digest and self.state.watched.get(ref) == seen[0]:
                # The last event was the seen version, with this digest: nothing read has changed.
                self.state.seen[ref] = (resource_version, seen[1])
                self.state.watched[ref] = resource_version
                return False
        self.state.watched[ref] = resource_version
        return seen is None or seen[0] != resource_version

    def forget_children(self) -> None:
        """Read every child again at its class's next reconcile (the resync: a change a watch missed
        while it was down is seen then), the TrustClass, engine and signing key included."""
        self.state.seen.clear()
        if self.kube.cache is not None:
            self.kube.cache.clear()

    def _set_finalizer(self, body: Obj, *, present: bool) -> None:
        patch = {
            "apiVersion": API_VERSION,
            "kind": "TrustClass",
            "metadata": {"name": body["metadata"]["name"], "finalizers": [FINALIZER] if present else []},
        }
        self.kube.apply(patch, field_manager=FINALIZER_MANAGER)

    def _finalize(self, body: Obj) -> set[Key]:
        name = body["metadata"]["name"]
        if FINALIZER not in (body["metadata"].get("finalizers") or []):
            return {ROUTING}
        self._forget(name)
        # Take the class out of the routing table first: nothing may route to what is going away.
        follow = self.reconcile_routing()
        tc: TrustClass | None
        try:
            tc = TrustClass.model_validate(body)
        except ValidationError:
            tc = accepted_trust_class(body)
        done = "its namespace is being deleted"
        if tc is not None:
            live_ns = self.kube.get("v1", "Namespace", tc.target_namespace)
            if (
                live_ns is not None
                and (live_ns["metadata"].get("labels") or {}).get(builders.LABEL_TRUST_CLASS) == name
            ):
                if modelcache.keeps_namespace(tc):
                    # The claim outlives the class, and so must its namespace: no owner reference left
                    # for garbage collection to follow (every other child still has one).
                    self.kube.apply(with_spec_hash(builders.namespace(tc, self.opts, None)))
                    done = (
                        f"its namespace {tc.target_namespace} is kept with the model cache claim "
                        f"{builders.model_cache_claim_name(tc)} (retained); delete it to release the claim"
                    )
                else:
                    self.kube.delete("v1", "Namespace", tc.target_namespace)
        self._emit(Event(body, "Deleted", f"trust class removed from routing; {done}"))
        self._set_finalizer(body, present=False)
        return follow

    def _forget(self, name: str) -> None:
        with self._routed_lock:
            self.state.awaiting_routing.discard(name)
            self.state.routed.discard(name)
        self.state.applied_early.pop(name, None)
        ns = self.state.class_namespace.get(name)
        if ns is not None:
            # What was remembered of the class's children (and of its namespace) goes with it.
            for memo in (self.state.seen, self.state.watched, self.state.digests):
                for ref in [r for r in memo if r[1] == ns or r == ("Namespace", "", ns)]:
                    del memo[ref]
        self.state.signing.pop(name, None)
        self.state.tenant_quotas.pop(name, None)
        self.state.bound_count.pop(name, None)
        self.state.class_namespace.pop(name, None)

    def _class_status(
        self,
        body: Obj,
        tc: TrustClass | None,
        *,
        deployment: Obj | None = None,
        key: bytes | None = None,
        degraded: tuple[str, str] | None = None,
    ) -> bool:
        """Patch the TrustClass status if it changed (:func:`status.trust_class_status`); return
        whether the engine rolled out. A degraded class applied nothing, so its engine Deployment is
        read here: its status shows the pods that run (as last rendered), never stale counts."""
        if degraded is not None and deployment is None:
            deployment = self._engine_deployment(body, tc, degraded[0])
        out = trust_class_status(
            body,
            tc,
            endpoint=builders.endpoint(tc, self.opts) if tc is not None else None,
            bound_tenants=self.state.bound_count.get(tc.name, 0) if tc is not None else 0,
            deployment=deployment,
            key=key,
            degraded=degraded,
        )
        if out.ready_flipped is not None:
            c = out.ready_flipped
            ok = c["status"] == "True"
            self._emit(Event(body, c["reason"], c["message"] or c["reason"], "Normal" if ok else "Warning"))
        live_status: Obj = body.get("status") or {}
        if status_differs(out.status, live_status):
            self.kube.patch_status(
                API_VERSION,
                "TrustClass",
                body["metadata"]["name"],
                None,
                status_patch(out.status, live_status),
            )
        return out.rolled_out

    def _engine_deployment(self, body: Obj, tc: TrustClass | None, reason: str) -> Obj | None:
        """The class's engine Deployment as it runs, for the status of a class that applied nothing:
        in its namespace (for a class that does not validate, its last accepted spec's, else the one
        its status names); None where it has none (the namespace is someone else's, or unknown)."""
        if reason == conditions.REASON_NAMESPACE_CONFLICT:
            return None
        served = tc or accepted_trust_class(body)
        ns = served.target_namespace if served is not None else (body.get("status") or {}).get("namespace")
        if not ns:
            return None
        return self.kube.get("apps/v1", "Deployment", builders.ENGINE_NAME, ns)

    # --- routing ---------------------------------------------------------------------------------
    def reconcile_routing(self) -> set[Key]:
        with self._routing_lock:
            try:
                return self._reconcile_routing()
            finally:
                # the decision's every binding, listed and validated at once, is garbage now
                memory.release_free_memory()

    def _reconcile_routing(self) -> set[Key]:
        # Taken before any key is read: a class reconcile stores its new key before it counts as
        # tried, so a class tried by now whose key this decision does not find truly has none.
        tried = set(self.state.class_tried)
        tc_bodies = self.kube.list(API_VERSION, "TrustClass")
        listed = [b for b in self.kube.list(API_VERSION, "TenantBinding", each=list_binding) if b is not None]
        namespaces = {
            n["metadata"]["name"]: dict(n["metadata"].get("labels") or {})
            for n in self.kube.list("v1", "Namespace")
        }
        classes: dict[str, ClassState] = {}
        for body in tc_bodies:
            try:
                tc = TrustClass.model_validate(body)
            except ValidationError:
                last = accepted_trust_class(body)
                if last is None:
                    continue
                tc = last
            deleting = bool(body["metadata"].get("deletionTimestamp"))
            keys = () if deleting else self._signing_keys(tc)
            classes[tc.name] = ClassState(tc, keys, deleting)
        bindings = [lb.model for lb in listed]
        raw = {lb.model.key: lb for lb in listed}
        del listed
        self._list_api_keys(bindings)
        lookups = dict(
            zip(
                [b.key for b in bindings],
                self._fanout.map(lambda b: self._api_keys(b, b.spec, b.key), bindings),
                strict=True,
            )
        )
        for b in bindings:
            accepted = b.accepted_spec()
            if accepted is not None and accepted.api_key_secret_ref != b.spec.api_key_secret_ref:
                lookups[accepted_key(b.key)] = self._api_keys(b, accepted, accepted_key(b.key))
        live_keys = set(lookups)
        for k in list(self.state.keys):
            if k not in live_keys:
                del self.state.keys[k]
        out = decide(classes, bindings, namespaces, lookups, self.opts)

        follow: set[Key] = set()
        bound: dict[str, int] = {}
        for d in out.decisions.values():
            if d.bound and d.trust_class:
                bound[d.trust_class] = bound.get(d.trust_class, 0) + 1
        for name in set(classes) | set(self.state.tenant_quotas) | set(out.tenant_quotas):
            if self.state.tenant_quotas.get(name, {}) != out.tenant_quotas.get(name, {}):
                follow.add(ClassKey(name))
        for name in classes:
            if self.state.bound_count.get(name, 0) != bound.get(name, 0):
                follow.add(ClassKey(name))
        self.state.tenant_quotas = out.tenant_quotas
        self.state.bound_count = bound
        # The decisions are made: engines can be configured even if the write below fails (say, the
        # router's namespace does not exist yet); the follow-ups survive a failed attempt.
        with self._routed_lock:
            self.state.routed = {n for n, c in classes.items() if c.signing_keys}
            woken = self.state.awaiting_routing & self.state.routed
            self.state.awaiting_routing -= woken
        follow |= {ClassKey(n) for n in woken}
        precedence = bool(woken) and self.notify is not None and self.renders_meanwhile
        if precedence:
            with self._renders:
                self._rendering |= woken
        self.state.routing_ready.set()
        classes_next = {k for k in follow if isinstance(k, ClassKey) and k.name in classes}
        if self.notify is not None:
            # Queued now, not after the bindings' status writes below: the woken classes render their
            # engines while those are sent.
            for ck in classes_next:
                self.later(ck, 0)
        else:
            self.state.pending_follow |= classes_next
        # A class not reconciled yet in this process and without a key is about to get one: its
        # bindings keep their status until the decision it queues (no "not ready" flip first).
        untried = {n for n, c in classes.items() if not c.signing_keys and not c.deleting and n not in tried}
        to_write = [
            b
            for b in bindings
            if not (
                out.decisions[b.key].reason == conditions.REASON_TRUST_CLASS_NOT_READY
                and out.decisions[b.key].trust_class in untried
            )
        ]

        secret = with_spec_hash(routing_secret(out.table, self.opts))
        live = self.kube.get("v1", "Secret", ROUTING_SECRET_NAME, self.opts.router_namespace)
        if needs_apply(secret, live):
            self.kube.apply(secret)
            log.info(
                "routing table written: %d trust classes, %d tenants",
                len(out.table.trust_classes),
                len(out.table.tenants),
            )
        if precedence:
            self._await_renders(len(woken))
        # list(): wait for every write, and raise the first failure (the routing key is retried).
        list(self._fanout.map(lambda b: self._binding_status(raw[b.key], out.decisions[b.key]), to_write))
        done, self.state.pending_follow = self.state.pending_follow, set()
        return done

    def _await_renders(self, count: int) -> None:
        """Wait (at most :data:`RENDER_PRECEDENCE_SECONDS`) until the classes this decision routed for
        the first time have been reconciled, so their engine configs name their tenants' quotas
        before the bindings are told ``Bound``. The bindings' status writes (one per binding) only
        report what the routing table written above already does; sent beside the renders,
        ROUTING_CONCURRENCY at a time against the renders' one per worker, they held the renders
        back (docs/operator.md, issue 16, eighth pass)."""
        started = time.monotonic()
        with self._renders:
            done = self._renders.wait_for(lambda: not self._rendering, RENDER_PRECEDENCE_SECONDS)
            left = len(self._rendering)
            if not done:
                # what is left renders beside the status writes, as before this wait
                self._rendering.clear()
        waited = time.monotonic() - started
        if not done:
            log.warning(
                "binding statuses waited %.0fs for the engines of %d newly routed trust classes; %d not "
                "rendered yet, writing the statuses now",
                waited,
                count,
                left,
            )
        elif waited >= 1.0:
            log.info("binding statuses written after the engines of %d trust classes (%.1fs)", count, waited)

    def _signing_keys(self, tc: TrustClass) -> tuple[bytes, ...]:
        cached = self.state.signing.get(tc.name)
        if cached is not None:
            return cached
        secret = self.kube.get("v1", "Secret", builders.SIGNING_SECRET_NAME, tc.target_namespace)
        held = builders.read_signing_secret(secret)
        if held is None:
            return ()
        # (after a restart) the order reconcile_class uses: the previous key first until propagated
        wait = builders.key_propagation_left(held, self._clock(), self.opts.signing_key_propagation_seconds)
        keys = builders.router_signing_keys(held, propagated=wait == 0)
        self.state.signing[tc.name] = keys
        return keys

    # --- what the work queue tells the reconciler (its state is its own) ----------------------------
    def forget_api_keys(self, binding: str | None = None) -> None:
        """Read ``binding``'s API keys again at its next routing decision (every binding's: None)."""
        if binding is None:
            self.state.keys.clear()
        else:
            self.state.keys.pop(binding, None)

    def secret_changed(self, namespace: str, name: str, resource_version: str) -> None:
        """The watch saw this version of an API-key Secret: a cached read of an older one is stale."""
        self.state.secret_versions[(namespace, name)] = resource_version

    def secret_untracked(self, secret: tuple[str, str]) -> None:
        """No binding reads this Secret any more."""
        self.state.secret_versions.pop(secret, None)

    def cached_secret_version(self, binding: str) -> str | None:
        """resourceVersion of the API-key Secret whose keys are cached for ``binding`` (or None)."""
        cached = self.state.keys.get(binding)
        return None if cached is None else cached[2]

    def _cached_api_keys(self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str) -> KeyLookup | None:
        ref = spec.api_key_secret_ref
        cached = self.state.keys.get(cache_key)
        watched = self.state.secret_versions.get((b.namespace, ref.name))
        if cached is not None and cached[0][:2] == (ref.name, ref.key) and watched in (None, cached[2]):
            return cached[1]
        return None

    def _list_api_keys(self, bindings: list[TenantBinding]) -> None:
        """Read the API keys of a namespace that has many to read with one paged LIST of its Secrets
        instead of a GET each (the routing decision's reads then find them cached). Only the Secrets
        its bindings name are kept (their keys hashed, as a GET would give them); every other Secret
        of the page is dropped as the page is read. A namespace that lets the operator read its
        Secrets one by one only (``get``, an older role) answers 403: its keys are read by GET."""
        wanted: dict[str, dict[str, list[TenantBinding]]] = {}
        for b in bindings:
            if self._cached_api_keys(b, b.spec, b.key) is None:
                wanted.setdefault(b.namespace, {}).setdefault(b.spec.api_key_secret_ref.name, []).append(b)
        for ns, names in wanted.items():
            if len(names) < API_KEYS_LIST_MIN:
                continue

            def keep(secret: Obj, names: dict[str, list[TenantBinding]] = names) -> Obj:
                meta = secret.get("metadata") or {}
                if meta.get("name") not in names:
                    return {}
                return {"metadata": meta, "data": secret.get("data") or {}}

            try:
                listed = self.kube.list("v1", "Secret", ns, each=keep)
            except KubeError as e:
                if e.forbidden:
                    continue
                raise
            for secret in listed:
                for b in names.get(str((secret.get("metadata") or {}).get("name")), ()):
                    self._store_api_keys(b, b.spec, b.key, secret)

    def _api_keys(self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str) -> KeyLookup:
        """The API keys of ``spec``'s Secret (cached under ``cache_key``: the binding's key, or
        :func:`bindings.accepted_key` of it for the Secret of its last accepted spec)."""
        cached = self._cached_api_keys(b, spec, cache_key)
        if cached is not None:
            return cached
        ref = spec.api_key_secret_ref
        try:
            secret = self.kube.get("v1", "Secret", ref.name, b.namespace)
        except KubeError as e:
            if e.forbidden:
                lookup = KeyLookup(
                    error=conditions.REASON_SECRET_FORBIDDEN,
                    message=f"the operator may not read Secret {b.namespace}/{ref.name} "
                    f"(bind the {self.opts.tenant_secrets_role} ClusterRole in this namespace)",
                )
                return lookup  # not cached: a RoleBinding granted later is seen at the next reconcile
            raise
        return self._store_api_keys(b, spec, cache_key, secret)

    def _store_api_keys(
        self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str, secret: Obj | None
    ) -> KeyLookup:
        """The lookup of the API-key Secret ``secret`` (as read; None: not found), cached unless it
        is an error."""
        ref = spec.api_key_secret_ref
        ident = (ref.name, ref.key, str(b.metadata.get("resourceVersion", "")))
        if secret is None:
            lookup = KeyLookup(
                error=conditions.REASON_SECRET_NOT_FOUND, message=f"Secret {b.namespace}/{ref.name} not found"
            )
        else:
            try:
                keys = api_keys_from_secret(secret, ref.key)
                lookup = KeyLookup(hashes=tuple(sorted({hash_api_key(k) for k in keys})))
            except (ValueError, UnicodeDecodeError):
                lookup = KeyLookup(
                    error=conditions.REASON_NO_API_KEYS, message="the API-key Secret is not UTF-8 text"
                )
        if lookup.error is None:
            version = str(((secret or {}).get("metadata") or {}).get("resourceVersion", ""))
            self.state.keys[cache_key] = (ident, lookup, version)
        return lookup

    def _binding_status(self, listed: ListedBinding, d: Decision) -> None:
        body = listed.body()
        meta = body["metadata"]
        gen = meta.get("generation")
        live_status: Obj = body["status"]
        existing = live_status.get("conditions", [])
        bound_reason = d.reason if not d.bound else conditions.REASON_BOUND
        conds = [
            set_condition(existing, conditions.BOUND, d.bound, bound_reason, d.message, gen),
            set_condition(
                existing,
                conditions.DENIED,
                d.denied,
                d.reason if d.denied else conditions.REASON_NOT_DENIED,
                d.message if d.denied else "",
                gen,
            ),
            set_condition(existing, conditions.READY, d.bound, bound_reason, d.message, gen),
        ]
        accepted_spec, accepted_gen = live_status.get(ACCEPTED_SPEC), live_status.get(ACCEPTED_GENERATION)
        refused = d.refused
        if d.bound and refused is None and d.served_spec is not None:
            accepted_spec, accepted_gen = d.served_spec.wire(), gen
        if refused is not None:
            refusal = (
                f"generation {gen} is not accepted: {refused.message}; the tenant is served with its last "
                f"accepted spec (generation {accepted_gen})"
            )
            spec_c = set_condition(existing, conditions.SPEC_ACCEPTED, False, refused.reason, refusal, gen)
        elif d.bound:
            spec_c = set_condition(
                existing, conditions.SPEC_ACCEPTED, True, conditions.REASON_ACCEPTED, "", gen
            )
        else:
            spec_c = set_condition(existing, conditions.SPEC_ACCEPTED, False, d.reason, d.message, gen)
        # The class edited under the spec in force: served within the class's current bounds.
        if d.bound and d.clamped:
            clamp = (
                f"the spec in force (generation {accepted_gen}) asks for more than TrustClass "
                f"{d.trust_class!r} allows now; the tenant is served within it: " + "; ".join(d.clamped)
            )
            clamp_c = set_condition(existing, conditions.CLAMPED, True, conditions.REASON_CLAMPED, clamp, gen)
        elif d.bound:
            clamp_c = set_condition(
                existing, conditions.CLAMPED, False, conditions.REASON_WITHIN_CLASS_LIMITS, "", gen
            )
        else:
            clamp_c = set_condition(existing, conditions.CLAMPED, False, conditions.REASON_NOT_BOUND, "", gen)
        conds += [spec_c, clamp_c]
        # A refused edit or a clamped spec needs a change by someone (the tenant is served meanwhile).
        stalled: tuple[str, str] | None = None
        if d.denied:
            stalled = (d.reason, d.message)
        elif refused is not None:
            stalled = (refused.reason, spec_c["message"])
        elif clamp_c["status"] == "True":
            stalled = (conditions.REASON_CLAMPED, clamp_c["message"])
        conds += kstatus_conditions(
            existing,
            reconciling=None
            if d.bound or d.denied or refused is not None
            else {"reason": d.reason, "message": d.message},
            stalled=stalled,
            generation=gen,
        )
        status: Obj = {"observedGeneration": gen, "conditions": conds}
        if accepted_spec is not None:
            status[ACCEPTED_SPEC] = accepted_spec
            status[ACCEPTED_GENERATION] = accepted_gen
        if d.trust_class:
            status["trustClass"] = d.trust_class
        if d.api_keys is not None:
            status["apiKeys"] = d.api_keys
        if not status_differs(status, live_status):
            return
        self.kube.patch_status(
            API_VERSION, "TenantBinding", meta["name"], meta["namespace"], status_patch(status, live_status)
        )
        old = {c.get("type"): c for c in existing}
        # One Event per transition; none for a new binding's first decision when it binds (its
        # status says so; an Event is for news: a denial, a binding waiting, a change of fate).
        first_bind = d.bound and conditions.BOUND not in old
        if not first_bind and (
            old.get(conditions.BOUND, {}).get("status") != conds[0]["status"]
            or old.get(conditions.DENIED, {}).get("reason") != conds[1]["reason"]
        ):
            self._emit(Event(body, d.reason, d.message, "Normal" if d.bound or not d.denied else "Warning"))
        was = old.get(conditions.SPEC_ACCEPTED, {})
        if refused is not None and (was.get("status"), was.get("reason")) != ("False", refused.reason):
            self._emit(Event(body, refused.reason, spec_c["message"], "Warning"))
        # Told when a clamp starts or changes (the class edited again, the guarantees of older
        # bindings changed what is left), and when it ends with the tenant still served.
        was = old.get(conditions.CLAMPED, {})
        if clamp_c["status"] == "True" and (was.get("status"), was.get("message")) != (
            "True",
            clamp_c["message"],
        ):
            self._emit(Event(body, conditions.REASON_CLAMPED, clamp_c["message"], "Warning"))
        elif d.bound and clamp_c["status"] == "False" and was.get("status") == "True":
            self._emit(
                Event(
                    body,
                    conditions.REASON_WITHIN_CLASS_LIMITS,
                    f"the spec in force is served as specified again: TrustClass {d.trust_class!r} allows it",
                )
            )
