"""Level-based reconciliation: read what is, build what should be, apply only the difference.

Nothing here depends on kopf: :class:`Reconciler` is driven by keys (``("class", name)`` or
``("routing",)``) from the work queue in :mod:`kvfence.operator.handlers`, and is safe to call again
at any time, for any reason (a watch event, a resync, a retry, a restart). A reconcile that finds the
cluster as it should be sends no write request at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfence.api import conditions as C
from kvfence.api.common import API_VERSION, TenantQuotas
from kvfence.api.routing import ROUTING_SECRET_NAME, hash_api_key
from kvfence.api.tenantbinding import TenantBinding, TenantBindingSpec
from kvfence.api.trustclass import TrustClass
from kvfence.contract import key_id, new_signing_key
from kvfence.operator import builders as B
from kvfence.operator import routes as R
from kvfence.operator.apply import Kube, KubeError, is_subset, now_rfc3339

log = logging.getLogger("kvfence.operator")

Obj = dict[str, Any]
Key = tuple[str, ...]
ROUTING: Key = ("routing",)
FINALIZER = "kvfence.dev/cleanup"
FINALIZER_MANAGER = "kvfence-operator-finalizer"
#: status fields holding the last accepted spec (both kinds) and its generation
ACCEPTED_SPEC = "acceptedSpec"
ACCEPTED_GENERATION = "acceptedGeneration"
#: Requests the routing decision has in flight at once for its per-binding reads and writes.
ROUTING_CONCURRENCY = 8


class Requeue(Exception):
    """Try again later (a dependency is not there yet)."""

    def __init__(self, message: str, delay: float = 2.0) -> None:
        super().__init__(message)
        self.delay = delay


def class_key(name: str) -> Key:
    return ("class", name)


def spec_hash(obj: Obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def with_spec_hash(obj: Obj) -> Obj:
    """``obj`` annotated with the hash of itself: a change of the *desired* object (also a field
    removed) is seen without reading anything but the live annotation."""
    h = spec_hash(obj)
    out = dict(obj)
    meta = dict(out["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), B.ANNOTATION_SPEC_HASH: h}
    out["metadata"] = meta
    return out


def needs_apply(desired: Obj, live: Obj | None) -> bool:
    if live is None:
        return True
    return not is_subset(desired, live)


def set_condition(
    existing: list[Obj], ctype: str, status: bool, reason: str, message: str, generation: int | None
) -> Obj:
    """A metav1.Condition; lastTransitionTime kept unless the status flips."""
    st = "True" if status else "False"
    old = next((c for c in existing if c.get("type") == ctype), None)
    ltt = (
        old["lastTransitionTime"]
        if old and old.get("status") == st and old.get("lastTransitionTime")
        else None
    )
    cond: Obj = {
        "type": ctype,
        "status": st,
        "reason": reason,
        "message": message,
        "lastTransitionTime": ltt or now_rfc3339(),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def kstatus_conditions(
    existing: list[Obj], *, reconciling: Obj | None, stalled: tuple[str, str] | None, generation: int | None
) -> list[Obj]:
    """``Reconciling`` and ``Stalled`` as kstatus reads them: ``reconciling`` is the (reason, message)
    of work in progress, ``stalled`` that of a state only a change by someone can leave; each False
    (reason ``Reconciled``/``AsExpected``) otherwise. Stalled wins: never both True."""
    if stalled is not None:
        reconciling = None
    return [
        set_condition(
            existing,
            C.RECONCILING,
            reconciling is not None,
            (reconciling or {}).get("reason") or C.REASON_RECONCILED,
            (reconciling or {}).get("message", ""),
            generation,
        ),
        set_condition(
            existing,
            C.STALLED,
            stalled is not None,
            stalled[0] if stalled else C.REASON_AS_EXPECTED,
            stalled[1] if stalled else "",
            generation,
        ),
    ]


def _strip_times(status: Obj) -> Obj:
    out = dict(status)
    out["conditions"] = sorted(
        ({k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions", [])),
        key=lambda c: str(c.get("type")),
    )
    return out


def status_differs(desired: Obj, live: Obj | None) -> bool:
    return _strip_times(desired) != _strip_times(live or {})


def _with_removals(new: Obj, old: Obj) -> Obj:
    """``new`` as a JSON merge patch over ``old``: every key of ``old`` that ``new`` lacks is null."""
    out: Obj = {}
    for k, v in new.items():
        was = old.get(k)
        out[k] = _with_removals(v, was) if isinstance(v, dict) and isinstance(was, dict) else v
    for k in old:
        if k not in new:
            out[k] = None
    return out


def status_patch(desired: Obj, live: Obj) -> Obj:
    """The merge patch that writes ``desired``: ``acceptedSpec`` replaced whole (a field the new spec
    no longer sets must not survive from the old one)."""
    out = dict(desired)
    if isinstance(desired.get(ACCEPTED_SPEC), dict) and isinstance(live.get(ACCEPTED_SPEC), dict):
        out[ACCEPTED_SPEC] = _with_removals(desired[ACCEPTED_SPEC], live[ACCEPTED_SPEC])
    return out


def _rolled_out_with(dep: Obj, kid: str) -> bool:
    """Whether every pod of the engine Deployment runs the template that carries key id ``kid``."""
    spec, st = dep.get("spec") or {}, dep.get("status") or {}
    annotations = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    want = int(spec.get("replicas", 1))
    return bool(
        annotations.get(B.ANNOTATION_KEY_ID) == kid
        and st.get("observedGeneration", 0) >= (dep.get("metadata") or {}).get("generation", 1)
        and (want == 0 or (st.get("updatedReplicas", 0) >= want and st.get("availableReplicas", 0) >= want))
    )


def accepted_trust_class(body: Obj) -> TrustClass | None:
    """The TrustClass as last accepted (``status.acceptedSpec``), or None (none, or it fails too)."""
    spec = (body.get("status") or {}).get(ACCEPTED_SPEC)
    if not isinstance(spec, dict):
        return None
    try:
        return TrustClass.model_validate({**body, "spec": spec})
    except ValidationError:
        return None


@dataclass
class Event:
    obj: Obj
    reason: str
    message: str
    type: str = "Normal"


@dataclass
class State:
    """What the reconciler remembers between reconciles (all of it can be rebuilt from the cluster)."""

    signing: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    #: binding key -> ((secret name, secret key, binding resourceVersion), lookup, the Secret's
    #: resourceVersion when it was read)
    keys: dict[str, tuple[tuple[str, str | None, str], R.KeyLookup, str]] = field(default_factory=dict)
    #: (namespace, name) of an API-key Secret -> the latest resourceVersion its watch reported
    #: (``secretwatch.DELETED`` once deleted). A cached lookup of an older version is read again.
    secret_versions: dict[tuple[str, str], str] = field(default_factory=dict)
    tenant_quotas: dict[str, dict[str, TenantQuotas]] = field(default_factory=dict)
    bound_count: dict[str, int] = field(default_factory=dict)
    class_namespace: dict[str, str] = field(default_factory=dict)
    pending_follow: set[Key] = field(default_factory=set)
    routing_ready: threading.Event = field(default_factory=threading.Event)


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        opts: B.OperatorOptions,
        *,
        emit: Callable[[Event], None] | None = None,
        new_key: Callable[[], bytes] = new_signing_key,
    ) -> None:
        self.kube = kube
        self.opts = opts
        self.state = State()
        self._emit = emit or (lambda e: None)
        self._new_key = new_key
        self._routing_lock = threading.Lock()
        # The routing decision's per-binding requests (API-key Secret reads, status writes and their
        # Events) are independent of each other: sent ROUTING_CONCURRENCY at a time, not one by one.
        self._fanout = ThreadPoolExecutor(ROUTING_CONCURRENCY, thread_name_prefix="kvfence-routing")

    # ---------------------------------------------------------------------------------------------
    def reconcile(self, key: Key) -> set[Key]:
        """Reconcile one key; return the keys that must be reconciled because of it."""
        if key == ROUTING:
            return self.reconcile_routing()
        if key[0] == "class":
            return self.reconcile_class(key[1])
        if key[0] == "secrets":
            return self.check_class_secret(key[1])
        if key[0] == "binding":
            # The binding's API-key Secret changed (its watch said so): read it again, decide again.
            self.state.keys.pop(f"{key[1]}/{key[2]}", None)
            return {ROUTING}
        raise ValueError(f"unknown key {key!r}")

    # --- TrustClass ------------------------------------------------------------------------------
    def reconcile_class(self, name: str) -> set[Key]:
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
            was: Obj = next(
                (c for c in (body.get("status") or {}).get("conditions", []) if c.get("type") == C.DEGRADED),
                {},
            )
            if (was.get("reason"), was.get("observedGeneration")) != (
                C.REASON_INVALID_SPEC,
                meta.get("generation"),
            ):
                self._emit(Event(body, C.REASON_INVALID_SPEC, msg[:1024], "Warning"))
            self._class_status(body, None, degraded=(C.REASON_INVALID_SPEC, msg))
            return set()
        ns_name = tc.target_namespace
        self.state.class_namespace[name] = ns_name
        owner = B.owner_reference(body)
        live_ns = self.kube.get("v1", "Namespace", ns_name)
        if live_ns is not None and (live_ns["metadata"].get("labels") or {}).get(B.LABEL_TRUST_CLASS) != name:
            msg = f"namespace {ns_name!r} exists and does not belong to TrustClass {name!r}"
            self._class_status(body, tc, degraded=(C.REASON_NAMESPACE_CONFLICT, msg))
            self._emit(Event(body, C.REASON_NAMESPACE_CONFLICT, msg, "Warning"))
            return set()
        if live_ns is not None and live_ns["metadata"].get("deletionTimestamp"):
            raise Requeue(f"namespace {ns_name} is still terminating", delay=5)
        changed: list[str] = []
        self._ensure(B.namespace(tc, self.opts, owner), live_ns, changed)

        if not self.state.routing_ready.is_set():
            raise Requeue("waiting for the first routing decision", delay=0.5)
        # The signing key: kept, created once, rotated on request.
        live_secret = self.kube.get("v1", "Secret", B.SIGNING_SECRET_NAME, ns_name)
        live_keys = B.read_signing_secret(live_secret)
        rotation = (meta.get("annotations") or {}).get(B.ANNOTATION_ROTATE)
        current, previous, token = B.plan_signing_keys(
            live_keys, rotation, self._new_key() if live_keys[0] is None or rotation != live_keys[2] else b""
        )
        if live_keys[0] is not None and current != live_keys[0]:
            self._emit(Event(body, "SigningKeyRotated", f"signing key rotated, new key id {key_id(current)}"))
        try:
            shared_texts = self._shared_prefix_texts(tc, ns_name)
        except LookupError as e:
            # Nothing is applied: the engines keep serving with the last config they were given.
            self._class_status(body, tc, degraded=(C.REASON_SHARED_PREFIX_UNRESOLVED, str(e)))
            self._emit(Event(body, C.REASON_SHARED_PREFIX_UNRESOLVED, str(e), "Warning"))
            raise Requeue(str(e), delay=10) from None
        try:
            objs = B.children(
                tc,
                signing=(current, previous, token),
                tenant_quotas=self.state.tenant_quotas.get(name),
                opts=self.opts,
                owner=owner,
                shared_texts=shared_texts,
            )
        except B.RefusedExtraArgs as e:
            # Nothing is applied: the engine keeps running as last rendered, and never with the flag.
            self._class_status(body, tc, degraded=(C.REASON_FORBIDDEN_EXTRA_ARGS, str(e)))
            self._emit(Event(body, C.REASON_FORBIDDEN_EXTRA_ARGS, str(e), "Warning"))
            return set()
        except ValueError as e:
            self._class_status(body, tc, degraded=(C.REASON_INVALID_ENGINE_CONFIG, str(e)))
            return set()
        deployment_live: Obj | None = None
        for obj in objs:
            if obj["kind"] == "Secret":
                live = live_secret
            else:
                live = self.kube.get(obj["apiVersion"], obj["kind"], obj["metadata"]["name"], ns_name)
            applied = self._ensure(obj, live, changed)
            if obj["kind"] == "Deployment":
                deployment_live = applied
        if changed:
            self._emit(Event(body, "Applied", "applied " + ", ".join(changed)))
        rolled_out = self._class_status(body, tc, deployment=deployment_live, key=current)
        # After a rotation the router keeps signing with the previous key until every engine pod runs
        # with the new one (the key id is in the pod template), so no request is signed with a key an
        # engine does not hold yet; then the new key goes first. Both keys verify throughout.
        keys = (current,) if previous is None else (current, previous) if rolled_out else (previous, current)
        follow: set[Key] = set()
        if self.state.signing.get(name) != keys:
            self.state.signing[name] = keys
            follow.add(ROUTING)
        return follow

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
            return {class_key(name)}
        cur, prev, _ = B.read_signing_secret(self.kube.get("v1", "Secret", B.SIGNING_SECRET_NAME, ns))
        live = set() if cur is None else {cur} if prev is None else {cur, prev}
        return set() if live == set(keys) else {class_key(name)}

    def _ensure(self, desired: Obj, live: Obj | None, changed: list[str]) -> Obj | None:
        desired = with_spec_hash(desired)
        if not needs_apply(desired, live):
            return live
        applied = self.kube.apply(desired)
        changed.append(f"{desired['kind']}/{desired['metadata']['name']}")
        log.info("applied %s %s", desired["kind"], desired["metadata"]["name"])
        return applied

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
        try:
            tc_ns: str | None = TrustClass.model_validate(body).target_namespace
        except ValidationError:
            last = accepted_trust_class(body)
            tc_ns = None if last is None else last.target_namespace
        if tc_ns:
            live_ns = self.kube.get("v1", "Namespace", tc_ns)
            if (
                live_ns is not None
                and (live_ns["metadata"].get("labels") or {}).get(B.LABEL_TRUST_CLASS) == name
            ):
                self.kube.delete("v1", "Namespace", tc_ns)
        self._emit(Event(body, "Deleted", "trust class removed from routing; its namespace is being deleted"))
        self._set_finalizer(body, present=False)
        return follow

    def _forget(self, name: str) -> None:
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
        """Patch the TrustClass status if it changed; return whether the engine rollout is complete."""
        meta = body["metadata"]
        gen = meta.get("generation")
        rolled = False
        live_status: Obj = body.get("status") or {}
        existing = live_status.get("conditions", [])
        status: Obj = {"observedGeneration": gen}
        if tc is not None:
            status["namespace"] = tc.target_namespace
            status["endpoint"] = B.endpoint(tc, self.opts)
            status["boundTenants"] = self.state.bound_count.get(tc.name, 0)
            status["desiredReplicas"] = tc.spec.replicas
            status["selector"] = ",".join(f"{k}={v}" for k, v in sorted(B.selector_labels(tc.name).items()))
        if key is not None:
            status["signingKeyId"] = key_id(key)
        if degraded is None and tc is not None:
            # Everything the spec asks for was rendered and applied: it is the spec in force.
            status[ACCEPTED_SPEC], status[ACCEPTED_GENERATION] = body.get("spec") or {}, gen
        elif isinstance(live_status.get(ACCEPTED_SPEC), dict):
            status[ACCEPTED_SPEC] = live_status[ACCEPTED_SPEC]
            status[ACCEPTED_GENERATION] = live_status.get(ACCEPTED_GENERATION)
        if degraded is not None:
            reason, msg = degraded
            conds = [
                set_condition(existing, C.READY, False, reason, msg, gen),
                set_condition(existing, C.PROGRESSING, False, reason, msg, gen),
                set_condition(existing, C.DEGRADED, True, reason, msg, gen),
                *kstatus_conditions(existing, reconciling=None, stalled=(reason, msg), generation=gen),
            ]
        else:
            assert tc is not None
            want = tc.spec.replicas
            dstat: Obj = (deployment or {}).get("status") or {}
            dgen_ok = dstat.get("observedGeneration", 0) >= (deployment or {}).get("metadata", {}).get(
                "generation", 1
            )
            ready = int(dstat.get("readyReplicas", 0) or 0)
            available = int(dstat.get("availableReplicas", 0) or 0)
            updated = int(dstat.get("updatedReplicas", 0) or 0)
            total = int(dstat.get("replicas", 0) or 0)
            status["replicas"] = total
            status["readyReplicas"] = ready
            dconds = {c.get("type"): c for c in dstat.get("conditions", [])}
            stuck = dconds.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
            failure = dconds.get("ReplicaFailure", {}).get("status") == "True"
            rolled = dgen_ok and updated >= want and total == want and available >= want
            rolled = rolled or want == 0
            if want == 0:
                ready_c = set_condition(
                    existing, C.READY, False, C.REASON_SCALED_TO_ZERO, "replicas is 0", gen
                )
            elif rolled:
                ready_c = set_condition(
                    existing,
                    C.READY,
                    True,
                    C.REASON_AVAILABLE,
                    f"{available}/{want} engine replicas available",
                    gen,
                )
            else:
                ready_c = set_condition(
                    existing,
                    C.READY,
                    False,
                    C.REASON_UNAVAILABLE,
                    f"{available}/{want} engine replicas available",
                    gen,
                )
            if rolled or want == 0:
                prog = set_condition(existing, C.PROGRESSING, False, C.REASON_ROLLOUT_COMPLETE, "", gen)
            else:
                prog = set_condition(
                    existing,
                    C.PROGRESSING,
                    True,
                    C.REASON_ROLLING_OUT,
                    f"{updated}/{want} updated, {ready}/{want} ready",
                    gen,
                )
            if stuck or failure:
                why = (dconds.get("ReplicaFailure") or dconds.get("Progressing") or {}).get("message", "")
                deg = set_condition(existing, C.DEGRADED, True, C.REASON_UNAVAILABLE, why, gen)
            else:
                deg = set_condition(existing, C.DEGRADED, False, C.REASON_AS_EXPECTED, "", gen)
            conds = [
                ready_c,
                prog,
                deg,
                *kstatus_conditions(
                    existing,
                    reconciling=None if deg["status"] == "True" or prog["status"] != "True" else prog,
                    stalled=(deg["reason"], deg["message"]) if deg["status"] == "True" else None,
                    generation=gen,
                ),
            ]
            old_ready: Obj = next((c for c in existing if c.get("type") == C.READY), {})
            if old_ready.get("status") != ready_c["status"]:
                self._emit(
                    Event(
                        body,
                        ready_c["reason"],
                        ready_c["message"] or ready_c["reason"],
                        "Normal" if ready_c["status"] == "True" else "Warning",
                    )
                )
        status["conditions"] = conds
        if status_differs(status, live_status):
            self.kube.patch_status(
                API_VERSION, "TrustClass", meta["name"], None, status_patch(status, live_status)
            )
        return rolled

    # --- routing ---------------------------------------------------------------------------------
    def reconcile_routing(self) -> set[Key]:
        with self._routing_lock:
            return self._reconcile_routing()

    def _reconcile_routing(self) -> set[Key]:
        tc_bodies = self.kube.list(API_VERSION, "TrustClass")
        tb_bodies = self.kube.list(API_VERSION, "TenantBinding")
        namespaces = {
            n["metadata"]["name"]: dict(n["metadata"].get("labels") or {})
            for n in self.kube.list("v1", "Namespace")
        }
        classes: dict[str, R.ClassState] = {}
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
            classes[tc.name] = R.ClassState(tc, keys, deleting)
        bindings: list[TenantBinding] = []
        raw: dict[str, Obj] = {}
        for body in tb_bodies:
            try:
                b = TenantBinding.model_validate(body)
            except ValidationError:
                continue
            bindings.append(b)
            raw[b.key] = body
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
                lookups[R.accepted_key(b.key)] = self._api_keys(b, accepted, R.accepted_key(b.key))
        live_keys = set(lookups)
        for k in list(self.state.keys):
            if k not in live_keys:
                del self.state.keys[k]
        out = R.decide(classes, bindings, namespaces, lookups, self.opts)

        follow: set[Key] = set()
        bound: dict[str, int] = {}
        for d in out.decisions.values():
            if d.bound and d.trust_class:
                bound[d.trust_class] = bound.get(d.trust_class, 0) + 1
        for name in set(classes) | set(self.state.tenant_quotas) | set(out.tenant_quotas):
            if self.state.tenant_quotas.get(name, {}) != out.tenant_quotas.get(name, {}):
                follow.add(class_key(name))
        for name in classes:
            if self.state.bound_count.get(name, 0) != bound.get(name, 0):
                follow.add(class_key(name))
        self.state.tenant_quotas = out.tenant_quotas
        self.state.bound_count = bound
        # The decisions are made: engines can be configured even if the write below fails (say, the
        # router's namespace does not exist yet); the follow-ups survive a failed attempt.
        self.state.routing_ready.set()
        self.state.pending_follow |= {k for k in follow if k[1] in classes}

        secret = with_spec_hash(R.routing_secret(out.table, self.opts))
        live = self.kube.get("v1", "Secret", ROUTING_SECRET_NAME, self.opts.router_namespace)
        if needs_apply(secret, live):
            self.kube.apply(secret)
            log.info(
                "routing table written: %d trust classes, %d tenants",
                len(out.table.trust_classes),
                len(out.table.tenants),
            )
        # list(): wait for every write, and raise the first failure (the routing key is retried).
        list(self._fanout.map(lambda b: self._binding_status(raw[b.key], out.decisions[b.key]), bindings))
        done, self.state.pending_follow = self.state.pending_follow, set()
        return done

    def _signing_keys(self, tc: TrustClass) -> tuple[bytes, ...]:
        cached = self.state.signing.get(tc.name)
        if cached is not None:
            return cached
        secret = self.kube.get("v1", "Secret", B.SIGNING_SECRET_NAME, tc.target_namespace)
        cur, prev, _ = B.read_signing_secret(secret)
        if cur is None:
            return ()
        if prev is None:
            keys: tuple[bytes, ...] = (cur,)
        else:
            # (after a restart) the same order reconcile_class uses: previous first until rolled out
            dep = self.kube.get("apps/v1", "Deployment", B.ENGINE_NAME, tc.target_namespace) or {}
            keys = (cur, prev) if _rolled_out_with(dep, key_id(cur)) else (prev, cur)
        self.state.signing[tc.name] = keys
        return keys

    def cached_secret_version(self, binding: str) -> str | None:
        """resourceVersion of the API-key Secret whose keys are cached for ``binding`` (or None)."""
        cached = self.state.keys.get(binding)
        return None if cached is None else cached[2]

    def _api_keys(self, b: TenantBinding, spec: TenantBindingSpec, cache_key: str) -> R.KeyLookup:
        """The API keys of ``spec``'s Secret (cached under ``cache_key``: the binding's key, or
        :func:`routes.accepted_key` of it for the Secret of its last accepted spec)."""
        ref = spec.api_key_secret_ref
        ident = (ref.name, ref.key, str(b.metadata.get("resourceVersion", "")))
        cached = self.state.keys.get(cache_key)
        watched = self.state.secret_versions.get((b.namespace, ref.name))
        if cached is not None and cached[0][:2] == ident[:2] and watched in (None, cached[2]):
            return cached[1]
        try:
            secret = self.kube.get("v1", "Secret", ref.name, b.namespace)
        except KubeError as e:
            if e.forbidden:
                lookup = R.KeyLookup(
                    error=C.REASON_SECRET_FORBIDDEN,
                    message=f"the operator may not read Secret {b.namespace}/{ref.name} "
                    "(bind the kvfence-operator-tenant-secrets ClusterRole in this namespace)",
                )
                return lookup  # not cached: a RoleBinding granted later is seen at the next reconcile
            raise
        if secret is None:
            lookup = R.KeyLookup(
                error=C.REASON_SECRET_NOT_FOUND, message=f"Secret {b.namespace}/{ref.name} not found"
            )
        else:
            try:
                keys = R.api_keys_from_secret(secret, ref.key)
                lookup = R.KeyLookup(hashes=tuple(sorted({hash_api_key(k) for k in keys})))
            except (ValueError, UnicodeDecodeError):
                lookup = R.KeyLookup(
                    error=C.REASON_NO_API_KEYS, message="the API-key Secret is not UTF-8 text"
                )
        if lookup.error is None:
            version = str(((secret or {}).get("metadata") or {}).get("resourceVersion", ""))
            self.state.keys[cache_key] = (ident, lookup, version)
        return lookup

    def _binding_status(self, body: Obj, d: R.Decision) -> None:
        meta = body["metadata"]
        gen = meta.get("generation")
        live_status: Obj = body.get("status") or {}
        existing = live_status.get("conditions", [])
        bound_reason = d.reason if not d.bound else C.REASON_BOUND
        conds = [
            set_condition(existing, C.BOUND, d.bound, bound_reason, d.message, gen),
            set_condition(
                existing,
                C.DENIED,
                d.denied,
                d.reason if d.denied else C.REASON_NOT_DENIED,
                d.message if d.denied else "",
                gen,
            ),
            set_condition(existing, C.READY, d.bound, bound_reason, d.message, gen),
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
            conds.append(set_condition(existing, C.SPEC_ACCEPTED, False, refused.reason, refusal, gen))
        elif d.bound:
            conds.append(set_condition(existing, C.SPEC_ACCEPTED, True, C.REASON_ACCEPTED, "", gen))
        else:
            conds.append(set_condition(existing, C.SPEC_ACCEPTED, False, d.reason, d.message, gen))
        conds += kstatus_conditions(
            existing,
            reconciling=None
            if d.bound or d.denied or refused is not None
            else {"reason": d.reason, "message": d.message},
            # A refused edit needs a change by someone (the tenant is served meanwhile).
            stalled=(d.reason, d.message)
            if d.denied
            else (refused.reason, conds[-1]["message"])
            if refused is not None
            else None,
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
        if (
            old.get(C.BOUND, {}).get("status") != conds[0]["status"]
            or old.get(C.DENIED, {}).get("reason") != conds[1]["reason"]
        ):
            self._emit(Event(body, d.reason, d.message, "Normal" if d.bound or not d.denied else "Warning"))
        spec_c = conds[3]
        was = old.get(C.SPEC_ACCEPTED, {})
        if refused is not None and (was.get("status"), was.get("reason")) != ("False", refused.reason):
            self._emit(Event(body, refused.reason, spec_c["message"], "Warning"))
